"""Shared pieces of ``bench.py`` and ``reproduce_seeds.py``.

- ``machine_header``: CPU model, cores, date, load; printed above every table.
- ``measure_ceilings``: memory bandwidth (large copy) and float32 matmul FLOP/s, measured now.
- ``ModelCost``: FLOPs and bytes one engine step must move, from the scheduled chunks;
  the roofline is the sum over steps of ``max(bytes / bandwidth, flops / flop_rate)``.
- ``make_workload``: seeded ShareGPT-like (lognormal) or decode-heavy token-id requests.
- ``run_offline`` / ``run_online``: drive ``LLM.add_request`` / ``LLM.step`` and record
  every step (its wall time, the chunks it ran, KV usage), token timestamps and outputs.
- ``CompileCounter``: XLA compilations (count and seconds), from ``jax.monitoring``.
- ``table`` / ``save_json`` / ``new_figure``: output.

Nothing here edits the engine: the step recorder reads the engine core's last decision
(``llm.core.last``) to see which chunks each step ran, and ``simulate`` drives the same
engine core with a runner that runs no model.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

OUT_DIR = Path(__file__).resolve().parent.parent / "bench_out"

def random_params(cfg, seed: int = 0) -> dict:
    """Random weights for a ``LlamaConfig`` (std 1/sqrt(fan-in)): the same FLOPs and bytes as
    a real checkpoint of that shape, for benchmarks on machines that cannot fetch one."""
    import jax

    from jaxpaged.loader import _abstract_params

    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: rng.standard_normal(a.shape, np.float32) / np.sqrt(a.shape[-1]),
                        _abstract_params(cfg))


def decode_metadata(lens: np.ndarray, tables: np.ndarray, block_size: int):
    """The attention metadata of a decode step: row ``i`` adds its token at position
    ``lens[i] - 1`` of a sequence whose blocks are ``tables[i]``."""
    import jax.numpy as jnp

    from jaxpaged.attention import AttentionMetadata

    S, last = len(lens), np.asarray(lens) - 1
    return AttentionMetadata(positions=jnp.asarray(last, jnp.int32),
                             slot_mapping=jnp.asarray(tables[np.arange(S), last // block_size] * block_size
                                                      + last % block_size, jnp.int32),
                             block_tables=jnp.asarray(tables), context_lens=jnp.asarray(lens, jnp.int32),
                             query_start_loc=jnp.arange(S + 1, dtype=jnp.int32), decode_only=True)


# ---- machine ------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    model, cpus = platform.processor() or platform.machine(), os.cpu_count()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in lscpu.splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "Model name":
                model = val.strip()
            elif key.strip() == "CPU(s)":
                cpus = int(val.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    info = {"cpu": model, "cores": cpus, "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "python": platform.python_version()}
    try:
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    try:
        import jax
        info["jax"] = f"{jax.__version__} {jax.default_backend()}"
    except ImportError:
        pass
    try:  # the engine is edited while benchmarks run: record exactly which tree was measured
        info["git"] = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                                     timeout=10, cwd=Path(__file__).resolve().parent).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        info["git"] = "?"
    return info


def machine_header() -> str:
    """``CPU model, N cores | date | jax version backend, load`` for the top of every table."""
    m = machine_info()
    load = m.get("load_avg_1m")
    text = f"{m['cpu']}, {m['cores']} cores | {m['date']} | jax {m.get('jax', '?')} | git {m.get('git', '?')}"
    if load is not None:
        text += f", load {load} on {m['cores']} cores"
        if load > 0.5 * m["cores"]:
            text += " (busy: numbers are noisy)"
    return text


# ---- output -------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        a = abs(v)
        return f"{v:,.0f}" if a >= 100 else f"{v:.1f}" if a >= 10 else f"{v:.2f}" if a >= 1 else f"{v:.3g}"
    return str(v)


def table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]], notes: Sequence[str] = ()) -> str:
    """A markdown table under a title and the machine header; printed and returned."""
    rows = [[fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) if i else c.ljust(w)  # noqa: E731
                                           for i, (c, w) in enumerate(zip(cells, widths))) + " |"
    out = [f"\n### {title}", f"_{machine_header()}_", "", line(headers),
           "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2)) for i, w in enumerate(widths)) + "|"]
    out += [line(r) for r in rows]
    out += [f"- {n}" for n in notes]
    text = "\n".join(out)
    print(text, flush=True)
    return text


def _jsonable(x):
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(x).items()}
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def save_json(name: str, obj: Any) -> Path:
    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / name
    path.write_text(json.dumps(_jsonable(obj), indent=1))
    print(f"wrote {path}")
    return path


def new_figure(nrows: int, ncols: int, title: str, size=(6.0, 4.0)):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(nrows, ncols, figsize=(size[0] * ncols, size[1] * nrows), squeeze=False)
    fig.suptitle(f"{title}\n{machine_header()}", fontsize=9)
    return fig, axes


def save_figure(fig, name: str) -> Path:
    import matplotlib.pyplot as plt

    OUT_DIR.mkdir(exist_ok=True)
    path = OUT_DIR / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def percentile(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, np.float64), q)) if len(xs) else float("nan")


def alternating_runs(run: Callable[[str], float], cases: Iterable[str], reps: int) -> dict[str, list[float]]:
    """``run(case)`` for every case ``reps`` times, the cases taking turns within each round (this
    machine's speed drifts within minutes, so side by side is the only fair order), after one
    untimed round that compiles every step shape."""
    cases = list(cases)
    for case in cases:
        run(case)
    rates: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(reps):
        for case in cases:
            rates[case].append(run(case))
    return rates


# ---- ceilings -----------------------------------------------------------------------


def _best_median(f, reps: int) -> tuple[float, float]:
    f()  # warm up (page faults, compilation)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts), float(np.median(ts))


def host_op_times(fn, *, reps: int = 3, top: int = 15) -> tuple[list[tuple[str, float, float]], float]:
    """Where ``fn()``'s time goes on a CPU backend: ``([(op, ms per call, share)], ms per call)``.

    Runs ``fn`` (which returns something to block on) ``reps`` times under ``jax.profiler`` and
    sums each XLA op's *self* time over the threads that ran it (a ``while`` or ``cond`` minus
    the ops inside it; the executor's and Python's own frames left out). An op split between
    threads shows only the part its own thread ran, so the sum is a lower bound of the work and
    the shares are of what the trace shows. The second value is the busiest thread's traced
    time per call.
    """
    import glob
    import tempfile

    import jax
    from jax.profiler import ProfileData

    jax.block_until_ready(fn())
    with tempfile.TemporaryDirectory() as folder:
        with jax.profiler.trace(folder):
            for _ in range(reps):
                jax.block_until_ready(fn())
        pd = ProfileData.from_file(sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))[-1])
        self_ns: collections.Counter = collections.Counter()
        busiest = 0
        for plane in pd.planes:
            if not plane.name.startswith("/host:CPU"):
                continue
            for line in plane.lines:
                events = sorted((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name) for ev in line.events
                                if not ev.name.startswith(("ThunkExecutor", "$", "PjitFunction", "python")))
                stack: list[tuple[int, str]] = []  # (end, name) of the enclosing events
                line_ns = 0
                for start, end, name in events:
                    while stack and stack[-1][0] <= start:
                        stack.pop()
                    if stack:
                        self_ns[stack[-1][1]] -= end - start
                    else:
                        line_ns += end - start
                    self_ns[name] += end - start
                    stack.append((end, name))
                busiest = max(busiest, line_ns)
    total = sum(v for v in self_ns.values() if v > 0)
    rows = [(name, ns / 1e6 / reps, ns / total) for name, ns in self_ns.most_common(top)]
    return rows, busiest / 1e6 / reps


def measure_ceilings(*, quick: bool = False) -> dict[str, float]:
    """Memory bandwidth (bytes read + written by a large copy) and float32 matmul FLOP/s.

    Each figure is the best of several runs (a ceiling is what the machine can do), with
    the median beside it to show the noise. The ceilings used for the roofline are the
    better of numpy and jax.
    """
    import jax
    import jax.numpy as jnp

    reps = 3 if quick else 7
    nbytes = 256 << 20
    a = np.ones(nbytes // 4, np.float32)
    b = np.empty_like(a)
    np_bw = [2 * nbytes / t for t in _best_median(lambda: np.copyto(b, a), reps)]
    # Donated, so XLA writes in place: a fresh 256 MiB output per call would time page faults.
    add = jax.jit(lambda x: x + 1.0, donate_argnums=0)
    box = [jnp.ones(nbytes // 4, jnp.float32)]

    def jax_copy():
        box[0] = add(box[0])
        box[0].block_until_ready()

    jax_bw = [2 * nbytes / t for t in _best_median(jax_copy, reps)]
    # A read alone (a sum on every thread): what a batch-1 decode, which only reads its weights,
    # can reach. On a 2-vCPU Xeon ~22-24 GB/s, about half the copy's bytes read + written.
    total = jax.jit(jnp.sum)
    read_bw = [nbytes / t for t in _best_median(lambda: total(box[0]).block_until_ready(), reps)]
    del a, b, box

    n = 1536 if quick else 2048
    m1 = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    m2 = np.random.default_rng(1).standard_normal((n, n), dtype=np.float32)
    np_mm = [2 * n ** 3 / t for t in _best_median(lambda: m1 @ m2, reps)]
    j1, j2 = jnp.asarray(m1), jnp.asarray(m2)
    dot = jax.jit(jnp.dot)
    jax_mm = [2 * n ** 3 / t for t in _best_median(lambda: dot(j1, j2).block_until_ready(), reps)]
    # Decode-shaped matmuls (M = 64 rows, the model's MLP and LM head): what small batches get
    x = jnp.asarray(np.random.default_rng(2).standard_normal((64, 576), dtype=np.float32))
    w_mlp = jnp.asarray(np.random.default_rng(3).standard_normal((576, 1536), dtype=np.float32))
    w_head = jnp.asarray(np.random.default_rng(4).standard_normal((49152, 576), dtype=np.float32))
    mlp = jax.jit(lambda x, w: x @ w)
    head = jax.jit(lambda x, w: jnp.einsum("SD,VD->SV", x, w))
    small_mlp = [2 * 64 * 576 * 1536 / t for t in _best_median(lambda: mlp(x, w_mlp).block_until_ready(), reps)]
    small_head = [2 * 64 * 576 * 49152 / t for t in _best_median(lambda: head(x, w_head).block_until_ready(), reps)]
    return {
        "matmul_jax_m64_mlp_best": small_mlp[0], "matmul_jax_m64_mlp_median": small_mlp[1],
        "matmul_jax_m64_head_best": small_head[0], "matmul_jax_m64_head_median": small_head[1],
        "bandwidth_numpy_best": np_bw[0], "bandwidth_numpy_median": np_bw[1],
        "bandwidth_jax_best": jax_bw[0], "bandwidth_jax_median": jax_bw[1],
        "read_bandwidth": read_bw[0], "read_bandwidth_median": read_bw[1],
        "matmul_numpy_best": np_mm[0], "matmul_numpy_median": np_mm[1],
        "matmul_jax_best": jax_mm[0], "matmul_jax_median": jax_mm[1], "matmul_n": n,
        "bandwidth": max(np_bw[0], jax_bw[0]), "flops": max(np_mm[0], jax_mm[0]),
        "bandwidth_median": max(np_bw[1], jax_bw[1]), "flops_median": max(np_mm[1], jax_mm[1]),
    }


def ceilings_table(c: dict[str, float], title: str = "Ceilings measured in this run") -> str:
    rows = [["memory bandwidth, numpy copy 256 MiB (GB/s, read + write)", c["bandwidth_numpy_best"] / 1e9,
             c["bandwidth_numpy_median"] / 1e9],
            ["memory bandwidth, jax x + 1 in place over 256 MiB (GB/s)", c["bandwidth_jax_best"] / 1e9,
             c["bandwidth_jax_median"] / 1e9],
            ["read bandwidth, jax sum over 256 MiB (GB/s, read)", c["read_bandwidth"] / 1e9,
             c["read_bandwidth_median"] / 1e9],
            [f"float32 matmul numpy {c['matmul_n']}^3 (GFLOP/s)", c["matmul_numpy_best"] / 1e9,
             c["matmul_numpy_median"] / 1e9],
            [f"float32 matmul jax {c['matmul_n']}^3 (GFLOP/s)", c["matmul_jax_best"] / 1e9,
             c["matmul_jax_median"] / 1e9],
            ["info: jax [64,576]x[576,1536] (an MLP matmul at batch 64, GFLOP/s)", c["matmul_jax_m64_mlp_best"] / 1e9,
             c["matmul_jax_m64_mlp_median"] / 1e9],
            ["info: jax [64,576]x[49152,576]^T (the LM head at batch 64, GFLOP/s)",
             c["matmul_jax_m64_head_best"] / 1e9, c["matmul_jax_m64_head_median"] / 1e9]]
    return table(title, ["ceiling", "best", "median"], rows,
                 [f"roofline uses the best: {c['bandwidth'] / 1e9:.1f} GB/s and {c['flops'] / 1e9:.0f} GFLOP/s; "
                  "the single stream's read floor (--peers llama.cpp) the read bandwidth",
                  "info rows: decode-shaped matmuls, not used by the roofline (it takes the large-matmul rate)"])


# ---- the model's cost per step ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Work one step must do, from the chunks it ran: ``(start, num_new_tokens, samples)``.

    FLOPs: ``2 * body_params`` per token (every matmul but the LM head), ``2 * head_params``
    per sampled token (prefill tokens that sample nothing skip the LM head), and attention
    ``4 * layers * heads * head_dim * context`` per token (QK^T and PV at the token's own
    context). Bytes: every weight once per step, the K/V of every scheduled sequence's
    context once (read), and the new tokens' K/V (written).
    """

    num_params: int  # every weight a step multiplies with (an untied embedding is only looked up)
    head_params: int  # the LM head (the tied embedding for SmolLM2)
    weight_bytes: int
    kv_bytes_per_token: int  # K and V, all layers
    attn_flops_per_ctx: int  # 4 * layers * heads * head_dim

    @classmethod
    def from_loaded(cls, lm, kv_dtype=None) -> ModelCost:
        """``kv_dtype``: the pool's (default: the model's; on CPU a 16-bit model's pool is float32)."""
        import jax
        from flax import nnx

        cfg = lm.config
        leaves = jax.tree.leaves(nnx.state(lm.model, nnx.Param))
        n = sum(int(np.prod(x.shape)) for x in leaves)
        itemsize = leaves[0].dtype.itemsize
        # An untied embedding is only looked up (a few rows a step): neither read whole nor multiplied.
        lookup = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
        return cls(num_params=n - lookup, head_params=cfg.vocab_size * cfg.hidden_size,
                   weight_bytes=(n - lookup) * itemsize,
                   kv_bytes_per_token=cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim
                   * (itemsize if kv_dtype is None else np.dtype(kv_dtype).itemsize),
                   attn_flops_per_ctx=4 * cfg.num_layers * cfg.num_heads * cfg.head_dim)

    @property
    def body_params(self) -> int:
        # num_params leaves out an untied embedding; a tied one is the LM head, counted there.
        return self.num_params - self.head_params

    def step(self, chunks: Sequence[tuple[int, int, bool]]) -> tuple[float, float]:
        """(FLOPs, bytes) of one step."""
        flops, nbytes = 0.0, float(self.weight_bytes)
        for start, n, samples in chunks:
            ctx_sum = n * start + n * (n + 1) / 2  # sum over the chunk's tokens of their context length
            flops += 2.0 * self.body_params * n + (2.0 * self.head_params if samples else 0.0) \
                + self.attn_flops_per_ctx * ctx_sum
            nbytes += self.kv_bytes_per_token * (start + 2 * n)  # read the context, write the new tokens
        return flops, nbytes

    def floor_s(self, chunks, bandwidth: float, flop_rate: float) -> float:
        flops, nbytes = self.step(chunks)
        return max(flops / flop_rate, nbytes / bandwidth)


