"""What sleep mode takes and gives back, on the default model (or ``--model``).

An engine with ``enable_sleep_mode`` runs a few greedy requests, then sleeps and wakes at each
level, ``--reps`` times; the table gives the median seconds of ``sleep`` and ``wake_up``, the
device memory let go (the bytes of the jax arrays alive before and while asleep), and whether the
requests gave the same tokens afterwards.

    python scripts/bench_sleep.py
    python scripts/bench_sleep.py --model ./my-llama --kv-cache-memory 2GiB
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import jax
from bench_common import table

from jaxpaged import LLM, SamplingParams

PROMPTS = ["What is paged attention?", "Write a haiku about memory.", "1, 2, 3, 4,"]


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, enable_sleep_mode=True)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def run():
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    want = run()
    rows = []
    for level in (1, 2):
        sleeps, wakes, freed, same = [], [], [], True
        for _ in range(args.reps):
            held = live_bytes()
            t0 = time.perf_counter()
            llm.sleep(level)
            t1 = time.perf_counter()
            freed.append(held - live_bytes())
            t2 = time.perf_counter()
            llm.wake_up()
            wakes.append(time.perf_counter() - t2)
            sleeps.append(t1 - t0)
            same &= run() == want
        rows.append([f"level {level}", statistics.median(sleeps), statistics.median(wakes),
                     f"{min(freed) / 2**20:.0f}", same])
    table("sleep mode", ["sleep", "sleep s", "wake_up s", "device MiB let go", "same tokens after"], rows,
          [f"{args.reps} rounds each; KV cache {args.kv_cache_memory}; level 2 loads the checkpoint again "
           "(through the converted-weights cache where there is one)"])


if __name__ == "__main__":
    main()
