"""Pallas (Triton) matmul against one layer of a stacked ``[L, K, N]`` weight, read in place.

Why: the model runs its layers under ``lax.scan`` over weights stacked ``[L, ...]``. On a
GPU, XLA slices each layer's weight out of the stack with a dynamic-slice and, when the
matmul goes to cuBLAS, copies it first: for Llama-3-8B's MLP (gate, up, down: 3 x 117 MB
a layer) that is 9.7 ms of a 24.6 ms decode step on an H100 (``scripts/bench_gpu.py``),
every step. This kernel takes the whole stack and the layer index, as the paged-attention
kernels take the whole pool, and reads the layer's tiles where they lie.

Grid ``(N / block_n, T / block_t)``, the token tiles innermost, so the programs that run
side by side read the same ``[K, block_n]`` weight column (L2 hits) and each weight byte
leaves HBM about once. Tiles per shape: :func:`default_config` (measured on an H100: 1.6-2.5
TB/s of weights, 2-3x faster than XLA's slice-then-matmul). A program walks K in ``block_k`` steps, accumulating
``[block_t, block_n]`` in float32 (Triton pipelines the loop's loads over ``num_stages``).
Used for steps of at most ``model.STACKED_MAX_TOKENS`` (1,024) tokens: decode steps and the
mixed decode + prefill-chunk steps of continuous batching, for all seven projections (q, k,
v, o as free reshapes of their stacks). Bigger prefill steps keep XLA's matmul: there the
copy is paid once for thousands of tokens and cuBLAS outruns this kernel (measured on an
H100, ``scripts/bench_gpu.py --only matmul``: a layer's projections 957 vs 1,045 us at
1,024 tokens, 1,729 vs 1,589 us at 2,048).

On CPU the kernel runs in the Pallas interpreter (tests only).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from jaxpaged.pallas import common


def _kernel(
    layer_ref,  # [1] int32, whole
    x_ref,  # [block_t, K]
    w_ref,  # [L, K, N], the whole stack
    o_ref,  # [block_t, block_n]: this split's partial sums (float32) or, unsplit, the output
    *,
    block_k: int,
    k_per_split: int,
):
    j = pl.program_id(0)
    k_start = pl.program_id(2) * k_per_split
    block_t = x_ref.shape[0]
    block_n = o_ref.shape[-1]
    layer = layer_ref[0]

    def body(kk, acc):
        k0 = k_start + kk * block_k
        x = x_ref[:, pl.ds(k0, block_k)]
        w = w_ref[layer, pl.ds(k0, block_k), pl.ds(j * block_n, block_n)]
        return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=common.dot_precision(w.dtype),
                                     preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_t, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _largest_power_of_2_dividing(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def default_config(T: int, K: int, N: int) -> tuple[tuple[int, int, int], int, int]:
    """``((block_t, block_n, block_k), num_warps, num_stages)`` for ``[T, K] x [K, N]``.

    Tiles are powers of two >= 16 (Triton's dot) that divide N and K. From a sweep on an
    H100 (bf16, Llama-3-8B's MLP; ``x @ w[layer]`` sliced by XLA: 138-144 us each):
    T <= 64 runs best as one token tile with narrow, deep tiles (64 x 4096 x 14336: 47 us,
    2.5 TB/s of weights); at T = 256, 128-token tiles, 128 x 64 for gate/up (62 us) and,
    where K > N (down: K = 14336), 64 x 128 with 8 warps and 4 stages (71 us).
    """
    bt = min(128, max(16, common.next_power_of_2(T)))
    if bt <= 64:
        bn, bk, warps, stages = 64, 128, 4, 3
    elif K > N:
        bn, bk, warps, stages = 64, 128, 8, 4
    else:
        bn, bk, warps, stages = 128, 64, 4, 3
    return (bt, _largest_power_of_2_dividing(N, bn), _largest_power_of_2_dividing(K, bk)), warps, stages


def supports(K: int, N: int) -> bool:
    """Whether Triton can tile ``[T, K] x [K, N]`` here: :func:`default_config` finds tiles of at
    least 16 (a power of two) that divide K and N. Otherwise callers keep XLA's matmul."""
    return _largest_power_of_2_dividing(K, 16) == 16 and _largest_power_of_2_dividing(N, 16) == 16


def stacked_matmul(
    x: Float[Array, "T K"],
    w: Float[Array, "L K N"],
    layer: Int[Array, ""] | int,
    *,
    blocks: tuple[int, int, int] | None = None,
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int = 1,
) -> Float[Array, "T N"]:
    """``x @ w[layer]`` without materialising ``w[layer]``.

    Args:
      x: activations; ``T`` is padded inside to a multiple of ``block_t``.
      w: the stacked weights (a free reshape of ``[L, K, *out]`` to ``[L, K, N]``).
      layer: which layer (traced or not; out of range reads are the caller's bug).
      blocks: ``(block_t, block_n, block_k)``; default from :func:`default_config`.
      interpret: run in the Pallas interpreter; default: on CPU.
      num_warps, num_stages: Triton compiler knobs; default from :func:`default_config`.
      splits: split-K: ``splits`` programs per output tile each sum ``K / splits`` of the
        products into float32 partials, added up afterwards. For few tokens and narrow
        outputs (Llama-3-8B's k/v: 16 output tiles of 64) the unsplit kernel is bound by
        each program's sequential walk over K (~50 us for any N at 16 tokens on an H100),
        not by bandwidth. Not yet measured on a GPU; off by default.
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"stacked_matmul: x {x.shape} and w {w.shape} must be [T, K] and [L, K, N]")
    if x.dtype != w.dtype:
        raise ValueError(f"stacked_matmul: x is {x.dtype}, w is {w.dtype}; expected one dtype")
    auto_blocks, warps, stages = default_config(*x.shape, w.shape[2])
    return _stacked_matmul(x, w, jnp.asarray(layer, jnp.int32).reshape(1), blocks=blocks or auto_blocks,
                           interpret=common.default_interpret() if interpret is None else interpret,
                           num_warps=num_warps or warps, num_stages=num_stages or stages, splits=splits)


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "num_warps", "num_stages", "splits"))
def _stacked_matmul(x, w, layer, *, blocks, interpret, num_warps, num_stages, splits):
    T, K = x.shape
    N = w.shape[2]
    bt, bn, bk = blocks
    if splits < 1 or K % (splits * bk):
        raise ValueError(f"stacked_matmul: splits={splits} x block_k={bk} does not divide K={K}")
    for name, b, n in (("block_n", bn, N), ("block_k", bk, K)):
        if n % b:
            raise ValueError(f"stacked_matmul: {name}={b} does not divide {n}")
        if not interpret and (b & (b - 1) or b < 16):
            raise ValueError(f"stacked_matmul: {name}={b} must be a power of two >= 16 on GPU")
    Tp = pl.cdiv(T, bt) * bt
    xp = jnp.pad(x, ((0, Tp - T), (0, 0))) if Tp != T else x
    if splits == 1:  # the output directly, in the activations' dtype
        out_shape = jax.ShapeDtypeStruct((Tp, N), x.dtype)
        out_spec = pl.BlockSpec((bt, bn), lambda j, i, s: (i, j))
    else:  # float32 partial sums per split, added below
        out_shape = jax.ShapeDtypeStruct((splits, Tp, N), jnp.float32)
        out_spec = pl.BlockSpec((None, bt, bn), lambda j, i, s: (s, i, j))
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, k_per_split=K // splits),
        grid=(N // bn, Tp // bt, splits),
        in_specs=[
            pl.BlockSpec(),  # layer
            pl.BlockSpec((bt, K), lambda j, i, s: (i, 0)),  # x
            pl.BlockSpec(),  # the whole stack
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"stacked_matmul_t{bt}_n{bn}_k{bk}" + (f"_s{splits}" if splits > 1 else ""),
    )(layer, xp, w)
    if splits > 1:
        out = out.sum(axis=0).astype(x.dtype)
    return out[:T] if Tp != T else out
