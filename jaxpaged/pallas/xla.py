"""Paged attention in plain XLA ops: the fast path on CPU, where Pallas only interprets.

Same algorithm as the Pallas kernels, batched the way XLA:CPU runs well: a
``lax.fori_loop`` over chunks of ``pages_per_chunk`` blocks; each step gathers that chunk
of every row's blocks from the full stacked pool in one gather (layer folded into the
row id) and multiplies it in float32. The loops stop at the longest context's last block,
not at the table width: full chunks, then what is left in half a chunk where it fits
(``_chunk_plan``).
Decode runs two passes (logits of every chunk, one exact softmax,
then ``p @ v`` chunk by chunk, see ``_two_pass_decode``); ragged batches, whose logits
would be too big to keep, an online softmax (``_blocked_attention``).

What the profile of XLA:CPU (jax 0.10.2, YNNPACK dots, 2-vCPU box) says, and what follows:

- The gathers dominate: 65-80% of decode time. XLA emits a gather as a vectorised copy
  loop, and random 4 KB tiles move at ~3.5-5 GB/s per thread, well below a streaming
  copy. XLA:CPU never fuses a gather into a dot or a reduction (YNNPACK fusions take no
  gather; its own fusion will not duplicate a gather into a consumer that reads elements
  twice, as every product over query heads does), so each K/V byte is read, written to
  the chunk buffer, and read again by the dot. Whole rows of a 2-D view of the pool
  (``[L * NB * KVH, BS * D]``) land directly in the ``[rows, KVH, keys, D]`` layout the
  dots want; 12 KB rows (all heads of a block), ``promise_in_bounds``, precomputed
  indices or masking V elsewhere measure the same.
- What does move the gathers is the tile's size, set by the block size: out of DRAM
  (30 layers' tiles, too many for the cache), random tiles of 4 / 16 / 64 KB read at
  13.5 / 18.9 / 26.8 GB/s against ~42-47 GB/s for a streaming read. Hence blocks of 64 on
  CPU (``engine_args.default_block_size``: 48 x 128-token requests 1.2x faster than
  with 16).
- Dot shapes: ``p @ v`` (``[heads, keys] x [keys, D]``, output minor D) runs ~3x faster
  per byte than ``k @ q`` (``[keys, D] x [D, heads]``, output minor heads = 3). K
  transposed would fix the latter, but a transposing gather costs 2x a plain one.
  Logits come out as ``[.., keys, heads]`` (``"bknd,bkmd->bknm"``, ~1.5x faster than
  ``[.., heads, keys]``) and are transposed afterwards when the softmax wants the keys
  minor. Padding the query heads to 4 or folding heads into bigger dots does not help.
- Two-pass decode vs the online loop: each step is one gather and one dot, instead of
  also a running max, two small reductions (~50-150 us each at decode shapes) and the
  rescaling. 1.1-1.3x less time and CPU at the default model's
  shapes (B x context 64 x 512, 32 x 1k, 8 x 2k, 256 x 128; 1 x 512 the same), and the
  dots' share drops from ~40% to ~20%: what is left is the gathers.
- Chunks: a step has ~20-50 us of fixed cost, and past some size the chunk leaves the
  cache and steps slow down; ``_decode_chunk`` takes ~8k keys per step for decode (more
  for batches over 128 rows), ``_default_chunk`` ~4k for ragged (compute-bound).
- No XLA flag helps (measured, set before jax starts): disabling YNNPACK
  (``--xla_cpu_experimental_ynn_fusion_type=``) or the new fusion emitters is 1.3-1.5x
  slower; ``--xla_cpu_enable_fast_math``, ``--xla_cpu_multi_thread_eigen=false`` and
  ``--xla_cpu_prefer_vector_width=512`` are within noise.
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

# This path computes in float32 on every platform (XLA's default on GPU is TF32 products).
_HIGHEST = lax.Precision.HIGHEST


def _block_reader(pool, bt):
    """``read(start, size) -> [B, KVH, size * BS, D]`` float32: blocks ``start .. start + size``
    of every row's table ``bt``, read from ``pool``.

    The pool is viewed as rows of one (layer, block, head) tile each, ``[L * NB * KVH,
    BS * D]``: a gather of whole rows lands directly in the ``[B, KVH, keys, D]`` layout
    the dots want, no transpose.
    """
    L, NB, KVH, BS, D = pool.shape
    B = bt.shape[0]
    rows_view = pool.reshape(L * NB * KVH, BS * D)
    heads = jnp.arange(KVH, dtype=jnp.int32)[None, :, None]

    def read(start, size: int):
        ids = lax.dynamic_slice_in_dim(bt, start, size, axis=1)  # [B, size]
        # mode="clip": the ids are in range already; skipping the fill-mode check is ~5% faster.
        x = rows_view.at[ids[:, None, :] * KVH + heads].get(mode="clip")
        return common.from_kv(x, jnp.float32).reshape(B, KVH, size * BS, D)

    return read


def _chunk_plan(n_blocks, chunk: int):
    """How the attention loops cover a batch's ``n_blocks`` (traced: the longest context's
    blocks): ``n_blocks // chunk`` full chunks, then what is left either in one piece of
    ``half`` a chunk (the largest power of two below ``chunk``) when it fits, or as one more
    full chunk. Returns ``(n_full, (half, start, run))``, the piece None for chunks of 1 block.

    Without the piece, every row paid for the last chunk's whole width: 48 rows at contexts
    140-160, chunks of 2 blocks of 64, read 256 keys a row where 192 hold the context (now
    192). Past the longest context's last block a loop now reads less than half a chunk,
    where it read up to a whole one. Pieces of a quarter chunk, an eighth and so on would
    make every read exact, but each piece is more code to compile in every step shape
    (binary pieces down to one block: +23% compile time for the default model's steps;
    this one piece: +15%).
    """
    n_full = n_blocks // chunk
    left = n_blocks - n_full * chunk
    half = common.next_power_of_2(chunk) // 2
    if half == 0:
        return n_full, None
    return n_full + (left > half), (half, n_full * chunk, (left > 0) & (left <= half))


def _over_blocks(n_blocks, chunk: int, step, carry):
    """``step(start, size, carry)`` over the blocks ``_chunk_plan`` reads: a loop of full
    chunks, then the piece under a conditional."""
    n_full, piece = _chunk_plan(n_blocks, chunk)
    carry = lax.fori_loop(0, n_full, lambda c, x: step(c * chunk, chunk, x), carry)
    if piece is not None:
        size, start, run = piece
        carry = lax.cond(run, functools.partial(step, start, size), lambda x: x, carry)
    return carry


def _padded_width(width: int, chunk: int) -> int:
    """Block-table columns the loops read: whole chunks, and one more chunk of padding so that
    no slice of the table is as wide as the table (XLA hoists the gather and dot of a
    full-width slice out of its loop, and so runs them even when the loop runs no step)."""
    return -(-width // chunk) * chunk + chunk


def _blocked_attention(qb, bt, row_pos, kv_len, k_pool, v_pool, *, scale: float, pages_per_chunk: int):
    """Online-softmax attention of row blocks over their own paged keys.

    qb: [B, KVH, M, D] queries (M rows per KV head); bt: [B, Wc + C] block ids (layer
    folded), the table padded to whole chunks and then one more chunk of C =
    ``pages_per_chunk`` columns (``_padded_width``); row_pos: [B, M] last key position each
    row sees; kv_len: [B] keys visible to the block; k_pool, v_pool: the full [L, NB, KVH,
    BS, D] pool. Returns [B, KVH, M, D] float32. Full chunks, then what is left in half a
    chunk where it fits (``_chunk_plan``).
    """
    B, KVH, M, D = qb.shape
    BS = k_pool.shape[3]
    C = pages_per_chunk
    read_k = _block_reader(k_pool, bt)
    read_v = _block_reader(v_pool, bt)
    q32 = qb.astype(jnp.float32) * scale
    # Logits come out of the dot as [.., keys, rows]. With many rows (prefill blocks) they
    # are transposed so that the softmax reduces over the minor axis and p @ v is a dot:
    # ~1.1-1.3x faster end to end. With a few (M <= 8: decode-like) that is ~1.25x
    # slower than reducing over the keys axis and one fused multiply-reduce for p @ v.
    keys_axis = 2 if M <= 8 else 3
    stat_shape = (B, KVH, 1, M) if M <= 8 else (B, KVH, M, 1)

    def body(start, size, carry):
        o, m, l = carry  # o [B, KVH, M, D]; m, l: stat_shape
        key_pos = start * BS + jnp.arange(size * BS, dtype=jnp.int32)
        in_ctx = key_pos[None, :] < kv_len[:, None]  # [B, keys]
        v = jnp.where(in_ctx[:, None, :, None], read_v(start, size), 0.0)  # stale slots may hold NaN
        s = jnp.einsum("bknd,bkmd->bknm", read_k(start, size), q32, precision=_HIGHEST)  # [B, KVH, keys, M]
        visible = key_pos[None, :, None] <= row_pos[:, None, :]  # [B, keys, M]
        if keys_axis == 3:
            s, visible = s.transpose(0, 1, 3, 2), visible.transpose(0, 2, 1)
        s = jnp.where(visible[:, None], s, common.MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=keys_axis, keepdims=True))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new)
        l = alpha * l + p.sum(axis=keys_axis, keepdims=True)
        if keys_axis == 2:
            o = o * alpha[:, :, 0, :, None] + jnp.sum(p[..., None] * v[:, :, :, None, :], axis=2)
        else:
            o = o * alpha + jnp.einsum("bkmn,bknd->bkmd", p, v, precision=_HIGHEST)
        return o, m_new, l

    carry = (jnp.zeros((B, KVH, M, D), jnp.float32),
             jnp.full(stat_shape, common.MASK_VALUE, jnp.float32),
             jnp.zeros(stat_shape, jnp.float32))
    o, m, l = _over_blocks((jnp.max(kv_len) + BS - 1) // BS, C, body, carry)
    if keys_axis == 2:
        l = l[:, :, 0, :, None]
    return o / jnp.where(l > 0, l, 1.0)


def _two_pass_decode(qg, bt, kv_len, k_pool, v_pool, *, scale: float, pages_per_chunk: int):
    """Decode attention in two passes over the paged keys, with an exact softmax between.

    qg: [B, KVH, G, D] queries; bt: [B, Wc + C] block ids (layer folded), the table padded
    to whole chunks and then one more chunk of C = ``pages_per_chunk`` columns
    (``_padded_width``); kv_len: [B]; k_pool, v_pool: the full [L, NB, KVH, BS, D] pool.
    Returns [B, KVH, G, D] float32.

    Pass 1 writes every chunk's logits into one ``[B, KVH, Wc * BS, G]`` buffer (4 bytes
    per key and query head: ~2% of the KV it is computed from); one softmax over the whole
    buffer; pass 2 accumulates ``p @ v`` chunk by chunk. Compared with the online
    softmax, each loop step is a gather and a dot, nothing else: no running max, no
    rescaling, no small reductions per step (see the module docstring). Each pass reads
    full chunks, then what is left in half a chunk where it fits (``_chunk_plan``).
    """
    B, KVH, G, D = qg.shape
    BS = k_pool.shape[3]
    C = pages_per_chunk
    NW = (bt.shape[1] - C) * BS
    read_k = _block_reader(k_pool, bt)
    read_v = _block_reader(v_pool, bt)
    q32 = qg.astype(jnp.float32) * scale
    n_blocks = (jnp.max(kv_len) + BS - 1) // BS

    def logits(start, size, s):  # s [B, KVH, NW, G]; positions past the context stay unwritten
        s_c = jnp.einsum("bknd,bkgd->bkng", read_k(start, size), q32, precision=_HIGHEST)
        return lax.dynamic_update_slice_in_dim(s, s_c, start * BS, axis=2)

    s = _over_blocks(n_blocks, C, logits, jnp.zeros((B, KVH, NW, G), jnp.float32))
    # Logits come out of the dot as [.., keys, heads] (the shape XLA:CPU multiplies
    # fastest; transposing each chunk inside the loop is 10-20% slower end to end) and
    # are transposed once so that the softmax reduces over the minor axis.
    s = s.transpose(0, 1, 3, 2)  # [B, KVH, G, NW]
    in_ctx = jnp.arange(NW, dtype=jnp.int32)[None, :] < kv_len[:, None]  # [B, NW]
    s = jnp.where(in_ctx[:, None, None, :], s, common.MASK_VALUE)
    p = jnp.exp(s - s.max(axis=3, keepdims=True))
    l = p.sum(axis=3, keepdims=True)  # >= 1: the max term is exp(0)

    def weighted_values(start, size, o):  # o [B, KVH, G, D]
        in_chunk = lax.dynamic_slice_in_dim(in_ctx, start * BS, size * BS, axis=1)  # [B, keys]
        v = jnp.where(in_chunk[:, None, :, None], read_v(start, size), 0.0)  # stale slots may hold NaN
        p_c = lax.dynamic_slice_in_dim(p, start * BS, size * BS, axis=3)
        return o + jnp.einsum("bkgn,bknd->bkgd", p_c, v, precision=_HIGHEST)

    o = _over_blocks(n_blocks, C, weighted_values, jnp.zeros((B, KVH, G, D), jnp.float32))
    return o / l


# Decode keeps every logit of the batch in one buffer (see _two_pass_decode) up to this size,
# e.g. 256 sequences x 9 heads x 7k keys; past it, the online softmax of _blocked_attention.
_MAX_LOGITS_BYTES = 64 << 20


def _default_chunk(num_rows: int, block_size: int, keys: int = 4096, per_row: int = 256) -> int:
    """Blocks per loop step: about ``keys`` gathered keys per step over all rows, at most
    ``per_row`` keys per row.

    Each step has a fixed cost, so steps should be big, but a chunk that falls out of
    cache slows down. Ragged steps (many query rows per key, compute-bound) do best at
    ~4096 keys; the two-pass decode, whose steps are a gather and one dot each, at ~8192
    keys or 64 per row, whichever is more, up to 1024 per row (see ``_decode_chunk``).
    """
    tokens = max(block_size, min(per_row, keys // max(num_rows, 1)))
    return max(1, tokens // block_size)


def _decode_chunk(num_rows: int, block_size: int) -> int:
    """The two-pass decode's chunk. Measured (default model's shape, 30 layers, block 16,
    2 vCPUs), against the former ~2048 keys capped at 256 per row: 64 rows x context 256
    and 512 1.2-1.35x faster, 16 x 2048 1.15x, 256 x 256 1.4x, 1 x 2048 1.0x."""
    return _default_chunk(num_rows, block_size, keys=max(8192, 64 * num_rows), per_row=1024)


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

    ``pages_per_chunk``: blocks gathered per loop step (default: ~8192 keys per step over
    the whole batch, see ``_decode_chunk``).
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, decode=True,
                              what="xla_paged_decode_attention")
    return _xla_decode(q, k_pool, v_pool, layer, block_tables, context_lens, scale=scale,
                       pages_per_chunk=pages_per_chunk, debug=debug)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_chunk", "debug"))
def _xla_decode(q, k_pool, v_pool, layer, block_tables, context_lens, *, scale, pages_per_chunk, debug):
    S, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    C = min(pages_per_chunk or _decode_chunk(S, BS), block_tables.shape[1])  # no chunk wider than the table
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    G = Hq // KVH
    qg = common.group_queries(q, KVH, G)
    width = _padded_width(block_tables.shape[1], C)
    bt = common.flat_block_ids(block_tables, context_lens, layer, NB, BS, width)
    if S * Hq * (width - C) * BS * 4 <= _MAX_LOGITS_BYTES:
        o = _two_pass_decode(qg, bt, context_lens, k_pool, v_pool, scale=scale, pages_per_chunk=C)
    else:
        row_pos = jnp.broadcast_to((context_lens - 1)[:, None], (S, G))
        o = _blocked_attention(qg, bt, row_pos, context_lens, k_pool, v_pool, scale=scale, pages_per_chunk=C)
    return common.ungroup_queries(o, Hq).astype(q.dtype)


def _default_block_q(num_tokens: int, num_seqs: int) -> int:
    """Query rows per block: half the mean tokens per sequence as a power of two, in [8, 32].

    Every block costs a gather and the dots for every chunk up to the longest context, so
    a decode row of a mixed step pays a whole block. Measured (default model's shape, 30
    layers, 2 vCPUs), KV blocks of 16: 40 decode rows at context 150 + 472 prompt tokens,
    block_q 8 / 16 / 32: 148-159 / 184-213 / 242-263 ms; 5 prompts of 100 tokens (+ 12):
    69-105 / 71-81 / 78-89 ms across three sittings, close and noisy. KV blocks of 64 (the
    CPU default): 39 + 473: 186 / 203 / 274 ms; 5 x 100 depends more on the keys per loop
    step than on block_q (block_q 32: 3 pages a step 63 ms, 2 pages 41).
    """
    mean = -(-num_tokens // max(num_seqs, 1))
    return min(32, max(8, common.next_power_of_2(mean) // 2))


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
    ``block_q``: see ``_default_block_q`` (prefill chunks run best at 16-32 rows, batches
    of mostly decodes at 8).
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                              decode=False, what="xla_ragged_paged_attention")
    if block_q is None:
        block_q = _default_block_q(q.shape[0], block_tables.shape[0])
    return _xla_ragged(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc,
                       scale=scale, block_q=block_q, pages_per_chunk=pages_per_chunk, debug=debug)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_chunk", "debug"))
def _xla_ragged(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc, *, scale, block_q,
                pages_per_chunk, debug):
    T, Hq, D = q.shape
    L, NB, KVH, BS, _ = k_pool.shape
    G = Hq // KVH
    C = min(pages_per_chunk or _default_chunk(common.num_q_blocks(T, block_tables.shape[0], block_q), BS),
            block_tables.shape[1])  # no chunk wider than the table
    if debug:
        common.debug_check_block_tables(block_tables, NB)
    width = _padded_width(block_tables.shape[1], C)
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
