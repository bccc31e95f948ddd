"""Mosaic GPU (Hopper) matmul against one layer of stacked ``[L, K, N]`` weights, read in place.

The same contract as :func:`jaxpaged.pallas.stacked_matmul.grouped_stacked_matmul` (``x @
w[layer]`` for one or several stacks of one input, without materialising ``w[layer]``),
written for Pallas' Mosaic GPU backend instead of Triton: the tensor cores through
``wgmma``, tiles brought into shared memory by the TMA engine, and a warp-specialized
pipeline (one warpgroup issues the copies, two compute). jax 0.11 deprecates the Triton
backend every other GPU kernel here uses; this is the first kernel on its successor, for
the steps where the Triton matmul is compute-bound and short of the tensor cores' rate
(Llama-3-8B's layer at 256-1,024 tokens: 366-598 TFLOP/s on an H100, 24th session).

Layout: a persistent kernel, one program per multiprocessor walking the output tiles
(``plgpu.nd_loop``). A tile is ``tile_m`` tokens by ``2 * tile_n`` columns, each compute
warpgroup taking ``tile_n`` of them; the tiles are visited token tile first, so the
programs running side by side share one weight column tile (read from HBM about once,
the activations from L2), as the Triton kernel's ``tokens_fastest`` launch does. The
layer index is read inside the kernel and offsets the weight ref (``w.at[layer]``), so
the TMA copies read the layer's tiles where they lie. With several stacks, each output
column tile picks its stack (``pl.when``), as the grouped Triton kernel does.

Constraints: bfloat16 or float16 (``wgmma`` has no IEEE float32); ``K`` a multiple of
``tile_k`` and every width a multiple of ``2 * tile_n``; tokens padded to ``tile_m``
inside. :func:`supports` says whether a shape fits. On CPU the kernel runs in Mosaic GPU's
interpret mode (tests only: it simulates the TMA, barriers and ``wgmma``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int


class MosaicMatmulConfig(NamedTuple):
    """Tiles of :func:`mosaic_grouped_stacked_matmul`: ``tile_m`` tokens by ``2 * tile_n``
    columns a program (two compute warpgroups), ``tile_k`` deep per pipeline step,
    ``max_concurrent_steps`` steps in flight, and the epilogue's ``epi_m x epi_n`` stores.
    The default is jax's Hopper matmul example's tile (128 x 256 a program, 64 deep, 4
    stages: 192 KB of shared memory for the operands)."""
    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    epi_m: int = 64
    epi_n: int = 64


DEFAULT_CONFIG = MosaicMatmulConfig()
# Smaller tiles, tried in this order when the default leaves multiprocessors idle: at 256
# tokens Llama-3-8B's o and down projections (4,096 wide) are 32 tiles of 128 x 256 for
# 132 multiprocessors.
SMALLER_CONFIGS = (MosaicMatmulConfig(tile_n=64), MosaicMatmulConfig(tile_m=64),
                   MosaicMatmulConfig(tile_m=64, tile_n=64))
# Programs when no GPU can say how many multiprocessors it has (tracing the CUDA branch on
# CPU, lowering for "cuda" without a GPU): a Hopper GPU's 132.
DEFAULT_NUM_SMS = 132
# Programs in interpret mode, which simulates each one: few keep the tests fast.
INTERPRET_NUM_SMS = 2


def supports(K: int, widths: tuple[int, ...], dtype, config: MosaicMatmulConfig = DEFAULT_CONFIG) -> bool:
    """Whether ``[T, K] x [K, N]`` for these output widths fits the kernel's tiles and dtype."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and K % config.tile_k == 0
            and widths_fit(widths, config))


def widths_fit(widths: tuple[int, ...], config: MosaicMatmulConfig) -> bool:
    """Whether every output width is a whole number of ``config``'s column tiles."""
    return all(n % (2 * config.tile_n) == 0 for n in widths)