# ---- workloads ----------------------------------------------------------------------

SHAREGPT_PROMPT_MEAN, SHAREGPT_OUTPUT_MEAN, SHAREGPT_SIGMA = 161.0, 338.0, 1.0  # vLLM paper's ShareGPT means
FIRST_ORDINARY_TOKEN = 256  # skip special and byte tokens at the start of the vocabulary


@dataclasses.dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    seed: int
    description: str

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def subset(self, n: int) -> Workload:
        return dataclasses.replace(self, prompts=self.prompts[:n], max_tokens=self.max_tokens[:n],
                                   description=f"{self.description} (first {n})")

    def with_fresh_ids(self, seed: int, vocab_size: int, shared_prefix_len: int = 0) -> Workload:
        """Same lengths, other token ids: warms up the same shapes without prefix-cache hits.

        ``shared_prefix_len``: the first tokens are one new prefix shared by every prompt
        again, so the warm-up sees the same prefix-cache hits (and so shapes) as the run.
        """
        rng = np.random.default_rng(seed)
        prefix = rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, shared_prefix_len).tolist()
        return dataclasses.replace(self, prompts=[
            prefix + rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, len(p) - shared_prefix_len).tolist()
            for p in self.prompts])

    def summary(self) -> dict[str, Any]:
        p, o = np.asarray(self.prompt_lens), np.asarray(self.max_tokens)
        return {"name": self.name, "num_requests": len(self), "seed": self.seed, "description": self.description,
                "prompt_tokens": int(p.sum()), "output_tokens": int(o.sum()),
                "prompt_len_mean": float(p.mean()), "prompt_len_p50": float(np.median(p)),
                "prompt_len_max": int(p.max()), "output_len_mean": float(o.mean()),
                "output_len_p50": float(np.median(o)), "output_len_max": int(o.max())}


