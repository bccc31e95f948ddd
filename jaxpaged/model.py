"""Llama in Flax NNX, run over the paged KV pool.

The model does not own the KV cache: ``Llama.__call__`` takes the pool and explicit
attention metadata and returns ``(logits, new_pool)``. Layers are stacked along a
leading axis and run with ``lax.scan`` so compile time does not grow with depth; the
pool is part of the scan carry, so each layer updates it in place.

Tokens of all sequences of a step are flattened along one axis ``T`` (no batch axis).
Letters in einsum strings: T tokens, D model dim, N query heads, K KV heads, H head dim,
F MLP dim, V vocabulary.

Under tensor parallelism (``mesh`` set, see :mod:`jaxpaged.sharding`) the same code runs
on sharded params: GSPMD partitions the projections, and the embedding lookup, the KV
write + paged attention, and the LM head go through the ``shard_map`` helpers there.
"""

from __future__ import annotations

import functools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxpaged import hugepages, sharding
from jaxpaged.attention import AttentionMetadata, paged_attention, resolve_backend
from jaxpaged.config import LinearRopeScaling, LlamaConfig, MoeConfig, YarnRopeScaling
from jaxpaged.kv_cache import KVPool, write_kv
from jaxpaged.pallas import moe_matmul
from jaxpaged.pallas.common import dot_precision, is_fp8_storage, kv_value_dtype
from jaxpaged.pallas.stacked_matmul import grouped_stacked_matmul, supports


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies of RoPE, scaled as the config says: Llama-3's frequency-dependent
    scaling, linear position interpolation, or YaRN (with :func:`rope_attention_factor`)."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = cfg.rope_scaling
    if isinstance(rs, LinearRopeScaling):
        inv_freq = inv_freq / rs.factor
    elif isinstance(rs, YarnRopeScaling):
        # The dimension whose frequency turns ``rotations`` times over the original context.
        def dim_of(rotations):
            return hd * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
                2 * math.log(cfg.rope_theta))

        low, high = dim_of(rs.beta_fast), dim_of(rs.beta_slow)
        if rs.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, hd - 1)
        # 0: the frequency as trained (it turns fast), 1: divided by the factor, linear between.
        ramp = np.clip((np.arange(hd // 2, dtype=np.float64) - low) / max(high - low, 1e-3), 0.0, 1.0)
        inv_freq = inv_freq * (1.0 - ramp) + inv_freq / rs.factor * ramp
    elif rs is not None:
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def rope_attention_factor(cfg: LlamaConfig) -> float:
    """What RoPE's cos and sin are multiplied by: YaRN's attention factor, else 1."""
    return cfg.rope_scaling.attention_factor if isinstance(cfg.rope_scaling, YarnRopeScaling) else 1.0


def apply_rope(x: Float[Array, "T N H"], positions: Int[Array, "T"], inv_freq: Float[Array, "H/2"],
               scale: float = 1.0):
    """Rotate-half RoPE (the Hugging Face Llama convention), computed in float32; ``scale``
    multiplies cos and sin (:func:`rope_attention_factor`)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, H/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def rms_norm(x, weight, eps: float):
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def _param(rngs: nnx.Rngs, shape, dtype, fan_in: int):
    return nnx.Param(jax.random.normal(rngs.params(), shape, dtype) / math.sqrt(fan_in))


# Steps of at most this many tokens (decode steps, the mixed decode + prefill-chunk steps
# of continuous batching, small prefills) read the layers' weights in place
# (stacked_matmul); bigger prefill steps keep XLA's matmul, where the per-layer weight copy
# is paid once for thousands of tokens. On an H100 the kernel beats XLA's
# slice-then-matmul on Llama-3-8B's layer at 2,048 tokens (1,411 vs 1,654 us); past that
# it is not measured.
STACKED_MAX_TOKENS = 2048
# q/k/v and gate/up as one launch each (grouped_stacked_matmul); scripts/bench_gpu.py turns
# it off to measure one launch per projection.
GROUPED_PROJECTIONS = True
# Which kernel reads the stacked weights for steps of more than MOSAIC_MIN_TOKENS tokens:
# "triton" (stacked_matmul), "mosaic" (stacked_matmul_mgpu: Mosaic GPU, wgmma and TMA on
# Hopper, where the shapes and dtype fit; Triton otherwise) or "auto" (Mosaic for the
# launches where an H100 measured it faster: stacks at least MOSAIC_AUTO_MIN_WIDTH wide, such
# as gate/up, and steps of at least MOSAIC_AUTO_MIN_TOKENS tokens). Decode-sized steps keep
# the Triton kernel's split-K, which reads the weights near the memory's rate. On an H100
# (27th session, Llama-3-8B's projections) Mosaic took 0.92-0.95x Triton's time on gate/up
# at 256-2,048 tokens and on every stack at 2,048, 1.06-1.14x on q/k/v and down below 2,048;
# the engine's one run each: 6,368 vs 6,306 output tok/s, within the noise. "triton" until
# an engine A/B says otherwise.
STACKED_KERNEL = "triton"
MOSAIC_MIN_TOKENS = 64
MOSAIC_AUTO_MIN_WIDTH = 16384
MOSAIC_AUTO_MIN_TOKENS = 2048


def _check_stacked_kernel() -> None:
    if STACKED_KERNEL not in ("triton", "mosaic", "auto"):
        raise ValueError(f"STACKED_KERNEL={STACKED_KERNEL!r}: 'triton', 'mosaic' or 'auto'")


def stacked_kernel_for(tokens: int, widths: tuple[int, ...]) -> str:
    """The kernel ``STACKED_KERNEL`` picks for a step of ``tokens`` tokens through one launch
    of stacks ``widths`` wide (before asking whether Mosaic supports the shapes)."""
    _check_stacked_kernel()
    if STACKED_KERNEL == "triton" or tokens <= MOSAIC_MIN_TOKENS:
        return "triton"
    if STACKED_KERNEL == "auto" and sum(widths) < MOSAIC_AUTO_MIN_WIDTH and tokens < MOSAIC_AUTO_MIN_TOKENS:
        return "triton"
    return "mosaic"


def _layer_matmuls(layers: nnx.Module, precision, *, stacked: bool):
    """``matmul(x, p, name, layer)``: ``x @ p.<name>`` inside the layer scan, contracting
    every axis of ``x`` after the first with the weight's leading axes (``"TD,DNH->TNH"``
    for the query projection, ``"TNH,NHD->TD"`` for the output one, ``"TD,DF->TF"`` ...);
    with a tuple of names, the tuple of those products.

    ``stacked``: lowered for CUDA, read the layer's weights straight out of the stacked
    ``[L, ...]`` arrays with :func:`~jaxpaged.pallas.stacked_matmul.grouped_stacked_matmul`
    (free reshapes to ``[L, K, N]``; q, k and v in one launch, gate and up in another).
    Under ``lax.scan`` XLA copies each layer's slice before a cuBLAS matmul: for the MLP
    9.7 ms of a 24.6 ms Llama-3-8B decode step on an H100. Triton runs it where it can tile
    the shapes; other platforms, and shapes it cannot tile, take the slices the scan made.
    """

    _check_stacked_kernel()  # read when a step is traced
    if STACKED_KERNEL != "triton":  # imported only when asked for (jax's Mosaic GPU modules: ~0.1 s)
        from jaxpaged.pallas import stacked_matmul_mgpu

    def dense(x, w):
        k = x.ndim - 1
        return jax.lax.dot_general(x, w, ((tuple(range(1, k + 1)), tuple(range(k))), ((), ())),
                                   precision=precision)

    def matmul(x, p, names: str | tuple[str, ...], layer):
        """One projection (``names`` a string) or several of the same input (a tuple: q, k,
        v; gate, up), one launch of the grouped kernel for all of them."""
        group = (names,) if isinstance(names, str) else names
        if len(group) > 1 and not GROUPED_PROJECTIONS:
            return tuple(matmul(x, p, name, layer) for name in group)
        sliced = [getattr(p, name)[...] for name in group]  # [*K, *N], this layer's slices, as the scan made them
        K = math.prod(x.shape[1:])
        outs = [w.shape[x.ndim - 1:] for w in sliced]
        # Every platform_dependent branch is traced: the kernel must accept the shapes and dtype.
        if not stacked or not all(supports(K, math.prod(o)) and x.dtype == w.dtype for o, w in zip(outs, sliced)):
            res = tuple(dense(x, w) for w in sliced)
            return res[0] if isinstance(names, str) else res
        ws = []
        for name, out in zip(group, outs):
            w = getattr(layers, name)[...]  # [L, *K, *N], the whole stack
            ws.append(w.reshape(w.shape[0], K, math.prod(out)))

        widths = tuple(math.prod(o) for o in outs)
        mosaic = (stacked_kernel_for(x.shape[0], widths) == "mosaic"
                  and stacked_matmul_mgpu.supports(K, widths, x.dtype))

        def kernel(x, ws, layer):
            impl = stacked_matmul_mgpu.mosaic_grouped_stacked_matmul if mosaic else grouped_stacked_matmul
            res = impl(x.reshape(x.shape[0], K), tuple(ws), layer, interpret=False)
            return tuple(r.reshape(x.shape[0], *out) for r, out in zip(res, outs))

        # Elsewhere the slices are used as before (and the unused stacks cost nothing).
        res = jax.lax.platform_dependent(x, ws, layer, cuda=kernel,
                                         default=lambda x, ws, layer: tuple(dense(x, w) for w in sliced))
        return res[0] if isinstance(names, str) else res

    return matmul


# One-token steps (single-stream decode) split the contraction of the CPU form's
# ``[in, out]`` projections into this many row blocks of the weight, a batched
# matrix-vector product.
SPLIT_K_ONE_TOKEN = 4

# One-token products over ``[out, in]`` weights of at most this many elements run as a batch of
# two half-products (see _cpu_dot): XLA:CPU (jax 0.10.2) runs a matrix-vector product of fewer
# elements on one thread, a batched one on both.
ONE_THREAD_MATVEC_MAX = 1 << 19

# Steps of 2 to this many tokens multiply an ``[out, in]`` weight with more inputs than outputs
# (the MLP's down projection) as a batch of its two row halves (see _cpu_dot).
TALL_HALVES_MAX_ROWS = 32

# The CPU form's weight layouts (see choose_cpu_layout).
CPU_LAYOUTS = ("in_out", "out_in")


def _cpu_dot(x: Float[Array, "T K"], w: Float[Array, "K N"] | Float[Array, "N K"], *, out_in: bool = False,
             precision) -> Float[Array, "T N"]:
    """``x @ w`` for the CPU form's weights, ``[in, out]`` or (``out_in``) ``[out, in]``.

    With one token and ``[in, out]`` weights it is a matrix-vector product, bound by reading
    ``w``. XLA:CPU splits a plain one's output columns between its threads, so each thread
    reads part of every row: strided, at ~36 GB/s on a 2-vCPU AMD EPYC whatever the memory
    does. Splitting the contraction into :data:`SPLIT_K_ONE_TOKEN` blocks of whole rows (a
    batched product of ``[1, K/s] x [K/s, N]``, then a sum) gives each thread contiguous
    blocks, and the read follows the memory's bandwidth: the default model's layer matmuls
    0.73-0.90x the time (the same process, alternating). With more tokens the batched form
    is slower (2 tokens 1.16-1.33x): a plain dot. ``[out, in]`` weights take the plain
    product at every size (their rows are contiguous already), except that a small one
    (at most :data:`ONE_THREAD_MATVEC_MAX` elements) at one token is computed as a batch of its
    two row halves: XLA:CPU runs a matrix-vector product of fewer than ~2^19 elements on one
    thread (~13 GB/s on a 2-vCPU Intel Xeon, against 21-25 GB/s for the bigger ones it splits
    between its threads: 576 x 576 to 896 x 576 measured; 960 x 576 is split), and a batch of
    two on both (576 x 576: 98 -> 65 us). Each output is the same sum either way. For the
    default model that is the attention output projection, and the batch-1 forward took 0.91x
    the time at context 170 (0.945x at 400; alternating in one process, bit-identical logits).
    A step of 2 to :data:`TALL_HALVES_MAX_ROWS` tokens takes the same two-halves form for an
    ``[out, in]`` weight with more inputs than outputs (the down projection, ``[576, 1536]`` in
    the default model): YNNPACK's product of a few rows reads such a weight at ~8 GB/s, the
    batch of two halves at ~19 (30 layers at 8 rows: 12.2 vs 5.5 ms); the default model's decode
    forward on a 2-vCPU Intel Xeon, alternating in one process, took 0.89x the time at 2 and 4
    rows, 0.93-0.95x at 8, 0.97x at 12 to 32, the same at 48 (and at 2 rows 1.03x when the other
    three projections were split too, so only tall weights are). The split contraction changes
    float32 rounding (~1e-7 relative): a row's logits alone and in a batch differ in their last
    bits, as between batch sizes.
    """
    if x.dtype != w.dtype:  # 16-bit weights under float32 activations: the CPU form of a 16-bit model
        return _cpu_dot_16bit(x, w, out_in=out_in)
    if out_in:
        N, K = w.shape
        T = x.shape[0]
        small_matvec = T == 1 and N * K <= ONE_THREAD_MATVEC_MAX
        few_rows_tall = 2 <= T <= TALL_HALVES_MAX_ROWS and K > N
        if N % 2 == 0 and (small_matvec or few_rows_tall):
            y = jax.lax.dot_general(jnp.broadcast_to(x, (2, T, K)), w.reshape(2, N // 2, K),
                                    (((2,), (2,)), ((0,), (0,))), precision=precision)  # [2, T, N/2]
            return y.transpose(1, 0, 2).reshape(T, N)
        return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), precision=precision)
    s = SPLIT_K_ONE_TOKEN
    K, N = w.shape
    if x.shape[0] != 1 or K % s:
        return jnp.dot(x, w, precision=precision)
    y = jax.lax.dot_general(x.reshape(s, 1, K // s), w.reshape(s, K // s, N), (((2,), (1,)), ((0,), (0,))),
                            precision=precision, preferred_element_type=jnp.float32)  # [s, 1, N]
    return y.sum(axis=0).astype(x.dtype)  # partials summed in float32, rounded once (bf16 weights)


# XLA:CPU multiplies 16-bit operands fast only as matrix products (YNNPACK's AMX / AVX512-BF16
# kernels); a product of fewer rows falls back to a slow loop, so those are padded to this many.
MIN_ROWS_16BIT = 32
# Up to this many tokens, ``[out, in]`` 16-bit weights are the product's left side instead (``W @
# x^T``, the tokens padded to 8 columns). Measured, not understood: with as many tokens as
# columns XLA folds the transpose back into a plain product of 8 rows, which some graphs run
# 7x slower; below 8 the form held in every graph tried.
WEIGHT_LHS_MAX_ROWS_16BIT = 7


def _cpu_dot_16bit(x: Float[Array, "T K"], w, *, out_in: bool) -> Float[Array, "T N"]:
    """``x @ w`` for 16-bit weights ``w`` and float32 ``x``: ``x`` rounded to ``w``'s dtype, the
    products accumulated in float32; steps of fewer than :data:`MIN_ROWS_16BIT` tokens padded,
    or, with ``[out, in]`` weights and at most :data:`WEIGHT_LHS_MAX_ROWS_16BIT` tokens,
    computed as ``(w @ x^T)^T`` (the same sums; the same greedy tokens in the engine).

    The CPU form of a 16-bit model (:meth:`Llama.unstacked`) keeps its activations, norms,
    residual stream, K/V and logits in float32 and rounds only the matmuls' inputs. On a
    2-vCPU Intel Xeon (Emerald Rapids, AMX), the default model's projections over 30 layers,
    bfloat16 against float32 (``[out, in]``): 41 vs 107 ms at 48 tokens, 168 vs 529 at 512;
    one token 17.9 ms as ``w @ x^T`` (8 columns), 28.5-29.3 padded to 32 rows, 135
    unpadded (XLA's own bfloat16 loop), 23.4-24.5 in float32; 4 tokens 15.4 / 25.0 / 36.1
    (``w @ x^T`` / 32 rows / float32). Over 16 layers, one token: 7.2 ms as ``w @ x^T``, 9.4
    / 10.4 / 11.9 padded to 8 / 16 / 32 rows (4 tokens: 6.8 vs 9.2 / 9.5 / 10.3). The tied
    LM head at one token: 2.0 vs 3.2 ms. Widening the weights to float32 at use instead
    (``astype``, or integer shifts of their bits) took 115-130 ms at one token.
    """
    T = x.shape[0]
    xw = x.astype(w.dtype)
    if out_in and T <= WEIGHT_LHS_MAX_ROWS_16BIT:
        xw = jnp.pad(xw, ((0, 8 - T), (0, 0)))
        yt = jax.lax.dot_general(w, xw, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return yt[:, :T].T
    if T < MIN_ROWS_16BIT:
        xw = jnp.pad(xw, ((0, MIN_ROWS_16BIT - T), (0, 0)))
    contract = ((1,), (1,)) if out_in else ((1,), (0,))
    return jax.lax.dot_general(xw, w, (contract, ((), ())), preferred_element_type=jnp.float32)[:T]


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        D, N, K, H, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
        self.input_norm = nnx.Param(jnp.ones((D,), dtype))
        self.wq = _param(rngs, (D, N, H), dtype, D)
        self.wk = _param(rngs, (D, K, H), dtype, D)
        self.wv = _param(rngs, (D, K, H), dtype, D)
        self.wo = _param(rngs, (N, H, D), dtype, N * H)
        self.post_attn_norm = nnx.Param(jnp.ones((D,), dtype))
        if (moe := cfg.moe) is None:
            self.w_gate = _param(rngs, (D, F), dtype, D)
            self.w_up = _param(rngs, (D, F), dtype, D)
            self.w_down = _param(rngs, (F, D), dtype, F)
        else:  # Mixtral, Qwen-MoE: the router and the experts (see moe_mlp)
            E, Fe = moe.num_experts, moe.intermediate_size
            self.router = _param(rngs, (D, E), dtype, D)
            self.we_gate = _param(rngs, (E, D, Fe), dtype, D)
            self.we_up = _param(rngs, (E, D, Fe), dtype, D)
            self.we_down = _param(rngs, (E, Fe, D), dtype, Fe)
            if Fs := moe.shared_intermediate_size:  # Qwen2-MoE's shared expert and its gate
                self.ws_gate = _param(rngs, (D, Fs), dtype, D)
                self.ws_up = _param(rngs, (D, Fs), dtype, D)
                self.ws_down = _param(rngs, (Fs, D), dtype, Fs)
                self.ws_router = _param(rngs, (D,), dtype, D)
        if cfg.qkv_bias:  # Qwen2
            self.bq = nnx.Param(jnp.zeros((N, H), dtype))
            self.bk = nnx.Param(jnp.zeros((K, H), dtype))
            self.bv = nnx.Param(jnp.zeros((K, H), dtype))
        if cfg.qk_norm:  # Qwen3
            self.q_norm = nnx.Param(jnp.ones((H,), dtype))
            self.k_norm = nnx.Param(jnp.ones((H,), dtype))


# How moe_mlp runs the experts.
MOE_IMPLS = ("grouped", "per_expert", "pallas")


def moe_mlp(h: Float[Array, "T D"], p, moe: MoeConfig, precision, *, experts: str = "grouped",
            stacks: tuple | None = None, layer=None, interpret: bool | None = None, out_in: bool = False,
            mesh: Mesh | None = None) -> Float[Array, "T D"]:
    """A mixture-of-experts layer's MLP output for inputs ``h``: ``p`` holds this layer's
    ``router`` ``[D, E]``, ``we_gate`` and ``we_up`` ``[E, D, F]``, ``we_down`` ``[E, F, D]``
    and, with a shared expert, ``ws_gate``, ``ws_up`` ``[D, Fs]``, ``ws_down`` ``[Fs, D]``,
    ``ws_router`` ``[D]`` (Qwen2-MoE).

    Routing follows Hugging Face's Mixtral and Qwen-MoE: a float32 softmax over the router's
    logits, the ``top_k`` largest (renormalised if ``moe.norm_topk_prob``). ``experts`` picks
    how the (token, expert) pairs run:

    - ``"grouped"``: the pairs sorted by expert through :func:`jax.lax.ragged_dot`, a grouped
      matmul that XLA runs natively on TPU (the stacked form's path; jax's CPU lowering
      expands it into every expert for every pair);
    - ``"pallas"``: the Triton kernel of :mod:`jaxpaged.pallas.moe_matmul` over ``stacks``
      (the whole ``[L, E, ...]`` ``we_gate``, ``we_up``, ``we_down``), read in place at
      ``layer`` (the stacked form's GPU path; ``interpret``: the Pallas interpreter, tests);
    - ``"per_expert"``: the CPU form's path (:func:`_experts_in_chunks`), over each expert's
      own arrays ``we_gate_up_{e}`` ``[D, 2F]`` and ``we_down_{e}`` ``[F, D]`` in ``p`` and the
      shared expert's ``ws_gate_up`` and ``ws_down`` (``out_in``: transposed, as the CPU form's
      layout has them; products by :func:`_cpu_dot`).

    Each token's ``top_k`` outputs are summed in float32, in rank order, on every path.

    ``mesh``: under tensor parallelism the experts' (and shared expert's) MLP width is
    sharded over ``"tp"``; each device runs its slice of every expert inside ``shard_map``
    and one all-reduce sums the partial outputs (one per layer, as for a dense MLP).
    """
    if experts not in MOE_IMPLS:
        raise ValueError(f"experts={experts!r}: choose from {MOE_IMPLS}")
    E = moe.num_experts
    routed = (tuple(f"we_gate_up_{e}" for e in range(E)) + tuple(f"we_down_{e}" for e in range(E))
              if experts == "per_expert" else ("we_gate", "we_up", "we_down"))
    shared = () if not moe.shared_intermediate_size else ("ws_gate_up", "ws_down", "ws_router") if (
        experts == "per_expert") else ("ws_gate", "ws_up", "ws_down", "ws_router")
    names = ("router",) + routed + shared
    cpu_dot = functools.partial(_cpu_dot, out_in=out_in, precision=precision)
    weights = tuple(getattr(p, n)[...] for n in names)

    def local(h, *weights):
        w = dict(zip(names, weights))
        T, k = h.shape[0], moe.top_k
        # The logits rounded to the model's dtype, as transformers' and vLLM's routers have them.
        logits = jax.lax.dot_general(h, w["router"], (((1,), (0,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32).astype(w["router"].dtype)
        # The softmax in float32 (transformers', vLLM's): in bfloat16, experts whose probabilities differ
        # by less than its ~0.4% step tie, and top_k takes the lower index of the two.
        probs, chosen = jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), k)  # [T, k], largest first
        if moe.norm_topk_prob:
            probs = probs / probs.sum(axis=-1, keepdims=True)
        flat = chosen.reshape(-1)  # pair t * k + j: token t's j-th expert
        if experts == "per_expert":
            y = _experts_in_chunks(h, flat, k, [(w[f"we_gate_up_{e}"], w[f"we_down_{e}"]) for e in range(E)], cpu_dot)
        elif experts == "pallas":
            plan = moe_matmul.align_to_tiles(flat, E, moe_matmul.default_block_t(T * k, E))
            xs = jnp.where((plan.rows < T * k)[:, None], h[jnp.minimum(plan.rows, T * k - 1) // k], 0)
            g, u, d = stacks
            mm = functools.partial(moe_matmul.moe_matmul, layer=layer, tile_expert=plan.tile_expert,
                                   interpret=interpret)
            y = mm(jax.nn.silu(mm(xs, g)) * mm(xs, u), d)[plan.slot]  # back in pair order
        else:
            order = jnp.argsort(flat, stable=True)  # the pairs grouped by expert
            sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
            xs = h[order // k]
            g = jax.lax.ragged_dot(xs, w["we_gate"], sizes, precision=precision)
            u = jax.lax.ragged_dot(xs, w["we_up"], sizes, precision=precision)
            y = jax.lax.ragged_dot(jax.nn.silu(g) * u, w["we_down"], sizes, precision=precision)
            y = jnp.zeros_like(y).at[order].set(y, unique_indices=True)  # back in pair order
        out = (y.astype(jnp.float32).reshape(T, k, -1) * probs[:, :, None]).sum(axis=1)
        if moe.shared_intermediate_size:
            if experts == "per_expert":  # the CPU form's: gate and up fused, in its layout
                g, u = jnp.split(cpu_dot(h, w["ws_gate_up"]), 2, axis=1)
                shared = cpu_dot(jax.nn.silu(g) * u, w["ws_down"])
            else:
                g, u = (jnp.dot(h, w[n], precision=precision) for n in ("ws_gate", "ws_up"))
                shared = jnp.dot(jax.nn.silu(g) * u, w["ws_down"], precision=precision)
            gate = jax.nn.sigmoid(jnp.dot(h, w["ws_router"].astype(h.dtype), precision=precision).astype(jnp.float32))
            out = out + shared.astype(jnp.float32) * gate[:, None]
        if mesh is not None:
            out = jax.lax.psum(out, sharding.TP)
        return out.astype(h.dtype)

    if mesh is None:
        return local(h, *weights)
    if experts == "pallas":
        raise ValueError("moe_mlp: experts='pallas' runs on one device")
    specs = tuple(sharding.moe_local_spec(n) for n in names)
    return jax.shard_map(local, mesh=mesh, in_specs=(P(),) + specs, out_specs=P())(h, *weights)


def _experts_in_chunks(h, flat, k: int, weights: list, dot):
    """The outputs ``[M, D]`` of the pairs routed to experts ``flat`` (pair ``m``: token
    ``m // k``): the pairs sorted by expert, each expert's run cut into chunks of C rows (the
    mean pairs per expert, a power of two), and one ``while`` loop over the chunks, in expert
    order, each through a ``lax.switch`` to its expert's branch, which reads that expert's own
    arrays where they lie (``weights[e]``: gate/up ``[D, 2F]`` and down ``[F, D]``, as ``dot(x,
    w)`` takes them). An expert no token chose is never visited. A chunk running past its
    expert's run writes rows that a later expert's chunks overwrite (they run after it) or the
    C rows of padding.

    Why on CPU: XLA:CPU copies a slice of a stacked ``[E, ...]`` array before a dot (static
    or not), and jax expands ``ragged_dot`` into every expert for every pair. The default
    model's attention with 8 experts of 768 (2 a token) in its MLP, the decode forward at 1 /
    8 / 48 rows on a 2-vCPU Intel Xeon (``scripts/bench_moe.py``): 29 / 141 / 351 ms this way,
    52 / 459 / 2,867 with each pair's weights gathered, 197 / 407 / 1,001 through
    ``ragged_dot``, 162 / 286 / 565 looping over static slices of the stacks. The price is
    compile time: a step's program holds a branch per layer and expert (one step of a tiny
    8-layer model with 128 experts compiled in 54 s, 16 layers in 87 s: minutes for
    Qwen3-30B-A3B's 48 x 128); one body shared by the layers would need the experts stacked
    and sliced, which XLA:CPU copies (not built)."""
    E = len(weights)
    M = flat.shape[0]
    C = min(64, 1 << max(0, (-(-M // E) - 1).bit_length()))
    counts = jnp.bincount(flat, length=E)
    starts = jnp.cumsum(counts) - counts
    chunks = -(-counts // C)
    chunk_end = jnp.cumsum(chunks)
    order = jnp.argsort(flat, stable=True)
    xs = jnp.pad(h[order // k], ((0, C), (0, 0)))

    def expert(gate_up, down, x):
        g, u = jnp.split(dot(x, gate_up), 2, axis=1)
        return dot(jax.nn.silu(g) * u, down)

    branches = [functools.partial(expert, gate_up, down) for gate_up, down in weights]

    def body(state):
        i, y = state
        e = jnp.searchsorted(chunk_end, i, side="right")  # chunk i is expert e's
        start = starts[e] + (i - (chunk_end[e] - chunks[e])) * C
        out = jax.lax.switch(e, branches, jax.lax.dynamic_slice_in_dim(xs, start, C))
        return i + 1, jax.lax.dynamic_update_slice_in_dim(y, out, start, 0)

    y = jnp.zeros((M + C, h.shape[1]), h.dtype)
    _, y = jax.lax.while_loop(lambda state: state[0] < chunk_end[-1], body, (jnp.int32(0), y))
    return jnp.zeros((M, y.shape[1]), y.dtype).at[order].set(y[:M], unique_indices=True)


def _moe_stacked(h, p, layers, layer, moe: MoeConfig, precision, *, kernel: bool, mesh: Mesh | None):
    """The stacked form's expert MLP: under ``kernel`` (lowered for CUDA, one device, shapes the
    kernel tiles) the Triton kernel reading the whole stacks, XLA's grouped matmul elsewhere."""
    grouped = functools.partial(moe_mlp, p=p, moe=moe, precision=precision, mesh=mesh)
    F, D = moe.intermediate_size, h.shape[-1]
    if not kernel or mesh is not None or not moe_matmul.supports(D, F) or not moe_matmul.supports(F, D):
        return grouped(h)
    stacks = tuple(getattr(layers, n)[...] for n in ("we_gate", "we_up", "we_down"))
    return jax.lax.platform_dependent(
        h, stacks, layer, cuda=lambda h, stacks, layer: moe_mlp(h, p, moe, precision, experts="pallas",
                                                               stacks=stacks, layer=layer, interpret=False),
        default=lambda h, stacks, layer: grouped(h))


# The LoRA modules (jaxpaged.lora.MODULES) each group of lora_deltas updates, by index.
_LORA_GROUPS = {"qkv": (0, 1, 2), "o": (3,), "gate_up": (4, 5), "down": (6,)}


def lora_deltas(lw, group: str, x: Float[Array, "T I"], precision):
    """The LoRA updates of the projections of ``group`` (``"qkv"``, ``"o"``, ``"gate_up"``,
    ``"down"``) of input ``x``: a tuple ``[T, out]`` for ``"qkv"`` and ``"gate_up"``, else one.
    ``lw``: ``(rows [T, S], weights)``, each token's one-hot adapter slot (a zero row for none)
    and the layer's ``(A [S, R, I], B [out, S, R])`` per module. Every slot's ``x A`` is
    computed, the other slots' zeroed, and one product with all the ``B`` stacked sums the
    token's own: two dense products, whatever the mix of adapters in the step."""
    rows, weights = lw
    T, S = rows.shape
    out = []
    for m in _LORA_GROUPS[group]:
        a, b = weights[m]
        t = jax.lax.dot_general(x, a.reshape(-1, a.shape[-1]).astype(x.dtype), (((1,), (1,)), ((), ())),
                                precision=precision)  # [T, S * R]
        t = (t.reshape(T, S, -1) * rows[:, :, None]).reshape(T, -1)
        out.append(jax.lax.dot_general(t, b.reshape(b.shape[0], -1).astype(x.dtype), (((1,), (1,)), ((), ())),
                                       precision=precision))
    return tuple(out) if len(out) > 1 else out[0]


def attention_inputs(cfg: LlamaConfig, p, q, k, v, *, add_bias: bool = True):
    """``q``, ``k``, ``v`` (``[T, heads, H]``, just projected) with what the architecture adds
    before RoPE: Qwen2's biases ``p.bq``, ``p.bk``, ``p.bv`` (``add_bias=False``: the caller
    added them, as the CPU form adds its fused ``bqkv``), Qwen3's per-head RMSNorm of queries
    and keys."""
    if cfg.qkv_bias and add_bias:
        q, k, v = q + p.bq[...], k + p.bk[...], v + p.bv[...]
    if cfg.qk_norm:
        q, k = rms_norm(q, p.q_norm[...], cfg.rms_norm_eps), rms_norm(k, p.k_norm[...], cfg.rms_norm_eps)
    return q, k, v


class FusedLayer(nnx.Module):
    """One decoder layer in arrays of its own, q/k/v and gate/up fused: the CPU form.

    Layer ``i`` of a stacked :class:`DecoderLayer`, copied out (see :meth:`Llama.unstacked`):
    ``wqkv`` ``[D, (N + 2K) * H]`` (the q, k, v columns in that order), ``wo`` ``[N * H, D]``,
    ``w_gate_up`` ``[D, 2F]`` (the gate's columns first), ``w_down`` ``[F, D]``; with
    ``out_in`` each of the four transposed, ``[out, in]`` (see :func:`choose_cpu_layout`);
    Qwen2's ``bqkv`` ``[(N + 2K) * H]`` (its q, k, v biases in the columns' order), Qwen3's
    ``q_norm`` and ``k_norm`` ``[H]``. A mixture of experts has, instead of ``w_gate_up`` and
    ``w_down``, each expert's ``we_gate_up_{e}`` ``[D, 2F]`` and ``we_down_{e}`` ``[F, D]``
    (transposed with ``out_in``), the ``router`` and, with a shared expert, ``ws_gate_up``,
    ``ws_down`` (as ``w_gate_up`` and ``w_down``) and ``ws_router`` ``[D]`` (:func:`moe_mlp`).
    Built from :func:`fused_layer_arrays` once they are on the device.
    """

    def __init__(self, arrays: dict, *, out_in: bool = False):
        self.out_in = out_in
        for name, a in arrays.items():
            setattr(self, name, nnx.Param(a))


def fused_layer_arrays(stacked: DecoderLayer, i: int, *, out_in: bool = False) -> dict[str, np.ndarray]:
    """Layer ``i``'s weights in :class:`FusedLayer`'s arrays, on the host."""
    def take(name):
        return np.asarray(getattr(stacked, name)[...][i])

    def weight(w):
        return np.ascontiguousarray(w.T) if out_in else w

    D = take("input_norm").shape[0]
    arrays = {"input_norm": take("input_norm"),
              "wqkv": weight(np.concatenate([take(n).reshape(D, -1) for n in ("wq", "wk", "wv")], axis=1)),
              "wo": weight(take("wo").reshape(-1, D)),
              "post_attn_norm": take("post_attn_norm")}
    if hasattr(stacked, "router"):  # each expert in arrays of its own, gate and up fused (see moe_mlp)
        arrays["router"] = take("router")
        gate, up, down = take("we_gate"), take("we_up"), take("we_down")
        for e in range(gate.shape[0]):
            arrays[f"we_gate_up_{e}"] = weight(np.concatenate([gate[e], up[e]], axis=1))
            arrays[f"we_down_{e}"] = weight(down[e])
        if hasattr(stacked, "ws_gate"):  # Qwen2-MoE's shared expert, as a dense MLP
            arrays["ws_gate_up"] = weight(np.concatenate([take("ws_gate"), take("ws_up")], axis=1))
            arrays["ws_down"], arrays["ws_router"] = weight(take("ws_down")), take("ws_router")
    else:
        arrays |= {"w_gate_up": weight(np.concatenate([take("w_gate"), take("w_up")], axis=1)),
                   "w_down": weight(take("w_down"))}
    if hasattr(stacked, "bq"):
        arrays["bqkv"] = np.concatenate([take(n).reshape(-1) for n in ("bq", "bk", "bv")])
    if hasattr(stacked, "q_norm"):
        arrays["q_norm"], arrays["k_norm"] = take("q_norm"), take("k_norm")
    return arrays


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype=jnp.float32, attention_backend: str = "reference",
                 mesh: Mesh | None = None, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attention_backend = attention_backend
        self.mesh = mesh  # the "tp" mesh the params are sharded over; None: one device, no TP
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), dtype, 1)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_layers(rngs):
            return DecoderLayer(cfg, dtype=dtype, rngs=rngs)

        self.layers = make_layers(rngs)  # every parameter has a leading [num_layers] axis
        self.final_norm = nnx.Param(jnp.ones((cfg.hidden_size,), dtype))
        self.lm_head = None if cfg.tie_word_embeddings else _param(
            rngs, (cfg.hidden_size, cfg.vocab_size), dtype, cfg.hidden_size)

    def with_backend(self, attention_backend: str) -> Llama:
        """The same weights (shared, not copied) behind another attention backend."""
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, state)
        model.attention_backend = attention_backend
        return model

    @property
    def is_stacked(self) -> bool:
        """Whether the layers are one stack (:class:`DecoderLayer` with a leading layer axis,
        as loaded), or a list of :class:`FusedLayer` (:meth:`unstacked`)."""
        return isinstance(self.layers, DecoderLayer)

    def unstacked(self, layout: str = "in_out") -> Llama:
        """This model with each layer in arrays of its own, q/k/v and gate/up fused (a copy of
        the layers' weights; the rest is shared). The layer loop then picks the layer's
        weights with ``lax.switch`` instead of slicing the stack: under ``lax.scan`` XLA:CPU
        copies every layer's slice before its matmuls (14 MB a layer for SmolLM2, 425 MB a
        step), so a bandwidth-bound batch-1 decode step moved each weight three times (read,
        write, read) instead of once. One device only: tensor parallelism shards the stack.
        ``layout``: the projections' weights ``"in_out"`` or ``"out_in"`` (transposed; see
        :func:`choose_cpu_layout`).
        """
        if self.mesh is not None:
            raise ValueError("unstacked(): a model sharded for tensor parallelism keeps its layers stacked")
        if layout not in CPU_LAYOUTS:
            raise ValueError(f"unstacked(): layout {layout!r} is not one of {CPU_LAYOUTS}")
        graphdef, state = nnx.split(self)
        model = nnx.merge(graphdef, state)
        out_in = layout == "out_in"
        L = self.cfg.num_layers
        # All the layers' weights in one region of huge pages on CPU (jaxpaged.hugepages), filled
        # a layer at a time.
        device = next(iter(self.embed[...].devices()))
        first = fused_layer_arrays(self.layers, 0, out_in=out_in)
        names = tuple(first)
        host = hugepages.host_arrays([(first[n].shape, first[n].dtype) for n in names] * L, device)
        layers = []
        for i in range(L):
            arrays = first if i == 0 else fused_layer_arrays(self.layers, i, out_in=out_in)
            placed = {}
            for n, dst in zip(names, host[i * len(names):(i + 1) * len(names)]):
                dst[...] = arrays[n]
                placed[n] = jax.device_put(dst, device)
            layers.append(FusedLayer(placed, out_in=out_in))
        model.layers = nnx.List(layers)
        hugepages.collapse([model.embed[...]] + ([] if model.lm_head is None else [model.lm_head[...]]))
        return model

    @property
    def dtype(self):
        return self.embed[...].dtype

    @property
    def platform(self) -> str:
        """Where the params live: ``"cpu"``, ``"gpu"`` or ``"tpu"`` (every shard on one kind)."""
        return next(iter(self.embed[...].devices())).platform

    def __call__(
        self,
        tokens: Int[Array, "T"],
        kv: KVPool,
        md: AttentionMetadata,
        logits_indices: Int[Array, "S"] | None = None,
        *,
        dp_axis: str | None = None,
        head_shard: Float[Array, "V/N D"] | None = None,
        return_hidden: bool = False,
        lora: tuple | None = None,
    ) -> tuple[Float[Array, "S V"], KVPool] | tuple[Float[Array, "S V"], KVPool, Float[Array, "S D"]]:
        """Run one step. Returns logits at ``logits_indices`` (all tokens when None) and the new pool;
        with ``return_hidden`` also the hidden states there after the final norm, float32 (the
        embeddings' last-token pooling, :mod:`jaxpaged.pooling`).

        ``dp_axis`` (the CPU form inside ``shard_map``; :mod:`jaxpaged.dp_attention`): this
        device's rows and pool run their attention here, the MLP is split over the axis (this
        device's gate/up columns and down rows for every device's rows: an all-gather before,
        a reduce-scatter after) and the logits come from ``head_shard``, this device's rows of
        the ``[V, D]`` LM head, for every device's rows, gathered by vocabulary.

        ``lora``: ``(slot [T] int32, weights)``, the LoRA adapters' slot of each token (-1: none)
        and :class:`~jaxpaged.lora.LoRASlots`' weights, per layer; each projection adds its
        token's low-rank update (:func:`lora_deltas`)."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        inv_freq = jnp.asarray(rope_inv_freq(cfg))
        rope_scale = rope_attention_factor(cfg)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        backend = self.attention_backend
        mesh = self.mesh
        prec = dot_precision(self.dtype)  # float32 weights: no TF32 products on GPU
        if mesh is None:
            x = self.embed[...][tokens]  # [T, D]
            if not self.is_stacked:  # the CPU form computes in float32 (16-bit weights: see _cpu_dot_16bit)
                x = x.astype(jnp.float32)
        else:
            x = sharding.embed_tokens(mesh, self.embed[...], tokens)
        T = tokens.shape[0]
        N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if lora is not None:
            if dp_axis is not None:
                raise ValueError("LoRA is not supported with dp_axis")
            lora_slot, lora_weights = lora
            lora_rows = jax.nn.one_hot(lora_slot, lora_weights[0][0][1].shape[1], dtype=x.dtype)  # [T, S]; -1: zeros

        def lora_layer(i: int):
            """The tokens' slots and layer ``i``'s LoRA weights, or None without LoRA."""
            return None if lora is None else (lora_rows, lora_weights[i])

        def attention(kv, q, k, v, layer):
            q = apply_rope(q, md.positions, inv_freq, rope_scale)
            k = apply_rope(k, md.positions, inv_freq, rope_scale)
            # In the pool's dtype (float32 K/V under a bfloat16 model on CPU: kv_cache.resolve_kv_cache_dtype);
            # a float8 pool's K/V are rounded as they are written, the queries stay in the model's dtype.
            dtype = q.dtype
            if not is_fp8_storage(kv.k.dtype):
                q, k, v = (t.astype(kv_value_dtype(kv.k.dtype)) for t in (q, k, v))
            if mesh is None:
                kv = write_kv(kv, layer, k, v, md.slot_mapping)
                o = paged_attention(q, kv, layer, md, scale=scale, backend=backend)
            else:
                o, kv = sharding.paged_attention_per_shard(mesh, q, k, v, kv, layer, md, scale=scale, backend=backend)
            return o.astype(dtype), kv

        if not self.is_stacked:  # per-layer arrays, the CPU form (see unstacked)
            dot = functools.partial(_cpu_dot, out_in=self.layers[0].out_in, precision=prec)

            def qkv_proj(p, lw, x):
                h = rms_norm(x, p.input_norm[...], eps)
                y = dot(h, p.wqkv[...])
                if cfg.qkv_bias:
                    y = y + p.bqkv[...]
                q, k, v = jnp.split(y, [N * H, (N + K) * H], axis=1)
                if lw is not None:
                    q, k, v = (t + d for t, d in zip((q, k, v), lora_deltas(lw, "qkv", h, prec)))
                return attention_inputs(cfg, p, q.reshape(T, N, H), k.reshape(T, K, H), v.reshape(T, K, H),
                                        add_bias=False)

            def out_proj_mlp(p, lw, x, o):
                o = o.reshape(T, N * H)
                x = x + dot(o, p.wo[...])
                if lw is not None:
                    x = x + lora_deltas(lw, "o", o, prec)
                h = rms_norm(x, p.post_attn_norm[...], eps)
                if cfg.moe is not None:
                    return x + moe_mlp(h, p, cfg.moe, prec, experts="per_expert", out_in=p.out_in)
                if dp_axis is not None:
                    h = jax.lax.all_gather(h, dp_axis, tiled=True)
                g, u = jnp.split(dot(h, p.w_gate_up[...]), 2, axis=1)
                if lw is not None:
                    g, u = (t + d for t, d in zip((g, u), lora_deltas(lw, "gate_up", h, prec)))
                a = jax.nn.silu(g) * u
                y = dot(a, p.w_down[...])
                if lw is not None:
                    y = y + lora_deltas(lw, "down", a, prec)
                if dp_axis is not None:  # partial sums over this device's MLP columns
                    y = jax.lax.psum_scatter(y, dp_axis, tiled=True)
                return x + y

            # The switches' branches read their layer's arrays where they are (LoRA's too: under
            # lax.scan a slice of stacked arrays is a copy) and return only activations; the
            # pool's update stays outside them, in the scan's carry.
            qkv_branches = [functools.partial(qkv_proj, p, lora_layer(i)) for i, p in enumerate(self.layers)]
            mlp_branches = [functools.partial(out_proj_mlp, p, lora_layer(i)) for i, p in enumerate(self.layers)]

            def fused_layer_fn(carry, layer):
                x, kv = carry
                q, k, v = jax.lax.switch(layer, qkv_branches, x)
                o, kv = attention(kv, q, k, v, layer)
                return (jax.lax.switch(layer, mlp_branches, x, o), kv), None

            (x, kv), _ = jax.lax.scan(fused_layer_fn, (x, kv), jnp.arange(cfg.num_layers, dtype=jnp.int32))
        else:
            layer_def, layer_state = nnx.split(self.layers)
            stacked_kernels = (T <= STACKED_MAX_TOKENS and mesh is None
                               and resolve_backend(backend, "cuda") == "pallas_gpu")
            matmul = _layer_matmuls(self.layers, prec, stacked=stacked_kernels)

            def layer_fn(carry, xs):
                x, kv = carry
                state, layer, lora_w = xs
                p = nnx.merge(layer_def, state)
                lw = None if lora is None else (lora_rows, lora_w)
                with jax.named_scope("attention"):
                    h = rms_norm(x, p.input_norm[...], eps)
                    q, k, v = matmul(h, p, ("wq", "wk", "wv"), layer)  # "TD,DNH->TNH", "TD,DKH->TKH"
                    if lw is not None:
                        q, k, v = (t + d.reshape(t.shape) for t, d in zip((q, k, v), lora_deltas(lw, "qkv", h, prec)))
                    q, k, v = attention_inputs(cfg, p, q, k, v)
                    o, kv = attention(kv, q, k, v, layer)
                    # Row-parallel under TP: GSPMD all-reduces the partial sums over the head shards.
                    x = x + matmul(o, p, "wo", layer)  # "TNH,NHD->TD"
                    if lw is not None:
                        x = x + lora_deltas(lw, "o", o.reshape(T, N * H), prec)
                with jax.named_scope("mlp"):
                    h = rms_norm(x, p.post_attn_norm[...], eps)
                    if cfg.moe is not None:
                        return (x + _moe_stacked(h, p, self.layers, layer, cfg.moe, prec, kernel=stacked_kernels,
                                                 mesh=mesh), kv), None
                    g, u = matmul(h, p, ("w_gate", "w_up"), layer)  # "TD,DF->TF"
                    if lw is not None:
                        g, u = (t + d for t, d in zip((g, u), lora_deltas(lw, "gate_up", h, prec)))
                    a = jax.nn.silu(g) * u
                    # Row-parallel, as wo.
                    x = x + matmul(a, p, "w_down", layer)  # "TF,FD->TD"
                    if lw is not None:
                        x = x + lora_deltas(lw, "down", a, prec)
                return (x, kv), None

            layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
            # The LoRA weights stacked by layer too (None without LoRA), for the scan to slice.
            stacked_lora = None if lora is None else jax.tree.map(lambda *w: jnp.stack(w), *lora_weights)
            (x, kv), _ = jax.lax.scan(layer_fn, (x, kv), (layer_state, layers, stacked_lora))
        if logits_indices is not None:
            x = x[logits_indices]
        x = rms_norm(x, self.final_norm[...], eps)
        if return_hidden:
            if dp_axis is not None:
                raise ValueError("return_hidden is not supported with dp_axis")
            return self._logits(x, prec), kv, x.astype(jnp.float32)
        if dp_axis is not None:
            x = jax.lax.all_gather(x, dp_axis, tiled=True)
            logits = jnp.einsum("SD,VD->SV", x, head_shard.astype(x.dtype), precision=prec)
            return jax.lax.all_gather(logits.astype(jnp.float32), dp_axis, axis=1, tiled=True), kv
        return self._logits(x, prec), kv

    def _logits(self, x: Float[Array, "S D"], prec) -> Float[Array, "S V"]:
        """The LM head over final-normed rows ``x``, float32."""
        mesh = self.mesh
        if mesh is not None:  # vocab shards -> whole rows on every device, for sampling
            tied = self.lm_head is None
            logits = sharding.vocab_parallel_logits(mesh, x, self.embed[...] if tied else self.lm_head[...],
                                                    tied=tied, precision=prec)
        elif not self.is_stacked and x.dtype != self.dtype:  # the CPU form of a 16-bit model
            tied = self.lm_head is None
            logits = _cpu_dot_16bit(x, self.embed[...] if tied else self.lm_head[...], out_in=tied)
        elif self.lm_head is None:
            logits = jnp.einsum("SD,VD->SV", x, self.embed[...], precision=prec)
        else:
            logits = jnp.einsum("SD,DV->SV", x, self.lm_head[...], precision=prec)
        return logits.astype(jnp.float32)


_LAYOUT_CHOICES: dict[tuple, str] = {}
# Timed at these step sizes: single-stream decode, a small and a typical decode batch, a prefill chunk.
_LAYOUT_TOKENS = (1, 8, 48, 256)
# Below this many projection parameters a layer, either layout will do: no timing.
_LAYOUT_MIN_PARAMS = 1 << 20


def choose_cpu_layout(cfg: LlamaConfig, dtype, *, reps: int = 5) -> str:
    """The CPU form's weight layout for this machine, found by timing both (once per process
    and shape): ``"out_in"`` when it runs a layer's four projections at least 5% faster than
    ``"in_out"`` in the geometric mean over :data:`_LAYOUT_TOKENS` tokens a step (the two
    alternating, medians of ``reps``), ``"in_out"`` otherwise; ``"in_out"`` without timing
    for layers under :data:`_LAYOUT_MIN_PARAMS` projection parameters (test-sized models).
    ~2-3 s for the default model.

    Which is faster depends on the CPU, through the library XLA:CPU hands the dot to
    (YNNPACK; ``[out, in]`` weights make a transposed product of it). The default model's
    projections, float32, 8 layers' worth alternating in one process: on a 2-vCPU Intel Xeon
    (Emerald Rapids) ``[out, in]`` takes 0.76-0.97x the time of ``[in, out]`` from 8 to 512
    tokens (48: 0.81) and 1.0-1.16x at one token (the engine there: 48 requests x 128 tokens
    1.08-1.16x faster, single-stream decode 5-10% slower); on a 2-vCPU AMD EPYC (Zen 4)
    ``[out, in]`` took 1.16-1.20x the time at 48 tokens, and at one token lost to the split
    contraction of :func:`_cpu_dot`.
    """
    shapes = _projection_shapes(cfg)
    if sum(k * n for k, n in shapes) < _LAYOUT_MIN_PARAMS:
        return "in_out"
    key = (shapes, jnp.dtype(dtype).name)
    if (layout := _LAYOUT_CHOICES.get(key)) is None:
        times = time_cpu_layouts(shapes, dtype, _LAYOUT_TOKENS, reps)
        ratios = [times[t]["out_in"] / times[t]["in_out"] for t in _LAYOUT_TOKENS]
        layout = _LAYOUT_CHOICES[key] = "out_in" if math.prod(ratios) ** (1 / len(ratios)) < 0.95 else "in_out"
    return layout


def _projection_shapes(cfg: LlamaConfig) -> tuple[tuple[int, int], ...]:
    """``(in, out)`` of wqkv, wo, w_gate_up, w_down (a mixture of experts: an expert's)."""
    D, H = cfg.hidden_size, cfg.head_dim
    F = cfg.intermediate_size if cfg.moe is None else cfg.moe.intermediate_size
    return ((D, (cfg.num_heads + 2 * cfg.num_kv_heads) * H), (cfg.num_heads * H, D), (D, 2 * F), (F, D))


def time_cpu_layouts(shapes, dtype, tokens, reps: int) -> dict[int, dict[str, float]]:
    """``{tokens: {layout: median seconds}}`` of a chain of layers' projections ``shapes``
    (``(in, out)`` each) in both CPU layouts, run alternately; random weights, enough layers
    (>= 64 MiB, at most 16 layers) that they are read from memory rather than from the core's cache."""
    import time

    layer_bytes = sum(k * n for k, n in shapes) * jnp.dtype(dtype).itemsize
    rng = np.random.default_rng(0)
    num_layers = min(16, -(-(64 << 20) // layer_bytes))  # one for layers of >= 64 MiB
    weights = [[rng.standard_normal((k, n), dtype=np.float32) for k, n in shapes] for _ in range(num_layers)]
    forms = {"in_out": [[jnp.asarray(w, dtype) for w in ws] for ws in weights],
             "out_in": [[jnp.asarray(w.T, dtype) for w in ws] for ws in weights]}
    del weights
    prec = dot_precision(dtype)

    def chain(out_in):
        def run(ws, x):
            for layer in ws:
                for w in layer:  # the input cut or padded to this projection's width
                    k = w.shape[1] if out_in else w.shape[0]
                    x = x[:, :k] if x.shape[1] >= k else jnp.pad(x, ((0, 0), (0, k - x.shape[1])))
                    x = 0.5 * _cpu_dot(x, w, out_in=out_in, precision=prec)  # 0.5: values stay bounded
            return x
        return jax.jit(run)

    fns = {name: chain(name == "out_in") for name in forms}
    times = {}
    for t in tokens:  # float32 activations, as in the CPU form (see _cpu_dot_16bit)
        x = jnp.asarray(rng.standard_normal((t, shapes[0][0]), dtype=np.float32))
        for name, f in fns.items():
            jax.block_until_ready(f(forms[name], x))
        samples = {name: [] for name in fns}
        for _ in range(reps):
            for name, f in fns.items():
                start = time.perf_counter()
                jax.block_until_ready(f(forms[name], x))
                samples[name].append(time.perf_counter() - start)
        times[t] = {name: float(np.median(v)) for name, v in samples.items()}
    return times


_UNSTACKED: weakref.WeakKeyDictionary[Llama, dict[str, Llama]] = weakref.WeakKeyDictionary()


def runtime_form(model: Llama, layout: str | None = None) -> Llama:
    """The form the engine runs ``model`` in: :meth:`Llama.unstacked` on one CPU device
    (made once per model and layout, and shared by every engine over it), ``model`` itself
    elsewhere (GPUs read the stack in place, see :func:`_layer_matmuls`; tensor parallelism
    shards it). ``layout``: the CPU form's weight layout, ``None`` for this machine's
    faster (:func:`choose_cpu_layout`).

    Measured on SmolLM2 in float32 (2-core AMD EPYC, alternating in one process): single-stream
    decode 43-49 -> 54-56 tok/s, 48 requests x 128 tokens 312-346 -> 346-377 generated tok/s,
    the same greedy tokens.
    """
    if not model.is_stacked or model.mesh is not None:
        return model
    if model.platform != "cpu":
        return model
    if layout is None:
        layout = choose_cpu_layout(model.cfg, model.dtype)
    forms = _UNSTACKED.setdefault(model, {})
    if (form := forms.get(layout)) is None:
        form = forms[layout] = model.unstacked(layout)
    return form
