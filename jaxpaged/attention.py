"""Attention metadata and the one attention entry point the model calls.

The metadata is an explicit pytree passed into the jitted step (no global context).
Tokens of all sequences in a step are flattened along one axis of padded length ``T``;
sequences are padded to ``S`` rows. Padding rows have zero query length and zero
context length; padding tokens sit after ``query_start_loc[S]`` and write their K/V into
the null block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.kv_cache import KVPool
from jaxpaged.pallas.reference import ref_ragged_paged_attention

BACKENDS = ("reference",)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions: Int[Array, "T"]  # position of each token in its own sequence (RoPE, causality)
    slot_mapping: Int[Array, "T"]  # block * block_size + offset where the token's K/V is written
    block_tables: Int[Array, "S W"]  # logical -> physical block; padding entries = null block 0
    context_lens: Int[Array, "S"]  # tokens in the cache after this step's writes; 0 = padding row
    query_start_loc: Int[Array, "S+1"]  # sequence s owns tokens [qsl[s], qsl[s+1])
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))  # T == S, one token each


def paged_attention(
    q: Float[Array, "T Hq D"],
    kv: KVPool,
    layer: Int[Array, ""],
    md: AttentionMetadata,
    *,
    scale: float,
    backend: str = "reference",
) -> Float[Array, "T Hq D"]:
    """Attention of this step's queries over the paged pool of one layer."""
    if backend == "reference":
        return ref_ragged_paged_attention(
            q, kv.k[layer], kv.v[layer], md.block_tables, md.context_lens, md.query_start_loc,
            md.positions, scale=scale,
        )
    raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
