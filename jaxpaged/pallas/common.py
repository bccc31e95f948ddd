"""What every paged-attention implementation shares: input checks, block-id folding, the
ragged query-block schedule.

Two conventions hold for all of them (reference, Pallas, pure XLA):

- **The layer is folded into the block id.** The pool ``[L, NB, KVH, BS, D]`` is viewed as
  ``[L * NB, KVH, BS, D]`` (a free reshape of a contiguous array) and a sequence's block
  ``b`` of layer ``l`` is row ``l * NB + b``. A kernel therefore reads the one layer it
  needs straight out of the full stacked pool; ``pool[layer]`` is never formed, which
  would be a copy of a whole layer per call and make step time grow with the pool.
- **Queries are the last tokens of their context.** Sequence ``s`` has ``context_lens[s]``
  tokens in the cache after this step's writes and ``q_len = qsl[s+1] - qsl[s]`` query
  tokens, the last ``q_len`` of them: token ``u`` of the chunk sits at position
  ``context_lens[s] - q_len + u`` and sees keys ``0 ..`` that position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int

from jaxpaged.padding import next_power_of_2  # noqa: F401  (re-exported for the kernels)

# Logit of a masked key: finite, so that a fully masked row never computes inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def dot_precision(dtype) -> jax.lax.Precision | None:
    """Precision of a dot over operands of ``dtype`` (attention and the model's matmuls).

    float32 asks for full float32 products: on GPU the default lets XLA and Triton
    multiply float32 operands in TF32 (10-bit mantissa, ~1e-3 relative error), which a
    float32 model is chosen to avoid (the native kernel tests failed at 8.6e-4 on an H100
    before). Other dtypes get ``None``, which follows ``jax.default_matmul_precision``: a
    product of two bfloat16 numbers is exact in the float32 accumulator anyway.
    """
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


# A pool may hold a float format as its raw bits, in the integer type of the same width that
# names the format. float8 K/V always are (as bytes), 16-bit ones on CPU: XLA:CPU upcasts a
# scatter into a float8 or 16-bit float array to float32, operand and all (one K/V write into
# a 184 MB float8 pool took 180 ms, into a 1 GiB bfloat16 one 0.8 s, instead of ~20 us), while
# integer scatters run in place everywhere. Kernels reinterpret the bits after loading a tile
# (free) and convert the values to the queries' dtype. float8 scales are 1 (vLLM's default for
# a checkpoint without calibrated ``k_scale``/``v_scale``): values past the range saturate.
BITS_STORAGE = {jnp.dtype(jnp.float8_e4m3fn): jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e5m2): jnp.dtype(jnp.int8),
                jnp.dtype(jnp.bfloat16): jnp.dtype(jnp.uint16), jnp.dtype(jnp.float16): jnp.dtype(jnp.int16)}
_BITS_VALUES = {storage: value for value, storage in BITS_STORAGE.items()}


def kv_value_dtype(dtype) -> jnp.dtype:
    """The dtype of the values a pool of (storage) ``dtype`` holds."""
    return _BITS_VALUES.get(jnp.dtype(dtype), jnp.dtype(dtype))


def is_fp8_storage(dtype) -> bool:
    """Whether a pool of ``dtype`` holds float8 K/V (as bytes, see ``BITS_STORAGE``)."""
    return kv_value_dtype(dtype).itemsize == 1


def to_kv(x, dtype):
    """``x`` as stored in a pool of ``dtype``: rounded to its values' dtype, a float8 pool's
    clipped to the format's finite range first (a cast past it gives NaN in e4m3fn, inf in
    e5m2), and kept as bits where the pool holds bits."""
    value = kv_value_dtype(dtype)
    if value == jnp.dtype(dtype):
        return x.astype(dtype)
    if value.itemsize == 1:
        big = float(jnp.finfo(value).max)
        x = jnp.clip(x, -big, big)
    return jax.lax.bitcast_convert_type(x.astype(value), dtype)


def from_kv(x, dtype):
    """A tile read out of a pool, as ``dtype`` values (a pool of bits decoded)."""
    value = kv_value_dtype(x.dtype)
    if value != x.dtype:
        x = jax.lax.bitcast_convert_type(x, value)
    return x.astype(dtype)


def default_interpret() -> bool:
    """Pallas kernels run in interpret mode where there is no GPU to lower them for."""
    return jax.default_backend() == "cpu"


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_paged_inputs(q, k_pool, v_pool, block_tables, context_lens, query_start_loc=None, *,
                       decode: bool, what: str) -> None:
    """Raise ``ValueError`` naming the offending value and the limit it breaks.

    Runs at trace time on shapes and dtypes; block-table entries are range-checked here
    only when the table is concrete (see :func:`debug_check_block_tables` for traced ones).
    """
    if q.ndim != 3:
        raise ValueError(f"{what}: q must be [tokens, num_heads, head_dim]; got shape {q.shape}")
    if k_pool.ndim != 5:
        raise ValueError(f"{what}: k_pool must be [num_layers, num_blocks, num_kv_heads, block_size, "
                         f"head_dim]; got shape {k_pool.shape}")
    if k_pool.shape != v_pool.shape:
        names = ("num_layers", "num_blocks", "num_kv_heads", "block_size", "head_dim")
        diff = [f"{n} {a} vs {b}" for n, a, b in zip(names, k_pool.shape, v_pool.shape) if a != b]
        raise ValueError(f"{what}: k_pool and v_pool differ: {', '.join(diff)}")
    if k_pool.dtype != v_pool.dtype:
        raise ValueError(f"{what}: k_pool dtype {k_pool.dtype} != v_pool dtype {v_pool.dtype}")
    T, Hq, D = q.shape
    _, NB, KVH, _, Dk = k_pool.shape
    if Hq % KVH:
        raise ValueError(f"{what}: num_heads={Hq} is not a multiple of num_kv_heads={KVH}")
    if D != Dk:
        raise ValueError(f"{what}: q head_dim {D} != pool head_dim {Dk}")
    if is_fp8_storage(k_pool.dtype):
        if not jnp.issubdtype(q.dtype, jnp.floating) or q.dtype.itemsize < 2:
            raise ValueError(f"{what}: q dtype {q.dtype}: a float8 pool ({kv_value_dtype(k_pool.dtype)} "
                             f"stored as {k_pool.dtype}) takes float32, bfloat16 or float16 queries")
    elif q.dtype != kv_value_dtype(k_pool.dtype):
        raise ValueError(f"{what}: q dtype {q.dtype} != pool dtype {k_pool.dtype}; cast q (or build "
                         f"the pool) in one dtype")
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(f"{what}: block_tables must be int32 [num_seqs, width]; got "
                         f"{block_tables.dtype}{list(block_tables.shape)}")
    S = block_tables.shape[0]
    if context_lens.shape != (S,) or context_lens.dtype != jnp.int32:
        raise ValueError(f"{what}: context_lens must be int32 [{S}] (one per block-table row); got "
                         f"{context_lens.dtype}{list(context_lens.shape)}")
    if decode and T != S:
        raise ValueError(f"{what}: decode takes one query per sequence; q has {T} tokens for {S} sequences")
    if query_start_loc is not None and (query_start_loc.shape != (S + 1,)
                                        or query_start_loc.dtype != jnp.int32):
        raise ValueError(f"{what}: query_start_loc must be int32 [{S + 1}]; got "
                         f"{query_start_loc.dtype}{list(query_start_loc.shape)}")
    if _is_concrete(block_tables) and block_tables.size:
        table = np.asarray(block_tables)  # host-side: jnp ops here would be staged into a trace
        lo, hi = int(table.min()), int(table.max())
        if lo < 0 or hi >= NB:
            raise ValueError(f"{what}: block table entry {hi if hi >= NB else lo} is outside the pool of "
                             f"{NB} blocks")


def _raise_if_out_of_pool(block_tables, num_blocks):
    bad = (block_tables < 0) | (block_tables >= num_blocks)
    if np.any(bad):
        raise ValueError(f"block table entry {int(block_tables[bad][0])} is outside the pool of "
                         f"{int(num_blocks)} blocks")


def debug_check_block_tables(block_tables: Int[Array, "S W"], num_blocks: int) -> None:
    """Range-check a traced block table at run time (``debug=True`` of the wrappers).

    The ``ValueError`` surfaces from the computation (as a runtime error carrying its
    message). Without it, out-of-range entries are clamped into the pool: memory-safe,
    wrong values.
    """
    jax.debug.callback(_raise_if_out_of_pool, block_tables, num_blocks)


def flat_block_ids(block_tables: Int[Array, "S W"], context_lens: Int[Array, "S"], layer,
                   num_blocks: int, block_size: int, width: int) -> Int[Array, "S width"]:
    """Block-table rows as rows of the ``[L * NB, ...]`` pool view, padded to ``width``.

    Entries past a sequence's last block become the layer's null block, so that reading a
    whole chunk at the end of a sequence touches only cached, harmless data, and entries
    outside the pool are clamped (see :func:`debug_check_block_tables`).
    """
    S, W = block_tables.shape
    assert width >= W, (width, W)
    bt = jnp.pad(block_tables, ((0, 0), (0, width - W)))
    used = (context_lens[:, None] + block_size - 1) // block_size
    bt = jnp.where(jnp.arange(width)[None, :] < used, jnp.clip(bt, 0, num_blocks - 1), 0)
    return bt + jnp.asarray(layer, jnp.int32) * num_blocks


def flat_pool(pool):
    """``[L, NB, KVH, BS, D] -> [L * NB, KVH, BS, D]``: a bitcast, no copy."""
    L, NB, KVH, BS, D = pool.shape
    return pool.reshape(L * NB, KVH, BS, D)


def num_q_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Static upper bound on ``sum_s cdiv(q_len[s], block_q)`` over ``num_tokens`` tokens."""
    n = min(num_seqs, num_tokens)  # sequences with at least one token
    return max(1, (num_tokens - n) // block_q + n)


def q_block_schedule(query_start_loc: Int[Array, "S+1"], context_lens: Int[Array, "S"],
                     num_tokens: int, block_q: int, skip: Bool[Array, "S"] | None = None):
    """Cut every sequence's query chunk into blocks of ``block_q`` tokens.

    Rows where ``skip`` holds get no block (another kernel attends them); their tokens'
    entries are meaningless.

    Returns ``(blocks, (tok_block, tok_row, tok_valid))``:

    - ``blocks = (seq, tok0, nq, pos0)``, each ``[NQB]`` int32: the block's sequence, its
      first token in the flat token axis, its number of real tokens (0 for padding
      blocks) and the position of its first token in the sequence.
    - per token ``[T]``: its block, its row within the block, and whether it is a real
      token (padding tokens past ``query_start_loc[S]`` are not).
    """
    S = context_lens.shape[0]
    NQB = num_q_blocks(num_tokens, S, block_q)
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [S]
    if skip is not None:
        q_len = jnp.where(skip, 0, q_len)
    nqb = (q_len + block_q - 1) // block_q
    qb_end = jnp.cumsum(nqb)  # blocks of sequences 0..s
    qb_start = qb_end - nqb
    b = jnp.arange(NQB, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(qb_end, b, side="right"), 0, S - 1).astype(jnp.int32)
    j = b - qb_start[seq]
    nq = jnp.where(b < qb_end[S - 1], jnp.clip(q_len[seq] - j * block_q, 0, block_q), 0)
    tok0 = jnp.where(nq > 0, query_start_loc[seq] + j * block_q, 0)  # padding blocks: in range, touch nothing
    pos0 = context_lens[seq] - q_len[seq] + j * block_q
    blocks = tuple(x.astype(jnp.int32) for x in (seq, tok0, nq, pos0))

    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tseq = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, S - 1)
    u = t - query_start_loc[tseq]
    tok_block = jnp.clip(qb_start[tseq] + u // block_q, 0, NQB - 1).astype(jnp.int32)
    tok_row = (u % block_q).astype(jnp.int32)
    tok_valid = t < query_start_loc[S]
    return blocks, (tok_block, tok_row, tok_valid)


def group_queries(q, num_kv_heads: int, group_pad: int):
    """``[..., Hq, D] -> [..., KVH, group_pad, D]``; the padded query heads are zeros."""
    *lead, Hq, D = q.shape
    G = Hq // num_kv_heads
    qg = q.reshape(*lead, num_kv_heads, G, D)
    if group_pad > G:
        qg = jnp.pad(qg, [(0, 0)] * (len(lead) + 1) + [(0, group_pad - G), (0, 0)])
    return qg


def ungroup_queries(o, num_heads: int):
    """Inverse of :func:`group_queries`: ``[..., KVH, group_pad, D] -> [..., Hq, D]``."""
    *lead, KVH, Gp, D = o.shape
    G = num_heads // KVH
    return o[..., :G, :].reshape(*lead, num_heads, D)


def pack_queries(q, tok0, num_kv_heads: int, block_q: int, group_pad: int):
    """``q [T, Hq, D] -> [NQB, KVH, block_q * group_pad, D]``.

    Row ``u * group_pad + g`` of block ``b`` and KV head ``h`` holds query head
    ``h * G + g`` of token ``tok0[b] + u``. Rows past a block's real tokens hold other
    tokens' queries (computed, never read back); padded heads are zeros.
    """
    T, Hq, D = q.shape
    NQB = tok0.shape[0]
    idx = jnp.clip(tok0[:, None] + jnp.arange(block_q, dtype=jnp.int32)[None, :], 0, T - 1)
    qg = group_queries(q[idx], num_kv_heads, group_pad)  # [NQB, BQ, KVH, Gp, D]
    return qg.transpose(0, 2, 1, 3, 4).reshape(NQB, num_kv_heads, block_q * group_pad, D)


def unpack_outputs(o_blocks, tok_block, tok_row, tok_valid, num_heads: int, block_q: int):
    """Inverse of :func:`pack_queries` for the outputs; padding tokens get zeros."""
    NQB, KVH, M, D = o_blocks.shape
    o = o_blocks.reshape(NQB, KVH, block_q, M // block_q, D)[tok_block, :, tok_row]  # [T, KVH, Gp, D]
    o = ungroup_queries(o, num_heads)
    return jnp.where(tok_valid[:, None, None], o, 0).astype(o_blocks.dtype)
