"""The paged-attention kernels and the engine on a GPU: correctness first, then timings.

Run where ``jax.default_backend() == "gpu"``. What it prints, in one process:

1. Ceilings measured now: device memory bandwidth (an in-place scale of 1 GiB, bytes read
   + written; a sum over it, bytes read) and the matmul rate (8192^3, bf16 and float32).
2. Decode attention, one layer, per implementation: the Pallas kernel (Triton; split-K
   chosen automatically, and forced off), the XLA paged path, and attention over the same
   keys laid out contiguously (a dense masked einsum: no paging at all). Each Pallas
   output is first checked against the reference (max abs error). Columns: time per
   call, KV bytes read per second and its fraction of the read bandwidth, and time over
   the contiguous baseline (the cost of paging; the seeds report 1.04-1.15x).
3. Tuning of the Pallas decode kernel (keys per loop step, warps, pipeline stages, split-K
   partitions) and of the ragged kernel on a busy mixed step, each case twice, and the
   block-size sweep (4-64 tokens per block).
4. Ragged prefill (Pallas vs XLA), causal attention FLOP/s; and (``--only mixed``) a busy
   mixed step's attention at Llama-3-8B shapes, each way ``ragged_paged_attention``'s
   switches run it (decode rows split off, the query block's rule, the query layout),
   beside its decode and prompt rows run as two steps.
5. The engine end to end on a random model with the default model's shapes (SmolLM2-135M:
   same layers, heads and vocabulary, so the same FLOPs and bytes; random weights because
   the device machine cannot fetch the GGUF): many requests, ``ignore_eos``, fixed output
   lengths, per attention backend.
6. ``--only matmul``: the in-place layer matmul (grouped as the model calls it; Triton, and
   past 64 tokens the Mosaic GPU kernel) against XLA's slice-then-matmul, per Llama-3-8B
   projection and tokens per step
   (``--matmul-tokens``; ``--matmul-sweep`` adds other tiles, warps and split factors;
   ``--use-fastest-tiles`` makes the fastest the default for a llama8b run after it).
7. ``--only llama8b``: Llama-3-8B shapes on a ShareGPT-like workload against vLLM's
   figure: throughput, where the wall time goes by batch size, device time per step (a
   synchronous pass) and by tokens per step, a profile. ``--lean`` times the run alone;
   ``--no-split-k``, ``--no-grouped`` and ``JAXPAGED_COMMAND_BUFFERS=0`` measure the engine
   without each, ``--stacked-max-tokens`` with another bound on the stacked matmul,
   ``--mixed``, ``--block-q-rule``, ``--query-layout`` and ``--block-order`` with the
   mixed-step switches,
   ``--stacked-kernel mosaic`` with the Mosaic GPU matmul past decode-sized steps (``auto``:
   where it measured faster, ``model.stacked_kernel_for``), and
   ``--ab-baseline`` (after ``--use-fastest-tiles``) again with the default tiles.
8. ``--only decode-profile``: decode steps of 4, 8, 32 and 256 sequences of the same model,
   each timed and traced: the step's period, the device's busy time, its floor (weights +
   KV at the measured bandwidth) and its kernels by time (``--decode-small-grid 0``: the
   decode kernel splits only long tables, the rule before the twenty-fourth session).
9. ``--only moe``: one mixture-of-experts layer (Qwen3-30B-A3B's and Mixtral-8x7B's shapes),
   the Triton kernel of ``pallas/moe_matmul.py`` against XLA's ragged dot, by tokens per step.

Timings: a call is dispatched ``n`` times back to back and the device drained once, so
host dispatch overlaps device work; the median of 5 such rounds after a warm-up. Writes
``bench_out/bench_gpu.json`` and a plot, ``bench_out/bench_gpu.png``.

    python scripts/bench_gpu.py            # a few minutes on an H100
    python scripts/bench_gpu.py --quick
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import bench_kernels
from bench_common import new_figure, random_params, save_figure, save_json
from bench_kernels import contiguous_cache, contiguous_dense

from jaxpaged import model as jaxpaged_model
from jaxpaged.padding import next_power_of_2, row_bucket, token_bucket
from jaxpaged.pallas import paged_attention
from jaxpaged.pallas import ragged_paged_attention as gpu_ragged
from jaxpaged.pallas.paged_attention import auto_num_splits, paged_decode_attention
from jaxpaged.pallas.ragged_paged_attention import mixed_paged_attention, ragged_paged_attention
from jaxpaged.pallas.reference import ref_paged_decode_attention, ref_ragged_paged_attention
from jaxpaged.pallas.xla import xla_paged_decode_attention, xla_ragged_paged_attention

# (name, query heads, KV heads, head_dim)
SMOLLM2 = ("SmolLM2-135M", 9, 3, 64)
LLAMA8B = ("Llama-3-8B", 32, 8, 128)


def per_call(f, *args, n=20, rounds=5):
    """Median seconds per call of ``f(*args)``, ``n`` calls in flight per round."""
    jax.block_until_ready(f(*args))
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / n)
    return float(np.median(ts))


def looped(f, reps: int):
    """``f(x, ws, layer)`` ``reps`` times inside one jitted loop, over the stacks' layers in
    turn, each output summed (a small reduction, so that nothing is dead code): timing it
    gives device time per call without the host's per-call dispatch (tens of us, as long
    as a decode-sized matmul), which back-to-back calls of ``f`` hide only where the
    device is slower than the host."""
    def body(i, acc, x, ws, layer):
        outs = f(x, ws, (layer + i) % ws[0].shape[0])
        return acc + sum(o.astype(jnp.float32).sum() for o in outs)

    return jax.jit(lambda x, ws, layer: jax.lax.fori_loop(
        0, reps, lambda i, acc: body(i, acc, x, ws, layer), jnp.float32(0)))


def ceilings():
    x = jnp.ones((256 * 2**20,), jnp.float32)  # 1 GiB
    scale = jax.jit(lambda x: x * 1.0001, donate_argnums=0)
    x = scale(scale(x))
    ts = []
    for _ in range(10):
        t = time.perf_counter()
        x = scale(x)
        x.block_until_ready()
        ts.append(time.perf_counter() - t)
    copy_bw = 2 * x.nbytes / np.median(ts)
    read_bw = x.nbytes / per_call(jax.jit(jnp.sum), x, n=10)
    del x
    rates = {}
    for dt in (jnp.bfloat16, jnp.float32):
        a = jax.random.normal(jax.random.key(0), (8192, 8192), dt)
        b = jax.random.normal(jax.random.key(1), (8192, 8192), dt)
        rates[jnp.dtype(dt).name] = 2 * 8192**3 / per_call(jax.jit(jnp.matmul), a, b, n=5, rounds=3)
    return copy_bw, read_bw, rates


def decode_inputs(shape, num_seqs, ctx, block_size, dtype):
    """bench_kernels' scattered one-layer pool for a ``(name, query heads, KV heads, head_dim)`` shape."""
    return bench_kernels.decode_inputs(num_seqs, ctx, heads=shape[1:], block_size=block_size, dtype=dtype)


def max_err(out, ref):
    return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))


def decode_table(bw, quick):
    grid = [(SMOLLM2, jnp.bfloat16, 256, 1024), (SMOLLM2, jnp.bfloat16, 64, 4096),
            (SMOLLM2, jnp.float32, 256, 1024), (LLAMA8B, jnp.bfloat16, 64, 2048),
            (LLAMA8B, jnp.bfloat16, 8, 16384), (LLAMA8B, jnp.bfloat16, 1, 32768)]
    if quick:
        grid = grid[:1] + grid[3:5]
    print("\n## Decode attention, one layer, block size 16; KV GB/s as a fraction of the read (sum) bandwidth; "
          "'vs contig' = time / contiguous dense")
    print(f"{'model':<14}{'dtype':<10}{'batch':>6}{'ctx':>7}  {'implementation':<26}{'us':>9}"
          f"{'KV GB/s':>9}{'of bw':>7}{'vs contig':>10}{'max err':>10}")
    rows = []
    for shape, dtype, S, ctx in grid:
        args = decode_inputs(shape, S, ctx, 16, dtype)
        q, k, v, layer, tables, lens = args
        scale = shape[3] ** -0.5
        ref = jax.jit(functools.partial(ref_paged_decode_attention, scale=scale))(*args) if S * ctx <= 2**18 \
            else None
        kc, vc = contiguous_cache(k, v, tables)
        impls = {
            f"pallas (splits={auto_num_splits(tables.shape[1] * 16, S * shape[2])})":
                functools.partial(paged_decode_attention, scale=scale),
            "pallas (splits=1)": functools.partial(paged_decode_attention, scale=scale, num_splits=1),
            "xla paged": functools.partial(xla_paged_decode_attention, scale=scale),
        }
        base = per_call(contiguous_dense, q, kc, vc, lens)
        dense_out = contiguous_dense(q, kc, vc, lens)
        kv_bytes = 2 * S * ctx * shape[2] * shape[3] * jnp.dtype(dtype).itemsize
        for name, f in list(impls.items()) + [("contiguous dense", None)]:
            if f is None:
                t, err = base, max_err(dense_out, ref) if ref is not None else float("nan")
            else:
                out = f(*args)
                err = max_err(out, ref if ref is not None else dense_out)
                t = per_call(f, *args)
            row = (shape[0], jnp.dtype(dtype).name, S, ctx, name, t * 1e6, kv_bytes / t / 1e9, kv_bytes / t / bw,
                   t / base, err)
            rows.append(row)
            print(f"{row[0]:<14}{row[1]:<10}{row[2]:>6}{row[3]:>7}  {row[4]:<26}{row[5]:>9.1f}{row[6]:>9.0f}"
                  f"{row[7]:>7.0%}{row[8]:>9.2f}x{row[9]:>10.1e}", flush=True)
        del kc, vc, args
    return rows