def make_workload(kind: str, num_requests: int, *, vocab_size: int, max_model_len: int, seed: int = 0,
                  prompt_len: int | None = None, output_len: int | None = None,
                  shared_prefix: Sequence[int] = ()) -> Workload:
    """Seeded token-id requests.

    ``sharegpt``: prompt and output lengths from lognormals with the vLLM paper's ShareGPT
    means (161 and 338 tokens, sigma 1), clipped so prompt + output fits ``max_model_len``.
    ``decode-heavy``: prompts of 90-110 tokens (``prompt_len`` +-10%), ``output_len``
    (default 256) new tokens each. ``fixed``: exactly ``prompt_len`` and ``output_len``.
    ``shared_prefix`` is prepended to every prompt (and counts in its length).
    """
    rng = np.random.default_rng(seed)
    if kind == "sharegpt":
        mu_p = math.log(prompt_len or SHAREGPT_PROMPT_MEAN) - SHAREGPT_SIGMA ** 2 / 2
        mu_o = math.log(output_len or SHAREGPT_OUTPUT_MEAN) - SHAREGPT_SIGMA ** 2 / 2
        p = np.clip(np.rint(rng.lognormal(mu_p, SHAREGPT_SIGMA, num_requests)), 4, max_model_len // 2).astype(int)
        o = np.rint(rng.lognormal(mu_o, SHAREGPT_SIGMA, num_requests)).astype(int)
        o = np.clip(o, 4, max_model_len - p).astype(int)
        desc = (f"lognormal lengths (prompt mean {prompt_len or SHAREGPT_PROMPT_MEAN:.0f}, output mean "
                f"{output_len or SHAREGPT_OUTPUT_MEAN:.0f}, sigma {SHAREGPT_SIGMA}), clipped to {max_model_len}")
    elif kind == "decode-heavy":
        base = prompt_len or 100
        p = rng.integers(int(base * 0.9), int(base * 1.1) + 1, num_requests)
        o = np.full(num_requests, output_len or 256)
        desc = f"prompts {int(base * 0.9)}-{int(base * 1.1)} tokens, {output_len or 256} new tokens each"
    elif kind == "fixed":
        p = np.full(num_requests, prompt_len)
        o = np.full(num_requests, output_len)
        desc = f"prompts of {prompt_len} tokens, {output_len} new tokens each"
    else:
        raise ValueError(f"unknown workload {kind!r}; choose sharegpt, decode-heavy or fixed")
    prefix = list(shared_prefix)
    if prefix:
        desc += f", a shared {len(prefix)}-token prefix"
    prompts = [prefix + rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, int(n) - len(prefix)).tolist() for n in p]
    if any(len(q) + int(m) > max_model_len for q, m in zip(prompts, o)):
        raise ValueError(f"a request exceeds max_model_len={max_model_len}")
    return Workload(kind, prompts, [int(m) for m in o], seed, desc)


