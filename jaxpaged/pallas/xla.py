"""Paged attention in plain XLA ops: the fast path on CPU, where Pallas only interprets.

Same algorithm as the Pallas kernels, batched the way XLA:CPU runs well: a
``lax.fori_loop`` over chunks of ``pages_per_chunk`` blocks; each step gathers that chunk
of every row's blocks from the full stacked pool in one gather (layer folded into the
row id), computes logits and the PV product, and updates an online softmax in float32.
Nothing of size ``width * block_size`` per row is ever formed, and the loop stops at the
longest context in the batch, not at the table width.

What the profile of XLA:CPU (jax 0.10.2, 2-vCPU Zen 3) says, and what follows from it:

- The gathers dominate. XLA emits a gather as a per-element loop; gathering whole rows
  of a 2-D view of the pool (``[L * NB * KVH, BS * D]``) runs ~2x faster than gathering
  from the 5-D pool and lands directly in the ``[rows, KVH, keys, D]`` layout the
  products want (no transpose).
- Logits are produced as ``[rows, KVH, keys, heads]`` (``"bknd,bkmd->bknm"``): about 2x
  faster than ``[.., heads, keys]``, which XLA:CPU runs as a slow transposed product.
- Each loop step costs ~50-75 us of fixed overhead, but a chunk much past ~4096 keys
  over the batch falls out of cache; ``_default_chunk`` aims between the two.
- A bf16 pool is converted to f32 inside the gather (XLA:CPU's bf16 matrix-vector
  products are ~20x slower than f32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from jaxpaged.pallas import common


def _blocked_attention(qb, bt, row_pos, kv_len, k_pool, v_pool, *, scale: float, pages_per_chunk: int):
    """Online-softmax attention of row blocks over their own paged keys.

    qb: [B, KVH, M, D] queries (M rows per KV head); bt: [B, Wp] block ids (layer folded);
    row_pos: [B, M] last key position each row sees; kv_len: [B] keys visible to the block;
    k_pool, v_pool: the full [L, NB, KVH, BS, D] pool. Returns [B, KVH, M, D] float32.
    """
    B, KVH, M, D = qb.shape
    L, NB, _, BS, _ = k_pool.shape
    C = pages_per_chunk
    N = C * BS
    # The pool as rows of one (layer, block, head) tile each, [L * NB * KVH, BS * D]: a
    # gather of whole rows lands directly in the [B, KVH, N, D] layout the dots want, and
    # XLA:CPU's gather loop is ~2x faster with 2-D operands than with the 5-D pool.
    k_rows = k_pool.reshape(L * NB * KVH, BS * D)
    v_rows = v_pool.reshape(L * NB * KVH, BS * D)
    heads = jnp.arange(KVH, dtype=jnp.int32)[None, :, None]
    q32 = qb.astype(jnp.float32) * scale

    def body(c, carry):
        o, m, l = carry  # o [B, KVH, M, D]; m, l [B, KVH, 1, M]
        ids = lax.dynamic_slice_in_dim(bt, c * C, C, axis=1)  # [B, C]
        rows = ids[:, None, :] * KVH + heads  # [B, KVH, C]
        key_pos = c * N + jnp.arange(N, dtype=jnp.int32)
        in_ctx = key_pos[None, :] < kv_len[:, None]  # [B, N]
        # mode="clip": the ids are in range already; skipping the fill-mode check is ~5% faster.
        k = k_rows.at[rows].get(mode="clip").astype(jnp.float32).reshape(B, KVH, N, D)
        v = v_rows.at[rows].get(mode="clip").astype(jnp.float32).reshape(B, KVH, N, D)
        v = jnp.where(in_ctx[:, None, :, None], v, 0.0)  # stale slots may hold NaN
        s = jnp.einsum("bknd,bkmd->bknm", k, q32)
        visible = key_pos[None, :, None] <= row_pos[:, None, :]  # [B, N, M]
        s = jnp.where(visible[:, None], s, common.MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=2, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        l = alpha * l + p.sum(axis=2, keepdims=True)
        if M <= 8:  # decode: XLA:CPU runs this as one fused reduction, ~1.5x the dot's speed
            pv = jnp.sum(p[..., None] * v[:, :, :, None, :], axis=2)
        else:
            pv = jnp.einsum("bknm,bknd->bkmd", p, v)
        o = o * alpha[:, :, 0, :, None] + pv
        return o, m_new, l

    init = (jnp.zeros((B, KVH, M, D), jnp.float32),
            jnp.full((B, KVH, 1, M), common.MASK_VALUE, jnp.float32),
            jnp.zeros((B, KVH, 1, M), jnp.float32))
    n_chunks = (jnp.max(kv_len) + N - 1) // N
    o, m, l = lax.fori_loop(0, n_chunks, body, init)
    l = l[:, :, 0, :, None]
    return o / jnp.where(l > 0, l, 1.0)


def _default_chunk(num_rows: int, block_size: int) -> int:
    """Blocks per loop step: about 4096 gathered keys per step over all rows.

    Measured on the 2-vCPU box: each step costs ~50-75 us of fixed overhead, so steps
    should be big, but past ~8k keys (6 MB of K per step at the default model's shape) the
    gathered chunk falls out of cache and throughput halves. Capped at 256 keys per row.
    """
    tokens = max(block_size, min(256, 4096 // max(num_rows, 1)))
    return max(1, tokens // block_size)


def xla_paged_decode_attention(
    q: Float[Array, "S Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    *,
    scale: float,
    pages_per_chunk: int | None = None,
    debug: bool = False,
) -> Float[Array, "S Hq D"]:
    """Decode attention in XLA ops; same contract as :func:`paged_decode_attention`.

    ``pages_per_chunk``: blocks gathered per loop step (default: ~4096 keys per step over
    the whole batch, see ``_default_chunk``).
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, decode=True,
                              what="xla_paged_decode_attention")
    return _xla_decode(q, k_pool, v_pool, layer, block_tables, context_lens, scale=scale,
                       pages_per_chunk=pages_per_chunk, debug=debug)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_chunk", "debug"))