def tuning_table(bw):
    """Keys per loop step, warps, pipeline stages and split-K partitions of the Pallas decode
    kernel, then keys per step, warps and stages of the ragged kernel on a busy mixed step;
    each case timed twice in turn (the spread between the two is the noise). The engine's
    shapes are here too: Llama-3-8B's decode steps of 256 sequences at short contexts (the
    busy phase, ~74% of the read bandwidth in the twenty-fourth session) and of 4 (the tail)."""
    print("\n## Pallas decode tuning, bf16, block size 16 (keys per step = pages_per_chunk * 16); two passes")
    print(f"{'model':<14}{'batch':>6}{'ctx':>7}{'keys/step':>10}{'warps':>6}{'stages':>7}{'splits':>7}{'us (1)':>9}"
          f"{'us (2)':>9}{'of bw':>7}")
    for shape, S, ctx in ((SMOLLM2, 256, 1024), (SMOLLM2, 64, 4096), (LLAMA8B, 64, 2048), (LLAMA8B, 8, 16384),
                          (LLAMA8B, 256, 256), (LLAMA8B, 4, 1024)):
        args = decode_inputs(shape, S, ctx, 16, jnp.bfloat16)
        kv_bytes = 2 * S * ctx * shape[2] * shape[3] * 2
        auto = auto_num_splits(ctx, S * shape[2])
        cases = [(ppc, w, 2, auto) for ppc in (4, 8, 16) for w in (4, 8)] if ctx <= 4096 else []
        if ctx <= 1024:  # short walks: do deeper pipelines pay?
            cases += [(ppc, 4, 3, auto) for ppc in (4, 8)]
        cases += [(4, 4, 2, k) for k in (1, 2, 4, 8, 16) if k != auto or not cases]
        fns = {c: functools.partial(paged_decode_attention, scale=0.125, pages_per_chunk=c[0], num_warps=c[1],
                                    num_stages=c[2], num_splits=c[3]) for c in cases}
        times = {c: [] for c in cases}
        for _ in range(2):
            for c in cases:
                times[c].append(per_call(fns[c], *args))
        for (ppc, w, st, k), (t1, t2) in times.items():
            print(f"{shape[0]:<14}{S:>6}{ctx:>7}{ppc * 16:>10}{w:>6}{st:>7}{k:>7}{t1 * 1e6:>9.1f}{t2 * 1e6:>9.1f}"
                  f"{kv_bytes / min(t1, t2) / bw:>7.0%}", flush=True)
    n_dec, n_prompt, plen = 254, 2, 200  # mixed_table's first case: a busy step
    q, k, v, bt, lens, qsl = mixed_inputs(n_dec, n_prompt, plen)
    scale = LLAMA8B[3] ** -0.5
    kv_bytes = 2 * int(np.asarray(lens).sum()) * LLAMA8B[2] * LLAMA8B[3] * 2
    print(f"\n## Ragged kernel tuning on a mixed step ({n_dec} decode rows + {n_prompt} x {plen}, Llama-3-8B, bf16, "
          f"layout {gpu_ragged.QUERY_LAYOUT}); of bw counts each key once")
    print(f"{'keys/step':>10}{'warps':>6}{'stages':>7}{'us (1)':>9}{'us (2)':>9}{'of bw':>7}")
    cases = [(ppc, w, st) for ppc in (4, 8) for w in (4, 8) for st in (2, 3)]
    fns = {c: jax.jit(functools.partial(ragged_paged_attention, scale=scale, pages_per_chunk=c[0], num_warps=c[1],
                                        num_stages=c[2])) for c in cases}
    times = {c: [] for c in cases}
    for _ in range(2):
        for c in cases:
            times[c].append(per_call(fns[c], q, k, v, jnp.int32(1), bt, lens, qsl))
    for (ppc, w, st), (t1, t2) in times.items():
        print(f"{ppc * 16:>10}{w:>6}{st:>7}{t1 * 1e6:>9.1f}{t2 * 1e6:>9.1f}{kv_bytes / min(t1, t2) / bw:>7.0%}",
              flush=True)


def block_size_table(bw):
    shape, dtype, S, ctx = LLAMA8B, jnp.bfloat16, 64, 2048
    print(f"\n## Pallas decode vs block size ({shape[0]}, bf16, {S} x {ctx})")
    print(f"{'block':>6}{'pages/chunk':>12}{'us':>9}{'KV GB/s':>9}{'of bw':>7}")
    kv_bytes = 2 * S * ctx * shape[2] * shape[3] * 2
    rows = []
    for bs in (4, 8, 16, 32, 64):
        args = decode_inputs(shape, S, ctx, bs, dtype)
        f = functools.partial(paged_decode_attention, scale=shape[3] ** -0.5)
        t = per_call(f, *args)
        rows.append({"block_size": bs, "us": t * 1e6, "of_bw": kv_bytes / t / bw})
        print(f"{bs:>6}{max(1, 64 // bs):>12}{t * 1e6:>9.1f}{kv_bytes / t / 1e9:>9.0f}{kv_bytes / t / bw:>7.0%}",
              flush=True)
    return rows