def poisson_arrivals(n: int, rate: float, seed: int) -> np.ndarray:
    """Arrival offsets (s) of ``n`` requests at ``rate`` requests/s; the first at 0."""
    gaps = np.random.default_rng(seed + 7919).exponential(1.0 / rate, n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# ---- compilations -------------------------------------------------------------------


class CompileCounter:
    """Counts XLA backend compilations (and their seconds) by function name, process-wide."""

    _instance: CompileCounter | None = None

    def __init__(self):
        self.count: collections.Counter[str] = collections.Counter()
        self.seconds: collections.Counter[str] = collections.Counter()

    @classmethod
    def get(cls) -> CompileCounter:
        if cls._instance is None:
            import jax

            cls._instance = inst = cls()

            def listener(event: str, duration: float, **kw):
                if event == "/jax/core/compile/backend_compile_duration":
                    name = str(kw.get("fun_name", "?"))
                    inst.count[name] += 1
                    inst.seconds[name] += duration

            jax.monitoring.register_event_duration_secs_listener(listener)
        return cls._instance

    def snapshot(self) -> tuple[int, float]:
        return sum(self.count.values()), sum(self.seconds.values())


# ---- driving the engine -------------------------------------------------------------


@dataclasses.dataclass
class StepRecord:
    t_start: float  # perf_counter at the step's start
    seconds: float  # wall time of llm.step()
    chunks: list[tuple[int, int, bool]]  # (start, num_new_tokens, samples) per scheduled sequence
    used_blocks: int
    tokens_stored: int
    slots_allocated: int
    running: int  # requests in the running queue after the step

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n, _ in self.chunks)

    @property
    def decode_only(self) -> bool:
        return bool(self.chunks) and all(n == 1 for _, n, _ in self.chunks)


