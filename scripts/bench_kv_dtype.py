"""What a bfloat16 or float8 KV cache holds, costs and changes, side by side, on the default model
(float32 weights).

For each ``kv_cache_dtype`` (float32, bfloat16, fp8 = fp8_e4m3, fp8_e5m2) at the same ``--kv-cache-memory``:

- **capacity**: the tokens the pool holds;
- **accuracy**: English prompts and the float32 cache's greedy continuations, scored by each
  cache with ``prompt_logprobs`` (teacher-forced, so every position is compared on the same
  text): how often the cache's most likely next token is float32's, the mean and largest
  difference of the text's token logprobs, and the share of greedy continuations identical
  to float32's;
- **speed**: generated tok/s on random prompt ids (greedy, ``ignore_eos``, all requests at
  once), engines alternating ``--reps`` times, the median and its ratio to float32's.

    python scripts/bench_kv_dtype.py
    python scripts/bench_kv_dtype.py --num-requests 48 --output-len 128 --kv-cache-memory 256MiB
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_common import alternating_runs, table

from jaxpaged import LLM, SamplingParams
from jaxpaged.loader import load_model

DTYPES = ("float32", "bfloat16", "fp8", "fp8_e5m2")
TEXTS = [
    "The history of the printing press begins in",
    "To make a good cup of tea, first",
    "Photosynthesis is the process by which plants",
    "The main difference between a list and a tuple in Python is",
    "In 1969, the Apollo 11 mission",
    "A healthy breakfast usually includes",
    "The rules of chess say that a bishop",
    "Paged attention splits the key-value cache into",
    "def quicksort(arr):\n",
    "Dear hiring manager, I am writing to apply for",
    "The water cycle consists of evaporation,",
    "Three tips for learning a new language are",
    "Once upon a time, in a small village by the sea,",
    "The capital cities of Europe include",
    "SELECT name, age FROM users WHERE",
    "The French Revolution began in 1789 when",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    lm = load_model(dtype=np.float32)
    engines = {d: LLM(lm, kv_cache_dtype=d, kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False)
               for d in DTYPES}
    tok = engines["float32"].tokenizer

    greedy = SamplingParams(temperature=0, max_tokens=args.output_len)
    conts = {d: [o.outputs[0].token_ids for o in e.generate(TEXTS, greedy, use_tqdm=False)]
             for d, e in engines.items()}
    texts = [tok(t)["input_ids"] + list(c) for t, c in zip(TEXTS, conts["float32"])]
    score = SamplingParams(max_tokens=1, prompt_logprobs=1)
    scored = {d: e.generate([{"prompt_token_ids": t} for t in texts], score, use_tqdm=False)
              for d, e in engines.items()}

    def per_position(d):
        """(top token, logprob of the text's token) at every scored position."""
        out = []
        for o, t in zip(scored[d], texts):
            for pos, entry in enumerate(o.prompt_logprobs[1:], start=1):
                top = max(entry, key=lambda k: entry[k].logprob)
                out.append((top, entry[t[pos]].logprob))
        return out

    ref = per_position("float32")
    rng = np.random.default_rng(0)
    cfg = lm.config
    bench = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, args.prompt_len).tolist()}
             for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def run(d: str) -> float:
        t = time.perf_counter()
        outs = engines[d].generate(bench, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    rates = alternating_runs(run, DTYPES, args.reps)
    rows = []
    for d in DTYPES:
        e = engines[d]
        pos = per_position(d)
        agree = np.mean([a[0] == b[0] for a, b in zip(pos, ref)])
        diff = np.abs([a[1] - b[1] for a, b in zip(pos, ref)])
        same = np.mean([a == b for a, b in zip(conts[d], conts["float32"])])
        med = statistics.median(rates[d])
        rows.append([d, str(e.runner.kv.k.dtype), e.bm.num_usable_blocks * e.block_size, f"{agree:.4f}",
                     f"{diff.mean():.4f}", f"{diff.max():.3f}", f"{same:.2f}", med,
                     med / statistics.median(rates["float32"]), " / ".join(f"{r:.1f}" for r in rates[d])])
    table(f"KV cache dtypes at {args.kv_cache_memory}: accuracy on {len(TEXTS)} English prompts + "
          f"{args.output_len} greedy tokens ({len(ref)} positions); speed on {args.num_requests} x "
          f"({args.prompt_len} + {args.output_len}) tokens, median of {args.reps}",
          ["kv_cache_dtype", "pool array", "tokens held", "top-1 = float32's", "mean |d logprob|",
           "max |d logprob|", "greedy text = float32's", "generated tok/s", "vs float32", "runs"], rows)


if __name__ == "__main__":
    main()