def prefill_table():
    print("\n## Ragged prefill attention, one layer (causal FLOPs = 2 * 2 * sum(q_len * ctx) * Hq * D / 2)")
    print(f"{'model':<14}{'batch':>6}{'tokens':>8}  {'implementation':<12}{'ms':>9}{'TFLOP/s':>9}{'max err':>10}"
          "  (vs the reference, or vs xla where the reference does not fit)")
    for shape, S, n in ((SMOLLM2, 8, 512), (LLAMA8B, 4, 2048)):
        _, hq, kvh, d = shape
        bs = 16
        rng = np.random.default_rng(0)
        per_seq = -(-n // bs)
        nb = 1 + S * per_seq
        k = jnp.asarray(rng.standard_normal((1, nb, kvh, bs, d), np.float32), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((1, nb, kvh, bs, d), np.float32), jnp.bfloat16)
        tables = jnp.asarray(rng.permutation(np.arange(1, nb)).reshape(S, per_seq), jnp.int32)
        q = jnp.asarray(rng.standard_normal((S * n, hq, d), np.float32), jnp.bfloat16)
        lens = jnp.full((S,), n, jnp.int32)
        qsl = jnp.arange(S + 1, dtype=jnp.int32) * n
        args = (q, k, v, jnp.int32(0), tables, lens, qsl)
        positions = jnp.tile(jnp.arange(n, dtype=jnp.int32), S)
        # The reference gathers every token's whole table: small cases only; else compare with xla.
        if S * n * n * kvh * d * 4 <= 2**31:
            ref = jax.jit(functools.partial(ref_ragged_paged_attention, scale=d ** -0.5))(*args, positions)
        else:
            ref = xla_ragged_paged_attention(*args, scale=d ** -0.5)
        flops = 2 * 2 * S * n * n / 2 * hq * d
        for name, f in (("pallas", ragged_paged_attention), ("xla", xla_ragged_paged_attention)):
            f = functools.partial(f, scale=d ** -0.5)
            err = max_err(f(*args), ref)
            t = per_call(f, *args, n=5)
            print(f"{shape[0]:<14}{S:>6}{n:>8}  {name:<12}{t * 1e3:>9.2f}{flops / t / 1e12:>9.1f}{err:>10.1e}",
                  flush=True)


def mixed_inputs(decode_rows: int, prompts: int, prompt_len: int, *, seed: int = 0, block_size: int = 16):
    """One mixed step at Llama-3-8B's attention shapes (bf16), padded as the engine pads it:
    ``decode_rows`` rows of one token at contexts 64-1,024, then ``prompts`` fresh prompt
    chunks of ``prompt_len`` tokens; a pool of two layers (the timed loop alternates them)."""
    _, hq, kvh, d = LLAMA8B
    rng = np.random.default_rng(seed)
    ctx = np.concatenate([rng.integers(64, 1025, decode_rows), np.full(prompts, prompt_len)])
    q_len = np.concatenate([np.ones(decode_rows, int), np.full(prompts, prompt_len)])
    S, T = row_bucket(len(ctx)), token_bucket(int(q_len.sum()))
    need = -(-ctx // block_size)
    W = next_power_of_2(int(need.max()))
    nb = 1 + int(need.sum())
    tables = np.zeros((S, W), np.int32)
    ids = rng.permutation(np.arange(1, nb))
    for s, (i, n) in enumerate(zip(np.cumsum(need) - need, need)):
        tables[s, :n] = ids[i:i + n]
    shape = (2, nb, kvh, block_size, d)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((T, hq, d), np.float32), jnp.bfloat16)
    lens = np.zeros(S, np.int32)
    lens[:len(ctx)] = ctx
    qsl = np.full(S + 1, q_len.sum(), np.int32)
    qsl[:len(ctx) + 1] = np.concatenate([[0], np.cumsum(q_len)])
    return q, k, v, jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(qsl)


def mixed_table(quick: bool) -> list[dict]:
    """Attention of a busy mixed step (decode rows beside prompt chunks) per layer, each
    way the GPU path can run it (``ragged_paged_attention``'s module settings), timed as
    20 calls inside one jitted loop over two layers (2 with ``quick``, which runs on CPU)."""
    cases = [(254, 2, 200), (192, 1, 512), (32, 4, 480)]
    if quick:
        cases = [(14, 1, 30)]
    ways = [(mixed, rule, layout, "sequence") for layout in ("packed", "direct") for mixed in ("ragged", "split")
            for rule in ("fixed", "mean")]
    ways += [("ragged", "mean", "direct", "longest_first"), ("split", "mean", "direct", "longest_first")]
    print("\n## Mixed steps, one layer, Llama-3-8B attention shapes (bf16, blocks of 16): us per call; "
          "'decode + prompts alone' = the decode kernel over the decode rows plus the ragged kernel over the "
          "prompt rows, as two steps would run them, then each of the two alone")
    print(f"{'decode rows':>12}{'prompts':>8}{'tokens (padded)':>16}  {'way (mixed, rule, layout, order)':<36}"
          f"{'block_q':>8}{'us':>9}{'max err':>10}")
    rows, scale, reps = [], LLAMA8B[3] ** -0.5, 2 if quick else 20
    group_pad = next_power_of_2(LLAMA8B[1] // LLAMA8B[2])

    def timed(f, *args):  # f(layer, *args) reps times in one jitted loop, alternating two layers
        loop = jax.jit(lambda *args: jax.lax.fori_loop(
            0, reps, lambda i, acc: acc + f(i % 2, *args).astype(jnp.float32).sum(), jnp.float32(0)))
        return per_call(loop, *args, n=1 if quick else 3) / reps

    saved = gpu_ragged.BLOCK_Q_RULE, gpu_ragged.QUERY_LAYOUT, gpu_ragged.BLOCK_ORDER
    for n_dec, n_prompt, plen in cases:
        q, k, v, bt, lens, qsl = mixed_inputs(n_dec, n_prompt, plen)
        T, S = q.shape[0], bt.shape[0]
        ref = xla_ragged_paged_attention(q, k, v, jnp.int32(1), bt, lens, qsl, scale=scale)
        for mixed, rule, layout, order in ways:  # layout and order are read by ragged_paged_attention, the rule here
            gpu_ragged.BLOCK_Q_RULE, gpu_ragged.QUERY_LAYOUT, gpu_ragged.BLOCK_ORDER = rule, layout, order
            block_q = gpu_ragged.default_block_q(T, S, group_pad)
            fn = mixed_paged_attention if mixed == "split" else ragged_paged_attention
            f = lambda layer, q, k, v, bt, lens, qsl, fn=fn, block_q=block_q: fn(  # noqa: E731
                q, k, v, layer, bt, lens, qsl, scale=scale, block_q=block_q)
            err = max_err(f(jnp.int32(1), q, k, v, bt, lens, qsl), ref)
            t = timed(f, q, k, v, bt, lens, qsl)
            label = f"{mixed}, {rule}, {layout}" + (", longest first" if order == "longest_first" else "")
            rows.append({"decode_rows": n_dec, "prompts": n_prompt, "prompt_len": plen, "tokens": T,
                         "way": label, "block_q": block_q, "us": t * 1e6, "max_err": err})
            print(f"{n_dec:>12}{n_prompt:>8}{T:>16}  {label:<36}{block_q:>8}{t * 1e6:>9.1f}{err:>10.1e}",
                  flush=True)
        # The floor a split could reach: the two parts as two steps would run them, under the
        # settings the command line left (the default packed layout otherwise).
        gpu_ragged.BLOCK_Q_RULE, gpu_ragged.QUERY_LAYOUT, gpu_ragged.BLOCK_ORDER = saved
        dq, dk, dv, dbt, dlens, _ = mixed_inputs(n_dec, 0, 0)
        pq, pk, pv, pbt, plens, pqsl = mixed_inputs(0, n_prompt, plen, seed=1)
        dq = dq[:dbt.shape[0]]  # one query per decode row

        def two_steps(layer, dq, dk, dv, dbt, dlens, pq, pk, pv, pbt, plens, pqsl):
            dec = paged_decode_attention(dq, dk, dv, layer, dbt, dlens, scale=scale)
            rag = ragged_paged_attention(pq, pk, pv, layer, pbt, plens, pqsl, scale=scale, block_q=gpu_ragged.BLOCK_Q)
            return dec.astype(jnp.float32).sum() + rag.astype(jnp.float32).sum()

        def decode_alone(layer, dq, dk, dv, dbt, dlens):
            return paged_decode_attention(dq, dk, dv, layer, dbt, dlens, scale=scale)

        def prompts_alone(layer, pq, pk, pv, pbt, plens, pqsl):
            return ragged_paged_attention(pq, pk, pv, layer, pbt, plens, pqsl, scale=scale, block_q=gpu_ragged.BLOCK_Q)

        # Which part the time is in: the decode rows' keys are most of the bytes, the prompts'
        # causal products most of the FLOPs.
        dec_bytes = 2 * int(np.asarray(dlens).sum()) * LLAMA8B[2] * LLAMA8B[3] * 2
        for label, fn, args in (("decode + prompts alone", two_steps, (dq, dk, dv, dbt, dlens, pq, pk, pv, pbt, plens,
                                                                        pqsl)),
                                ("decode rows alone", decode_alone, (dq, dk, dv, dbt, dlens)),
                                ("prompts alone", prompts_alone, (pq, pk, pv, pbt, plens, pqsl))):
            t = timed(fn, *args)
            note = f"  ({dec_bytes / t / 1e12:.2f} TB/s of keys and values)" if fn is decode_alone else ""
            rows.append({"decode_rows": n_dec, "prompts": n_prompt, "prompt_len": plen, "tokens": T,
                         "way": label, "us": t * 1e6})
            print(f"{n_dec:>12}{n_prompt:>8}{T:>16}  {label:<36}{'':>8}{t * 1e6:>9.1f}{note}", flush=True)
    return rows


def engine_table(quick, backends=("pallas", "xla")):
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.config import LlamaConfig
    from jaxpaged.loader import LoadedModel, build_model

    cfg = LlamaConfig.smollm2_135m()
    params = random_params(cfg)
    rng = np.random.default_rng(0)
    n_req, prompt_len, new = (64, 128, 64) if quick else (256, 128, 256)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, prompt_len).tolist()} for _ in range(n_req)]
    sp = SamplingParams(max_tokens=new, ignore_eos=True, temperature=0.0)
    print(f"\n## Engine, random SmolLM2-135M-shaped model (bf16), {n_req} requests x {prompt_len} prompt tokens, "
          f"{new} new tokens each, ignore_eos, greedy, max_num_seqs 256")
    print(f"{'backend':<10}{'tok/s (gen)':>12}{'steps':>7}{'ms/step':>9}{'same tokens':>13}"
          f"  ms/step in: schedule / batch / device / postprocess")
    ref_tokens = None
    for backend in backends:
        model = build_model(cfg, params, dtype=jnp.bfloat16, attention_backend=backend)
        llm = LLM(LoadedModel(model, None, cfg, "random"), max_num_seqs=256, max_model_len=1024,
                  max_num_batched_tokens=4096, enable_prefix_caching=False, kv_cache_memory="8GiB")
        llm.generate(prompts[:8], sp, use_tqdm=False)  # compile the common shapes
        llm.generate(prompts, sp, use_tqdm=False)
        keys = ("time_schedule_s", "time_batch_s", "time_device_s", "time_postprocess_s")
        s0 = llm.stats()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        s1 = llm.stats()
        steps = s1["num_steps"] - s0["num_steps"]
        phases = " / ".join(f"{(s1[k] - s0[k]) / steps * 1e3:.2f}" for k in keys)
        toks = [o.outputs[0].token_ids for o in outs]
        if ref_tokens is None:
            ref_tokens = toks
        # bf16 over 30 layers: count requests whose first 16 tokens agree with the first backend.
        same = sum(a[:16] == b[:16] for a, b in zip(toks, ref_tokens))
        print(f"{backend:<10}{n_req * new / dt:>12.0f}{steps:>7}{dt / steps * 1e3:>9.2f}"
              f"{same:>9}/{n_req}  {phases}", flush=True)
        del llm, model