@dataclasses.dataclass
class RunResult:
    label: str
    wall_s: float
    steps: list[StepRecord]
    num_prompt_tokens: int
    num_generated: int
    num_requests: int
    token_times: dict[str, list[float]]  # request id -> perf_counter time each output token came back
    arrivals: dict[str, float]  # request id -> perf_counter time it arrived (online: its scheduled time)
    engine_stats: dict[str, Any]  # llm.stats() deltas over the run (timers, steps, preemptions)
    compiles: int  # XLA compilations during the run
    compile_s: float
    new_shapes: int  # step shapes first seen during the run
    wrong_lengths: int  # requests whose output length differs from max_tokens
    outputs: dict[int, list[int]]  # workload index -> first completion's token ids
    cpu_s: float = float("nan")  # CPU time of the whole process (every thread) over the run

    @property
    def cores_busy(self) -> float:
        """CPU seconds per wall second: how many of the machine's cores the run kept busy."""
        return self.cpu_s / self.wall_s

    @property
    def gen_tok_s(self) -> float:
        return self.num_generated / self.wall_s

    @property
    def total_tok_s(self) -> float:
        return (self.num_generated + self.num_prompt_tokens) / self.wall_s

    @property
    def req_s(self) -> float:
        return self.num_requests / self.wall_s

    def kv_at_peak(self) -> dict[str, float]:
        """Utilization (stored / allocated) at the step that used the most blocks, and averages."""
        steps = [s for s in self.steps if s.slots_allocated]
        if not steps:
            return {"peak_used_blocks": 0, "utilization_at_peak": float("nan"), "utilization_avg": float("nan")}
        peak = max(steps, key=lambda s: (s.used_blocks, s.tokens_stored))
        return {"peak_used_blocks": peak.used_blocks, "utilization_at_peak": peak.tokens_stored / peak.slots_allocated,
                "utilization_avg": sum(s.tokens_stored for s in steps) / sum(s.slots_allocated for s in steps),
                "max_running": max(s.running for s in self.steps)}

    def latency(self) -> dict[str, float]:
        ttft = [ts[0] - self.arrivals[r] for r, ts in self.token_times.items() if ts]
        itl = [b - a for ts in self.token_times.values() for a, b in zip(ts, ts[1:])]
        e2e = [ts[-1] - self.arrivals[r] for r, ts in self.token_times.items() if ts]
        return {"ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
                "ttft_mean_s": float(np.mean(ttft)) if ttft else float("nan"),
                "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
                "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99)}

    def slowest_steps(self, k: int = 3) -> list[dict[str, Any]]:
        """The ``k`` slowest steps and their shapes: where a cliff in step time shows up."""
        worst = sorted(range(len(self.steps)), key=lambda i: -self.steps[i].seconds)[:k]
        return [{"step": i, "seconds": self.steps[i].seconds, "seqs": len(self.steps[i].chunks),
                 "tokens": self.steps[i].num_tokens, "decode_only": self.steps[i].decode_only,
                 "max_context": max((a + n for a, n, _ in self.steps[i].chunks), default=0)} for i in worst]

    def phase_split(self) -> dict[str, float]:
        decode = [s for s in self.steps if s.decode_only]
        mixed = [s for s in self.steps if not s.decode_only]
        return {"decode_steps": len(decode), "decode_s": sum(s.seconds for s in decode),
                "prefill_or_mixed_steps": len(mixed), "prefill_or_mixed_s": sum(s.seconds for s in mixed),
                "decode_step_median_s": float(np.median([s.seconds for s in decode])) if decode else float("nan")}

    def roofline(self, cost: ModelCost, bandwidth: float, flop_rate: float) -> dict[str, float]:
        flops = nbytes = floor = 0.0
        for s in self.steps:
            f, b = cost.step(s.chunks)
            flops, nbytes = flops + f, nbytes + b
            floor += max(f / flop_rate, b / bandwidth)
        return {"flops": flops, "bytes": nbytes, "roofline_s": floor,
                "roofline_gen_tok_s": self.num_generated / floor if floor else float("nan"),
                "fraction_of_roofline": floor / self.wall_s if self.wall_s else float("nan"),
                "achieved_gflop_s": flops / self.wall_s / 1e9, "achieved_gb_s": nbytes / self.wall_s / 1e9}

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "wall_s": self.wall_s, "num_requests": self.num_requests,
                "num_prompt_tokens": self.num_prompt_tokens, "num_generated": self.num_generated,
                "gen_tok_s": self.gen_tok_s, "total_tok_s": self.total_tok_s, "req_s": self.req_s,
                "num_steps": len(self.steps), "compiles": self.compiles, "compile_s": self.compile_s,
                "new_shapes": self.new_shapes, "wrong_lengths": self.wrong_lengths,
                "slowest_steps": self.slowest_steps(),
                **self.kv_at_peak(), **self.phase_split(), "engine": self.engine_stats}


