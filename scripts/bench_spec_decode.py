"""Speculative decoding with n-gram drafts against plain decoding, side by side, on the default model.

Workloads (greedy, float32): a chat request to repeat a passage, one to rename a function
(outputs that copy their input: where n-gram drafts pay), an open question (they do not),
issue #18's single stream (random prompt ids, ``ignore_eos``: a small model's greedy
output soon loops) and 8 passage-repeating requests at once. Each workload runs on both
engines in turn, ``--reps`` times; the table gives the median generated tok/s of each, their
ratio, the drafts' acceptance rate and mean acceptance length (tokens a drafting step gains),
and whether both gave the same tokens.

    python scripts/bench_spec_decode.py                 # k = 4, lookup 2..4
    python scripts/bench_spec_decode.py --k 2 --reps 5
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np

from jaxpaged import LLM, SamplingParams

PASSAGE = ("The KV cache is split into fixed-size blocks. Every sequence has a block table that maps its logical "
           "blocks to physical ones, blocks are allocated on demand, and sequences share blocks by reference count.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n    return subtotal + tax\n")


def workloads(llm: LLM, rng: np.random.Generator) -> dict[str, tuple[list, SamplingParams]]:
    def chat(text: str) -> list[int]:
        templated = llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                      tokenize=False)
        return llm.tokenizer.encode(templated, add_special_tokens=False)

    greedy = SamplingParams(temperature=0, max_tokens=128)
    random_ids = {"prompt_token_ids": rng.integers(3, llm.config.vocab_size, 107).tolist()}
    return {
        "repeat a passage": ([{"prompt_token_ids": chat(f"Repeat this text exactly:\n\n{PASSAGE}")}], greedy),
        "rename a function": ([{"prompt_token_ids": chat(f"Rename total_price to compute_total:\n\n{CODE}")}], greedy),
        "open question": ([{"prompt_token_ids": chat("Why is the sky blue?")}], greedy),
        "#18 single stream": ([random_ids], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)),
        "8 x repeat a passage": ([{"prompt_token_ids": chat(f"Repeat this text exactly ({i}):\n\n{PASSAGE}")}
                                  for i in range(8)], greedy),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    plain = LLM(dtype="float32", enable_prefix_caching=False)
    config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
              "prompt_lookup_max": args.lookup_max}
    drafting = LLM(plain.loaded, enable_prefix_caching=False, speculative_config=config)
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
          f"speculative_config={config}, medians of {args.reps}\n")
    print("| workload | plain tok/s | drafting tok/s | ratio | acceptance rate | mean acceptance length | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, (prompts, params) in workloads(plain, np.random.default_rng(0)).items():
        times, outs = {"plain": [], "drafting": []}, {}
        for llm in (plain, drafting):  # warm-up: every step shape compiled
            llm.generate(prompts, params, use_tqdm=False)
        before = drafting.spec_decode_stats()
        for _ in range(args.reps):
            for label, llm in (("plain", plain), ("drafting", drafting)):
                t0 = time.perf_counter()
                outs[label] = llm.generate(prompts, params, use_tqdm=False)
                times[label].append(time.perf_counter() - t0)
        after = drafting.spec_decode_stats()
        tokens = sum(len(o.outputs[0].token_ids) for o in outs["plain"])
        rate = {k: tokens / statistics.median(v) for k, v in times.items()}
        drafts = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        steps = after["spec_num_drafts"] - before["spec_num_drafts"]
        same = [o.outputs[0].token_ids for o in outs["plain"]] == [o.outputs[0].token_ids for o in outs["drafting"]]
        print(f"| {name} | {rate['plain']:.1f} | {rate['drafting']:.1f} | {rate['drafting'] / rate['plain']:.2f} | "
              f"{accepted / drafts if drafts else 0:.2f} | {1 + accepted / steps if steps else 0:.2f} | {same} |",
              flush=True)


if __name__ == "__main__":
    main()