# vLLM on one H100, Llama-3-8B, ShareGPT, 1,000 prompts (vLLM PR #8335): output and total tok/s.
VLLM_H100_LLAMA3_8B = (8382.0, 17514.0)
H100_BF16_DENSE_FLOPS = 989e12  # H100 SXM datasheet, dense bf16


def device_random_params(cfg, dtype, seed: int = 0) -> dict:
    """Random weights generated on the device in ``dtype`` (std 0.02, norms 1): an 8B model
    never passes through the host."""
    from jaxpaged.loader import _abstract_params

    abstract = _abstract_params(cfg)
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    key = jax.random.key(seed)
    leaves = []
    for i, (path, a) in enumerate(paths):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            leaves.append(jnp.ones(a.shape, dtype))
        else:
            leaves.append(jax.jit(lambda k, shape=a.shape: (0.02 * jax.random.normal(k, shape, jnp.float32))
                                  .astype(dtype))(jax.random.fold_in(key, i)))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def trace_summary(folder: str, top: int = 25) -> dict:
    """Where the device's time went in a ``jax.profiler`` trace: busy fraction of the window,
    the kernels that took most of it (merged over streams), and for each the HLO ops (the
    trace's ``hlo_op`` stat) that launched it, so a copy or transpose can be traced to its
    op in the step."""
    import glob

    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True))
    if not files:
        return {}
    pd = ProfileData.from_file(files[-1])
    by_name: collections.Counter = collections.Counter()
    by_op: collections.defaultdict = collections.defaultdict(collections.Counter)
    spans = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue
            for ev in line.events:
                by_name[ev.name] += ev.duration_ns
                stats = dict(ev.stats)
                by_op[ev.name][f"{stats.get('hlo_module', '?')}/{stats.get('hlo_op', '?')}"] += ev.duration_ns
                spans.append((ev.start_ns, ev.start_ns + ev.duration_ns))
    if not spans:
        return {}
    spans.sort()
    busy, (cur_a, cur_b) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > cur_b:
            busy += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    busy += cur_b - cur_a
    window = spans[-1][1] - spans[0][0]
    total = sum(by_name.values())
    return {"window_ms": window / 1e6, "device_busy": busy / window, "events": len(spans),
            "kernels": [(name[:70], ns / 1e6, ns / total) for name, ns in by_name.most_common(top)],
            "ops": {name[:70]: [(op[:90], ns / 1e6) for op, ns in by_op[name].most_common(4)]
                    for name, _ in by_name.most_common(top)}}


BATCH_BUCKETS = ((1, 8), (9, 32), (33, 64), (65, 128), (129, 256), (257, 1 << 20))


def by_batch_table(timeline, records) -> list[dict]:
    """Where the timed run's wall time went, by the number of sequences in a step: steps,
    seconds between one step's dispatch and the next one's (with async scheduling, the step
    period), and the device time of decode steps of that size in the synchronous pass."""
    period = [(n, tok, t1 - t0) for (n, tok, t0), (_, _, t1) in zip(timeline, timeline[1:])]
    rows = []
    print("by sequences per step: steps, wall s, ms per step (period), tokens per step; device ms per decode "
          "step and per step of any kind (synchronous pass: launch to sampled tokens on the host; median, and the "
          "mean to set beside the period, which is a mean)")
    for lo, hi in BATCH_BUCKETS:
        sel = [(tok, dt) for n, tok, dt in period if lo <= n <= hi]
        dev = [dt * 1e3 for c, dt in records if lo <= len(c) <= hi and all(k == 1 for _, k, _ in c)]
        dev_all = [dt * 1e3 for c, dt in records if lo <= len(c) <= hi]
        if not sel:
            continue
        wall = sum(dt for _, dt in sel)
        r = {"seqs": f"{lo}-{hi}", "steps": len(sel), "wall_s": wall, "ms_per_step": 1e3 * wall / len(sel),
             "tokens_per_step": sum(tok for tok, _ in sel) / len(sel),
             "decode_device_ms": float(np.median(dev)) if dev else float("nan"),
             "step_device_ms": float(np.median(dev_all)) if dev_all else float("nan"),
             "step_device_ms_mean": float(np.mean(dev_all)) if dev_all else float("nan")}
        rows.append(r)
        print(f"    {r['seqs']:>9}  {r['steps']:>5}  {wall:>6.1f} s  {r['ms_per_step']:>6.2f} ms  "
              f"{r['tokens_per_step']:>7.0f}  device: decode {r['decode_device_ms']:>6.2f} ms, "
              f"any step {r['step_device_ms']:>6.2f} ms, mean {r['step_device_ms_mean']:>6.2f}")
    return rows


TOKEN_BUCKETS = ((1, 64), (65, 256), (257, 512), (513, 1024), (1025, 2048), (2049, 1 << 20))


def by_tokens_table(timeline) -> list[dict]:
    """The timed run's steps by tokens per step (which matmul regime they take: decode-sized
    tiles up to 64, the stacked kernel up to ``model.STACKED_MAX_TOKENS``, XLA's matmul past
    it): steps, wall seconds (the step period) and ms per step."""
    period = [(tok, t1 - t0) for (_, tok, t0), (_, _, t1) in zip(timeline, timeline[1:])]
    rows = []
    print("by tokens per step: steps, wall s, ms per step (period)")
    for lo, hi in TOKEN_BUCKETS:
        sel = [dt for tok, dt in period if lo <= tok <= hi]
        if sel:
            rows.append({"tokens": f"{lo}-{hi}", "steps": len(sel), "wall_s": sum(sel),
                         "ms_per_step": 1e3 * sum(sel) / len(sel)})
            print(f"    {rows[-1]['tokens']:>11}  {len(sel):>5}  {sum(sel):>6.1f} s  {rows[-1]['ms_per_step']:>6.2f} ms")
    return rows


