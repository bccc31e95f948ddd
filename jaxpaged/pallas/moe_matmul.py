"""Pallas (Triton) grouped matmul of a mixture of experts: each expert's tokens against that
expert's weights, read in place from the layer-stacked ``[L, E, K, N]`` expert weights.

Why: XLA's ``ragged_dot`` is native on TPU, but on a GPU (jax 0.10-0.11) nothing guarantees
a grouped kernel, and jax's own CPU lowering computes every expert for every row (E times
the work). And under the layer ``lax.scan``, a layer's ``[E, K, N]`` slice of the stack
would be copied before an XLA matmul, as the dense MLP's was (see :mod:`stacked_matmul`):
for a Mixtral-8x7B layer that is 2.8 GB a step. This kernel is vLLM's ``fused_moe`` idea in
Pallas: the (token, expert) pairs sorted by expert, each expert's run padded to whole tiles
of ``block_t`` rows (:func:`align_to_tiles`), so that every token tile belongs to one expert;
a program takes one token tile and one output column tile, looks up the tile's expert and
walks K reading that expert's weight tiles of layer ``layer`` where they lie. Tiles past the
last used one (the plan's room for the worst case) write zeros and read nothing, so a decode
step reads only the experts its tokens chose.

Grid ``(N / block_n, tiles)``, each program accumulating ``[block_t, block_n]`` in float32.
On CPU the kernel runs in the Pallas interpreter (tests only).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from jaxpaged.pallas import common


class TilePlan(NamedTuple):
    """Where each (token, expert) pair sits in the expert-sorted, tile-padded rows.

    ``rows[i]``: the pair in row ``i`` (``M``, one past the last pair, for a padding row);
    ``tile_expert[g]``: the expert of tile ``g`` (rows ``g * block_t`` on), -1 for a tile
    no pair uses; ``slot[m]``: the row of pair ``m``."""
    rows: Int[Array, "R"]
    tile_expert: Int[Array, "G"]
    slot: Int[Array, "M"]


def num_tiles(num_pairs: int, num_experts: int, block_t: int) -> int:
    """Tiles enough for any routing of ``num_pairs`` pairs: each expert's run rounds up by less
    than a tile, so ``ceil(M / block_t) + E``, and never more than one tile per pair."""
    return min(-(-num_pairs // block_t) + num_experts, num_pairs)


def align_to_tiles(experts: Int[Array, "M"], num_experts: int, block_t: int) -> TilePlan:
    """The :class:`TilePlan` of pairs routed to ``experts`` (each in ``[0, num_experts)``): sorted
    by expert (stable: within an expert, in pair order), each expert's run starting a tile."""
    M = experts.shape[0]
    G = num_tiles(M, num_experts, block_t)
    counts = jnp.bincount(experts, length=num_experts)
    tiles = -(-counts // block_t)  # [E]
    tile_end = jnp.cumsum(tiles)
    tile_start = tile_end - tiles
    pair_start = jnp.cumsum(counts) - counts
    order = jnp.argsort(experts, stable=True)  # the pairs, by expert
    e_sorted = experts[order]
    rank = jnp.arange(M) - pair_start[e_sorted]  # place within its expert's run
    slot_sorted = tile_start[e_sorted] * block_t + rank
    slot = jnp.zeros((M,), jnp.int32).at[order].set(slot_sorted.astype(jnp.int32), unique_indices=True)
    rows = jnp.full((G * block_t,), M, jnp.int32).at[slot].set(jnp.arange(M, dtype=jnp.int32), unique_indices=True)
    g = jnp.arange(G)
    owner = jnp.searchsorted(tile_end, g, side="right")  # the expert whose tiles cover g
    tile_expert = jnp.where(g < tile_end[-1], owner, -1).astype(jnp.int32)
    return TilePlan(rows, tile_expert, slot)


def _kernel(layer_ref, tile_expert_ref, x_ref, w_ref, o_ref, *, block_k: int):
    j, g = pl.program_id(0), pl.program_id(1)
    e = tile_expert_ref[g]
    block_t, block_n = o_ref.shape
    K = x_ref.shape[1]

    @pl.when(e < 0)
    def _():
        o_ref[...] = jnp.zeros((block_t, block_n), o_ref.dtype)

    @pl.when(e >= 0)
    def _():
        layer = layer_ref[0]

        def body(kk, acc):
            k0 = kk * block_k
            w = w_ref[layer, e, pl.ds(k0, block_k), pl.ds(j * block_n, block_n)]
            return acc + lax.dot_general(x_ref[:, pl.ds(k0, block_k)], w, (((1,), (0,)), ((), ())),
                                         precision=common.dot_precision(w.dtype), preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, K // block_k, body, jnp.zeros((block_t, block_n), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)


def _largest_power_of_2_dividing(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def default_block_t(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: the pairs an expert gets on average, as a power of two in [16, 64] (16:
    Triton's smallest dot; a decode step's experts get a row or two, and the padding rows
    cost compute, not weight reads)."""
    return min(64, max(16, common.next_power_of_2(-(-num_pairs // num_experts))))


def supports(K: int, N: int) -> bool:
    """Whether the kernel tiles ``[K, N]`` expert weights on GPU: both multiples of 16."""
    return K % 16 == 0 and N % 16 == 0


def moe_matmul(
    x: Float[Array, "R K"],
    w: Float[Array, "L E K N"],
    layer: Int[Array, ""] | int,
    tile_expert: Int[Array, "G"],
    *,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Float[Array, "R N"]:
    """Row tile ``g`` of ``x`` (``R = G * block_t`` rows) times ``w[layer, tile_expert[g]]``;
    zeros for tiles of expert -1. ``block_t = R / G``; ``block_n`` and ``block_k`` the largest
    powers of two up to 128 and 64 dividing N and K."""
    R, K = x.shape
    G = tile_expert.shape[0]
    if w.ndim != 4 or w.shape[2] != K or R % G:
        raise ValueError(f"moe_matmul: x {x.shape}, w {w.shape}, {G} tiles: expected [G * block_t, K] and [L, E, K, N]")
    if x.dtype != w.dtype:
        raise ValueError(f"moe_matmul: x is {x.dtype}, w is {w.dtype}; expected one dtype")
    interpret = common.default_interpret() if interpret is None else interpret
    bt, N = R // G, w.shape[3]
    bn, bk = _largest_power_of_2_dividing(N, 128), _largest_power_of_2_dividing(K, 64)
    if not interpret and (bt < 16 or bt & (bt - 1) or bn < 16 or bk < 16):
        raise ValueError(f"moe_matmul: tiles {bt} x {bn} x {bk} must be powers of two >= 16 on GPU")
    return _moe_matmul(x, w, jnp.asarray(layer, jnp.int32).reshape(1), tile_expert.astype(jnp.int32),
                       blocks=(bt, bn, bk), interpret=interpret, num_warps=num_warps, num_stages=num_stages)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "num_warps", "num_stages"))
def _moe_matmul(x, w, layer, tile_expert, *, blocks, interpret, num_warps, num_stages):
    bt, bn, bk = blocks
    R, K = x.shape
    N = w.shape[3]
    return pl.pallas_call(
        functools.partial(_kernel, block_k=bk),
        grid=(N // bn, R // bt),
        in_specs=[
            pl.BlockSpec(),  # layer
            pl.BlockSpec(),  # tile_expert, whole
            pl.BlockSpec((bt, K), lambda j, g: (g, 0)),  # x
            pl.BlockSpec(),  # the whole stack
        ],
        out_specs=pl.BlockSpec((bt, bn), lambda j, g: (g, j)),
        out_shape=jax.ShapeDtypeStruct((R, N), x.dtype),
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"moe_matmul_t{bt}_n{bn}_k{bk}",
    )(layer, tile_expert, x, w)
