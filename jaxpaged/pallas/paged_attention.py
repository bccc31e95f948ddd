"""Pallas decode attention over the paged pool, with split-K ("PagedAttention v2").

One query token per sequence. Grid ``(num_seqs, num_kv_heads, num_splits)``: a program
takes all query heads of one KV head (GQA/MQA: the group is padded to ``block_h`` rows,
>= 16 and a power of two, as Triton's ``dot`` needs) and walks that sequence's blocks in
logical order, ``pages_per_chunk`` blocks per step, each read through the block table
from the full stacked pool. Online softmax in float32 (running max ``m``, running sum
``l``, rescaled accumulator ``o``). The loop bound comes from the sequence's length, not
the table width, so a padding row (length 0) reads nothing and writes zeros.

With ``num_splits > 1`` the blocks are cut into partitions computed by separate programs;
each returns unnormalised ``(o, m, l)`` and :func:`merge_partitions` combines them with
the log-sum-exp rule. Long contexts with few sequences need it to fill a GPU.

On CPU the kernel runs with ``interpret=True``; on GPU it lowers through Pallas' Triton
backend (power-of-two tiles: ``pages_per_chunk * block_size`` keys, ``head_dim``,
``block_h`` rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from jaxpaged.pallas import common

# Split-K defaults (see auto_num_splits), after vLLM's v1/v2 choice: split long tables, and
# short ones only while the grid is too small to fill the GPU on its own.
SPLIT_THRESHOLD_TOKENS = 2048
PARTITION_TOKENS = 1024
TARGET_PROGRAMS = 1024  # ~8 programs per SM on an H100 (132 SMs); see auto_num_splits
SMALL_GRID_PROGRAMS = 264  # ~2 programs per SM: below it, short tables split too
MIN_PARTITION_TOKENS = 256


def _decode_kernel(
    lens_ref,  # [S] int32, whole array
    bt_ref,  # [pages_per_partition] int32: this partition's block ids, layer folded in
    q_ref,  # [block_h, D]
    k_ref,  # [L * NB, KVH, BS, D], whole pool
    v_ref,  # [L * NB, KVH, BS, D], whole pool
    o_ref,  # [block_h, D]: normalised (no split) or unnormalised f32 (split)
    *ml_refs,  # split only: m, l [block_h] f32
    scale: float,
    block_size: int,
    pages_per_chunk: int,
    pages_per_partition: int,
):
    s, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    block_h, head_dim = q_ref.shape
    chunk = pages_per_chunk * block_size
    length = lens_ref[s]
    first_page = p * pages_per_partition
    n_pages = jnp.clip(pl.cdiv(length, block_size) - first_page, 0, pages_per_partition)
    q = q_ref[...]

    def body(c, carry):
        o, m, l = carry
        ids = bt_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]
        k = common.from_kv(k_ref[ids, h].reshape(chunk, head_dim), q.dtype)
        v = common.from_kv(v_ref[ids, h].reshape(chunk, head_dim), q.dtype)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=common.dot_precision(k.dtype),
                                 preferred_element_type=jnp.float32) * scale  # [block_h, chunk]
        key_pos = (first_page + c * pages_per_chunk) * block_size + lax.broadcasted_iota(
            jnp.int32, (1, chunk), 1)
        valid = key_pos < length  # [1, chunk]
        logits = jnp.where(valid, logits, common.MASK_VALUE)
        m_new = jnp.maximum(m, logits.max(axis=1))
        alpha = jnp.exp(m - m_new)
        probs = jnp.exp(logits - m_new[:, None])
        l = alpha * l + probs.sum(axis=1)
        # Stale slots past the length may hold anything (even NaN); 0 * NaN would leak.
        v = jnp.where(valid.reshape(chunk, 1), v, jnp.zeros_like(v))
        pv = lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=common.dot_precision(v.dtype),
                             preferred_element_type=jnp.float32)
        return alpha[:, None] * o + pv, m_new, l

    init = (jnp.zeros((block_h, head_dim), jnp.float32),
            jnp.full((block_h,), common.MASK_VALUE, jnp.float32),
            jnp.zeros((block_h,), jnp.float32))
    o, m, l = lax.fori_loop(0, pl.cdiv(n_pages, pages_per_chunk), body, init)
    if ml_refs:
        m_ref, l_ref = ml_refs
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l
    else:
        o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def merge_partitions(o: Float[Array, "P *rows D"], m: Float[Array, "P *rows"],
                     l: Float[Array, "P *rows"]) -> Float[Array, "*rows D"]:
    """Combine split-K partials: ``o = sum_p e^(m_p - M) o_p / sum_p e^(m_p - M) l_p``.

    Empty partitions carry ``l = 0`` (and ``m`` = the mask value), so they weigh nothing;
    a row with no keys at all gives zeros.
    """
    m_max = m.max(axis=0)
    w = jnp.exp(m - m_max[None])
    l_tot = (w * l).sum(axis=0)
    o_tot = (w[..., None] * o).sum(axis=0)
    return o_tot / jnp.where(l_tot > 0, l_tot, 1.0)[..., None]


def auto_num_splits(max_context: int, num_programs: int) -> int:
    """Partitions for a table of ``max_context`` tokens and a grid of ``num_programs``
    (sequences x KV heads) programs, never more than needed to reach ``TARGET_PROGRAMS``
    programs (a full grid gains nothing from splitting and pays for the partials and the
    merge). Both sizes are static, so the choice is made at trace time.

    - Tables longer than ``SPLIT_THRESHOLD_TOKENS``: one partition per ``PARTITION_TOKENS``.
    - Shorter tables: one partition per ``MIN_PARTITION_TOKENS`` while the grid has fewer
      than ``SMALL_GRID_PROGRAMS`` programs, else none.

    Measured on an H100 (bf16, ``scripts/bench_gpu.py --only tune``): a grid of 192
    programs (SmolLM2, 64 sequences x 4096 keys) runs 1.6x faster in 4 partitions than
    in one; 64 programs x 16k keys (Llama-3-8B, 8 sequences) 1.1x faster in 8-16 than in
    4; at 64 x 2048 keys (512 programs, not split) 2-16 partitions measured 2-20%
    slower. Hence ~8 programs per SM rather than 2. The small-grid rule is for the
    engine's small batches (``--only decode-profile``): Llama-3-8B, 4 sequences at a
    1,024-key table, unsplit, is 32 programs walking 960 keys each, 37 us a layer for
    16 MB of keys and values (0.42 TB/s), 16% of a decode step's device time.
    """
    cap = max(1, TARGET_PROGRAMS // max(num_programs, 1))
    if max_context > SPLIT_THRESHOLD_TOKENS:
        return min(pl.cdiv(max_context, PARTITION_TOKENS), cap)
    if num_programs < SMALL_GRID_PROGRAMS:
        return min(pl.cdiv(max_context, MIN_PARTITION_TOKENS), cap)
    return 1


def paged_decode_attention(
    q: Float[Array, "S Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    *,
    scale: float,
    num_splits: int | None = None,
    pages_per_chunk: int | None = None,
    block_h: int | None = None,
    interpret: bool | None = None,
    debug: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Float[Array, "S Hq D"]:
    """Decode attention of one query token per sequence over one layer of the paged pool.

    Args:
      q: the query of each sequence; row ``s`` sits at position ``context_lens[s] - 1``.
      k_pool, v_pool: the full stacked pool; ``layer`` (traced or not) picks the layer
        inside the kernel.
      block_tables: logical -> physical block per sequence; entries past a sequence's
        length are ignored (read as the null block).
      context_lens: keys per sequence, this step's included; 0 marks a padding row.
      scale: logit scale, usually ``head_dim ** -0.5``.
      num_splits: split-K partitions; ``None`` picks :func:`auto_num_splits` of the table
        width and grid size, ``1`` forces the single-pass kernel.
      pages_per_chunk: blocks per loop step (keys per step = this * block_size, a power of
        two >= 16); default: 64 keys.
      block_h: rows of the query-head tile (the GQA group padded); default
        ``max(16, next_power_of_2(group))``.
      interpret: run the kernel in the Pallas interpreter; default: on CPU.
      debug: range-check the block table at run time (it is checked at call time when
        it is a concrete array).
      num_warps, num_stages: Triton compiler knobs.
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, decode=True,
                              what="paged_decode_attention")
    return _paged_decode_attention(q, k_pool, v_pool, layer, block_tables, context_lens, scale=scale,
                                   num_splits=num_splits, pages_per_chunk=pages_per_chunk,
                                   block_h=block_h, interpret=interpret, debug=debug,
                                   num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=(
    "scale", "num_splits", "pages_per_chunk", "block_h", "interpret", "debug", "num_warps", "num_stages"))