def matmul_table(tokens=(16, 64, 256, 512, 1024, 2048), sweep: bool = False, budget_s: float = float("inf"),
                 quick: bool = False) -> list[dict]:
    """The stacked-weight matmul against XLA's slice-then-matmul for Llama-3-8B's projections
    as the model calls them (q/k/v and gate/up grouped, one launch each), by tokens per
    step: the default (split-K from ``default_splits``) and, where it splits, the unsplit
    kernel; with ``sweep``, other tiles, warps, stages and split factors too (for few
    tokens: narrow deep tiles and splits; for more: Hopper-sized tiles and 8 warps, each in
    both launch orders). Token counts are swept in the order given until ``budget_s`` has
    passed; the rest get the default and XLA only. ``quick``: small shapes, in the Pallas
    interpreter off a GPU (the code path only). Times are device time per call: 20 calls
    in one jitted loop (:func:`looped`), so that a decode-sized matmul is not timed at the
    host's dispatch rate."""
    from jaxpaged.pallas.stacked_matmul import MatmulConfig, grouped_config, grouped_stacked_matmul
    from jaxpaged.pallas.stacked_matmul_mgpu import MosaicMatmulConfig, mosaic_grouped_stacked_matmul
    from jaxpaged.pallas.stacked_matmul_mgpu import default_config as mosaic_default_config
    from jaxpaged.pallas.stacked_matmul_mgpu import supports as mosaic_supports

    print("\n## Stacked matmul vs XLA (x @ w[layer] of [3, K, N] stacks), Llama-3-8B projections, bf16")
    shapes = (("q/k/v", 4096, (4096, 1024, 1024)), ("o", 4096, (4096,)), ("gate/up", 4096, (14336, 14336)),
              ("down", 14336, (4096,)))
    if quick:
        shapes = (("q/k/v", 256, (256, 64, 64)), ("down", 512, (256,)))
    interpret = jax.default_backend() != "gpu"
    kernel = functools.partial(grouped_stacked_matmul, interpret=interpret)
    layer = jax.device_put(jnp.int32(1))
    xla = jax.jit(lambda x, ws, l: tuple(x @ jax.lax.dynamic_index_in_dim(w, l, keepdims=False) for w in ws))
    rows, deadline = [], time.perf_counter() + budget_s
    for T in tokens:
        full = sweep and time.perf_counter() < deadline
        if sweep and not full:
            print(f"  T={T}: sweep budget ({budget_s:.0f} s) spent, default tiles only")
        for name, K, widths in shapes:
            x = jax.random.normal(jax.random.key(0), (T, K), jnp.bfloat16)
            ws = tuple((jax.random.normal(jax.random.key(1 + i), (3, K, n), jnp.float32) / 64).astype(jnp.bfloat16)
                       for i, n in enumerate(widths))
            want = [np.asarray(o, np.float32) for o in xla(x, ws, layer)]
            N, gcd = sum(widths), int(np.gcd.reduce(widths))
            config = grouped_config(T, K, widths)
            (bt, bn, bk), nw, ns, splits, tf = config
            cands = [("xla", xla, None), (f"default {config.blocks} w{nw} s{ns} split{splits}{' tf' if tf else ''}",
                                          jax.jit(kernel), config)]
            if splits > 1:
                cands.append(("default unsplit", jax.jit(functools.partial(kernel, splits=1)),
                              config._replace(splits=1)))
            if T > 64 and mosaic_supports(K, widths, x.dtype):  # the Mosaic GPU kernel (wgmma, TMA)
                auto = mosaic_default_config(T, K, widths, 2 if interpret else jax.devices()[0].core_count)
                mcfgs = [(None, auto)]  # its tiles chosen by shape, as the model calls it
                if full:
                    mcfgs += [(c, c) for c in (MosaicMatmulConfig(), MosaicMatmulConfig(tile_n=64),
                                               MosaicMatmulConfig(tile_m=64),
                                               MosaicMatmulConfig(tile_m=64, tile_n=64),
                                               MosaicMatmulConfig(max_concurrent_steps=3))
                              if c != auto and mosaic_supports(K, widths, x.dtype, c)]
                for given, mc in mcfgs:
                    cands.append((f"mosaic{' default' if given is None else ''} m{mc.tile_m} n{2 * mc.tile_n} "
                                  f"k{mc.tile_k} st{mc.max_concurrent_steps}",
                                  jax.jit(functools.partial(mosaic_grouped_stacked_matmul, config=given,
                                                            interpret=interpret)), None))
            if full:  # (block_t, block_n, block_k, warps, stages, splits), in both launch orders past one tile
                t = max(16, next_power_of_2(T))
                grid = (((t, 32, 128, 4, 4, 1), (t, 64, 256, 4, 3, 1), (t, 64, 128, 4, 3, 2), (t, 64, 128, 4, 3, 8),
                         (t, 128, 128, 4, 3, 4), (t, 128, 64, 4, 4, 2), (t, 64, 64, 4, 5, 4), (t, 32, 256, 4, 3, 2),
                         (t, 256, 64, 8, 3, 2), (t, 128, 64, 4, 6, 2), (t, 256, 32, 4, 6, 4), (t, 512, 32, 8, 4, 2),
                         (t, 128, 128, 8, 4, 2)) if T <= 64 else
                        ((128, 128, 64, 4, 3, 1), (128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1),
                         (128, 128, 128, 8, 3, 1), (128, 64, 128, 8, 4, 1), (256, 128, 64, 8, 3, 1),
                         (64, 128, 64, 4, 4, 1)))
                for bt_, bn_, bk_, nw_, ns_, sp in grid:
                    if gcd % bn_ or K % (sp * bk_) or bt_ > t:
                        continue
                    for tf_ in ((False,) if T <= bt_ else (False, True)):
                        cfg = MatmulConfig((bt_, bn_, bk_), nw_, ns_, sp, tf_)
                        cands.append((f"t{bt_} n{bn_} k{bk_} w{nw_} s{ns_} split{sp}{' tf' if tf_ else ''}",
                                      jax.jit(functools.partial(kernel, **cfg._asdict())), cfg))
            line = []
            for label, f, cfg in cands:
                try:
                    err = max(float(np.max(np.abs(np.asarray(o, np.float32) - w)))
                              for o, w in zip(f(x, ws, layer), want))
                    reps = 2 if interpret else 20
                    us = per_call(looped(f, reps), x, ws, layer, n=1 if interpret else 3,
                                  rounds=1 if interpret else 5) * 1e6 / reps
                except Exception as e:  # a tile Triton refuses (shared memory)
                    print(f"    T={T} {name} {label}: {type(e).__name__} {str(e)[:60]}")
                    continue
                rows.append({"T": T, "shape": name, "K": K, "N": N, "impl": label,
                             "cfg": None if cfg is None else cfg._asdict(), "us": us,
                             "tflops": 2 * T * K * N / us / 1e6, "weight_tb_s": K * N * 2 / us / 1e6,
                             "max_err": err})
                line.append(f"{label} {us:.0f}us ({err:.0e})")
            print(f"  T={T:>4} {name:<8} " + " | ".join(line), flush=True)
    return rows


def moe_table(tokens=(1, 8, 64, 256, 1024, 4096), quick: bool = False) -> list[dict]:
    """One layer's experts (routing, gate, up, down, the weighted sum) at Qwen3-30B-A3B's shapes
    (2,048 wide, 128 experts of 768, 8 a token) and Mixtral-8x7B's (4,096, 8 of 14,336, 2), bf16,
    random weights and a random router: the Triton kernel reading a 2-layer expert stack in place
    (``moe_mlp(experts="pallas")``, what a CUDA step runs) against XLA's ragged dot over the
    layer's slice of it (``"grouped"``), device time per call (:func:`looped`), and the weights
    of the experts the tokens chose over that time. A shape XLA cannot run (its ragged dot
    expanded into every expert, out of memory) prints its error. ``quick``: a tiny layer, in the
    Pallas interpreter off a GPU (the code path only)."""
    import types

    from jaxpaged.config import MoeConfig
    from jaxpaged.model import moe_mlp

    print("\n## Mixture of experts, one layer: the Triton kernel vs XLA's ragged dot, bf16")
    shapes = (("qwen3-30b-a3b", 2048, MoeConfig(128, 8, 768, True)),
              ("mixtral-8x7b", 4096, MoeConfig(8, 2, 14336, True)))
    if quick:
        shapes, tokens = (("tiny", 64, MoeConfig(8, 2, 32, True)),), (1, 16)
    interpret = jax.default_backend() != "gpu"
    reps = 2 if interpret else 10
    layer = jax.device_put(jnp.int32(1))
    rows = []
    for name, D, moe in shapes:
        E, F = moe.num_experts, moe.intermediate_size
        keys = jax.random.split(jax.random.key(0), 4)
        stacks = tuple((jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[-2])).astype(jnp.bfloat16)
                       for k, shape in zip(keys, ((2, E, D, F), (2, E, D, F), (2, E, F, D))))
        router = (jax.random.normal(keys[3], (D, E), jnp.float32) / np.sqrt(D)).astype(jnp.bfloat16)

        def call(impl):
            def f(x, stacks, layer):
                p = types.SimpleNamespace(router=router, **{n: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
                                                            for n, w in zip(("we_gate", "we_up", "we_down"), stacks)})
                return (moe_mlp(x, p, moe, None, experts=impl, stacks=stacks, layer=layer, interpret=interpret),)
            return f

        for T in tokens:
            x = jax.random.normal(jax.random.key(T), (T, D), jnp.float32).astype(jnp.bfloat16)
            logits = np.asarray(x.astype(jnp.float32) @ router.astype(jnp.float32))
            chosen = len(np.unique(np.argsort(-logits, axis=1)[:, :moe.top_k]))
            weight_bytes = chosen * 3 * D * F * 2
            out, line = {}, []
            for impl in ("pallas", "grouped"):
                try:
                    out[impl] = np.asarray(jax.jit(call(impl))(x, stacks, layer)[0], np.float32)
                    us = per_call(looped(call(impl), reps), x, stacks, layer, n=1 if interpret else 3,
                                  rounds=1 if interpret else 5) * 1e6 / reps
                except Exception as e:  # noqa: BLE001 - XLA's expansion out of memory, say
                    line.append(f"{impl}: {type(e).__name__} {str(e)[:60]}")
                    continue
                rows.append({"shape": name, "T": T, "impl": impl, "us": us, "experts_read": chosen,
                             "weight_tb_s": weight_bytes / us / 1e6})
                line.append(f"{impl} {us:.0f} us ({weight_bytes / us / 1e6:.2f} TB/s of chosen weights)")
            if len(out) == 2:
                line.append(f"max |diff| {float(np.max(np.abs(out['pallas'] - out['grouped']))):.1e}")
            print(f"  {name:<14} T={T:>5} experts read {chosen:>3}: " + " | ".join(line), flush=True)
    return rows


