"""Benchmark the paged-attention backends on this machine and print a table.

1. Memory bandwidth, measured in the same run: an in-place ``x * c`` over 256 MiB
   (bytes read + written) and a ``sum`` (bytes read).
2. Paged decode attention per backend vs contiguous attention over the same lengths:
   the same online-softmax loop reading a contiguous ``[S, KVH, ctx, D]`` cache with
   ``dynamic_slice`` (so the difference is the cost of paging), and the plain dense
   masked einsum. KV bytes/s = K and V bytes of all sequences / time, and its fraction
   of the measured bandwidth.
3. A decode step (``scan`` over layers of ``write_kv`` + attention, the pool donated) at
   1k / 4k / 16k pool blocks: must be flat.
4. Mixed steps (decode rows beside prompt chunks, as continuous batching admits prompts):
   the xla backend's ragged attention over 30 layers per query block size (the default
   is ``_default_block_q``), and beside it what an exact split would cost, the decode rows
   through the decode path and the prompt rows alone through the ragged one. (The engine
   does not split: a split at a bucketed count leaves some decodes in the ragged part,
   and that measured no better; see docs/measurements.md's "not kept".)
5. The CPU form's four projections (fused q/k/v, o, fused gate/up, down) over the default
   model's 30 layers, random weights, as the engine runs them (a ``lax.switch`` per layer
   inside a scan): ``[in, out]`` weights with the plain dot, with ``model._cpu_dot`` (a
   one-token step splits the contraction), and ``[out, in]`` weights with the plain dot and
   with ``model._cpu_dot`` (a one-token step over a small weight, ``o``'s, runs as a batch of
   two row halves); at 1 and 48 tokens.
   Weight GB/s = the 425 MB of weights / time.
6. The decode forward at 1 and 48 rows (the default model's shapes, random weights, as the
   engine runs it on CPU), whole and with attention left out, beside its floor as
   ``bench.py``'s roofline counts it (weights at the copy bandwidth, matmul FLOPs at the
   2048^3 rate, both measured in this run): what the matmuls alone reach, so how much of
   the floor a step could reach even if attention cost nothing; and how many cores the
   process kept busy (2 vCPUs, 2026-11-27: ~1.6 for the 48-row forward, ~1.85 without its
   attention). ``--trace``
   adds each forward's XLA ops by self time (``bench_common.host_op_times``).

Shapes are the default model's attention (SmolLM2-135M: 9 query heads, 3 KV heads,
head_dim 64, float32), at the engine's default block size on this platform (64 on CPU, 16
on GPU: ``engine_args.default_block_size``). Pallas runs in interpret mode on CPU, which is a
correctness tool; it is timed at one size to justify ``backend="auto"`` = xla on CPU.

    python scripts/bench_kernels.py            # full run, a few minutes
    python scripts/bench_kernels.py --quick    # fewer shapes and repeats
    python scripts/bench_kernels.py --only-forward --trace   # section 6, with where its time goes per op
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpaged.attention import AttentionMetadata, paged_attention
from jaxpaged.engine_args import default_block_size
from jaxpaged.kv_cache import KVPool, write_kv
from jaxpaged.pallas.common import dot_precision
from jaxpaged.pallas.paged_attention import paged_decode_attention
from jaxpaged.pallas.reference import ref_paged_decode_attention
from jaxpaged.pallas.xla import _default_block_q, xla_paged_decode_attention, xla_ragged_paged_attention

HQ, KVH, D = 9, 3, 64
BS = default_block_size(jax.devices()[0].platform)  # the engine's: 64 on CPU, 16 on GPU
DTYPE = jnp.float32


def timeit(f, *args, reps=10, warmup=2):
    """(median, min) seconds of ``f(*args)`` after ``warmup`` calls."""
    return time_round_robin({"f": (f, args)}, reps=reps, warmup=warmup)["f"]


def time_round_robin(cases, reps=10, warmup=2):
    """``{name: (f, args)} -> {name: (median, min)}`` seconds, the cases timed in turn.

    On a shared, noisy machine, alternating the cases spreads the noise over all of them
    instead of biasing whichever ran during a busy spell.
    """
    for f, args in cases.values():
        for _ in range(warmup):
            jax.block_until_ready(f(*args))
    ts = {name: [] for name in cases}
    for _ in range(reps):
        for name, (f, args) in cases.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            ts[name].append(time.perf_counter() - t)
    return {name: (float(np.median(t)), float(np.min(t))) for name, t in ts.items()}


def bandwidth(reps):
    x = jnp.ones((64 * 2**20,), jnp.float32)  # 256 MiB
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    x = scale(scale(x))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        x = scale(x)
        x.block_until_ready()
        ts.append(time.perf_counter() - t)
    copy = 2 * x.nbytes / np.median(ts)
    read = x.nbytes / timeit(jax.jit(jnp.sum), x, reps=reps)[0]
    return copy, read


def decode_inputs(num_seqs, ctx, seed=0, extra_blocks=64, *, heads=(HQ, KVH, D), block_size=BS, dtype=DTYPE):
    """A one-layer pool holding ``num_seqs`` sequences of ``ctx`` tokens in scattered blocks;
    ``heads`` = (query heads, KV heads, head_dim). Returns the decode kernels' arguments."""
    hq, kvh, d = heads
    rng = np.random.default_rng(seed)
    per_seq = -(-ctx // block_size)
    nb = 1 + num_seqs * per_seq + extra_blocks
    shape = (1, nb, kvh, block_size, d)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    tables = rng.permutation(np.arange(1, nb))[: num_seqs * per_seq].reshape(num_seqs, per_seq)
    q = jnp.asarray(rng.standard_normal((num_seqs, hq, d), np.float32), dtype)
    lens = jnp.full((num_seqs,), ctx, jnp.int32)
    return q, k, v, jnp.int32(0), jnp.asarray(tables, jnp.int32), lens


def contiguous_cache(k, v, tables):
    """The same K/V laid out contiguously: [S, KVH, ctx, D]."""
    def lay(pool):
        x = pool[0][tables]  # [S, W, KVH, BS, D]
        S, W, kvh, bs, d = x.shape
        return x.transpose(0, 2, 1, 3, 4).reshape(S, kvh, W * bs, d)
    return lay(k), lay(v)


@functools.partial(jax.jit, static_argnames=("chunk",))
def contiguous_chunked(q, k, v, lens, chunk=128):
    """The xla backend's online softmax over a contiguous cache (dynamic_slice, no gather)."""
    S, KVH_, N, D_ = k.shape
    G = q.shape[1] // KVH_
    qg = q.reshape(S, KVH_, G, D_) * D_ ** -0.5

    def body(c, carry):
        o, m, l = carry
        kc = lax.dynamic_slice_in_dim(k, c * chunk, chunk, axis=2)
        vc = lax.dynamic_slice_in_dim(v, c * chunk, chunk, axis=2)
        s = jnp.einsum("sknd,skgd->skng", kc, qg)
        pos = c * chunk + jnp.arange(chunk)
        s = jnp.where((pos[None, :] < lens[:, None])[:, None, :, None], s, -1e30)
        m_new = jnp.maximum(m, s.max(2, keepdims=True))
        a = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        l = a * l + p.sum(2, keepdims=True)
        return o * a[:, :, 0, :, None] + jnp.einsum("skng,sknd->skgd", p, vc), m_new, l

    init = (jnp.zeros((S, KVH_, G, D_)), jnp.full((S, KVH_, 1, G), -1e30), jnp.zeros((S, KVH_, 1, G)))
    o, m, l = lax.fori_loop(0, (jnp.max(lens) + chunk - 1) // chunk, body, init)
    return (o / l[:, :, 0, :, None]).reshape(S, -1, D_)


@jax.jit
def contiguous_dense(q, k, v, lens):
    """The plain dense masked einsum over a contiguous cache (no paging at all); float32
    multiplies in full float32, as the kernels do (on GPU the default is TF32)."""
    S, KVH_, N, D_ = k.shape
    G = q.shape[1] // KVH_
    prec = dot_precision(k.dtype)
    s = jnp.einsum("skgd,sknd->skgn", q.reshape(S, KVH_, G, D_), k, precision=prec,
                   preferred_element_type=jnp.float32) * D_ ** -0.5
    s = jnp.where((jnp.arange(N)[None, :] < lens[:, None])[:, None, None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("skgn,sknd->skgd", p, v, precision=prec, preferred_element_type=jnp.float32)
    return o.astype(q.dtype).reshape(S, -1, D_)


def attention_rows(shapes, bw, reps):
    rows = []
    for num_seqs, ctx in shapes:
        args = decode_inputs(num_seqs, ctx)
        q, k, v, layer, tables, lens = args
        kv_bytes = 2 * num_seqs * ctx * KVH * D * jnp.dtype(DTYPE).itemsize
        kc, vc = contiguous_cache(k, v, tables)
        scale = D ** -0.5
        times = time_round_robin({
            "xla (paged)": (functools.partial(xla_paged_decode_attention, scale=scale), args),
            "reference (paged)": (jax.jit(functools.partial(ref_paged_decode_attention, scale=scale)), args),
            "contiguous, same loop": (contiguous_chunked, (q, kc, vc, lens)),
            "contiguous, dense einsum": (contiguous_dense, (q, kc, vc, lens)),
        }, reps=reps)
        base = times["contiguous, same loop"][0]
        for name, (med, best) in times.items():
            rows.append((f"S={num_seqs} ctx={ctx}", name, med * 1e3, best * 1e3, kv_bytes / med / 1e9,
                         kv_bytes / med / bw, med / base))
        del kc, vc
    return rows


def pallas_interpret_rows(bw, reps, num_seqs=32, ctx=512):
    """The Pallas kernel in the interpreter (its only mode on CPU) next to the xla backend."""
    args = decode_inputs(num_seqs, ctx)
    kv_bytes = 2 * num_seqs * ctx * KVH * D * 4
    times = time_round_robin({
        "pallas (interpret)": (functools.partial(paged_decode_attention, scale=D ** -0.5, interpret=True),
                               args),
        "xla (paged)": (functools.partial(xla_paged_decode_attention, scale=D ** -0.5), args),
    }, reps=reps)
    return [(f"S={num_seqs} ctx={ctx}", name, med * 1e3, best * 1e3, kv_bytes / med / 1e9,
             kv_bytes / med / bw, float("nan")) for name, (med, best) in times.items()]


def step_fn(num_layers, backend):
    def step(kv, q, k, v, md):
        def layer_fn(kv, xs):
            layer, q_l, k_l, v_l = xs
            kv = write_kv(kv, layer, k_l, v_l, md.slot_mapping)
            return kv, paged_attention(q_l, kv, layer, md, scale=D ** -0.5, backend=backend)
        return lax.scan(layer_fn, kv, (jnp.arange(num_layers, dtype=jnp.int32), q, k, v))
    return jax.jit(step, donate_argnums=0)


def step_rows(pool_sizes, num_layers, num_seqs, ctx, backend, reps):
    """Median/min step time per pool size; the pools are timed in turn (round robin)."""
    rng = np.random.default_rng(1)
    per_seq = -(-ctx // BS)
    state = {}
    for nb in pool_sizes:
        shape = (num_layers, nb, KVH, BS, D)
        kv = KVPool(jnp.zeros(shape, DTYPE), jnp.zeros(shape, DTYPE))
        # Blocks scattered over the whole pool: the worst case for locality.
        tables = rng.permutation(np.arange(1, nb))[: num_seqs * per_seq].reshape(num_seqs, per_seq)
        pos = np.full(num_seqs, ctx - 1)
        slots = tables[:, -1] * BS + pos % BS
        md = AttentionMetadata(
            positions=jnp.asarray(pos, jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
            block_tables=jnp.asarray(tables, jnp.int32), context_lens=jnp.full((num_seqs,), ctx, jnp.int32),
            query_start_loc=jnp.arange(num_seqs + 1, dtype=jnp.int32), decode_only=True)
        q = jnp.asarray(rng.standard_normal((num_layers, num_seqs, HQ, D)), DTYPE)
        k = jnp.asarray(rng.standard_normal((num_layers, num_seqs, KVH, D)), DTYPE)
        v = jnp.asarray(rng.standard_normal((num_layers, num_seqs, KVH, D)), DTYPE)
        state[nb] = [kv, (q, k, v, md)]
    step = step_fn(num_layers, backend)
    ts = {nb: [] for nb in pool_sizes}
    for it in range(reps + 2):
        for nb in pool_sizes:
            kv, rest = state[nb]
            t = time.perf_counter()
            kv, o = step(kv, *rest)  # the pool is donated: rebind it
            jax.block_until_ready(o)
            if it >= 2:
                ts[nb].append(time.perf_counter() - t)
            state[nb][0] = kv
    rows = [(nb, backend, 2 * state[nb][0].k.nbytes / 2**20, float(np.median(ts[nb])) * 1e3,
             float(np.min(ts[nb])) * 1e3) for nb in pool_sizes]
    del state
    return rows


def mixed_inputs(q_lens, ctx_lens, num_layers=30, width=16, seed=0):
    """Ragged-attention arguments for rows with ``q_lens`` new tokens over ``ctx_lens`` keys."""
    rng = np.random.default_rng(seed)
    S = len(q_lens)
    nb = 1 + S * width
    k, v = (jnp.asarray(rng.standard_normal((num_layers, nb, KVH, BS, D)), DTYPE) for _ in range(2))
    tables = np.zeros((S, width), np.int32)
    for s, n in enumerate(ctx_lens):
        tables[s, :-(-n // BS)] = 1 + s * width + np.arange(-(-n // BS))
    q = jnp.asarray(rng.standard_normal((sum(q_lens), HQ, D)), DTYPE)
    qsl = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k, v, jnp.asarray(tables), jnp.asarray(ctx_lens, jnp.int32), qsl


def over_layers(fn, num_layers=30):
    """``fn(q, k, v, layer, ...)`` summed over every layer of the pool, in one jit."""
    return jax.jit(lambda q, k, v, *rest: sum(fn(q, k, v, layer, *rest) for layer in range(num_layers)))


def mixed_rows(compositions, reps):
    """Per composition (decode rows at context 150 + prompt tokens in rows of 100): ms of the
    ragged attention over 30 layers per block_q, and of an exact split (decode path + ragged path)."""
    rows = []
    for num_decodes, prompt_tokens in compositions:
        prompts = [100] * (prompt_tokens // 100) + ([prompt_tokens % 100] if prompt_tokens % 100 else [])
        q_lens, ctx = [1] * num_decodes + prompts, [150] * num_decodes + prompts
        args = mixed_inputs(q_lens, ctx)
        q, k, v, tables, lens, qsl = args
        default = _default_block_q(q.shape[0], tables.shape[0])
        cases = {f"ragged, block_q {bq}{' (default)' if bq == default else ''}": (
            over_layers(functools.partial(xla_ragged_paged_attention, scale=D ** -0.5, block_q=bq)), args)
            for bq in (8, 16, 32)}
        nd = num_decodes
        if nd == 0:  # nothing to split
            times = time_round_robin(cases, reps=reps, warmup=1)
            rows += [(f"0 dec + {prompt_tokens} prompt", name, med * 1e3, best * 1e3)
                     for name, (med, best) in times.items()]
            continue
        decode = over_layers(functools.partial(xla_paged_decode_attention, scale=D ** -0.5))
        cases["exact split: decode rows"] = (decode, (q[:nd], k, v, tables[:nd], lens[:nd]))
        ragged = over_layers(functools.partial(xla_ragged_paged_attention, scale=D ** -0.5))
        cases["exact split: prompt rows"] = (ragged, (q[nd:], k, v, tables[nd:], lens[nd:], qsl[nd:] - nd))
        times = time_round_robin(cases, reps=reps, warmup=1)
        label = f"{nd} dec + {prompt_tokens} prompt"
        rows += [(label, name, med * 1e3, best * 1e3) for name, (med, best) in times.items()]
    return rows


def projection_rows(token_counts, reps, num_layers=30, d=576, qkv=960, f=1536):
    """``(tokens, variant, median ms, min ms, weight GB/s, vs plain)`` for the CPU form's projections."""
    from jaxpaged.model import _cpu_dot

    rng = np.random.default_rng(0)
    shapes = {"wqkv": (d, qkv), "wo": (d, d), "wgu": (d, 2 * f), "wd": (f, d)}
    io = [{k: jnp.asarray(rng.standard_normal(sh, dtype=np.float32) / np.sqrt(sh[0])) for k, sh in shapes.items()}
          for _ in range(num_layers)]
    oi = [{k: w.T.copy() for k, w in layer.items()} for layer in io]
    nbytes = sum(w.nbytes for layer in io for w in layer.values())
    hi = lax.Precision.HIGHEST

    def plain(x, w):
        return jnp.dot(x, w, precision=hi)

    def split(x, w):
        return _cpu_dot(x, w, precision=hi)

    def out_in(x, w):
        return lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=hi)

    def out_in_cpu_dot(x, w):
        return _cpu_dot(x, w, out_in=True, precision=hi)

    def make(dot, layers):
        def layer(p, x):
            h = dot(x, p["wqkv"])[:, :d]
            x = x + dot(h, p["wo"])
            g, u = jnp.split(dot(x, p["wgu"]), 2, axis=1)
            x = x + 0.1 * dot(jax.nn.silu(g) * u, p["wd"])
            return x * lax.rsqrt(jnp.mean(x * x, axis=1, keepdims=True))

        branches = [functools.partial(layer, p) for p in layers]
        return jax.jit(lambda x: lax.scan(lambda x, i: (lax.switch(i, branches, x), None), x,
                                          jnp.arange(num_layers))[0])

    variants = {"[in, out], plain dot": make(plain, io), "[in, out], _cpu_dot": make(split, io),
                "[out, in], plain dot": make(out_in, oi), "[out, in], _cpu_dot": make(out_in_cpu_dot, oi)}
    rows = []
    for t in token_counts:
        x = jnp.asarray(rng.standard_normal((t, d), dtype=np.float32))
        cases = {name: (f, (x,)) for name, f in variants.items() if t == 1 or not name.endswith("_cpu_dot")}
        res = time_round_robin(cases, reps=reps)
        base = res["[in, out], plain dot"][0]
        rows += [(t, name, med * 1e3, mn * 1e3, nbytes / med / 1e9, med / base) for name, (med, mn) in res.items()]
    return rows


def cores_busy(f, reps=5):
    """CPU seconds of the whole process (every thread) per wall second over ``reps`` calls of ``f()``."""
    jax.block_until_ready(f())
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(reps):
        jax.block_until_ready(f())
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def forward_rows(batches, reps, ctx=170, spread=60, trace=False):
    """``(weight bytes, [(rows, variant, median ms, min ms, cores busy)], {rows: op times})`` of the
    default model's decode forward as the engine runs it on CPU (random weights,
    :func:`~jaxpaged.model.runtime_form`, 64-token blocks), whole and with attention left out:
    the queries pass through, no K/V is written. Rows have contexts spread over ``ctx +-
    spread`` (one row: ``ctx``). With ``trace``, where the whole forward's time goes, per op
    (:func:`bench_common.host_op_times`)."""
    import contextlib

    from flax import nnx

    import jaxpaged.model as model_mod
    from jaxpaged.config import LlamaConfig
    from jaxpaged.loader import build_model
    from bench_common import decode_metadata, host_op_times, random_params

    cfg = LlamaConfig.smollm2_135m()
    model = model_mod.runtime_form(build_model(cfg, random_params(cfg), dtype=DTYPE))
    graphdef, params = nnx.split(model)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

    @contextlib.contextmanager
    def without_attention():
        saved = model_mod.paged_attention, model_mod.write_kv
        model_mod.paged_attention = lambda q, kv, layer, md, **kw: q
        model_mod.write_kv = lambda kv, layer, k, v, slots: kv
        try:
            yield
        finally:
            model_mod.paged_attention, model_mod.write_kv = saved

    def forward(params, kv, tokens, md):
        return nnx.merge(graphdef, params)(tokens, kv, md, logits_indices=jnp.arange(tokens.shape[0]))

    def compile_forward(*args):
        # A new function each time: jax reuses the trace of a function it has seen, patch or not.
        return jax.jit(lambda *a: forward(*a), donate_argnums=(1,)).lower(*args).compile()

    def stepper(compiled, kv, tokens, md):
        """A call that runs ``compiled`` with the pool donated and keeps the pool it returns,
        as the engine does (without donation XLA copies the pool: a 48-row step 3-5x slower)."""
        box = [kv]

        def step():
            logits, box[0] = compiled(params, box[0], tokens, md)
            return logits

        return step

    rng = np.random.default_rng(0)
    rows, traces = [], {}
    for S in batches:
        lens = np.full(S, ctx) if S == 1 else rng.integers(ctx - spread, ctx + spread + 1, S)
        W = -(-int(lens.max()) // BS)
        shape = (cfg.num_layers, S * W + 1, cfg.num_kv_heads, BS, cfg.head_dim)
        pools = [KVPool(jnp.asarray(rng.standard_normal(shape, dtype=np.float32)),
                        jnp.asarray(rng.standard_normal(shape, dtype=np.float32))) for _ in range(2)]
        tables = 1 + rng.permutation(S * W).reshape(S, W).astype(np.int32)
        md = decode_metadata(lens, tables, BS)
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, S), jnp.int32)
        whole = compile_forward(params, pools[0], tokens, md)
        with without_attention():
            bare = compile_forward(params, pools[1], tokens, md)
        cases = {"whole": (stepper(whole, pools[0], tokens, md), ()),
                 "without attention": (stepper(bare, pools[1], tokens, md), ())}
        res = time_round_robin(cases, reps=reps)
        rows += [(S, name, med * 1e3, mn * 1e3, cores_busy(cases[name][0])) for name, (med, mn) in res.items()]
        if trace:
            traces[S] = host_op_times(cases["whole"][0])
    return weight_bytes, rows, traces


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-forward", action="store_true", help="only the last section (the decode forward)")
    ap.add_argument("--trace", action="store_true",
                    help="also where the decode forward's time goes, per XLA op (a jax.profiler trace)")
    args = ap.parse_args()
    reps = 5 if args.quick else 15
    print(f"# bench_kernels  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  "
          f"jax {jax.__version__}  {jax.default_backend()}  {platform.processor() or platform.machine()}  "
          f"{os.cpu_count()} CPUs  load {os.getloadavg()[0]:.1f}")
    if not args.only_forward:
        other_sections(args, reps)
    forward_section(args, reps)


def other_sections(args, reps):
    copy_bw, read_bw = bandwidth(reps)
    print(f"\nmemory bandwidth: in-place scale {copy_bw / 1e9:.1f} GB/s (read+write), "
          f"sum {read_bw / 1e9:.1f} GB/s (read)")

    shapes = [(32, 512), (8, 2048)] if args.quick else [(64, 512), (32, 1024), (8, 2048), (256, 128)]
    print(f"\n## decode attention, one layer ({HQ} q heads, {KVH} KV heads, head_dim {D}, block {BS}, "
          f"{jnp.dtype(DTYPE).name}); KV GB/s as fraction of the in-place-scale bandwidth")
    print(f"{'batch':<16}{'implementation':<27}{'median ms':>10}{'min ms':>9}{'KV GB/s':>9}{'of bw':>7}"
          f"{'vs contig':>10}")
    for r in attention_rows(shapes, copy_bw, reps) + pallas_interpret_rows(copy_bw, max(3, reps // 3)):
        rel = "" if np.isnan(r[6]) else f"{r[6]:>9.2f}x"
        print(f"{r[0]:<16}{r[1]:<27}{r[2]:>10.2f}{r[3]:>9.2f}{r[4]:>9.2f}{r[5]:>7.0%}{rel}")

    pools = [1024, 4096, 16384]
    num_layers, num_seqs, ctx = 4, 32, 256
    print(f"\n## decode step ({num_layers} layers: write_kv + attention, pool donated; "
          f"{num_seqs} seqs x {ctx} tokens)")
    print(f"{'pool blocks':>12}  {'backend':<10}{'pool MiB':>9}{'median ms':>11}{'min ms':>9}")
    for backend in ("xla", "reference"):
        for r in step_rows(pools, num_layers, num_seqs, ctx, backend, reps):
            print(f"{r[0]:>12}  {r[1]:<10}{r[2]:>9.0f}{r[3]:>11.2f}{r[4]:>9.2f}")

    compositions = [(15, 497), (39, 473)] if args.quick else [(0, 512), (5, 507), (15, 497), (29, 483), (39, 473)]
    print("\n## mixed steps: xla ragged attention over 30 layers (decode rows at context 150, prompts of "
          "100 tokens); the exact split's two rows add up to one step")
    print(f"{'step':<24}{'implementation':<30}{'median ms':>10}{'min ms':>9}")
    for r in mixed_rows(compositions, max(3, reps // 3)):
        print(f"{r[0]:<24}{r[1]:<30}{r[2]:>10.1f}{r[3]:>9.1f}")

    print("\n## the CPU form's projections over 30 layers (default model's shapes, random weights); "
          "at 48 tokens _cpu_dot is the plain dot")
    print(f"{'tokens':>7}  {'weights, dot':<24}{'median ms':>10}{'min ms':>9}{'weight GB/s':>12}{'vs plain':>9}")
    for r in projection_rows((1, 48), 3 * reps):
        print(f"{r[0]:>7}  {r[1]:<24}{r[2]:>10.2f}{r[3]:>9.2f}{r[4]:>12.1f}{r[5]:>8.2f}x")


def forward_section(args, reps):
    from bench_common import measure_ceilings

    ceil = measure_ceilings(quick=args.quick)
    weights, rows, traces = forward_rows((1, 48), reps, trace=args.trace)
    print(f"\n## the decode forward and its floors (default model's shapes, random weights, the CPU form; "
          f"48 rows at contexts 110-230, 1 at 170): the floor is the larger of the weights' bytes at the "
          f"bandwidth and the matmul FLOPs at the {ceil['matmul_n']}^3 rate, as bench.py's roofline takes them "
          f"({weights / 1e6:.0f} MB at {ceil['bandwidth'] / 1e9:.1f} GB/s, {ceil['flops'] / 1e9:.0f} GFLOP/s; "
          f"attention's FLOPs and KV bytes left out)")
    print(f"{'rows':>5}  {'forward':<20}{'median ms':>10}{'min ms':>9}{'floor ms':>10}{'floor / median':>16}"
          f"{'cores busy':>12}")
    for S, name, med, mn, busy in rows:
        floor = max(weights / ceil["bandwidth"], 2 * S * weights / jnp.dtype(DTYPE).itemsize / ceil["flops"])
        print(f"{S:>5}  {name:<20}{med:>10.2f}{mn:>9.2f}{floor * 1e3:>10.2f}{floor * 1e3 / med:>16.2f}"
              f"{busy:>9.2f} of {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}")
    print("cores busy: the process's CPU seconds (every thread) per wall second while the forward runs")
    for S, (ops, busiest) in traces.items():
        print(f"\n## where the whole forward's time goes at {S} row(s): XLA ops by self time summed over the threads "
              f"that ran them (an op split between threads counts its own thread's part); busiest thread "
              f"{busiest:.2f} ms a call")
        print(f"{'op':<44}{'ms a call':>10}{'share':>8}")
        for name, ms, share in ops:
            print(f"{name[:43]:<44}{ms:>10.3f}{share:>8.1%}")


if __name__ == "__main__":
    main()
