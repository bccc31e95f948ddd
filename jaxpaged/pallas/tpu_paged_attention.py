"""Mosaic (TPU) paged decode attention with split-K.

Same signature and semantics as :func:`.paged_attention.paged_decode_attention`; the
page pipeline (SMEM tables, pool in HBM, per-page DMAs into double-buffered VMEM slots,
online softmax), the tile rules and the comparison with JAX's own TPU kernels are in
:mod:`.tpu_common`.

**Grid** ``(num_seqs, num_splits)``, both ``"parallel"``. A program takes one sequence
(with split-K: one partition of its pages, ``pages_per_partition`` of them, a whole
number of compute blocks) and every KV head. Its queries are ``[KVH, group_pad, D]``:
the query heads of each KV head as rows, padded to a whole sublane tile (8 rows for
float32, 16 for bf16, which packs two rows per sublane). SMEM holds the context lengths
and the flat block table. A padding row (length 0) copies nothing and writes zeros.

**Split-K on TPU.** A TensorCore runs its programs one after another, so splitting a
sequence adds no parallelism beyond the two cores of a megacore chip (v4, v5p):
:func:`auto_num_splits` splits long tables only when there are fewer sequences than
cores. Partitions return unnormalised ``(o, m, l)`` (``m``, ``l`` lane-broadcast,
``[..., 128]``), merged outside the kernel by :func:`.paged_attention.merge_partitions`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from jaxpaged.pallas import common
from jaxpaged.pallas.paged_attention import merge_partitions
from jaxpaged.pallas.tpu_common import (LANES, attend_pages, check_tpu_shapes, default_pages_per_block,
                                        interpret_params, kv_scratch, normalised, round_up, sublane_rows)

TPU_CORES = 2  # megacore (v4, v5p); v5e and v6e have one TensorCore per chip
SPLIT_THRESHOLD_TOKENS = 2048


def auto_num_splits(max_context: int, num_seqs: int) -> int:
    """Partitions per sequence: split tables longer than SPLIT_THRESHOLD_TOKENS only while
    the sequences alone cannot give each of TPU_CORES cores a program."""
    if max_context <= SPLIT_THRESHOLD_TOKENS or num_seqs >= TPU_CORES:
        return 1
    return min(TPU_CORES, pl.cdiv(max_context, SPLIT_THRESHOLD_TOKENS))


def _decode_kernel(
    lens_ref,  # [S] int32, SMEM
    bt_ref,  # [S * Wp] int32, SMEM: block ids, layer folded in
    q_ref,  # [KVH, Gp, D]
    k_hbm,  # [L * NB, KVH, BS, D], HBM
    v_hbm,  # [L * NB, KVH, BS, D], HBM
    o_ref,  # [KVH, Gp, D]: normalised (no split) or unnormalised f32 (split)
    *refs,  # split only: m, l [KVH, Gp, 128] f32; then the scratch of kv_scratch
    scale: float,
    pages_per_partition: int,
    split: bool,
):
    s, p = pl.program_id(0), pl.program_id(1)
    m_out, l_out = refs[:2] if split else (None, None)
    kbuf, vbuf, sems, acc_ref, m_ref, l_ref = refs[2:] if split else refs
    block_size = k_hbm.shape[2]
    length = lens_ref[s]
    first_page = p * pages_per_partition
    n_pages = jnp.clip(pl.cdiv(length, block_size) - first_page, 0, pages_per_partition)
    attend_pages(bt_ref, q_ref, k_hbm, v_hbm, kbuf, vbuf, sems, acc_ref, m_ref, l_ref,
                 table_off=s * pages_per_partition * pl.num_programs(1), first_page=first_page,
                 n_pages=n_pages, row_pos=length - 1, kv_len=length, scale=scale)
    if split:
        o_ref[...], m_out[...], l_out[...] = acc_ref[...], m_ref[...], l_ref[...]
    else:
        o_ref[...] = normalised(acc_ref, l_ref, o_ref.dtype)


def tpu_paged_decode_attention(
    q: Float[Array, "S Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    *,
    scale: float,
    num_splits: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool | str | pltpu.InterpretParams | None = None,
    debug: bool = False,
) -> Float[Array, "S Hq D"]:
    """Decode attention on TPU; arguments as :func:`.paged_attention.paged_decode_attention`.

    Args:
      num_splits: split-K partitions; ``None``: :func:`auto_num_splits`.
      pages_per_block: pages per compute block (DMA double-buffer slot); ``None``:
        :func:`default_pages_per_block`.
      interpret: TPU interpret mode (``True`` or ``pltpu.InterpretParams``), or ``"hlo"`` for
        Pallas' generic interpreter (see :func:`.tpu_common.interpret_params`); default: TPU
        interpret mode on CPU.
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, decode=True,
                              what="tpu_paged_decode_attention")
    return _tpu_paged_decode_attention(q, k_pool, v_pool, layer, block_tables, context_lens,
                                       scale=scale, num_splits=num_splits,
                                       pages_per_block=pages_per_block,
                                       interpret=interpret_params(interpret), debug=debug)