def use_fastest_tiles(rows: list[dict]):
    """Make the sweep's fastest kernel configuration per (tokens, K, N) the stacked matmul's
    default for the rest of this process (the llama8b run after it), so one device call
    measures the engine with tuned tiles; a step's token count takes the nearest swept one
    within 1.5x (any swept one for decode-sized steps <= 64, where the token tile follows
    the step's size), else the defaults. Prints the choices, to be written into ``default_config``,
    ``default_splits`` and ``default_tokens_fastest``. Returns them and a function that
    restores the defaults."""
    import math

    from jaxpaged.pallas import stacked_matmul as sm

    best: dict[tuple[int, int, int], dict] = {}
    for r in rows:
        key = (r["T"], r["K"], r["N"])
        if r["cfg"] is not None and r["max_err"] < 0.1 and (key not in best or r["us"] < best[key]["us"]):
            best[key] = r
    saved = sm.default_config, sm.default_splits, sm.default_tokens_fastest

    def restore():
        sm.default_config, sm.default_splits, sm.default_tokens_fastest = saved

    if not best:
        return {}, restore
    swept = sorted({T for T, _, _ in best})
    orig_config, orig_splits, orig_tf = saved

    def pick(T, K, N):  # the nearest swept token count: any decode-sized one (one token tile), else within 1.5x
        near = ([s for s in swept if s <= 64] if T <= 64 else
                [s for s in swept if s > 64 and abs(math.log2(s / T)) <= math.log2(1.5)])
        if not near:
            return None
        r = best.get((min(near, key=lambda s: abs(math.log2(s / max(T, 1)))), K, N))
        return r["cfg"] if r else None

    def config(T, K, N):
        c = pick(T, K, N)
        if not c:
            return orig_config(T, K, N)
        bt, bn, bk = c["blocks"]
        fit = max(16, next_power_of_2(T))  # the step's tokens, as a power of two
        # Decode-sized: one token tile of the step's size, as the default does; otherwise the
        # swept tile, but never taller than the step (a 96-token step in 256-row tiles).
        bt = fit if T <= 64 else min(bt, fit)
        return (bt, bn, bk), c["num_warps"], c["num_stages"]

    def splits(T, K, N, blocks):
        c = pick(T, K, N)
        return c["splits"] if c else orig_splits(T, K, N, blocks)

    def tokens_fastest(T, K, N, blocks):
        c = pick(T, K, N)
        return c["tokens_fastest"] if c else orig_tf(T, K, N, blocks)

    sm.default_config, sm.default_splits, sm.default_tokens_fastest = config, splits, tokens_fastest
    print("fastest kernel per (tokens, K, N), now the default in this process:")
    for (T, K, N), r in sorted(best.items()):
        print(f"    T={T:>4} {r['shape']:<8} {r['impl']:<40} {r['us']:>7.1f} us  cfg {r['cfg']}")
    return {f"{T},{K},{N}": r["cfg"] for (T, K, N), r in best.items()}, restore


def llama8b_model(args):
    """A random model with Llama-3-8B's shapes in bf16, its weights made on the device (a
    2-layer, 256-wide one with ``--quick``, which also runs on CPU): ``(cfg, model, seconds)``."""
    from jaxpaged.config import LlamaConfig
    from jaxpaged.loader import build_model

    cfg = LlamaConfig.llama3_8b()
    if args.quick:  # the code path on a small model (also runs on CPU)
        cfg = dataclasses.replace(cfg, num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                                  num_kv_heads=2, head_dim=64, vocab_size=1024)
    t = time.perf_counter()
    params = jax.block_until_ready(device_random_params(cfg, jnp.bfloat16))
    model = build_model(cfg, params, dtype=jnp.bfloat16, attention_backend=args.backend)
    return cfg, model, time.perf_counter() - t


def decode_profile_table(args, bw: float) -> list[dict]:
    """Where a decode step's time goes at a few batch sizes (Llama-3-8B shapes, bf16): for
    each, ``batch`` requests of ``context`` prompt tokens are prefilled, then ``steps`` decode
    steps are timed (the async loop's period) and ``steps`` more traced with ``jax.profiler``.
    Per step: the period, the device's busy time and kernel launches (from the trace), the
    floor its bytes set at the measured read bandwidth (weights + KV, ``ModelCost``), and the
    kernels that took the most device time. The engine's own decode steps of these sizes:
    ``--only llama8b``'s tail (1-8 sequences) and busy phase (129-256)."""
    import shutil

    from bench_common import CompileCounter, ModelCost, greedy_params

    from jaxpaged import LLM
    from jaxpaged.loader import LoadedModel

    cfg, model, _ = llama8b_model(args)
    # Prompts end short of a power-of-two context (the block tables' width is bucketed), so
    # the timed and traced steps run one shape each.
    cases = [(2, 48), (8, 40)] if args.quick else [(4, 960), (8, 1900), (32, 448), (256, 192)]
    steps = 4 if args.quick else 16
    llm = LLM(LoadedModel(model, None, cfg, "random"), max_num_seqs=max(b for b, _ in cases), max_model_len=2048,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              kv_cache_memory=args.kv_cache_memory)
    cost = ModelCost.from_loaded(LoadedModel(model, None, cfg, "random"))
    counter, rng, rows = CompileCounter.get(), np.random.default_rng(0), []
    print(f"\n## Decode steps by batch size (Llama-3-8B shapes, bf16, {args.backend}): {steps} steps timed, "
          f"{steps} traced; floor = weights + KV read at {bw / 1e12:.2f} TB/s")
    print(f"{'batch':>6}{'context':>9}{'period ms':>11}{'busy ms':>9}{'floor ms':>10}{'kernels':>9}"
          f"{'compiles':>10}  top kernels, ms a step")
    for batch, context in cases:
        rids = [llm.add_request(rng.integers(100, cfg.vocab_size, context).tolist(),
                                greedy_params(3 * steps + 16)) for _ in range(batch)]
        started: set[str] = set()
        while len(started) < batch:  # prefill (chunked), then a few decode steps to settle
            started.update(o.request_id for o in llm.step() if o.outputs and o.outputs[0].token_ids)
        for _ in range(4):
            llm.step()
        c0 = counter.snapshot()[0]
        t = time.perf_counter()
        for _ in range(steps):
            llm.step()
        period = (time.perf_counter() - t) / steps
        folder = os.path.join(os.environ.get("OUT", "bench_out"), f"trace_decode_{batch}")
        shutil.rmtree(folder, ignore_errors=True)
        with jax.profiler.trace(folder):
            for _ in range(steps):
                llm.step()
        compiles = counter.snapshot()[0] - c0
        for rid in rids:
            llm.abort(rid)
        while llm.has_unfinished_requests():
            llm.step()
        tr = trace_summary(folder, top=12)
        shutil.rmtree(folder, ignore_errors=True)
        floor = cost.step([(context + 8 + steps, 1, True)] * batch)[1] / bw
        r = {"batch": batch, "context": context, "period_ms": 1e3 * period, "floor_ms": 1e3 * floor,
             "compiles": compiles}
        if tr:
            r["busy_ms"] = tr["window_ms"] * tr["device_busy"] / steps
            r["kernels_per_step"] = tr["events"] / steps
            r["top"] = [(name, ms / steps) for name, ms, _ in tr["kernels"]]
        rows.append(r)
        print(f"{batch:>6}{context:>9}{r['period_ms']:>11.2f}{r.get('busy_ms', float('nan')):>9.2f}"
              f"{r['floor_ms']:>10.2f}{r.get('kernels_per_step', float('nan')):>9.0f}{compiles:>10}", flush=True)
        for name, ms in r.get("top", []):
            print(f"{'':>14}{ms:>8.3f}  {name}")
    return rows


