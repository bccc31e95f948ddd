"""Mosaic (TPU) ragged paged attention: prefill, chunked prefill and mixed prefill + decode.

Same signature and semantics as :func:`.ragged_paged_attention.ragged_paged_attention`;
the page pipeline (SMEM tables, pool in HBM, per-page DMAs into double-buffered VMEM
slots, online softmax), the tile rules for pages and the comparison with JAX's own TPU
kernel are in :mod:`.tpu_common`.

**Grid** ``(num_q_blocks,)``, ``"parallel"``. Each sequence's query chunk (the last
``q_len`` tokens of its context) is cut into blocks of ``block_q`` tokens
(:func:`common.q_block_schedule`, sized for the worst case: blocks past the real ones
have no tokens, copy nothing and write zeros). A program takes one query block and every
KV head: its queries arrive as ``[KVH, block_q * G, D]`` (row ``u * G + g`` is query head
``h * G + g`` of token ``u``), and it walks the sequence's pages up to the block's last
query position, masking causally per row. Scalars prefetched into SMEM: each query
block's sequence, real-token count and first position, and the flat block table.
Outputs are written per query block (disjoint tiles) and gathered back to token order
outside the kernel.

**Query tile** (:func:`default_block_q`): ``block_q * G`` ~ ``Q_ROWS`` (128) rows, one
MXU height on v5e, rounded so the rows fill whole bf16 sublane tiles (a multiple of 16).
Bigger tiles re-read a prefix fewer times (a prefill of P tokens reads ~P^2 / (2 block_q)
keys per head); smaller ones waste less MXU work on a decode row in a mixed batch (it
still fills a whole tile, though it moves the same bytes as in the decode kernel).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from jaxpaged.pallas import common
from jaxpaged.pallas.tpu_common import (attend_pages, check_tpu_shapes, default_pages_per_block,
                                        interpret_params, kv_scratch, normalised, round_up)

Q_ROWS = 128


def default_block_q(group: int, num_tokens: int) -> int:
    """Tokens per query block: ~Q_ROWS rows, ``block_q * group`` a multiple of 16, and no
    bigger than the (rounded-up) token count of the batch."""
    align = 16 // math.gcd(group, 16)
    return round_up(min(pl.cdiv(Q_ROWS, group), num_tokens), align)


def _ragged_kernel(
    qb_seq_ref,  # [NQB] int32, SMEM: sequence of each query block
    qb_nq_ref,  # [NQB] int32, SMEM: real tokens in the block (0 = padding block)
    qb_pos_ref,  # [NQB] int32, SMEM: position of the block's first token
    bt_ref,  # [S * Wp] int32, SMEM: block ids, layer folded in
    q_ref,  # [KVH, M, D], M = block_q * G
    k_hbm,  # [L * NB, KVH, BS, D], HBM
    v_hbm,  # [L * NB, KVH, BS, D], HBM
    o_ref,  # [KVH, M, D]
    kbuf, vbuf, sems, acc_ref, m_ref, l_ref,  # kv_scratch
    *,
    scale: float,
    group: int,
    table_width: int,
):
    b = pl.program_id(0)
    seq, nq, pos0 = qb_seq_ref[b], qb_nq_ref[b], qb_pos_ref[b]
    kv_len = jnp.where(nq > 0, pos0 + nq, 0)  # keys [0, kv_len) are visible to some row
    rows = q_ref.shape[1]
    # lax.div, not //: floor division lowers through sign(), which asks for the TPU generation.
    row_pos = pos0 + lax.div(lax.broadcasted_iota(jnp.int32, (rows, 1), 0), group)  # [M, 1]
    attend_pages(bt_ref, q_ref, k_hbm, v_hbm, kbuf, vbuf, sems, acc_ref, m_ref, l_ref,
                 table_off=seq * table_width, first_page=0,
                 n_pages=pl.cdiv(kv_len, k_hbm.shape[2]), row_pos=row_pos, kv_len=kv_len,
                 scale=scale)
    o_ref[...] = normalised(acc_ref, l_ref, o_ref.dtype)


def tpu_ragged_paged_attention(
    q: Float[Array, "T Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    query_start_loc: Int[Array, "S+1"],
    *,
    scale: float,
    block_q: int | None = None,
    pages_per_block: int | None = None,
    interpret: bool | str | pltpu.InterpretParams | None = None,
    debug: bool = False,
) -> Float[Array, "T Hq D"]:
    """Causal attention of ragged query chunks on TPU; arguments as
    :func:`.ragged_paged_attention.ragged_paged_attention`.

    Args:
      block_q: query tokens per program; ``block_q * (Hq // KVH)`` must be a multiple of
        8 (whole sublane tiles). ``None``: :func:`default_block_q`.
      pages_per_block: pages per compute block; ``None``:
        :func:`.tpu_common.default_pages_per_block`.
      interpret: TPU interpret mode (``True`` or ``pltpu.InterpretParams``), or ``"hlo"`` for
        Pallas' generic interpreter (see :func:`.tpu_common.interpret_params`); default: TPU
        interpret mode on CPU.
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                              decode=False, what="tpu_ragged_paged_attention")
    return _tpu_ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens,
                                       query_start_loc, scale=scale, block_q=block_q,
                                       pages_per_block=pages_per_block,
                                       interpret=interpret_params(interpret), debug=debug)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block", "interpret", "debug"))
def _tpu_ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc,
                                *, scale, block_q, pages_per_block, interpret, debug):
    what = "tpu_ragged_paged_attention"
    T, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    W = block_tables.shape[1]
    G = Hq // KVH
    check_tpu_shapes(BS, k_pool.dtype, what)
    bq = default_block_q(G, T) if block_q is None else block_q
    if bq < 1 or (bq * G) % 8:
        raise ValueError(f"{what}: block_q={bq} times the group of {G} query heads must be a "
                         f"positive multiple of 8 (whole sublane tiles)")
    ppb = default_pages_per_block(BS, KVH, D, k_pool.dtype, W) if pages_per_block is None \
        else pages_per_block
    if ppb < 1:
        raise ValueError(f"{what}: pages_per_block={ppb} must be >= 1")
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    Wp = round_up(W, ppb)  # whole compute blocks: the last one never indexes past a row
    bt = common.flat_block_ids(block_tables, context_lens, layer, NB, BS, Wp).reshape(-1)
    (qb_seq, qb_tok0, qb_nq, qb_pos0), (tok_block, tok_row, tok_valid) = common.q_block_schedule(
        query_start_loc, context_lens, T, bq)
    NQB = qb_seq.shape[0]
    M = bq * G
    qb = common.pack_queries(q, qb_tok0, KVH, bq, G)  # [NQB, KVH, M, D]

    tile = pl.BlockSpec((None, KVH, M, D), lambda b, *_: (b, 0, 0, 0))
    o_blocks = pl.pallas_call(
        functools.partial(_ragged_kernel, scale=scale, group=G, table_width=Wp),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(NQB,),
            in_specs=[tile, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=tile,
            scratch_shapes=kv_scratch(KVH, M, D, ppb * BS, k_pool.dtype),
        ),
        out_shape=jax.ShapeDtypeStruct((NQB, KVH, M, D), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret,
        name=f"tpu_ragged_paged_bs{BS}_bq{bq}_g{G}_ppb{ppb}",
    )(qb_seq, qb_nq, qb_pos0, bt, qb, common.flat_pool(k_pool), common.flat_pool(v_pool))
    return common.unpack_outputs(o_blocks, tok_block, tok_row, tok_valid, Hq, bq)
