"""Pure-jnp paged attention, written for clarity: the oracle every kernel is tested against.

One function serves prefill, chunked prefill and decode. Tokens of all sequences are
flattened ("ragged") along one axis; sequence ``s`` owns tokens
``query_start_loc[s] : query_start_loc[s + 1]``. A token at position ``p`` of its
sequence attends to the keys at positions ``0..p`` of the same sequence, all of which
are already in the pool (the step writes this step's K/V before attending).

It gathers every block of every token's table (``[T, W * block_size]`` keys per head), so
it is slow and memory-hungry by design; the kernels never do that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.pallas.common import from_kv

# The oracle computes in float32 on every platform (XLA's default on GPU is TF32 products).
_HIGHEST = jax.lax.Precision.HIGHEST


def ref_ragged_paged_attention(
    q: Float[Array, "T Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    query_start_loc: Int[Array, "S+1"],
    positions: Int[Array, "T"],
    *,
    scale: float,
) -> Float[Array, "T Hq D"]:
    """Attention of ragged query tokens over their sequences' cached blocks of one layer.

    Query head ``h`` uses KV head ``h // (Hq // KVH)``. Tokens past
    ``query_start_loc[S]`` (padding) and sequences of context length 0 give zeros.
    Softmax in float32 whatever the input dtype.
    """
    T, Hq, D = q.shape
    _, _, KVH, BS, _ = k_pool.shape
    S, W = block_tables.shape
    G = Hq // KVH
    t = jnp.arange(T)
    # Sequence of each token; tokens past the last sequence (padding) get an empty mask.
    seq = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, S - 1)
    valid_tok = t < query_start_loc[S]
    blocks = block_tables[seq]  # [T, W]
    k = k_pool[layer, blocks]  # [T, W, KVH, BS, D]; one gather, no copy of the layer
    v = v_pool[layer, blocks]
    k = from_kv(k.transpose(0, 2, 1, 3, 4).reshape(T, KVH, W * BS, D), jnp.float32)
    v = from_kv(v.transpose(0, 2, 1, 3, 4).reshape(T, KVH, W * BS, D), jnp.float32)
    qg = q.reshape(T, KVH, G, D).astype(jnp.float32)
    s = jnp.einsum("tkgd,tknd->tkgn", qg, k, precision=_HIGHEST) * scale
    j = jnp.arange(W * BS)  # key position in the sequence
    mask = (j[None, :] <= positions[:, None]) & (j[None, :] < context_lens[seq][:, None]) & valid_tok[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    # Masked keys get weight exactly 0; where() keeps NaN/inf in stale slots out of the sum.
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("tkgn,tknd->tkgd", p, jnp.where(mask[:, None, :, None], v, 0.0),
                   precision=_HIGHEST)
    o = o / jnp.where(l > 0, l, 1.0)
    return o.reshape(T, Hq, D).astype(q.dtype)


def ref_paged_decode_attention(
    q: Float[Array, "S Hq D"],
    k_pool: Float[Array, "L NB KVH BS D"],
    v_pool: Float[Array, "L NB KVH BS D"],
    layer: Int[Array, ""] | int,
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    *,
    scale: float,
) -> Float[Array, "S Hq D"]:
    """Decode: row ``s`` is the last token of sequence ``s`` (position ``context_lens[s] - 1``)."""
    S = q.shape[0]
    # Every row owns one token; a padding row's context of 0 masks all its keys (zeros out).
    qsl = jnp.arange(S + 1, dtype=jnp.int32)
    return ref_ragged_paged_attention(q, k_pool, v_pool, layer, block_tables, context_lens, qsl,
                                      context_lens - 1, scale=scale)