def _chunks(llm) -> list[tuple[int, int, bool]]:
    """(start, num_new_tokens, samples) of each sequence the engine's last step ran."""
    out = llm.core.last
    return [] if out is None else [(s.start, s.num_new_tokens, s.samples) for s in out.scheduled]


_TIMER_KEYS = ("num_steps", "num_preemptions", "time_schedule_s", "time_batch_s", "time_device_s",
               "time_postprocess_s", "num_compiled_shapes", "prefix_cache_hits", "prefix_cache_queries")


def _drive(llm, workload: Workload, params_for, label: str, *, arrivals: np.ndarray | None,
           progress: bool) -> RunResult:
    from tqdm.auto import tqdm

    counter = CompileCounter.get()
    c0, cs0 = counter.snapshot()
    shapes0 = len(llm.runner.compiled_shapes)
    before = llm.stats()
    order = list(range(len(workload)))
    ids: dict[str, int] = {}
    token_times: dict[str, list[float]] = {}
    arrival_t: dict[str, float] = {}
    finished: dict[str, int] = {}
    outputs: dict[int, list[int]] = {}
    bar = tqdm(total=len(workload), desc=label, unit="req", disable=not progress, dynamic_ncols=True, leave=False)
    steps: list[StepRecord] = []
    generated = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    due = collections.deque(order) if arrivals is not None else None
    if arrivals is None:
        for i in order:
            rid = llm.add_request(workload.prompts[i], params_for(i))
            ids[rid], token_times[rid], arrival_t[rid] = i, [], t0
    try:
        while True:
            now = time.perf_counter()
            if due is not None:
                while due and t0 + arrivals[due[0]] <= now:
                    i = due.popleft()
                    rid = llm.add_request(workload.prompts[i], params_for(i))
                    ids[rid], token_times[rid], arrival_t[rid] = i, [], t0 + float(arrivals[i])
                if not llm.has_unfinished_requests():
                    if not due:
                        break
                    time.sleep(max(0.0, t0 + arrivals[due[0]] - time.perf_counter()))
                    continue
            elif not llm.has_unfinished_requests():
                break
            ts = time.perf_counter()
            outs = llm.step()
            te = time.perf_counter()
            m = llm.bm.stats()
            steps.append(StepRecord(ts, te - ts, _chunks(llm), m.num_used_blocks, m.tokens_stored, m.slots_allocated,
                                    len(llm.scheduler.running)))
            for o in outs:
                if o.request_id not in token_times:
                    continue
                n = len(o.outputs[0].token_ids) if o.outputs else 0
                times = token_times[o.request_id]
                if n > len(times):
                    times.extend([te] * (n - len(times)))
                if o.finished and o.request_id not in finished:
                    finished[o.request_id] = sum(len(c.token_ids) for c in o.outputs)
                    outputs[ids[o.request_id]] = list(o.outputs[0].token_ids)
                    generated += finished[o.request_id]
                    bar.update(1)
                    bar.set_postfix_str(f"{generated / (te - t0):.1f} tok/s")
    finally:
        bar.close()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = llm.stats()
    c1, cs1 = counter.snapshot()
    wrong = sum(1 for rid, n in finished.items()
                if n != workload.max_tokens[ids[rid]] * max(1, params_for(ids[rid]).n))
    return RunResult(
        label=label, wall_s=wall, steps=steps, num_prompt_tokens=sum(len(workload.prompts[i]) for i in ids.values()),
        num_generated=generated, num_requests=len(finished), token_times=token_times, arrivals=arrival_t,
        engine_stats={k: after[k] - before[k] for k in _TIMER_KEYS} | {"peak_kv_utilization": after[
            "peak_kv_utilization"]},
        compiles=c1 - c0, compile_s=cs1 - cs0, new_shapes=len(llm.runner.compiled_shapes) - shapes0,
        wrong_lengths=wrong + (len(workload) - len(finished)), outputs=outputs, cpu_s=cpu)


