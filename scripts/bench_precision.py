"""bfloat16 against float32 on the default model: accuracy and speed (issue #18's optional
lower-precision path).

One process, both precisions of the same GGUF:

1. Accuracy, teacher-forced: each prompt followed by float32's greedy continuation is scored
   by both models (``prompt_logprobs``); per position, the logprob of the actual token and
   whether both models rank the same token first. Free-running: how many requests keep
   float32's greedy tokens, and where the first one diverges.
2. Speed, alternating float32 / bfloat16 twice after a warm-up: one request's decode rate
   and a batch's generated tokens per second.

On CPU a bfloat16 model keeps its activations in float32 and multiplies in bfloat16 with
float32 sums (``model._cpu_dot_16bit``): fast where the CPU has AMX or AVX512-BF16, through
XLA:CPU's YNNPACK.

    python scripts/bench_precision.py            # ~5 min on 2 cores
    python scripts/bench_precision.py --quick
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from bench_common import machine_header
from jaxpaged import LLM, SamplingParams
from llama_cpp_peer import cpu_flags

PROMPTS = [
    "The history of the printing press begins",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in two sentences.",
    "The three largest cities in France are",
    "Once upon a time, in a small village,",
    "Photosynthesis is the process by which",
    "List five prime numbers:",
]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def accuracy(llms: dict[str, LLM], prompts: list[str], new_tokens: int) -> None:
    f32, b16 = llms["float32"], llms["bfloat16"]
    outs = {k: llm.generate(prompts, greedy(new_tokens), use_tqdm=False) for k, llm in llms.items()}
    ids32 = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs["float32"]]
    div = [first_divergence(a.outputs[0].token_ids, b.outputs[0].token_ids)
           for a, b in zip(outs["float32"], outs["bfloat16"])]
    scored = {k: llm.generate([{"prompt_token_ids": ids} for ids in ids32], greedy(1, prompt_logprobs=1),
                              use_tqdm=False) for k, llm in (("float32", f32), ("bfloat16", b16))}
    dlp, same_top, n = [], 0, 0
    for o32, o16, ids in zip(scored["float32"], scored["bfloat16"], ids32):
        for pos in range(1, len(ids)):
            p32, p16 = o32.prompt_logprobs[pos], o16.prompt_logprobs[pos]
            tok = ids[pos]
            dlp.append(abs(p32[tok].logprob - p16[tok].logprob))
            top32 = next(t for t, lp in p32.items() if lp.rank == 1)
            top16 = next(t for t, lp in p16.items() if lp.rank == 1)
            same_top += top32 == top16
            n += 1
    dlp = np.array(dlp)
    print(f"\n## Accuracy ({len(prompts)} prompts + {new_tokens} greedy float32 tokens, {n} scored positions)")
    print(f"teacher-forced: same top-1 token at {same_top / n:.2%} of positions; |logprob(bf16) - "
          f"logprob(f32)| of the actual token: mean {dlp.mean():.3f}, p99 {np.percentile(dlp, 99):.3f}, "
          f"max {dlp.max():.3f} nats")
    kept = sum(d is None for d in div)
    firsts = [d for d in div if d is not None]
    print(f"free-running greedy: {kept} of {len(div)} requests keep float32's {new_tokens} tokens"
          + (f"; the others diverge at token {sorted(firsts)}" if firsts else ""))


def speed(llms: dict[str, LLM], batch: int, new_tokens: int, single_tokens: int) -> None:
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, 40000, 100).tolist()} for _ in range(batch)]
    one = [{"prompt_token_ids": rng.integers(100, 40000, 32).tolist()}]
    for llm in llms.values():  # compile every shape first
        llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
        llm.generate(one, greedy(single_tokens), use_tqdm=False)
    rows = {k: [] for k in llms}
    for _ in range(2):
        for k, llm in llms.items():
            t = time.perf_counter()
            llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
            batch_tps = batch * new_tokens / (time.perf_counter() - t)
            t = time.perf_counter()
            llm.generate(one, greedy(1), use_tqdm=False)  # prefill alone
            t_prefill = time.perf_counter() - t
            t = time.perf_counter()
            llm.generate(one, greedy(single_tokens), use_tqdm=False)
            single_tps = (single_tokens - 1) / (time.perf_counter() - t - t_prefill)
            rows[k].append((batch_tps, single_tps))
    print(f"\n## Speed (alternating, two rounds): {batch} requests x {new_tokens} new tokens; one request "
          f"x {single_tokens} (prefill excluded)")
    print(f"{'dtype':<10}{'batch gen tok/s':>20}{'single-stream tok/s':>24}")
    for k, r in rows.items():
        print(f"{k:<10}{' / '.join(f'{b:.0f}' for b, _ in r):>20}{' / '.join(f'{s:.1f}' for _, s in r):>24}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(machine_header(), "| CPU flags:", cpu_flags())
    llms = {dt: LLM(dtype=dt, enable_prefix_caching=False) for dt in ("float32", "bfloat16")}
    accuracy(llms, PROMPTS[:4] if args.quick else PROMPTS, 32 if args.quick else 64)
    speed(llms, 8 if args.quick else 16, 16 if args.quick else 32, 16 if args.quick else 32)


if __name__ == "__main__":
    main()