def _xla_decode(q, k_pool, v_pool, layer, block_tables, context_lens, *, scale, pages_per_chunk, debug):
    S, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    C = pages_per_chunk or _default_chunk(S, BS)
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    width = -(-block_tables.shape[1] // C) * C
    bt = common.flat_block_ids(block_tables, context_lens, layer, NB, BS, width)
    G = Hq // KVH
    row_pos = jnp.broadcast_to((context_lens - 1)[:, None], (S, G))
    o = _blocked_attention(common.group_queries(q, KVH, G), bt, row_pos, context_lens, k_pool, v_pool,
                           scale=scale, pages_per_chunk=C)
    return common.ungroup_queries(o, Hq).astype(q.dtype)


def xla_ragged_paged_attention(
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
    pages_per_chunk: int | None = None,
    debug: bool = False,
) -> Float[Array, "T Hq D"]:
    """Ragged (prefill / mixed) attention in XLA ops; same contract as
    :func:`ragged_paged_attention`.

    Rows are query blocks of ``block_q`` tokens. Every row costs compute for every chunk
    up to the longest context, so a decode sequence in a mixed batch pays ``block_q``
    rows; decode-only batches should use :func:`xla_paged_decode_attention`. Default
    ``block_q``: the mean tokens per sequence (``T / S``) as a power of two in [8, 32]
    (measured: prefill chunks run best at 16-32, batches of mostly decodes at 8).
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                              decode=False, what="xla_ragged_paged_attention")
    if block_q is None:
        mean = -(-q.shape[0] // max(block_tables.shape[0], 1))
        block_q = min(32, max(8, common.next_pow2(mean)))
    return _xla_ragged(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc,
                       scale=scale, block_q=block_q, pages_per_chunk=pages_per_chunk, debug=debug)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_chunk", "debug"))
def _xla_ragged(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc, *, scale, block_q,
                pages_per_chunk, debug):
    T, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    G = Hq // KVH
    C = pages_per_chunk or _default_chunk(common.num_q_blocks(T, block_tables.shape[0], block_q), BS)
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    width = -(-block_tables.shape[1] // C) * C
    bt = common.flat_block_ids(block_tables, context_lens, layer, NB, BS, width)
    (qb_seq, qb_tok0, qb_nq, qb_pos0), (tok_block, tok_row, tok_valid) = common.q_block_schedule(
        query_start_loc, context_lens, T, block_q)
    qb = common.pack_queries(q, qb_tok0, KVH, block_q, G)  # [NQB, KVH, block_q * G, D]
    M = block_q * G
    row_pos = qb_pos0[:, None] + jnp.arange(M, dtype=jnp.int32)[None, :] // G
    kv_len = jnp.where(qb_nq > 0, qb_pos0 + qb_nq, 0)
    o = _blocked_attention(qb, bt[qb_seq], row_pos, kv_len, k_pool, v_pool, scale=scale,
                           pages_per_chunk=C)
    return common.unpack_outputs(o.astype(q.dtype), tok_block, tok_row, tok_valid, Hq, block_q)