# ---- host-only simulation -------------------------------------------------------------


@dataclasses.dataclass
class SimResult:
    steps: int
    preemptions: int
    used_blocks: list[int]  # per step
    tokens_stored: list[int]
    slots_allocated: list[int]
    running: list[int]  # requests running after each step
    num_blocks: int  # usable blocks of the pool
    block_size: int
    scheduled_tokens: int = 0  # tokens run through the model, recomputation included
    ideal_tokens: int = 0  # prompts + outputs - 1 per request: the work without preemption

    def summary(self) -> dict[str, float]:
        used, stored, alloc = map(np.asarray, (self.used_blocks, self.tokens_stored, self.slots_allocated))
        peak = int(np.lexsort((stored, used))[-1])
        pool_slots = self.num_blocks * self.block_size
        return {"steps": self.steps, "preemptions": self.preemptions, "peak_used_blocks": int(used.max()),
                "utilization_at_peak": float(stored[peak] / alloc[peak]) if alloc[peak] else float("nan"),
                "utilization_avg": float(stored.sum() / alloc.sum()) if alloc.sum() else float("nan"),
                "budget_holding_tokens_avg": float(stored.mean() / pool_slots),
                "max_running": int(max(self.running)), "mean_running": float(np.mean(self.running)),
                "recomputed_fraction": self.scheduled_tokens / self.ideal_tokens - 1 if self.ideal_tokens else 0.0}


