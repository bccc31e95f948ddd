"""Pallas ragged paged attention: prefill, chunked prefill and mixed prefill + decode batches.

Each sequence's query chunk (``query_start_loc[s] : query_start_loc[s+1]``, the last
``q_len`` tokens of its context) is cut into blocks of ``block_q`` tokens
(:func:`common.q_block_schedule`). Grid ``(num_q_blocks, num_kv_heads)``: a program takes
one query block and every query head of one KV head, as a ``[block_q * group_pad, D]``
tile (row ``u * group_pad + g``), and walks the sequence's blocks up to the block's last
query position with an online softmax, masking causally. Keys come straight from the
full stacked pool through the block table, so cached prefix and this chunk are read the
same way (the step has written the chunk's K/V before attending). A chunk may start
anywhere, mid-block included.

Outputs are written per query block (``[NQB, KVH, block_q * group_pad, D]``, disjoint
tiles, no masked stores) and gathered back to token order outside the kernel. Query
blocks past the real ones (the grid is sized for the worst case) read nothing.
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


def _ragged_kernel(
    qb_seq_ref,  # [NQB] int32: sequence of each query block
    qb_nq_ref,  # [NQB] int32: real tokens in the block (0 = padding block)
    qb_pos_ref,  # [NQB] int32: position of the block's first token
    bt_ref,  # [S, Wp] int32 block ids, layer folded in, whole array
    q_ref,  # [M, D], M = block_q * group_pad
    k_ref,  # [L * NB, KVH, BS, D], whole pool
    v_ref,  # [L * NB, KVH, BS, D], whole pool
    o_ref,  # [M, D]
    *,
    scale: float,
    block_size: int,
    pages_per_chunk: int,
    group_pad: int,
):
    b, h = pl.program_id(0), pl.program_id(1)
    M, head_dim = q_ref.shape
    chunk = pages_per_chunk * block_size
    seq, nq, pos0 = qb_seq_ref[b], qb_nq_ref[b], qb_pos_ref[b]
    kv_len = jnp.where(nq > 0, pos0 + nq, 0)  # keys [0, kv_len) are visible to some row
    n_pages = pl.cdiv(kv_len, block_size)
    row_pos = pos0 + lax.broadcasted_iota(jnp.int32, (M, 1), 0) // group_pad  # [M, 1]
    q = q_ref[...]

    def body(c, carry):
        o, m, l = carry
        ids = bt_ref[seq, pl.ds(c * pages_per_chunk, pages_per_chunk)]
        k = k_ref[ids, h].reshape(chunk, head_dim)
        v = v_ref[ids, h].reshape(chunk, head_dim)
        logits = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=common.dot_precision(k.dtype),
                                 preferred_element_type=jnp.float32) * scale  # [M, chunk]
        key_pos = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
        logits = jnp.where(key_pos <= row_pos, logits, common.MASK_VALUE)
        m_new = jnp.maximum(m, logits.max(axis=1))
        alpha = jnp.exp(m - m_new)
        probs = jnp.exp(logits - m_new[:, None])
        l = alpha * l + probs.sum(axis=1)
        v = jnp.where((key_pos < kv_len).reshape(chunk, 1), v, jnp.zeros_like(v))
        pv = lax.dot_general(probs.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                             precision=common.dot_precision(v.dtype),
                             preferred_element_type=jnp.float32)
        return alpha[:, None] * o + pv, m_new, l

    init = (jnp.zeros((M, head_dim), jnp.float32),
            jnp.full((M,), common.MASK_VALUE, jnp.float32),
            jnp.zeros((M,), jnp.float32))
    o, m, l = lax.fori_loop(0, pl.cdiv(n_pages, pages_per_chunk), body, init)
    o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


def ragged_paged_attention(
    q: Float[Array, "T Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    query_start_loc: Int[Array, "S+1"],
    *,
    scale: float,
    block_q: int = 16,
    pages_per_chunk: int | None = None,
    interpret: bool | None = None,
    debug: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Float[Array, "T Hq D"]:
    """Causal attention of ragged query chunks over their sequences' paged K/V of one layer.

    Args:
      q: query tokens of all sequences, flattened; sequence ``s`` owns
        ``query_start_loc[s] : query_start_loc[s+1]``, the last tokens of its context;
        tokens past ``query_start_loc[S]`` are padding and get zeros.
      k_pool, v_pool: the full stacked pool (this step's K/V already written).
      block_tables, context_lens: as for decode; ``context_lens`` counts this step's tokens.
      block_q: query tokens per program (``block_q * next_power_of_2(group)`` >= 16 on GPU).
      pages_per_chunk: blocks per loop step; default: 64 keys.
      interpret: run in the Pallas interpreter; default: on CPU.
      debug: range-check the block table at run time (it is checked at call time when
        it is a concrete array).
      num_warps, num_stages: Triton compiler knobs.
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                              decode=False, what="ragged_paged_attention")
    return _ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens,
                                   query_start_loc, scale=scale, block_q=block_q,
                                   pages_per_chunk=pages_per_chunk, interpret=interpret, debug=debug,
                                   num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_q", "pages_per_chunk", "interpret", "debug", "num_warps", "num_stages"))
def _ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc, *,
                            scale, block_q, pages_per_chunk, interpret, debug, num_warps, num_stages):
    what = "ragged_paged_attention"
    T, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    S, W = block_tables.shape
    G = Hq // KVH
    Gp = common.next_power_of_2(G)
    interpret = common.default_interpret() if interpret is None else interpret
    ppc = max(1, 64 // BS) if pages_per_chunk is None else pages_per_chunk
    if not interpret:
        for name, n in (("block_size", BS), ("head_dim", D), ("block_q * group_pad", block_q * Gp),
                        ("pages_per_chunk * block_size", ppc * BS)):
            if n & (n - 1) or n < (1 if name == "block_size" else 16):
                raise ValueError(f"{what}: {name}={n} must be a power of two (>= 16 for tiles) on GPU")
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    bt = common.flat_block_ids(block_tables, context_lens, layer, NB, BS, pl.cdiv(W, ppc) * ppc)
    (qb_seq, qb_tok0, qb_nq, qb_pos0), (tok_block, tok_row, tok_valid) = common.q_block_schedule(
        query_start_loc, context_lens, T, block_q)
    NQB = qb_seq.shape[0]
    M = block_q * Gp
    qb = common.pack_queries(q, qb_tok0, KVH, block_q, Gp)  # [NQB, KVH, M, D]

    kernel = functools.partial(_ragged_kernel, scale=scale, block_size=BS, pages_per_chunk=ppc,
                               group_pad=Gp)
    whole = pl.BlockSpec()
    tile = pl.BlockSpec((None, None, M, D), lambda b, h: (b, h, 0, 0))
    o_blocks = pl.pallas_call(
        kernel,
        grid=(NQB, KVH),
        in_specs=[whole, whole, whole, whole, tile, whole, whole],
        out_specs=tile,
        out_shape=jax.ShapeDtypeStruct((NQB, KVH, M, D), q.dtype),
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps,
                                                                  num_stages=num_stages),
        name=f"ragged_paged_bs{BS}_bq{block_q}_g{Gp}_ppc{ppc}",
    )(qb_seq, qb_nq, qb_pos0, bt, qb, common.flat_pool(k_pool), common.flat_pool(v_pool))
    return common.unpack_outputs(o_blocks, tok_block, tok_row, tok_valid, Hq, block_q)