def check_config(config: MosaicMatmulConfig) -> None:
    """Raise if ``config``'s tiles do not fit together (wgmma takes 64-row tiles per warpgroup)."""
    tm, tn, tk, steps, em, en = config
    if tm % 64 or tn % 8 or tk % 8 or steps < 1 or em <= 0 or en <= 0 or tm % em or tn % en:
        raise ValueError(f"mosaic stacked matmul: {config} does not fit: tile_m a multiple of 64, tile_n and "
                         "tile_k of 8, epi_m dividing tile_m and epi_n dividing tile_n, max_concurrent_steps >= 1")


def default_config(T: int, K: int, widths: tuple[int, ...], num_sms: int) -> MosaicMatmulConfig:
    """The default tile (:data:`DEFAULT_CONFIG`) where it gives every multiprocessor an output
    tile; else the first of :data:`SMALLER_CONFIGS` that does and fits the widths, else the
    one with the most tiles. Each program then walks at least one tile."""
    def tiles(c):
        return -(-T // c.tile_m) * (sum(widths) // (2 * c.tile_n))

    fits = [c for c in (DEFAULT_CONFIG, *SMALLER_CONFIGS) if widths_fit(widths, c)]
    return next((c for c in fits if tiles(c) >= num_sms), max(fits, key=tiles))


def _num_sms() -> int:
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        return dev.core_count
    abstract = jax.sharding.get_abstract_mesh().abstract_device
    return getattr(abstract, "num_cores", None) or DEFAULT_NUM_SMS


def _kernel(layer_gmem, x_gmem, *refs, config: MosaicMatmulConfig, tile_starts: tuple[int, ...], m_iters: int):
    w_gmems, o_gmems = refs[:len(refs) // 2], refs[len(refs) // 2:]  # one output per stack
    o_dtype = o_gmems[0].dtype
    tm, tn, tk = config.tile_m, config.tile_n, config.tile_k
    em, en = config.epi_m, config.epi_n
    cta_n = 2 * tn
    k_iters = x_gmem.shape[1] // tk
    n_iters = tile_starts[-1]
    itemsize = jnp.dtype(x_gmem.dtype).itemsize
    swizzle = plgpu.find_swizzle(tk * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))
    out_swizzle = plgpu.find_swizzle(en * itemsize * 8)
    out_transforms = (plgpu.TilingTransform((8, out_swizzle // itemsize)), plgpu.SwizzleTransform(out_swizzle))
    slots = min(2, (tm * tn) // (em * en))
    layer = layer_gmem[0]

    def pipeline(body, context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tm, tk), lambda k: (0, k), transforms=transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((tk, cta_n), lambda k: (k, 0), transforms=transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=context,
        )

    def ignore(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmems[0].at[layer]),
        out_smem=plgpu.SMEM((2, slots, em, en), o_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocations, out_smem):
        wg = lax.axis_index("wg")
        wg_cols = pl.ds(wg * tn, tn)

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def _tiles(info: plgpu.NDLoopInfo):
            (t,) = info.index
            mi, ni = lax.rem(t, m_iters), lax.div(t, m_iters)  # token tiles fastest: one weight tile at a time
            rows = pl.ds(mi * tm, tm)

            def context(run, o_gmem, col):  # col: the column tile within o_gmem's stack
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                def _acc(acc_ref):
                    run(acc_ref)
                    acc = acc_ref[...].astype(o_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last tile's stores read out_smem
                    for i in range(tm // em):
                        for j in range(tn // en):
                            slot = (i * (tn // en) + j) % slots
                            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
                            out_smem[wg, slot] = acc[i * em:(i + 1) * em, j * en:(j + 1) * en]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg, slot],
                                o_gmem.at[rows, pl.ds(col * cta_n, cta_n)].at[:, wg_cols]
                                .at[pl.ds(i * em, em), pl.ds(j * en, en)])

            def mma(_, x_smem, w_smem, acc_ref):
                plgpu.wgmma(acc_ref, x_smem, w_smem.at[:, wg_cols])
                plgpu.wgmma_wait(0)
                return acc_ref

            for w_gmem, o_gmem, lo, hi in zip(w_gmems, o_gmems, tile_starts, tile_starts[1:]):
                def run(w_gmem=w_gmem, o_gmem=o_gmem, lo=lo):
                    col = ni - lo
                    pipeline(mma, functools.partial(context, o_gmem=o_gmem, col=col))(
                        x_gmem.at[rows, :], w_gmem.at[layer].at[:, pl.ds(col * cta_n, cta_n)],
                        allocations=allocations)

                if len(w_gmems) == 1:
                    run()
                else:  # the stack this column tile comes from
                    pl.when((ni >= lo) & (ni < hi))(run)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def mosaic_grouped_stacked_matmul(
    x: Float[Array, "T K"],
    ws: tuple[Float[Array, "L K _"], ...],
    layer: Int[Array, ""] | int,
    *,
    config: MosaicMatmulConfig | None = None,
    interpret: bool = False,
) -> tuple[Float[Array, "T _"], ...]:
    """``tuple(x @ w[layer] for w in ws)`` in one launch of the Mosaic GPU kernel (see the
    module's docstring); ``interpret`` runs it in Mosaic GPU's interpreter (CPU tests)."""
    if x.ndim != 2 or not ws or any(w.ndim != 3 or w.shape[:2] != ws[0].shape[:2] for w in ws) \
            or x.shape[1] != ws[0].shape[1]:
        raise ValueError(f"mosaic stacked matmul: x {x.shape} and w {', '.join(str(w.shape) for w in ws)} must be "
                         "[T, K] and [L, K, N] with one L and K")
    if any(w.dtype != x.dtype for w in ws):
        raise ValueError(f"mosaic stacked matmul: x is {x.dtype}, w {', '.join(str(w.dtype) for w in ws)}; "
                         "expected one dtype")
    widths = tuple(w.shape[2] for w in ws)
    num_sms = INTERPRET_NUM_SMS if interpret else _num_sms()
    if config is None and supports(x.shape[1], widths, x.dtype):
        config = default_config(x.shape[0], x.shape[1], widths, num_sms)
    config = config or DEFAULT_CONFIG
    check_config(config)
    if not supports(x.shape[1], widths, x.dtype, config):
        raise ValueError(f"mosaic stacked matmul: K={x.shape[1]} and widths {widths} in {x.dtype} do not fit tiles "
                         f"{config} (bf16/f16, K % tile_k == 0, widths % (2 * tile_n) == 0)")
    return _mosaic_stacked_matmul(x, tuple(ws), jnp.asarray(layer, jnp.int32).reshape(1), config=config,
                                  interpret=interpret, num_sms=num_sms)


@functools.partial(jax.jit, static_argnames=("config", "interpret", "num_sms"))
def _mosaic_stacked_matmul(x, ws, layer, *, config, interpret, num_sms):
    T, K = x.shape
    widths = [w.shape[2] for w in ws]
    cta_n = 2 * config.tile_n
    Tp = pl.cdiv(T, config.tile_m) * config.tile_m
    xp = jnp.pad(x, ((0, Tp - T), (0, 0))) if Tp != T else x
    tile_starts = tuple(int(t) for t in np.cumsum([0, *widths]) // cta_n)
    if interpret:  # Mosaic GPU's interpreter (a private module: imported only for CPU tests)
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
        interpret = InterpretGPUParams()
    kernel = plgpu.kernel(
        functools.partial(_kernel, config=config, tile_starts=tile_starts, m_iters=Tp // config.tile_m),
        out_type=tuple(jax.ShapeDtypeStruct((Tp, n), x.dtype) for n in widths),
        grid=(num_sms,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret or None,
    )
    return tuple(o[:T] if Tp != T else o for o in kernel(layer, xp, *ws))
