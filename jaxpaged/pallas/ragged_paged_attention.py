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

In the packed layout the queries are gathered per block before the kernel and
its outputs written per query block (``[NQB, KVH, block_q * group_pad, D]``, disjoint
tiles, no masked stores), then gathered back to token order outside it. Query
blocks past the real ones (the grid is sized for the worst case) read nothing.

A decode row of a mixed step (one query token beside other rows' prompt chunks) fills
one row of a ``block_q``-token block, and the packed queries and outputs are sized for
the worst case (``common.num_q_blocks``): at Llama-3-8B's group of 4, a busy step's
~250 decode rows packed ~16x their bytes each way per layer. The defaults below avoid
that; the module settings keep the other ways (``scripts/bench_gpu.py --only mixed``
times all eight combinations on Llama-3-8B's shapes; ``--mixed``, ``--block-q-rule``
and ``--query-layout`` run the engine either way):

- ``QUERY_LAYOUT = "direct"`` (default; ``"packed"`` as described above): no packing;
  each program reads its block's queries where they lie in ``q`` and writes its outputs
  there, masked to the block's real tokens (:func:`_ragged_kernel_direct`);
- ``BLOCK_Q_RULE = "mean"`` (default; ``"fixed"``: always ``BLOCK_Q``): the query block
  follows the step's mean tokens per row (:func:`default_block_q`), down to 16 tile rows;
- ``MIXED_DECODE_ROWS = "split"`` (``"ragged"`` by default): one-token rows go to the
  decode kernel (:func:`mixed_paged_attention`), and this kernel runs no program's loop
  for them;
- ``BLOCK_ORDER = "longest_first"`` (``"sequence"`` by default): the query blocks are
  launched in decreasing order of the keys they walk (a GPU starts programs in grid
  order): in a busy step the decode rows' contexts differ ~10x, and in sequence order
  a long row started last holds the kernel's tail while the other multiprocessors idle.

On an H100 (Llama-3-8B's attention, one layer, three busy mixed steps) the direct layout
took 150-332 us a call against 319-498 packed, about what the decode and prompt rows
take as two separate launches, and the engine's offline throughput rose ~1.09x
(6,283-6,337 against 5,753-5,804 output tok/s on one machine); the split was 1.3-1.7x
slower than the direct layout without it (docs/measurements.md, "Twenty-third session").
The settings combine; they are read when a step is traced.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Bool, Float, Int

from jaxpaged.pallas import common
from jaxpaged.pallas.paged_attention import paged_decode_attention

BLOCK_Q = 16  # query tokens per block under the "fixed" rule, and the most under "mean"
BLOCK_Q_RULE = "mean"  # or "fixed": see default_block_q
QUERY_LAYOUT = "direct"  # or "packed": see _ragged_kernel_direct
MIXED_DECODE_ROWS = "ragged"  # or "split": see mixed_paged_attention
BLOCK_ORDER = "sequence"  # or "longest_first": see order_blocks


def default_block_q(num_tokens: int, num_seqs: int, group_pad: int) -> int:
    """Query tokens per block for a step of ``num_tokens`` tokens over ``num_seqs`` rows
    (both padded, so static): ``BLOCK_Q`` under the "fixed" rule; under "mean", the mean
    tokens per row rounded up to a power of two, at least ``16 / group_pad`` (a Triton dot
    takes >= 16 rows) and at most ``BLOCK_Q``.

    >>> BLOCK_Q_RULE, default_block_q(720, 256, 4), default_block_q(8192, 256, 4)
    ('mean', 4, 16)
    """
    if BLOCK_Q_RULE == "fixed":
        return BLOCK_Q
    if BLOCK_Q_RULE != "mean":
        raise ValueError(f"BLOCK_Q_RULE={BLOCK_Q_RULE!r}: 'fixed' or 'mean'")
    mean = common.next_power_of_2(-(-num_tokens // max(num_seqs, 1)))
    return min(BLOCK_Q, max(mean, -(-16 // group_pad)))


def order_blocks(blocks, tok_block, order: str):
    """The query blocks of :func:`common.q_block_schedule` in launch order: as scheduled
    (``"sequence"``), or by decreasing keys walked (``"longest_first"``: ``pos0 + nq``, the
    keys visible to a block's last token; padding blocks last), with ``tok_block``
    renumbered to match. A program's work is its block's, whatever its place in the grid."""
    if order == "sequence":
        return blocks, tok_block
    if order != "longest_first":
        raise ValueError(f"BLOCK_ORDER={order!r}: 'sequence' or 'longest_first'")
    seq, tok0, nq, pos0 = blocks
    perm = jnp.argsort(jnp.where(nq > 0, -(pos0 + nq), 1), stable=True)
    rank = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=perm.dtype))
    return tuple(x[perm] for x in blocks), rank[tok_block].astype(tok_block.dtype)


def _attend_block(q, seq, nq, pos0, h, bt_ref, k_ref, v_ref, *, scale: float, block_size: int,
                  pages_per_chunk: int, group_pad: int):
    """One query block's rows (``[M, D]``, row ``u * group_pad + g``) against its sequence's
    keys up to its last token, online softmax; the normalised output, float32."""
    M, head_dim = q.shape
    chunk = pages_per_chunk * block_size
    kv_len = jnp.where(nq > 0, pos0 + nq, 0)  # keys [0, kv_len) are visible to some row
    n_pages = pl.cdiv(kv_len, block_size)
    row_pos = pos0 + lax.broadcasted_iota(jnp.int32, (M, 1), 0) // group_pad  # [M, 1]

    def body(c, carry):
        o, m, l = carry
        ids = bt_ref[seq, pl.ds(c * pages_per_chunk, pages_per_chunk)]
        k = common.from_kv(k_ref[ids, h].reshape(chunk, head_dim), q.dtype)
        v = common.from_kv(v_ref[ids, h].reshape(chunk, head_dim), q.dtype)
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
    return o / jnp.where(l > 0, l, 1.0)[:, None]


def _ragged_kernel(
    qb_seq_ref,  # [NQB] int32: sequence of each query block
    qb_nq_ref,  # [NQB] int32: real tokens in the block (0 = padding block)
    qb_pos_ref,  # [NQB] int32: position of the block's first token
    bt_ref,  # [S, Wp] int32 block ids, layer folded in, whole array
    q_ref,  # [M, D], M = block_q * group_pad
    k_ref,  # [L * NB, KVH, BS, D], whole pool
    v_ref,  # [L * NB, KVH, BS, D], whole pool
    o_ref,  # [M, D]
    **kw,
):
    b, h = pl.program_id(0), pl.program_id(1)
    o = _attend_block(q_ref[...], qb_seq_ref[b], qb_nq_ref[b], qb_pos_ref[b], h, bt_ref, k_ref, v_ref, **kw)
    o_ref[...] = o.astype(o_ref.dtype)


def _ragged_kernel_direct(
    qb_seq_ref, qb_nq_ref, qb_pos_ref,  # as in _ragged_kernel
    qb_tok_ref,  # [NQB] int32: the block's first token
    bt_ref,  # [S, Wp] int32 block ids, layer folded in, whole array
    q_ref,  # [T, KVH, group_pad, D], whole array
    k_ref,  # [L * NB, KVH, BS, D], whole pool
    v_ref,  # [L * NB, KVH, BS, D], whole pool
    o_ref,  # [T, KVH, group_pad, D], whole array
    *,
    block_q: int,
    **kw,
):
    """The same attention, reading the block's queries where they lie and writing its
    outputs there, masked to its real tokens (no packed copies)."""
    b, h = pl.program_id(0), pl.program_id(1)
    _, _, group_pad, head_dim = q_ref.shape
    nq = qb_nq_ref[b]
    rows = pl.ds(qb_tok_ref[b], block_q)
    real = jnp.broadcast_to(lax.broadcasted_iota(jnp.int32, (block_q, 1, 1), 0) < nq,
                            (block_q, group_pad, head_dim))
    q = plt.load(q_ref.at[rows, h], mask=real, other=0).reshape(block_q * group_pad, head_dim)
    o = _attend_block(q, qb_seq_ref[b], nq, qb_pos_ref[b], h, bt_ref, k_ref, v_ref, group_pad=group_pad, **kw)
    plt.store(o_ref.at[rows, h], o.reshape(block_q, group_pad, head_dim).astype(o_ref.dtype), mask=real)


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
    block_q: int | None = None,
    pages_per_chunk: int | None = None,
    interpret: bool | None = None,
    debug: bool = False,
    num_warps: int = 4,
    num_stages: int = 2,
    skip_rows: Bool[Array, "S"] | None = None,
) -> Float[Array, "T Hq D"]:
    """Causal attention of ragged query chunks over their sequences' paged K/V of one layer.

    Args:
      q: query tokens of all sequences, flattened; sequence ``s`` owns
        ``query_start_loc[s] : query_start_loc[s+1]``, the last tokens of its context;
        tokens past ``query_start_loc[S]`` are padding and get zeros.
      k_pool, v_pool: the full stacked pool (this step's K/V already written).
      block_tables, context_lens: as for decode; ``context_lens`` counts this step's tokens.
      block_q: query tokens per program (``block_q * next_power_of_2(group)`` >= 16 on GPU);
        default: :func:`default_block_q`.
      pages_per_chunk: blocks per loop step; default: 64 keys.
      interpret: run in the Pallas interpreter; default: on CPU.
      debug: range-check the block table at run time (it is checked at call time when
        it is a concrete array).
      num_warps, num_stages: Triton compiler knobs.
      skip_rows: rows this kernel leaves out (their tokens' outputs are meaningless), for
        :func:`mixed_paged_attention`.
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                              decode=False, what="ragged_paged_attention")
    if block_q is None:
        G = q.shape[1] // k_pool.shape[2]
        block_q = default_block_q(q.shape[0], block_tables.shape[0], common.next_power_of_2(G))
    if QUERY_LAYOUT not in ("packed", "direct"):
        raise ValueError(f"QUERY_LAYOUT={QUERY_LAYOUT!r}: 'packed' or 'direct'")
    # The settings go in as static arguments: a module global read under the jit would be
    # hidden by the trace cached for the same shapes.
    return _ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens,
                                   query_start_loc, skip_rows, scale=scale, block_q=block_q,
                                   pages_per_chunk=pages_per_chunk, interpret=interpret, debug=debug,
                                   num_warps=num_warps, num_stages=num_stages, query_layout=QUERY_LAYOUT,
                                   block_order=BLOCK_ORDER)


@functools.partial(jax.jit, static_argnames=(
    "scale", "block_q", "pages_per_chunk", "interpret", "debug", "num_warps", "num_stages", "query_layout",
    "block_order"))
def _ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc, skip_rows,
                            *, scale, block_q, pages_per_chunk, interpret, debug, num_warps, num_stages,
                            query_layout, block_order):
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
    blocks, (tok_block, tok_row, tok_valid) = common.q_block_schedule(query_start_loc, context_lens, T, block_q,
                                                                      skip_rows)
    (qb_seq, qb_tok0, qb_nq, qb_pos0), tok_block = order_blocks(blocks, tok_block, block_order)
    NQB = qb_seq.shape[0]
    M = block_q * Gp
    whole = pl.BlockSpec()
    call = functools.partial(
        pl.pallas_call, grid=(NQB, KVH), interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    kw = dict(scale=scale, block_size=BS, pages_per_chunk=ppc)
    pools = common.flat_pool(k_pool), common.flat_pool(v_pool)
    if query_layout == "direct":
        qg = common.group_queries(q, KVH, Gp)  # [T, KVH, Gp, D]: a free reshape where the group is a power of two
        o = call(functools.partial(_ragged_kernel_direct, block_q=block_q, **kw),
                 in_specs=[whole] * 8, out_specs=whole, out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
                 name=f"ragged_paged_direct_bs{BS}_bq{block_q}_g{Gp}_ppc{ppc}",
                 )(qb_seq, qb_nq, qb_pos0, qb_tok0, bt, qg, *pools)
        # Tokens no block holds were never written: padding gets zeros here; skipped rows'
        # tokens keep whatever the buffer held (meaningless, as documented).
        return jnp.where(tok_valid[:, None, None], common.ungroup_queries(o, Hq), 0).astype(q.dtype)
    qb = common.pack_queries(q, qb_tok0, KVH, block_q, Gp)  # [NQB, KVH, M, D]
    tile = pl.BlockSpec((None, None, M, D), lambda b, h: (b, h, 0, 0))
    o_blocks = call(functools.partial(_ragged_kernel, group_pad=Gp, **kw),
                    in_specs=[whole, whole, whole, whole, tile, whole, whole], out_specs=tile,
                    out_shape=jax.ShapeDtypeStruct((NQB, KVH, M, D), q.dtype),
                    name=f"ragged_paged_bs{BS}_bq{block_q}_g{Gp}_ppc{ppc}",
                    )(qb_seq, qb_nq, qb_pos0, bt, qb, *pools)
    return common.unpack_outputs(o_blocks, tok_block, tok_row, tok_valid, Hq, block_q)


def mixed_paged_attention(
    q: Float[Array, "T Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    query_start_loc: Int[Array, "S+1"],
    *,
    scale: float,
    num_splits: int | None = None,
    block_q: int | None = None,
    interpret: bool | None = None,
    debug: bool = False,
) -> Float[Array, "T Hq D"]:
    """:func:`ragged_paged_attention`'s contract, with the rows of one query token (a
    mixed step's decode rows) run by :func:`~jaxpaged.pallas.paged_attention.paged_decode_attention`
    and the other rows by the ragged kernel, as vLLM splits a batch into its decode and
    prefill parts.

    Both kernels run over all ``S`` rows (shapes are static): the decode kernel reads
    nothing for the rows it does not take (their length goes in as 0), the ragged kernel
    schedules no query block for them. ``num_splits`` goes to the decode kernel.
    """
    common.check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
                              decode=False, what="mixed_paged_attention")
    T, S = q.shape[0], context_lens.shape[0]
    one = query_start_loc[1:] - query_start_loc[:-1] == 1  # [S]
    last = jnp.clip(query_start_loc[1:] - 1, 0, T - 1)
    dec = paged_decode_attention(q[last], k_pool, v_pool, layer, block_tables, jnp.where(one, context_lens, 0),
                                 scale=scale, num_splits=num_splits, interpret=interpret, debug=debug)
    rag = ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc,
                                 scale=scale, block_q=block_q, interpret=interpret, debug=debug, skip_rows=one)
    t = jnp.arange(T, dtype=jnp.int32)
    row = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, S - 1)
    take = one[row] & (t < query_start_loc[S])
    return jnp.where(take[:, None, None], dec[row], rag)
