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
  tokens point at it. The block manager never hands it out. Its contents are junk (padding
  tokens write there); kernels mask every key they read from it.
- Layer-major outside the blocks lets kernels view the pool as ``[L * NB, KVH, BS, D]``
  (a free reshape) and fold the layer into the block id (``layer * NB + block``): one
  gather or pointer offset reads a layer's block out of the full pool, never a copy of the
  layer (see ``pallas/common.py``).
- K and V are separate arrays (not interleaved as in tpu-inference) so that a decode
  program's K tile and V tile are each one contiguous ``[BS, D]`` slab of one head, the
  shape Triton (and Mosaic TPU) tiles load directly. JAX's GPU op puts the KV head first
  (``[KVH, NB, BS, D]``); block-major keeps a block's heads together, so copy-on-write,
  swaps and a block's K/V write are each one contiguous slab per layer.

Every update here (``write_kv``, ``copy_blocks``, ``scatter_blocks``) is a scatter into
the pool: inside a jit that donates the pool, XLA performs it in place, so step time and
peak memory do not grow with the number of blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.padding import NULL_BLOCK
from jaxpaged.pallas.common import BITS_STORAGE, to_kv

KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# vLLM's names: "fp8" is e4m3 (3 mantissa bits, range +-448), e5m2 trades a bit for range (+-57344).
_FP8 = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn, "fp8_e5m2": jnp.float8_e5m2}


def check_kv_cache_dtype(requested: str) -> None:
    if requested not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={requested!r}; choose from {KV_CACHE_DTYPES}")


def resolve_kv_cache_dtype(requested: str, model_dtype, platform: str):
    """The pool's dtype: ``requested`` (one of :data:`KV_CACHE_DTYPES`), where ``"auto"`` is
    the model's dtype, except that a 16-bit float model on ``"cpu"`` keeps float32 K/V.

    A float8 cache (``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``) is an 8-bit integer pool
    holding the float8 values' bytes (``pallas.common.BITS_STORAGE``): a quarter of a
    float32 pool's bytes, half a bfloat16 one's. K and V are rounded to float8 when written
    (scale 1, values past the range saturate); attention reads them back in the queries'
    dtype. On CPU a 16-bit pool holds its values' bits too (``uint16`` for bfloat16,
    ``int16`` for float16): XLA:CPU upcasts a scatter into a 16-bit float array, operand
    and all (a K/V write into a 1 GiB bfloat16 pool: 0.8 s; into a float32 one: 20 us).

    On CPU a 16-bit model's activations, K and V included, are float32 (``model._cpu_dot_16bit``),
    and the XLA attention path computes in float32 whatever the pool holds, so ``"auto"``
    keeps them exact there; ``"bfloat16"`` rounds them as an accelerator's pool does, in
    half the bytes.
    """
    check_kv_cache_dtype(requested)
    if requested in _FP8:
        return BITS_STORAGE[jnp.dtype(_FP8[requested])]
    if platform == "cpu" and requested in ("bfloat16", "float16"):
        return BITS_STORAGE[jnp.dtype(requested)]
    if requested != "auto":
        return jnp.dtype(requested)
    dtype = jnp.dtype(model_dtype)
    if platform == "cpu" and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.float32)
    return dtype


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
                 head_dim: int, dtype=jnp.float32, device=None) -> KVPool:
    """A zeroed pool; ``device`` may be a ``Sharding`` (each device then allocates only its shard)."""
    shape = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
    return KVPool(jnp.zeros(shape, dtype, device=device), jnp.zeros(shape, dtype, device=device))


def kv_pool_bytes(num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int,
                  head_dim: int, dtype) -> int:
    return 2 * num_layers * num_blocks * num_kv_heads * block_size * head_dim * jnp.dtype(dtype).itemsize


def write_kv(kv: KVPool, layer: Int[Array, ""], k: Float[Array, "T KVH D"], v: Float[Array, "T KVH D"],
             slot_mapping: Int[Array, "T"]) -> KVPool:
    """Scatter this step's K/V of one layer into their slots (``block * block_size + offset``).

    Inside a jit whose pool argument is donated, XLA performs the scatter in place.

    A single token is written together with a dummy write to the null block: XLA turns a
    one-index scatter into a dynamic-update-slice, and that, inside the model's layer loop
    next to the attention loops reading the pool, made XLA:CPU copy the whole pool several
    times per layer (a 1-sequence decode step at 1456 blocks: 15 s instead of 60 ms).
    ``tests/test_kv_cache.py`` checks compiled steps for copies of the pool.

    The slots are in the pool (the batch builder writes only slots the block manager
    reserved, and padding into the null block), so the scatter clamps its indices
    (``mode="clip"``) instead of checking each update and dropping those out of bounds, as
    the model's gathers do: XLA:CPU's bounds-checked scatters took 6.7-11.6 ms of a 48-row
    decode step of the default model (30 layers' K and V writes, 2-vCPU Intel Xeon, two
    traces), the clamped ones 1.2-2.4 ms.
    """
    if k.shape[0] == 1:
        k, v = jnp.concatenate([k, k]), jnp.concatenate([v, v])
        slot_mapping = jnp.concatenate([slot_mapping, jnp.full((1,), NULL_BLOCK * kv.block_size, slot_mapping.dtype)])
    bs = kv.block_size
    blk, off = slot_mapping // bs, slot_mapping % bs
    return KVPool(
        kv.k.at[layer, blk, :, off, :].set(to_kv(k, kv.k.dtype), mode="clip"),
        kv.v.at[layer, blk, :, off, :].set(to_kv(v, kv.v.dtype), mode="clip"),
    )


def copy_blocks(kv: KVPool, src: Int[Array, "N"], dst: Int[Array, "N"]) -> KVPool:
    """Copy whole blocks, every layer, ``src[i] -> dst[i]`` (copy-on-write).

    All sources are read before any destination is written. Padding pairs are
    ``NULL_BLOCK -> NULL_BLOCK`` (harmless; several may repeat). Real destinations must be
    distinct. Under a donated pool, XLA updates it in place.
    """
    return KVPool(kv.k.at[:, dst].set(kv.k[:, src]), kv.v.at[:, dst].set(kv.v[:, src]))


def gather_blocks(kv: KVPool, block_ids: Int[Array, "N"]) -> tuple[Float[Array, "L N KVH BS D"],
                                                                    Float[Array, "L N KVH BS D"]]:
    """K and V of ``block_ids`` (all layers), to be copied to the host when swapping out."""
    return kv.k[:, block_ids], kv.v[:, block_ids]


def scatter_blocks(kv: KVPool, block_ids: Int[Array, "N"],
                   data: tuple[Float[Array, "L N KVH BS D"], Float[Array, "L N KVH BS D"]]) -> KVPool:
    """Write swapped-out blocks back (swap in): ``data`` as returned by :func:`gather_blocks`.

    Padding entries point at ``NULL_BLOCK`` (their data lands in the null block, which holds
    nothing). Under a donated pool, XLA updates it in place.
    """
    k, v = data
    if k.shape[0] != kv.num_layers or k.shape[2:] != kv.k.shape[2:] or k.shape[1] != block_ids.shape[0]:
        raise ValueError(f"scatter_blocks: data of shape {k.shape} does not hold {block_ids.shape[0]} "
                         f"blocks of a pool of shape {kv.k.shape}")
    return KVPool(kv.k.at[:, block_ids].set(k.astype(kv.k.dtype)),
                  kv.v.at[:, block_ids].set(v.astype(kv.v.dtype)))