def llama8b_table(args, bw: float, rates: dict) -> dict:
    """Offline throughput of a random model with Llama-3-8B's shapes (bf16) on a synthetic
    ShareGPT-like workload, measured the way vLLM's benchmark_throughput does: every request
    submitted at once, ``ignore_eos``, wall time from the first step to the last token."""
    from bench_common import CompileCounter, ModelCost, make_workload, run_offline

    from jaxpaged import LLM
    from jaxpaged.loader import LoadedModel

    cfg, model, t_init = llama8b_model(args)
    n_req = args.num_requests
    max_len = 2048
    wl = make_workload("sharegpt", n_req, vocab_size=cfg.vocab_size, max_model_len=max_len,
                       prompt_len=215, output_len=200)
    llm = LLM(LoadedModel(model, None, cfg, "random"), max_num_seqs=args.max_num_seqs, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
              kv_cache_memory=args.kv_cache_memory)
    cost = ModelCost.from_loaded(LoadedModel(model, None, cfg, "random"))
    runner, records, chunks = llm.runner, [], {}
    dispatch, collect, launch = runner.dispatch, runner.collect, runner.launch
    launch_s, launch_t0 = [0.0], [0.0]

    def timed_launch(*a, **k):  # the launch (sampling metadata, the jit calls): enqueueing kernels takes host time
        launch_t0[0] = time.perf_counter()
        res = launch(*a, **k)
        launch_s[0] += time.perf_counter() - launch_t0[0]
        return res

    # Per step: the chunks and the device step, from the launch to the sampled tokens on the
    # host. Only meaningful with async scheduling off (the device is idle at the launch), so
    # a separate pass. On a GPU the launch itself takes milliseconds (the host enqueues every
    # layer's kernels), so the wait in collect alone would undercount.
    counter = CompileCounter.get()
    skipped = collections.Counter()  # steps of the synchronous pass that compiled something: not step times

    def timed_dispatch(out, prev=None, **kw):
        shapes_before, compiles_before = len(runner.compiled_shapes), counter.snapshot()[0]
        step = dispatch(out, prev, **kw)
        if step is not None:
            chunks[id(step)] = ([(s.start, s.num_new_tokens, s.num_samples > 0) for s in out.scheduled],
                                launch_t0[0], len(runner.compiled_shapes) > shapes_before, compiles_before)
        return step

    def timed_collect(step):
        res = collect(step)
        if step is not None:
            c, t0, new_shape, compiles_before = chunks.pop(id(step))
            # A shape the warm-up did not see, or any XLA compilation (a jit cache miss the
            # shape keys cannot see, say a synchronous-only variant), is not a step time.
            if new_shape:
                skipped["a step shape the warm-up did not meet"] += 1
            elif counter.snapshot()[0] > compiles_before:
                skipped["a compilation for a step shape met before"] += 1
            else:
                records.append((c, time.perf_counter() - t0))
        return res

    summary = wl.summary()
    print(f"\n## Llama-3-8B shapes (random weights, bf16, {args.backend}), {n_req} requests: "
          f"{summary['prompt_tokens']} prompt + {summary['output_tokens']} output tokens "
          f"(means {summary['prompt_len_mean']:.0f} / {summary['output_len_mean']:.0f}), ignore_eos, greedy; "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}, "
          f"KV {args.kv_cache_memory} = {llm.bm.num_usable_blocks} blocks of {llm.block_size}; "
          f"weights made on the device in {t_init:.1f} s", flush=True)
    t = time.perf_counter()
    warm = run_offline(llm, wl.with_fresh_ids(1, cfg.vocab_size), "warm-up", progress=False)
    print(f"warm-up pass (compiles every step shape): {time.perf_counter() - t:.1f} s, "
          f"{warm.compiles} compilations in {warm.compile_s:.1f} s", flush=True)
    timeline = []  # per dispatched step of the timed run: (sequences, tokens, dispatch time)

    def logged_dispatch(out, prev=None, **kw):
        timeline.append((len(out.scheduled), sum(s.num_new_tokens for s in out.scheduled), time.perf_counter()))
        return dispatch(out, prev, **kw)

    runner.dispatch, runner.launch = logged_dispatch, timed_launch
    run = run_offline(llm, wl, "jaxpaged", progress=False)
    timeline.append((0, 0, time.perf_counter()))
    timed_run_launch_s = launch_s[0]
    runner.dispatch, runner.launch = dispatch, launch
    # 1.5x max_num_seqs requests with outputs capped at 96 tokens: the first batch prefills,
    # decodes, and as it finishes the rest are admitted in chunks beside the running
    # decodes, so the pass holds the busy phase's mixed steps too, in a few seconds.
    n_sub = min(n_req, 3 * args.max_num_seqs // 2)
    sub = dataclasses.replace(wl, prompts=wl.prompts[:n_sub], max_tokens=[min(m, 96) for m in wl.max_tokens[:n_sub]])
    if not args.lean:
        llm.core.async_scheduling, runner.dispatch, runner.collect = False, timed_dispatch, timed_collect
        runner.launch = timed_launch
        before = collections.Counter(counter.count)
        run_offline(llm, sub.with_fresh_ids(3, cfg.vocab_size), "per-step device times", progress=False)
        compiled = counter.count - before
        print(f"synchronous pass: {len(records)} steps timed, {sum(skipped.values())} left out ("
              + "; ".join(f"{k}: {n}" for k, n in skipped.items()) + "; compiled: "
              + ", ".join(f"{n} x{k}" for n, k in compiled.most_common()) + ")")
        llm.core.async_scheduling, runner.dispatch, runner.collect, runner.launch = True, dispatch, collect, launch
    e = run.engine_stats
    steps = e["num_steps"]
    phases = {k: e[f"time_{k}_s"] / steps * 1e3 for k in ("schedule", "batch", "device", "postprocess")}
    decode = [(c, dt) for c, dt in records if c and all(n == 1 for _, n, _ in c)]
    prefill = [(c, dt) for c, dt in records if sum(n for _, n, _ in c) >= args.max_num_batched_tokens // 2]
    dec_bw = [cost.step(c)[1] / dt / bw for c, dt in decode if len(c) >= 64]
    pre_mfu = [cost.step(c)[0] / dt for c, dt in prefill]
    vllm_out, vllm_total = VLLM_H100_LLAMA3_8B
    row = {"gen_tok_s": run.gen_tok_s, "total_tok_s": run.total_tok_s, "req_s": run.req_s, "wall_s": run.wall_s,
           "steps": steps, "new_compiles_in_timed_run": run.compiles, "preemptions": e["num_preemptions"],
           "ms_per_step": phases, "decode_steps": len(decode), "decode_bw_fraction_median":
           float(np.median(dec_bw)) if dec_bw else float("nan"), "prefill_steps": len(prefill),
           "prefill_tflops_median": float(np.median(pre_mfu)) / 1e12 if pre_mfu else float("nan"),
           "wrong_lengths": run.wrong_lengths, "workload": summary}
    print(f"{'':<24}{'output tok/s':>14}{'total tok/s':>13}{'req/s':>8}{'wall s':>8}")
    print(f"{'jaxpaged (this run)':<24}{run.gen_tok_s:>14.0f}{run.total_tok_s:>13.0f}{run.req_s:>8.2f}"
          f"{run.wall_s:>8.1f}")
    print(f"{'vLLM, H100 (PR #8335)':<24}{vllm_out:>14.0f}{vllm_total:>13.0f}")
    print(f"ratio to vLLM: output {run.gen_tok_s / vllm_out:.2f}x, total {run.total_tok_s / vllm_total:.2f}x; "
          f"{steps} steps, {e['num_preemptions']} preemptions, {run.compiles} compilations in the timed run, "
          f"{run.wrong_lengths} wrong lengths")
    row["launch_ms_per_step"] = 1e3 * timed_run_launch_s / steps
    print(f"of batch: launching the jits {row['launch_ms_per_step']:.2f} ms per step")
    print("ms per step: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
          + f"; host busy {1 - phases['device'] / sum(phases.values()):.0%} (async scheduling: device = waiting)")
    if dec_bw:
        print(f"decode steps (>= 64 sequences, synchronous pass): {len(dec_bw)}, bytes moved "
              f"(weights + KV read/written) per "
              f"device-step second: median {np.median(dec_bw):.0%} of the read bandwidth ({bw / 1e12:.2f} TB/s), "
              f"p90 {np.percentile(dec_bw, 90):.0%}")
    if pre_mfu:
        peak = rates.get("bfloat16", H100_BF16_DENSE_FLOPS)
        print(f"prefill-heavy steps (>= {args.max_num_batched_tokens // 2} tokens): {len(pre_mfu)}, median "
              f"{np.median(pre_mfu) / 1e12:.0f} TFLOP/s = {np.median(pre_mfu) / H100_BF16_DENSE_FLOPS:.0%} MFU "
              f"(of 989 dense bf16), {np.median(pre_mfu) / peak:.0%} of the 8192^3 matmul rate measured now")
    row["by_batch"] = by_batch_table(timeline, records)
    row["by_tokens"] = by_tokens_table(timeline)
    if args.lean:
        return row
    # A profile of the same slice (prefill, decode, mixed steps).
    folder = os.path.join(os.environ.get("OUT", "bench_out"), "trace_8b")
    with jax.profiler.trace(folder):
        run_offline(llm, sub.with_fresh_ids(2, cfg.vocab_size), "traced", progress=False)
    tr = trace_summary(folder)
    if tr:
        row["trace"] = tr
        print(f"profile of {n_sub} requests (outputs <= 96 tokens): device busy {tr['device_busy']:.0%} of "
              f"{tr['window_ms']:.0f} ms; "
              "top kernels (ms, share of kernel time):")
        for name, ms, share in tr["kernels"]:
            print(f"    {ms:>9.1f}  {share:>5.1%}  {name}")
            for op, op_ms in tr["ops"][name]:
                print(f"    {'':>9}  {op_ms:>7.1f} ms  {op}")
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("decode", "tune", "block-size", "prefill", "mixed", "engine", "llama8b",
                                       "decode-profile", "matmul", "moe"),
                    action="append")
    ap.add_argument("--num-requests", type=int, default=1000, help="llama8b: requests of the workload")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="llama8b")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="llama8b")
    ap.add_argument("--kv-cache-memory", help="llama8b (default 24GiB; 1GiB with --quick, which also runs on CPU)")
    ap.add_argument("--backend", default="pallas", help="llama8b: attention backend")
    ap.add_argument("--engine-backends", default="pallas,xla", help="comma-separated attention backends")
    ap.add_argument("--matmul-tokens", default="16,64,256,512,1024,2048", help="matmul: tokens per step")
    ap.add_argument("--matmul-sweep", action="store_true", help="matmul: other tiles and split factors too")
    ap.add_argument("--matmul-budget-s", type=float, default=float("inf"),
                    help="matmul: stop sweeping new token counts after this many seconds")
    ap.add_argument("--use-fastest-tiles", action="store_true",
                    help="matmul: the fastest configuration found becomes the default for llama8b after it")
    ap.add_argument("--ab-baseline", action="store_true",
                    help="with --use-fastest-tiles: run llama8b again afterwards with the default tiles, same process")
    ap.add_argument("--no-split-k", action="store_true", help="stacked_matmul never splits K (the old kernel)")
    ap.add_argument("--no-grouped", action="store_true", help="one launch per projection (no q/k/v, gate/up groups)")
    ap.add_argument("--stacked-max-tokens", type=int,
                    help="steps of at most this many tokens use the stacked matmul (model.STACKED_MAX_TOKENS)")
    ap.add_argument("--mixed", choices=("ragged", "split"),
                    help="mixed steps' decode rows: in the ragged kernel, or split off to the decode kernel "
                         "(ragged_paged_attention.MIXED_DECODE_ROWS)")
    ap.add_argument("--block-q-rule", choices=("fixed", "mean"),
                    help="the ragged kernel's query block (ragged_paged_attention.BLOCK_Q_RULE)")
    ap.add_argument("--query-layout", choices=("packed", "direct"),
                    help="the ragged kernel's queries packed per block, or read in place "
                         "(ragged_paged_attention.QUERY_LAYOUT)")
    ap.add_argument("--block-order", choices=("sequence", "longest_first"),
                    help="the ragged kernel's query blocks in this launch order (ragged_paged_attention.BLOCK_ORDER)")
    ap.add_argument("--stacked-kernel", choices=("triton", "mosaic", "auto"),
                    help="steps past decode size read the stacked weights with this kernel (model.STACKED_KERNEL)")
    ap.add_argument("--decode-small-grid", type=int,
                    help="decode attention splits short tables below this many programs "
                         "(paged_attention.SMALL_GRID_PROGRAMS; 0: only long tables split, the rule before)")
    ap.add_argument("--lean", action="store_true",
                    help="llama8b: the timed run only (no synchronous pass, no profile)")
    args = ap.parse_args()
    args.kv_cache_memory = args.kv_cache_memory or ("1GiB" if args.quick else "24GiB")
    if jax.default_backend() != "gpu" and not (args.quick and set(args.only or ()) <= {"llama8b", "matmul", "mixed",
                                                                                 "decode-profile", "moe"}):
        raise SystemExit(f"bench_gpu needs a GPU; jax runs on {jax.default_backend()}")
    dev = jax.devices()[0]
    if args.no_split_k:
        from jaxpaged.pallas import stacked_matmul
        stacked_matmul.SPLIT_K = False
    if args.no_grouped:
        jaxpaged_model.GROUPED_PROJECTIONS = False
    if args.stacked_max_tokens is not None:
        jaxpaged_model.STACKED_MAX_TOKENS = args.stacked_max_tokens
    if args.stacked_kernel:
        jaxpaged_model.STACKED_KERNEL = args.stacked_kernel
    if args.decode_small_grid is not None:
        paged_attention.SMALL_GRID_PROGRAMS = args.decode_small_grid
    if args.mixed:
        gpu_ragged.MIXED_DECODE_ROWS = args.mixed
    if args.block_q_rule:
        gpu_ragged.BLOCK_Q_RULE = args.block_q_rule
    if args.query_layout:
        gpu_ragged.QUERY_LAYOUT = args.query_layout
    if args.block_order:
        gpu_ragged.BLOCK_ORDER = args.block_order
    print(f"# bench_gpu  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  jax {jax.__version__}  "
          f"{dev.device_kind}  {os.cpu_count()} CPUs  split-K {'off' if args.no_split_k else 'auto'}  "
          f"grouped {'off' if args.no_grouped else 'on'}  stacked max tokens "
          f"{args.stacked_max_tokens or 'default'}  mixed {gpu_ragged.MIXED_DECODE_ROWS}  "
          f"block_q rule {gpu_ragged.BLOCK_Q_RULE}  query layout {gpu_ragged.QUERY_LAYOUT}  "
          f"block order {gpu_ragged.BLOCK_ORDER}  "
          f"decode small grid {paged_attention.SMALL_GRID_PROGRAMS}  stacked kernel {jaxpaged_model.STACKED_KERNEL}  "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if jax.default_backend() == "gpu":
        copy_bw, bw, rates = ceilings()
    else:  # --quick --only llama8b checks the code path on CPU; no ceilings to speak of
        copy_bw, bw, rates = 20e9, 20e9, {}
    print(f"memory bandwidth: copy {copy_bw / 1e12:.2f} TB/s (read + write), sum {bw / 1e12:.2f} TB/s (read); "
          "matmul 8192^3 "
          + ", ".join(f"{k} {v / 1e12:.0f} TFLOP/s" for k, v in rates.items()))
    only = set(args.only or ("decode", "tune", "block-size", "prefill", "mixed", "engine", "llama8b"))
    report = {"device": dev.device_kind, "jax": jax.__version__, "copy_bw": copy_bw, "read_bw": bw,
              "matmul_flops": rates}
    if "decode" in only:
        keys = ("model", "dtype", "batch", "ctx", "implementation", "us", "kv_gb_s", "of_bw", "vs_contiguous",
                "max_err")
        report["decode"] = [dict(zip(keys, r)) for r in decode_table(bw, args.quick)]
    if "tune" in only:
        tuning_table(bw)
    if "block-size" in only:
        report["block_size"] = block_size_table(bw)
    if "prefill" in only:
        prefill_table()
    if "mixed" in only:
        report["mixed"] = mixed_table(args.quick)
    if "engine" in only:
        engine_table(args.quick, tuple(args.engine_backends.split(",")))
    restore_tiles = None
    if "matmul" in only:
        report["matmul"] = matmul_table(tuple(int(t) for t in args.matmul_tokens.split(",")), args.matmul_sweep,
                                        args.matmul_budget_s, args.quick)
        if args.use_fastest_tiles:
            report["tuned_tiles"], restore_tiles = use_fastest_tiles(report["matmul"])
    if "moe" in only:
        report["moe"] = moe_table(quick=args.quick)
    if "decode-profile" in only:
        report["decode_profile"] = decode_profile_table(args, bw)
    if "llama8b" in only:
        report["llama8b"] = llama8b_table(args, bw, rates)
        if args.ab_baseline and restore_tiles is not None:
            import gc

            restore_tiles()
            jax.clear_caches()  # the step traced with the tuned tiles: trace it again
            gc.collect()
            live = sum(a.nbytes for a in jax.live_arrays()) / 2**30
            print(f"\n# A/B baseline: the default tiles, same process ({live:.2f} GiB still live on the device)")
            report["llama8b_default_tiles"] = base = llama8b_table(args, bw, rates)
            tuned = report["llama8b"]
            print(f"tuned / default tiles: output tok/s {tuned['gen_tok_s']:.0f} / {base['gen_tok_s']:.0f} = "
                  f"{tuned['gen_tok_s'] / base['gen_tok_s']:.3f}x")
    name = "bench_gpu_quick" if args.quick else "bench_gpu"
    save_json(f"{name}.json", report)
    if "decode" in report or "block_size" in report:
        plot(report, f"{name}.png")


def plot(report: dict, name: str) -> None:
    """Decode attention's fraction of the read bandwidth per shape and implementation, and
    the Pallas kernel's time per block size."""
    fig, axes = new_figure(1, 2, f"Paged decode attention on {report['device']} (jax {report['jax']})")
    ax1, ax2 = axes[0]
    rows = report.get("decode", [])
    shapes = list(dict.fromkeys(f"{r['model']} {r['dtype']}\n{r['batch']} x {r['ctx']}" for r in rows))
    impls = [("pallas (splits=", "Pallas (auto split-K)"), ("xla paged", "XLA paged path"),
             ("contiguous dense", "contiguous dense einsum")]
    width = 0.8 / len(impls)
    for j, (prefix, label) in enumerate(impls):
        xs, ys = [], []
        for i, shape in enumerate(shapes):
            hits = [r for r in rows if f"{r['model']} {r['dtype']}\n{r['batch']} x {r['ctx']}" == shape
                    and r["implementation"].startswith(prefix)]
            if hits:  # the auto-split row comes first
                xs.append(i + (j - 1) * width)
                ys.append(100 * hits[0]["of_bw"])
        ax1.bar(xs, ys, width, label=label)
    ax1.set_xticks(range(len(shapes)), shapes, fontsize=6)
    ax1.set_ylabel("KV bytes/s, % of read bandwidth")
    ax1.legend(fontsize=7)
    sweep = report.get("block_size", [])
    ax2.plot([r["block_size"] for r in sweep], [r["us"] for r in sweep], "o-")
    ax2.set_xscale("log", base=2)
    ax2.set_ylim(bottom=0)  # flat is the claim: show it from zero
    ax2.set_xlabel("block size (tokens)")
    ax2.set_ylabel("us per call")
    ax2.set_title("Pallas decode vs block size (Llama-3-8B, bf16, 64 x 2048)", fontsize=8)
    save_figure(fig, name)


if __name__ == "__main__":
    main()