class ConstantRunner:
    """An engine-core runner that runs no model: every sampled row gets the same ordinary token.

    Token values only matter for prefix-cache hits (random ids never hit) and stops (EOS
    ignored), so memory, concurrency and preemption are exactly the engine's.
    """

    def dispatch(self, out, prev=None):
        return out

    def collect(self, out):
        from jaxpaged.scheduler import RunnerOutput
        from jaxpaged.sampler import SamplerOutput

        rows = sum(s.num_samples for s in out.scheduled)
        return RunnerOutput(SamplerOutput(np.full(rows, FIRST_ORDINARY_TOKEN), np.zeros(rows), np.ones(rows, int),
                                          np.full((rows, 1), FIRST_ORDINARY_TOKEN), np.zeros((rows, 1))))


def simulate(bm, workload: Workload, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 512,
             preemption_mode: str = "recompute", max_model_len: int = 1 << 20) -> SimResult:
    """Run the engine core (its scheduler, stop rule and all) over a block manager with no
    model (``ConstantRunner``): exact memory and concurrency, at host speed."""
    from jaxpaged.engine_core import EngineCore
    from jaxpaged.scheduler import Scheduler
    from jaxpaged.sequence import Request

    core = EngineCore(Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=bm.max_model_len or max_model_len, preemption_mode=preemption_mode),
                      ConstantRunner())
    for i, (p, m) in enumerate(zip(workload.prompts, workload.max_tokens)):
        core.add(Request(f"sim{i}", None, list(p), greedy_params(m), 0.0, i))
    res = SimResult(0, 0, [], [], [], [], 0, bm.block_size,
                    ideal_tokens=sum(map(len, workload.prompts)) + sum(workload.max_tokens) - len(workload))
    while core.has_unfinished():
        core.step()
        res.scheduled_tokens += core.last.num_batched_tokens
        m = bm.stats()
        res.steps += 1
        res.used_blocks.append(m.num_used_blocks)
        res.tokens_stored.append(m.tokens_stored)
        res.slots_allocated.append(m.slots_allocated)
        res.running.append(len(core.scheduler.running))
        res.num_blocks = m.num_blocks
    res.preemptions = core.scheduler.num_preemptions
    return res


def greedy_params(max_tokens: int, **kw):
    from jaxpaged.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, **kw)


def run_offline(llm, workload: Workload, label: str = "jaxpaged", *, progress: bool = True,
                params_for=None) -> RunResult:
    """Submit every request at once, then step until all finish (default: greedy, ``ignore_eos``)."""
    params_for = params_for or (lambda i: greedy_params(workload.max_tokens[i]))
    return _drive(llm, workload, params_for, label, arrivals=None, progress=progress)


def run_online(llm, workload: Workload, rate: float, label: str = "jaxpaged online", *, seed: int = 0,
               progress: bool = True, params_for=None) -> RunResult:
    """Requests arrive by a Poisson process at ``rate``/s on the wall clock; TTFT counts from arrival."""
    arrivals = poisson_arrivals(len(workload), rate, seed)
    params_for = params_for or (lambda i: greedy_params(workload.max_tokens[i]))
    return _drive(llm, workload, params_for, label, arrivals=arrivals, progress=progress)


def warm_then_run(llm, workload: Workload, *, vocab_size: int, label: str, progress: bool = True,
                  warmup: bool = True, params_for=None) -> tuple[RunResult, RunResult | None]:
    """Compile every step shape with the same lengths (fresh ids, no prefix hits), then time."""
    warm = None
    if warmup:
        warm = run_offline(llm, workload.with_fresh_ids(workload.seed + 10_000, vocab_size), f"{label} (warm-up)",
                           progress=progress, params_for=params_for)
    return run_offline(llm, workload, label, progress=progress, params_for=params_for), warm
