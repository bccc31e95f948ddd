"""Model configuration: a frozen dataclass built from a Hugging Face config dict."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
    """Position interpolation (``rope_type == "linear"``): every frequency divided by ``factor``."""

    factor: float


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
    """YaRN (``rope_type == "yarn"``; the long-context configs of Qwen2.5 and Qwen3): the
    frequencies that turn fewer than ``beta_slow`` times over the original context are divided by
    ``factor``, those that turn more than ``beta_fast`` times are kept, a linear ramp between; and
    cos / sin are multiplied by ``attention_factor`` (0.1 ln(factor) + 1 unless the config says)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True  # the ramp's ends rounded outwards to whole dimensions


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _rope_scaling(rs: dict[str, Any], max_positions: int) -> RopeScaling | LinearRopeScaling | YarnRopeScaling | None:
    """The RoPE scaling a config's ``rope_scaling`` / ``rope_parameters`` asks for (None: plain RoPE);
    ``max_positions`` gives YaRN a factor where the config has none (DeepSeek's convention)."""
    rope_type = rs.get("rope_type", rs.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3":
        return RopeScaling(factor=float(rs["factor"]), low_freq_factor=float(rs["low_freq_factor"]),
                           high_freq_factor=float(rs["high_freq_factor"]),
                           original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
    if rope_type == "linear":
        return LinearRopeScaling(factor=float(rs["factor"]))
    if rope_type == "yarn":
        original = int(rs["original_max_position_embeddings"])
        factor = float(rs["factor"]) if rs.get("factor") is not None else max_positions / original
        attention = rs.get("attention_factor")
        if attention is None:
            mscale, all_dims = rs.get("mscale"), rs.get("mscale_all_dim")
            attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dims) if mscale and all_dims
                         else _yarn_mscale(factor))
        return YarnRopeScaling(factor=factor, original_max_position_embeddings=original,
                               beta_fast=float(rs.get("beta_fast") or 32.0),
                               beta_slow=float(rs.get("beta_slow") or 1.0),
                               attention_factor=float(attention), truncate=bool(rs.get("truncate", True)))
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: none, llama3, linear, yarn)")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A mixture of experts in place of every layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

    Each token's router logits (``x @ router``, ``[E]``) go through a softmax; the ``top_k``
    most probable experts (SwiGLU MLPs ``intermediate_size`` wide) each run on the token and
    their outputs are summed weighted by those probabilities, renormalised to sum to 1 when
    ``norm_topk_prob`` (Mixtral always; Qwen's per config). Qwen2-MoE adds a shared expert
    (``shared_intermediate_size`` wide, 0: none) that every token runs, its output scaled by
    ``sigmoid(x @ w)``. ``hf_block`` and ``hf_experts`` are the checkpoint's names for the
    block and its experts' gate, up and down projections."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_intermediate_size: int = 0
    hf_block: str = "mlp"
    hf_experts: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be between 1 and num_experts={self.num_experts}")

    @property
    def widths(self) -> tuple[int, ...]:
        """The MLP widths tensor parallelism splits: the experts' and the shared expert's."""
        return (self.intermediate_size,) + ((self.shared_intermediate_size,) if self.shared_intermediate_size else ())


# transformers' defaults for the keys a config leaves out: experts, experts a token, an
# expert's width, the shared expert's width.
_MOE_DEFAULTS = {"mixtral": (8, 2, 14336, 0), "qwen2_moe": (60, 4, 1408, 5632), "qwen3_moe": (128, 8, 768, 0)}


def _moe_config(d: dict[str, Any], model_type: str) -> MoeConfig | None:
    """The experts of a Mixtral / Qwen2-MoE / Qwen3-MoE config, None for a dense model."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    if model_type != "mixtral":
        # Qwen's MoE configs may keep some layers dense; every layer here is one stack.
        dense = d.get("mlp_only_layers") or []
        step = d.get("decoder_sparse_step", 1)
        if dense or step != 1:
            raise ValueError(f"unsupported: dense MLP layers among the expert layers (mlp_only_layers={dense}, "
                             f"decoder_sparse_step={step}); every layer must be a mixture of experts")
    experts, top_k, width, shared = _MOE_DEFAULTS[model_type]
    given = [d[k] for k in ("num_local_experts", "num_experts") if d.get(k) is not None]
    experts = int(given[0]) if given else experts  # 0 is refused below, not taken for the default
    top_k = int(d.get("num_experts_per_tok", top_k))
    if model_type == "mixtral":
        return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=int(d.get("intermediate_size", width)),
                         norm_topk_prob=True, hf_block="block_sparse_moe", hf_experts=("w1", "w3", "w2"))
    if model_type == "qwen2_moe":
        shared = int(d["shared_expert_intermediate_size"] or 0) if "shared_expert_intermediate_size" in d else shared
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=int(d.get("moe_intermediate_size", width)),
                     norm_topk_prob=bool(d.get("norm_topk_prob", False)), shared_intermediate_size=shared)


# The ``model_type``s whose checkpoints load (and any architecture named ``*Llama*``).
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3") + MOE_MODEL_TYPES


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Qwen2's q/k/v projections carry a bias (its o_proj none); Qwen3 normalises each query and
    # key head (RMSNorm over head_dim, before RoPE). Otherwise the same decoder as Llama's.
    qkv_bias: bool = False
    qk_norm: bool = False
    # Mixtral, Qwen2-MoE, Qwen3-MoE: experts instead of the MLP (intermediate_size then unused).
    moe: MoeConfig | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> LlamaConfig:
        """Build from a ``config.json`` dict of a Llama-architecture model: Llama, Mistral,
        Qwen2 (q/k/v biases) or Qwen3 (q/k norms), and their mixtures of experts (Mixtral,
        Qwen2-MoE, Qwen3-MoE; :class:`MoeConfig`), all layers full attention."""
        archs = d.get("architectures") or []
        model_type = d.get("model_type", "llama")
        if model_type not in MODEL_TYPES and not any("Llama" in a for a in archs):
            raise ValueError(f"unsupported architecture: model_type={model_type!r}, architectures={archs} "
                             f"(supported: {', '.join(MODEL_TYPES)})")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {d['hidden_act']!r} (Llama uses 'silu')")
        # Qwen2's q/k/v always have biases (its config has no attention_bias key). attention_bias
        # (Llama, Qwen3) would put one on o_proj too: not supported.
        for bias in ("attention_bias", "mlp_bias"):
            if d.get(bias):
                raise ValueError(f"unsupported {bias}=True ({model_type}'s projections have no bias here)")
        if d.get("use_sliding_window") or any(t != "full_attention" for t in d.get("layer_types") or ()):
            raise ValueError(f"unsupported sliding-window attention (use_sliding_window="
                             f"{d.get('use_sliding_window')}, layer_types={d.get('layer_types')}): "
                             "only full attention in every layer")
        max_positions = int(d.get("max_position_embeddings", 2048))
        if model_type in ("mistral", "mixtral") and d.get("sliding_window"):
            # Mistral-7B-v0.1: every layer sees the last 4,096 keys. Within the window that is
            # full attention, so the model runs exactly up to it and no further.
            max_positions = min(max_positions, int(d["sliding_window"]))
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        scaling = None
        # transformers < 5 writes rope_theta + rope_scaling; >= 5 writes rope_parameters.
        rs = d.get("rope_scaling") or d.get("rope_parameters")
        rope_theta = d.get("rope_theta")
        if rs is not None:
            rope_theta = rope_theta if rope_theta is not None else rs.get("rope_theta")
            scaling = _rope_scaling(rs, int(d.get("max_position_embeddings", 2048)))
        moe = _moe_config(d, model_type)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            # A mixture of experts' own (unused) MLP width may be left out.
            intermediate_size=int(d["intermediate_size"] if moe is None or "intermediate_size" in d
                                  else moe.intermediate_size),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=int(num_heads),
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=max_positions,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and bool(d.get("qkv_bias", True))),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=moe,
        )

    @classmethod
    def smollm2_135m(cls) -> LlamaConfig:
        """SmolLM2-135M(-Instruct): the embedded default model."""
        return cls(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
            num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
            tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,),
        )

    @classmethod
    def llama3_8b(cls) -> LlamaConfig:
        """Meta-Llama-3-8B's shapes (for benchmarks with random weights: same FLOPs and bytes)."""
        return cls(
            vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
            num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
            tie_word_embeddings=False, max_position_embeddings=8192, bos_token_id=128000,
            eos_token_ids=(128001, 128009),
        )