@functools.partial(jax.jit, static_argnames=("scale", "num_splits", "pages_per_block", "interpret", "debug"))
def _tpu_paged_decode_attention(q, k_pool, v_pool, layer, block_tables, context_lens, *, scale,
                                num_splits, pages_per_block, interpret, debug):
    what = "tpu_paged_decode_attention"
    S, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    W = block_tables.shape[1]
    check_tpu_shapes(BS, k_pool.dtype, what)
    splits = auto_num_splits(W * BS, S) if num_splits is None else num_splits
    if splits < 1:
        raise ValueError(f"{what}: num_splits={splits} must be >= 1")
    per_split = pl.cdiv(W, splits)
    ppb = default_pages_per_block(BS, KVH, D, k_pool.dtype, per_split) if pages_per_block is None \
        else pages_per_block
    if ppb < 1:
        raise ValueError(f"{what}: pages_per_block={ppb} must be >= 1")
    ppp = round_up(per_split, ppb)  # pages per partition: whole compute blocks
    Gp = round_up(Hq // KVH, sublane_rows(q.dtype))  # the group as whole sublane tiles
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    bt = common.flat_block_ids(block_tables, context_lens, layer, NB, BS, splits * ppp).reshape(-1)
    qg = common.group_queries(q, KVH, Gp)  # [S, KVH, Gp, D]
    split = splits > 1

    q_spec = pl.BlockSpec((None, KVH, Gp, D), lambda s, p, *_: (s, 0, 0, 0))
    part = lambda *tail: pl.BlockSpec((None, None, KVH, Gp, *tail), lambda s, p, *_: (p, s, 0, 0, 0))
    if split:
        out_shape = [jax.ShapeDtypeStruct((splits, S, KVH, Gp, D), jnp.float32)] + [
            jax.ShapeDtypeStruct((splits, S, KVH, Gp, LANES), jnp.float32)] * 2
        out_specs = [part(D), part(LANES), part(LANES)]
    else:
        out_shape = jax.ShapeDtypeStruct((S, KVH, Gp, D), q.dtype)
        out_specs = q_spec
    outs = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, pages_per_partition=ppp, split=split),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(S, splits),
            in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=out_specs,
            scratch_shapes=kv_scratch(KVH, Gp, D, ppb * BS, k_pool.dtype),
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        name=f"tpu_paged_decode_bs{BS}_g{Gp}_ppb{ppb}_splits{splits}",
    )(context_lens, bt, qg, common.flat_pool(k_pool), common.flat_pool(v_pool))
    if split:
        o, m, l = outs
        o = merge_partitions(o, m[..., 0], l[..., 0]).astype(q.dtype)
    else:
        o = outs
    return common.ungroup_queries(o, Hq)
