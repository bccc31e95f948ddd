"""Pallas (Triton) matmul against one layer of a stacked ``[L, K, N]`` weight, read in place.

Why: the model runs its layers under ``lax.scan`` over weights stacked ``[L, ...]``. On a
GPU, XLA slices each layer's weight out of the stack with a dynamic-slice and, when the
matmul goes to cuBLAS, copies it first: for Llama-3-8B's MLP (gate, up, down: 3 x 117 MB
a layer) that is 9.7 ms of a 24.6 ms decode step on an H100 (``scripts/bench_gpu.py``),
every step. This kernel takes the whole stack and the layer index, as the paged-attention
kernels take the whole pool, and reads the layer's tiles where they lie.

Grid ``(N / block_n, T / block_t, splits)``: a launch runs its programs with the first grid
axis varying fastest, so by default the programs that run side by side take different
output columns of one token tile, and a weight column is read again for each token tile
(from L2 if it is still there). ``tokens_fastest`` launches ``(T / block_t, N / block_n,
splits)`` instead: the token tiles of one weight column run side by side, each weight byte
leaves HBM about once and the activations (a few MB) stay in L2; it matters only for steps
of several token tiles (:func:`default_tokens_fastest`). Tiles per shape: :func:`default_config`
(measured on an H100: 1.6-2.5 TB/s of weights for decode steps, 2-3x faster than XLA's
slice-then-matmul; about 500-600 TFLOP/s for Llama-3-8B's layer at 512-1,024 tokens).
A program walks K (or its split's share, :func:`default_splits`) in ``block_k`` steps,
accumulating ``[block_t, block_n]`` in float32 (Triton pipelines the loop's loads over
``num_stages``). :func:`grouped_stacked_matmul` runs several stacks of one input in one
launch (q, k and v; gate and up), each program picking the stack of its output tile.
Used for steps of at most ``model.STACKED_MAX_TOKENS`` (2,048) tokens: decode steps and the
mixed decode + prefill-chunk steps of continuous batching, for all seven projections (q, k,
v, o as free reshapes of their stacks). Bigger prefill steps keep XLA's matmul, where the
copy is paid once for thousands of tokens (measured on an H100, ``scripts/bench_gpu.py
--only matmul``, a Llama-3-8B layer's projections, kernel vs XLA: with the token tiles
first, 747 vs 991 us at 1,024 tokens and 1,411 vs 1,654 us at 2,048; the columns-first
launch before lost at 2,048, 1,729 vs 1,589 us).

On CPU the kernel runs in the Pallas interpreter (tests only).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jaxtyping import Array, Float, Int

from jaxpaged.pallas import common


def _kernel(
    layer_ref,  # [1] int32, whole
    x_ref,  # [block_t, K]
    *refs,  # the weight stacks [L, K, N_g], whole, then o_ref [block_t, block_n]: this
    # split's partial sums (float32) or, unsplit, the output
    block_k: int,
    k_per_split: int,
    tile_starts: tuple[int, ...],  # first output tile of each weight, then the total
    n_axis: int,  # the grid axis of the output column tiles (0, or 1 with the token tiles first)
):
    *w_refs, o_ref = refs
    j = pl.program_id(n_axis)
    k_start = pl.program_id(2) * k_per_split
    block_t = x_ref.shape[0]
    block_n = o_ref.shape[-1]
    layer = layer_ref[0]

    def product(w_ref, col):
        def body(kk, acc):
            k0 = k_start + kk * block_k
            x = x_ref[:, pl.ds(k0, block_k)]
            w = w_ref[layer, pl.ds(k0, block_k), pl.ds(col, block_n)]
            return acc + lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=common.dot_precision(w.dtype),
                                         preferred_element_type=jnp.float32)

        acc = lax.fori_loop(0, k_per_split // block_k, body, jnp.zeros((block_t, block_n), jnp.float32))
        o_ref[...] = acc.astype(o_ref.dtype)

    if len(w_refs) == 1:
        product(w_refs[0], j * block_n)
        return
    for w_ref, lo, hi in zip(w_refs, tile_starts, tile_starts[1:]):  # the weight this output tile comes from
        pl.when((j >= lo) & (j < hi))(functools.partial(product, w_ref, (j - lo) * block_n))


def _largest_power_of_2_dividing(n: int, cap: int) -> int:
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


# Programs a launch of several token tiles should have: about one wave over a Hopper
# GPU's 132 multiprocessors (default_config widens block_n only while it keeps them).
WAVE_PROGRAMS = 128


def default_config(T: int, K: int, N: int) -> tuple[tuple[int, int, int], int, int]:
    """``((block_t, block_n, block_k), num_warps, num_stages)`` for ``[T, K] x [K, N]``.

    Tiles are powers of two >= 16 (Triton's dot) that divide N and K. T <= 64 runs best as
    one token tile with narrow, deep tiles (an H100, Llama-3-8B's MLP at 64 tokens: 47 us,
    2.5 TB/s of weights); split-K (:func:`default_splits`) fills the GPU there.

    Past 64 tokens: 128-token tiles, 8 warps, and the widest ``block_n`` of 256, 128 and 64
    that still gives :data:`WAVE_PROGRAMS` programs (wide tiles reuse each loaded weight
    tile over more outputs; too few programs leave multiprocessors idle); ``block_k`` 64
    beside 256-wide tiles, 128 beside 64-wide ones and where K > N (``down``). From a
    sweep on an H100 (``bench_gpu.py --only matmul --matmul-sweep``, Llama-3-8B's grouped
    projections, both launch orders): at 256, 512 and 1,024 tokens a layer's four launches
    take 305 / 448 / 747 us with this rule's tiles, within 1-2% of the layer made of each
    projection's fastest swept tiles (301 / 438 / 736; no projection more than 16% off), against
    374 / 582 / 1,128 us with the tiles used before (4 warps and 128 x 64 everywhere but
    ``down``, launched columns-first) and 991 us for XLA's slice-then-matmul at 1,024.
    """
    bt = min(128, max(16, common.next_power_of_2(T)))
    if bt <= 64:
        bn, bk, warps, stages = 64, 128, 4, 3
    else:
        token_tiles = -(-T // bt)
        bn = next((b for b in (256, 128) if (N // b) * token_tiles >= WAVE_PROGRAMS), 64)
        bk = 64 if bn == 256 else 128 if bn == 64 or K > N else 64
        warps, stages = 8, 4 if bn == 64 else 3
    return (bt, _largest_power_of_2_dividing(N, bn), _largest_power_of_2_dividing(K, bk)), warps, stages


# Whether stacked_matmul picks a split-K factor itself (default_splits); scripts/bench_gpu.py
# turns it off to measure the unsplit kernel in the engine.
SPLIT_K = True
# Programs a launch should offer to fill a Hopper GPU's 132 multiprocessors about twice over.
TARGET_PROGRAMS = 264


def default_splits(T: int, K: int, N: int, blocks: tuple[int, int, int]) -> int:
    """Split-K factor for ``[T, K] x [K, N]`` with ``blocks``. Steps of one token tile
    (``T <= 64``: decode steps) only: the largest power of two that keeps the launch at or
    under :data:`TARGET_PROGRAMS` programs, each program at least 4 ``block_k`` steps of K
    (Triton pipelines the loop), and the float32 partials at most a quarter of the weight
    bytes they stand beside (``2 * splits * T <= K / 4``).

    Few tokens and narrow outputs leave the unsplit kernel a handful of programs, each bound
    by its sequential walk over K rather than by bandwidth: Llama-3-8B's k/v at 16 tokens
    are 16 output tiles of 64 (16 of 132 multiprocessors busy), q/o and down 64. This gives
    them 8, 4 and 4 splits; gate/up (224 tiles) stay whole. Measured on an H200
    (``bench_gpu.py --only matmul``, us, split vs unsplit): k/v 34 vs 40, down 44 vs 65,
    q/o 34 vs 33; at 128 tokens splitting gained nothing over a layer (387 vs 393 us).
    """
    bt, bn, bk = blocks
    if T > 64:
        return 1
    programs = (N // bn) * -(-T // bt)
    s = 1
    while (programs * s * 2 <= TARGET_PROGRAMS and K % (s * 2 * bk) == 0 and K // (s * 2 * bk) >= 4
           and 2 * (s * 2) * T * 4 <= K):
        s *= 2
    return s


def default_tokens_fastest(T: int, K: int, N: int, blocks: tuple[int, int, int]) -> bool:
    """Whether ``[T, K] x [K, N]`` with ``blocks`` launches its token tiles fastest (see the
    module's docstring): whenever there is more than one. Measured on an H100 (Llama-3-8B's
    gate/up, 128 x 256 x 64 tiles, 8 warps): 134 vs 183 us at 256 tokens, 230 vs 340 at
    512, 399 vs 629 at 1,024, where XLA's slice-then-matmul takes 512 (its 235 MB of weights
    no longer leave HBM once per token tile). The narrow projections (q/k/v, o), whose
    weights mostly fit in L2, went either way by tile (-24 to +31 us at 256-512 tokens, in
    times near the host's per-call dispatch), so the rule is the wide ones'."""
    return -(-T // blocks[0]) > 1


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
    splits: int | None = None,
    tokens_fastest: bool | None = None,
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
        outputs the unsplit kernel has few programs (Llama-3-8B's k/v: 16 output tiles of
        64 for 132 multiprocessors), each walking all of K in sequence. Default:
        :func:`default_splits` (1 in the interpreter, where splitting only adds work).
      tokens_fastest: launch the token tiles of an output column side by side rather than
        the output columns of a token tile. Default: :func:`default_tokens_fastest`.
    """
    return grouped_stacked_matmul(x, (w,), layer, blocks=blocks, interpret=interpret, num_warps=num_warps,
                                  num_stages=num_stages, splits=splits, tokens_fastest=tokens_fastest)[0]


def grouped_stacked_matmul(
    x: Float[Array, "T K"],
    ws: tuple[Float[Array, "L K _"], ...],
    layer: Int[Array, ""] | int,
    *,
    blocks: tuple[int, int, int] | None = None,
    interpret: bool | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int | None = None,
    tokens_fastest: bool | None = None,
) -> tuple[Float[Array, "T _"], ...]:
    """``tuple(x @ w[layer] for w in ws)`` in one launch: the products of one input with
    several stacks (a layer's q, k and v; gate and up), as one matmul over their
    concatenated outputs would give, without concatenating the weights. Each program finds
    the stack its output tile comes from. One launch instead of three, and the narrow
    ones (k, v) no longer leave the GPU short of programs on their own. Arguments as
    :func:`stacked_matmul`; tiles from the summed width, ``block_n`` dividing every one.
    """
    if x.ndim != 2 or not ws or any(w.ndim != 3 or w.shape[:2] != ws[0].shape[:2] for w in ws) \
            or x.shape[1] != ws[0].shape[1]:
        raise ValueError(f"stacked_matmul: x {x.shape} and w {', '.join(str(w.shape) for w in ws)} must be "
                         "[T, K] and [L, K, N] with one L and K")
    for w in ws:
        if x.dtype != w.dtype:
            raise ValueError(f"stacked_matmul: x is {x.dtype}, w is {w.dtype}; expected one dtype")
    interpret = common.default_interpret() if interpret is None else interpret
    auto = grouped_config(*x.shape, tuple(w.shape[2] for w in ws), blocks=blocks, interpret=interpret)
    return _stacked_matmul(x, tuple(ws), jnp.asarray(layer, jnp.int32).reshape(1), blocks=auto.blocks,
                           interpret=interpret, num_warps=num_warps or auto.num_warps,
                           num_stages=num_stages or auto.num_stages,
                           splits=auto.splits if splits is None else splits,
                           tokens_fastest=auto.tokens_fastest if tokens_fastest is None else tokens_fastest)


class MatmulConfig(NamedTuple):
    """How one stacked matmul launches: tiles ``(block_t, block_n, block_k)``, Triton's
    warps and pipeline stages, split-K factor, launch order."""
    blocks: tuple[int, int, int]
    num_warps: int
    num_stages: int
    splits: int
    tokens_fastest: bool


def grouped_config(T: int, K: int, widths: tuple[int, ...], *, blocks: tuple[int, int, int] | None = None,
                   interpret: bool = False) -> MatmulConfig:
    """The configuration :func:`grouped_stacked_matmul` runs ``[T, K]`` against stacks of
    these output widths with by default: :func:`default_config` for the summed width,
    ``block_n`` narrowed to divide every width, :func:`default_splits` (``blocks`` given:
    the splits for those; 1 in the interpreter) and :func:`default_tokens_fastest`."""
    (bt, bn, bk), warps, stages = default_config(T, K, sum(widths))
    blocks = blocks or (bt, _largest_power_of_2_dividing(math.gcd(*widths), bn), bk)
    splits = 1 if interpret or not SPLIT_K else default_splits(T, K, sum(widths), blocks)
    return MatmulConfig(blocks, warps, stages, splits, default_tokens_fastest(T, K, sum(widths), blocks))


@functools.partial(jax.jit, static_argnames=("blocks", "interpret", "num_warps", "num_stages", "splits",
                                             "tokens_fastest"))
def _stacked_matmul(x, ws, layer, *, blocks, interpret, num_warps, num_stages, splits, tokens_fastest):
    T, K = x.shape
    widths = [w.shape[2] for w in ws]
    N = sum(widths)
    bt, bn, bk = blocks
    if splits < 1 or K % (splits * bk):
        raise ValueError(f"stacked_matmul: splits={splits} x block_k={bk} does not divide K={K}")
    for name, b, n in (*(("block_n", bn, n) for n in widths), ("block_k", bk, K)):
        if n % b:
            raise ValueError(f"stacked_matmul: {name}={b} does not divide {n}")
        if not interpret and (b & (b - 1) or b < 16):
            raise ValueError(f"stacked_matmul: {name}={b} must be a power of two >= 16 on GPU")
    Tp = pl.cdiv(T, bt) * bt
    xp = jnp.pad(x, ((0, Tp - T), (0, 0))) if Tp != T else x
    # Index maps take (column tile j, token tile i, split s) whatever the launch order.
    if tokens_fastest:
        grid, order = (Tp // bt, N // bn, splits), (lambda f: lambda i, j, s: f(j, i, s))
    else:
        grid, order = (N // bn, Tp // bt, splits), (lambda f: f)
    if splits == 1:  # the output directly, in the activations' dtype
        out_shape = jax.ShapeDtypeStruct((Tp, N), x.dtype)
        out_spec = pl.BlockSpec((bt, bn), order(lambda j, i, s: (i, j)))
    else:  # float32 partial sums per split, added below
        out_shape = jax.ShapeDtypeStruct((splits, Tp, N), jnp.float32)
        out_spec = pl.BlockSpec((None, bt, bn), order(lambda j, i, s: (s, i, j)))
    tile_starts = tuple(int(t) for t in np.cumsum([0, *widths]) // bn)
    out = pl.pallas_call(
        functools.partial(_kernel, block_k=bk, k_per_split=K // splits, tile_starts=tile_starts,
                          n_axis=1 if tokens_fastest else 0),
        grid=grid,
        in_specs=[
            pl.BlockSpec(),  # layer
            pl.BlockSpec((bt, K), order(lambda j, i, s: (i, 0))),  # x
            *(pl.BlockSpec() for _ in ws),  # the whole stacks
        ],
        out_specs=out_spec,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=None if interpret else plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"stacked_matmul_t{bt}_n{bn}_k{bk}" + (f"_g{len(ws)}" if len(ws) > 1 else "")
        + (f"_s{splits}" if splits > 1 else "") + ("_tf" if tokens_fastest else ""),
    )(layer, xp, *ws)
    if splits > 1:
        out = out.sum(axis=0).astype(x.dtype)
    out = out[:T] if Tp != T else out
    if len(ws) == 1:
        return (out,)
    return tuple(out[:, a:b] for a, b in zip(np.cumsum([0, *widths[:-1]]), np.cumsum(widths)))