def _paged_decode_attention(q, k_pool, v_pool, layer, block_tables, context_lens, *, scale, num_splits,
                            pages_per_chunk, block_h, interpret, debug, num_warps, num_stages):
    what = "paged_decode_attention"
    S, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    W = block_tables.shape[1]
    G = Hq // KVH
    interpret = common.default_interpret() if interpret is None else interpret
    block_h = max(16, common.next_power_of_2(G)) if block_h is None else block_h
    ppc = max(1, 64 // BS) if pages_per_chunk is None else pages_per_chunk
    if block_h < G:
        raise ValueError(f"{what}: block_h={block_h} is smaller than the query group of {G} heads")
    if not interpret:
        for name, n in (("block_size", BS), ("head_dim", D), ("block_h", block_h),
                        ("pages_per_chunk * block_size", ppc * BS)):
            if n & (n - 1) or n < (1 if name == "block_size" else 16):
                raise ValueError(f"{what}: {name}={n} must be a power of two (>= 16 for tiles) on GPU")
    splits = auto_num_splits(W * BS, S * KVH) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"{what}: num_splits={splits} must be >= 1")
    # Pages per partition: a whole number of chunks; the table is padded to splits * ppp.
    ppp = pl.cdiv(pl.cdiv(W, splits), ppc) * ppc
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    bt = common.flat_block_ids(block_tables, context_lens, layer, NB, BS, splits * ppp)
    qg = common.group_queries(q, KVH, block_h)  # [S, KVH, block_h, D]
    split = splits > 1

    kernel = functools.partial(_decode_kernel, scale=scale, block_size=BS, pages_per_chunk=ppc,
                               pages_per_partition=ppp)
    whole = pl.BlockSpec()
    o_spec = pl.BlockSpec((None, None, None, block_h, D), lambda s, h, p: (p, s, h, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, block_h), lambda s, h, p: (p, s, h, 0))
    o_dtype = jnp.float32 if split else q.dtype
    out_shape = [jax.ShapeDtypeStruct((splits, S, KVH, block_h, D), o_dtype)]
    out_specs = [o_spec]
    if split:
        out_shape += [jax.ShapeDtypeStruct((splits, S, KVH, block_h), jnp.float32)] * 2
        out_specs += [ml_spec, ml_spec]
    outs = pl.pallas_call(
        kernel,
        grid=(S, KVH, splits),
        in_specs=[
            whole,  # context_lens
            pl.BlockSpec((None, ppp), lambda s, h, p: (s, p)),  # block ids of the partition
            pl.BlockSpec((None, None, block_h, D), lambda s, h, p: (s, h, 0, 0)),  # q
            whole,  # k pool
            whole,  # v pool
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps,
                                                                  num_stages=num_stages),
        name=f"paged_decode_bs{BS}_h{block_h}_ppc{ppc}_splits{splits}",
    )(context_lens, bt, qg, common.flat_pool(k_pool), common.flat_pool(v_pool))
    if split:
        o = merge_partitions(*outs).astype(q.dtype)
    else:
        o = outs[0][0]
    return common.ungroup_queries(o, Hq)
