"""The paged KV pool that lives on the device, and the in-place updates applied to it.

Layout, one array for K and one for V::

    k, v: [num_layers, num_blocks, num_kv_heads, block_size, head_dim]

This is vLLM's per-layer layout ``[num_blocks, num_kv_heads, block_size, head_dim]``
stacked over layers. Why:
- Layers are stacked because the model runs its layers with ``lax.scan``. The pool is
  the scan *carry* and every layer indexes it with its layer number: a pool passed as
  scan ``xs`` and returned as ``ys`` would be a second buffer, i.e. a full copy per step.
- Head-major inside a block makes the tile one kernel program reads, one block of one
  KV head, a contiguous ``[block_size, head_dim]`` slab.
- Block 0 is the null block: padding entries of block tables and the slots of padding
  tokens point at it. The block manager never hands it out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

NULL_BLOCK = 0


class KVPool(NamedTuple):
    k: Float[Array, "L NB KVH BS D"]
    v: Float[Array, "L NB KVH BS D"]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k.shape[2]

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def head_dim(self) -> int:
        return self.k.shape[4]


def init_kv_pool(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                 head_dim: int, dtype=jnp.float32) -> KVPool:
    shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    return KVPool(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))


def kv_pool_bytes(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                  head_dim: int, dtype) -> int:
    return 2 * num_layers * num_blocks * num_kv_heads * block_size * head_dim * jnp.dtype(dtype).itemsize


def write_kv(kv: KVPool, layer: Int[Array, ""], k: Float[Array, "T KVH D"], v: Float[Array, "T KVH D"],
             slot_mapping: Int[Array, "T"]) -> KVPool:
    """Scatter this step's K/V of one layer into their slots (``block * block_size + offset``).

    Inside a jit whose pool argument is donated, XLA performs the scatter in place.
    """
    bs = kv.block_size
    blk, off = slot_mapping // bs, slot_mapping % bs
    return KVPool(
        kv.k.at[layer, blk, :, off, :].set(k.astype(kv.k.dtype)),
        kv.v.at[layer, blk, :, off, :].set(v.astype(kv.v.dtype)),
    )
