"""Pure-jnp paged attention, written for clarity: the oracle every kernel is tested against.

One function serves prefill, chunked prefill and decode. Tokens of all sequences are
flattened ("ragged") along one axis; sequence ``s`` owns tokens
``query_start_loc[s] : query_start_loc[s + 1]``. A token at position ``p`` of its
sequence attends to the keys at positions ``0..p`` of the same sequence, all of which
are already in the pool (the step writes this step's K/V before attending).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def ref_ragged_paged_attention(
    q: Float[Array, "T Hq D"],
    k_pool: Float[Array, "NB KVH BS D"],
    v_pool: Float[Array, "NB KVH BS D"],
    block_tables: Int[Array, "S W"],
    context_lens: Int[Array, "S"],
    query_start_loc: Int[Array, "S+1"],
    positions: Int[Array, "T"],
    *,
    scale: float,
) -> Float[Array, "T Hq D"]:
    T, Hq, D = q.shape
    _, KVH, BS, _ = k_pool.shape
    S, W = block_tables.shape
    G = Hq // KVH
    t = jnp.arange(T)
    # Sequence of each token; tokens past the last sequence (padding) get an empty mask.
    seq = jnp.clip(jnp.searchsorted(query_start_loc, t, side="right") - 1, 0, S - 1)
    valid_tok = t < query_start_loc[S]
    k = k_pool[block_tables[seq]]  # [T, W, KVH, BS, D]
    v = v_pool[block_tables[seq]]
    k = k.transpose(0, 2, 1, 3, 4).reshape(T, KVH, W * BS, D).astype(jnp.float32)
    v = v.transpose(0, 2, 1, 3, 4).reshape(T, KVH, W * BS, D).astype(jnp.float32)
    qg = q.reshape(T, KVH, G, D).astype(jnp.float32)
    s = jnp.einsum("tkgd,tknd->tkgn", qg, k) * scale
    j = jnp.arange(W * BS)
    mask = (j[None, :] <= positions[:, None]) & (j[None, :] < context_lens[seq][:, None]) & valid_tok[:, None]
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    l = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("tkgn,tknd->tkgd", p, v) / jnp.where(l > 0, l, 1.0)
    return o.reshape(T, Hq, D).astype(q.dtype)
