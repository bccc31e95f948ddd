"""Benchmark ``jax.jit(sample)`` at the default model's vocabulary and print a markdown table.

For S in {1, 8, 64} rows and V = 49152 (SmolLM2), per sampling setting: the compile time
(``lower(...).compile()``), the median and best time of one call (compiled, inputs on
device, ``block_until_ready``), and the median time of ``truncate_logits`` alone. With
``--baseline REV`` the sampler of that git revision is timed too, cell by cell next to
the working tree's, in the same process (e.g. ``--baseline HEAD`` while the working tree
holds a change to ``jaxpaged/sampler.py``).

The run starts by measuring what bounds the top-p search on this machine: memory
bandwidth, and one masked row-sum over ``[S, V]`` (``sum(where(logits > t, p, 0))``),
the body of the bisection; 32 of them predict its cost. XLA:CPU does not fuse the
``where`` into the sum: each step writes and reads an ``[S, V]`` temporary.

    python scripts/bench_sampler.py                     # the working tree's sampler
    python scripts/bench_sampler.py --baseline HEAD     # before / after
    python scripts/bench_sampler.py --rows 1 8 --repeat 5

A script, not a test: timings depend on the machine and its load (take ranges).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import os
import platform
import subprocess
import sys
import time
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

import jaxpaged.sampler
from jaxpaged.sampling_params import SamplingParams

VOCAB = 49152
SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "top_p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k 50": SamplingParams(temperature=0.8, top_k=50),
    "top_k 50 + top_p 0.9": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
}


def sampler_at(rev: str) -> ModuleType:
    """``jaxpaged/sampler.py`` as it is at git revision ``rev``, imported under another name."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = subprocess.run(["git", "show", f"{rev}:jaxpaged/sampler.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    name = f"jaxpaged._sampler_at_{rev.replace('~', '_').replace('^', '_')}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(src, f"{rev}:jaxpaged/sampler.py", "exec"), module.__dict__)
    return module


HEAD = 20


def bench_logits(rows: int, scale: float, flat_rows: float, rng: np.random.Generator) -> jax.Array:
    """``[rows, V]`` logits ~ N(0, scale^2); all but ``flat_rows`` of the rows also get a
    head of ``HEAD`` tokens ~ N(10, 2^2) that holds most of the mass, as a language model's
    next-token distributions mostly do. The flat rows are the ones whose top-p nucleus
    (0.9 at temperature 0.8: thousands of tokens) goes past the sampler's window."""
    x = scale * rng.standard_normal((rows, VOCAB))
    for i in range(round(flat_rows * rows), rows):
        x[i, rng.choice(VOCAB, HEAD, replace=False)] = rng.normal(10.0, 2.0, HEAD)
    return jnp.asarray(x, jnp.float32)


def call_seconds(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return times


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bandwidth_gbs() -> float:
    """Bytes read + written per second by a large in-place numpy multiply (best of 5)."""
    x = np.ones(64 << 20, np.float32)  # 256 MiB
    best = min(_timed(lambda: np.multiply(x, 1.0001, out=x)) for _ in range(5))
    return 2 * x.nbytes / best / 1e9


def masked_sum_ms(rows: int, logits: jax.Array) -> float:
    """One step of the top-p bisection over ``[rows, V]``, in ms."""
    probs = jnp.exp(logits - logits.max(axis=-1, keepdims=True))
    cut = jnp.full((rows,), 2.0, jnp.float32)
    step = jax.jit(lambda x, p, t: jnp.sum(jnp.where(x > t[:, None], p, 0.0), axis=-1))
    jax.block_until_ready(step(logits, probs, cut))
    return 1e3 * float(np.median(call_seconds(lambda: step(logits, probs, cut), 21)))


def bench(module: ModuleType, rows: int, params: SamplingParams, logits: jax.Array, repeat: int
          ) -> dict[str, float | str]:
    """Compile time and call times of ``module.sample`` (and of its truncation alone)."""
    batch = [module.SamplingRow(params, 1000 + i, [], []) for i in range(rows)]
    sm, num_logprobs, use_penalties = module.build_sampling_metadata(batch, rows, VOCAB, [0])
    sm = jax.device_put(sm)
    step = jax.jit(functools.partial(module.sample, num_logprobs=num_logprobs,
                                     use_penalties=use_penalties))
    t = time.perf_counter()
    compiled = step.lower(logits, sm).compile()
    compile_s = time.perf_counter() - t
    jax.block_until_ready(compiled(logits, sm))
    times = call_seconds(lambda: compiled(logits, sm), repeat)
    truncate = jax.jit(module.truncate_logits).lower(logits, sm).compile()
    jax.block_until_ready(truncate(logits, sm))
    plan = f"C={sm.top_k_bound}" + (" search" if getattr(sm, "top_p_search", False) else "")
    return dict(compile_s=compile_s, median_ms=1e3 * np.median(times), best_ms=1e3 * min(times),
                truncate_ms=1e3 * np.median(call_seconds(lambda: truncate(logits, sm), repeat)),
                plan=plan)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--repeat", type=int, default=7, help="timed calls per cell (median)")
    parser.add_argument("--baseline", help="also time jaxpaged/sampler.py at this git revision")
    parser.add_argument("--scale", type=float, default=1.0, help="std of the random logits")
    parser.add_argument("--flat-rows", type=float, default=0.125,
                        help="fraction of rows left flat; the others get a peaked head (see bench_logits)")
    args = parser.parse_args()

    print(f"# sampler benchmark, {datetime.datetime.now():%Y-%m-%d %H:%M}, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, jax {jax.__version__}, load average {os.getloadavg()[0]:.1f}")
    print(f"\nMemory bandwidth (in-place multiply, read + write): {bandwidth_gbs():.1f} GB/s")
    versions = {"after": jaxpaged.sampler}
    if args.baseline:
        versions = {f"before ({args.baseline})": sampler_at(args.baseline), **versions}

    rng = np.random.default_rng(0)
    all_logits = {s: bench_logits(s, args.scale, args.flat_rows, rng) for s in args.rows}
    print("\nOne bisection step, sum(where(logits > t, p, 0)) over [S, V]; 32 of them predict "
          "the top-p search:")
    print("| S | step ms | x 32 ms |\n|---:|---:|---:|")
    for s in args.rows:
        ms = masked_sum_ms(s, all_logits[s])
        print(f"| {s} | {ms:.3f} | {32 * ms:.1f} |", flush=True)

    print(f"\nlogits ~ N(0, {args.scale}^2), V = {VOCAB}, a head of {HEAD} tokens ~ N(10, 2^2) in all but "
          f"{args.flat_rows:.0%} of the rows. compile: lower + compile of sample (s); "
          f"step: median and best of {args.repeat} calls of sample (ms); truncate: median of "
          f"truncate_logits alone (ms); plan: top_k_bound, top_p_search\n")
    cols = ("compile s", "step ms", "best ms", "truncate ms", "plan")
    head = "| setting | S |" + "".join(f" {v}: {cols[0]} |" + "".join(f" {c} |" for c in cols[1:])
                                       for v in versions)
    print(head + "\n|---|---:|" + "---:|---:|---:|---:|---|" * len(versions))
    for name, params in SETTINGS.items():
        for s in args.rows:
            cells = []
            for module in versions.values():
                r = bench(module, s, params, all_logits[s], args.repeat)
                cells += [f"{r['compile_s']:.2f}", f"{r['median_ms']:.1f}", f"{r['best_ms']:.1f}",
                          f"{r['truncate_ms']:.1f}", r["plan"]]
            print(f"| {name} | {s} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
