"""Async scheduling where a step's sampler needs the step before's tokens (structured outputs'
masks follow them, penalties count them): the next step's forward launched ahead and its
sampler once the tokens are applied ("overlapped"), against the previous rule ("not
overlapped": a structured row's step is not overlapped with the next, a penalised request
sits every other step out while it runs ahead) and the synchronous loop, side by side on the
default model.

Workloads (float32, 64 tokens each, ``ignore_eos``): one sequence under a regex, 16 at once, 8
beside 8 free ones, one JSON object (a named tool call's constraint: compact JSON), one
penalised sequence (repetition, presence and frequency penalties, seeded sampling) and 8
beside 8 free ones. Each runs on the three engines in turn, ``--reps`` times; the table gives
the median generated tok/s of each and whether all three gave the same tokens.

    python scripts/bench_overlap.py --reps 5
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

from jaxpaged import LLM, SamplingParams

REGEX = {"regex": "[a-z ,.]{500}"}  # never complete within 64 tokens: every step samples under it
JSON = {"json": {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string"}}},
                 "required": ["words"]}, "disable_any_whitespace": True}


def workloads(llm: LLM) -> dict[str, tuple[list, list[SamplingParams]]]:
    def chat(text: str) -> dict:
        return llm.chat_prompt([{"role": "user", "content": text}])

    def params(so=None, **kw):
        return SamplingParams(**{"temperature": 0, "max_tokens": 64, "ignore_eos": True, "structured_outputs": so,
                                 **kw})

    penalised = params(temperature=0.7, seed=1, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)
    words = [chat(f"List some words about the number {i}.") for i in range(16)]
    return {
        "1 x regex": (words[:1], [params(REGEX)]),
        "16 x regex": (words, [params(REGEX)] * 16),
        "8 x regex + 8 free": (words, [params(REGEX)] * 8 + [params()] * 8),
        "1 x JSON object": (words[:1], [params(JSON)]),
        "1 x penalties": (words[:1], [penalised]),
        "8 x penalties + 8 free": (words, [penalised] * 8 + [params()] * 8),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    overlapped = LLM(dtype="float32", enable_prefix_caching=False)
    held = LLM(overlapped.loaded, enable_prefix_caching=False)
    held.core.defer_sampling = False  # a structured row's step is not overlapped, a penalised request sits one out
    sync = LLM(overlapped.loaded, enable_prefix_caching=False, async_scheduling=False)
    engines = {"overlapped": overlapped, "not overlapped": held, "synchronous": sync}
    print(f"# {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.processor() or platform.machine()}, "
          f"medians of {args.reps}, generated tok/s\n")
    print("| workload | overlapped | not overlapped | synchronous | overlapped / not | same tokens |")
    print("|---|---|---|---|---|---|")
    for name, (prompts, params) in workloads(overlapped).items():
        times, outs = {k: [] for k in engines}, {}
        for llm in engines.values():  # warm-up: every step shape compiled
            llm.generate(prompts, params, use_tqdm=False)
        for _ in range(args.reps):
            for label, llm in engines.items():
                t0 = time.perf_counter()
                outs[label] = llm.generate(prompts, params, use_tqdm=False)
                times[label].append(time.perf_counter() - t0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs["overlapped"])
        rate = {k: tokens / statistics.median(v) for k, v in times.items()}
        ids = [[o.outputs[0].token_ids for o in outs[k]] for k in engines]
        print(f"| {name} | {rate['overlapped']:.1f} | {rate['not overlapped']:.1f} | {rate['synchronous']:.1f} | "
              f"{rate['overlapped'] / rate['not overlapped']:.2f} | {ids[0] == ids[1] == ids[2]} |", flush=True)


if __name__ == "__main__":
    main()
