"""Reading a llama.cpp GGUF file: a Hugging Face config dict, float32 weights (one tensor at a
time), and the tokenizer.

Everything is handed over in Hugging Face terms (``config.json`` keys, ``model.layers.{i}...``
parameter names, ``[out_features, in_features]`` matrices), so the rest of jaxpaged has one
checkpoint format to convert from. The ``llama``, ``qwen2`` and ``qwen3`` architectures and the
byte-level BPE (``gpt2``) tokenizer are supported; anything else raises rather than loading half
a model.

Imports numpy and gguf only; ``transformers`` is imported when a tokenizer is built. No torch.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

# GGUF tensor name (without ".weight") -> Hugging Face parameter name (without ".weight").
# The same pairs as gguf.get_tensor_name_map(MODEL_ARCH.LLAMA, n) (tests check that).
GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# What Qwen2 and Qwen3 add to each layer (the pairs of gguf.get_tensor_name_map(MODEL_ARCH.QWEN2 /
# QWEN3, n), with their suffixes).
ARCH_LAYER_TENSORS = {
    "llama": {},
    "qwen2": {"attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
              "attn_v.bias": "self_attn.v_proj.bias"},
    "qwen3": {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"},
}
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ROPE_FREQS = "rope_freqs.weight"  # llama3 RoPE scaling, precomputed by convert_hf_to_gguf.py


class _GGUFFile:
    """A parsed GGUF header; every error it raises names the file."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.exists():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        try:
            self.reader = gguf.GGUFReader(self.path)
        except OSError:
            raise
        except Exception as e:  # the reader parses untrusted bytes; any failure means a bad file
            raise ValueError(f"{self.path} is not a valid GGUF file (truncated or corrupt?): {e}") from e

    def error(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: {message}")

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.reader.get_field(key)
        if field is None:
            if default is ...:
                raise self.error(f"metadata key {key!r} is missing")
            return default
        value = field.contents()
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # shortest decimal: 1e-05, not 9.999999747378752e-06
        return value


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a Llama, Qwen2 or Qwen3 GGUF file into a Hugging Face config and float32 weights.

    Returns:
      ``(config, tensors)``: ``config`` has the keys of a Hugging Face Llama ``config.json``;
      ``tensors`` maps Hugging Face parameter names to dequantized float32 arrays in Hugging
      Face orientation::

        model.embed_tokens.weight                    [vocab_size, hidden_size]
        model.layers.{i}.self_attn.q_proj.weight     [num_heads * head_dim, hidden_size]
        model.layers.{i}.self_attn.k_proj.weight     [num_kv_heads * head_dim, hidden_size]   (v_proj alike)
        model.layers.{i}.self_attn.o_proj.weight     [hidden_size, num_heads * head_dim]
        model.layers.{i}.mlp.{gate,up}_proj.weight   [intermediate_size, hidden_size]
        model.layers.{i}.mlp.down_proj.weight        [hidden_size, intermediate_size]
        model.layers.{i}.{input,post_attention}_layernorm.weight, model.norm.weight   [hidden_size]
        lm_head.weight                               [vocab_size, hidden_size]   (absent when tied)
        model.layers.{i}.self_attn.{q,k,v}_proj.bias [heads * head_dim]   (Qwen2)
        model.layers.{i}.self_attn.{q,k}_norm.weight [head_dim]   (Qwen3)

      The whole model in float32: to load one, stream it with :func:`open_gguf` instead.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: not a GGUF file, truncated or corrupt; an architecture other than llama, qwen2, qwen3;
        missing metadata; missing, extra or mis-shaped tensors; a tensor type gguf cannot dequantize.
    """
    config, _, tensors = open_gguf(path)
    return config, dict(tensors)


def open_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, tuple[int, ...]],
                                                  Iterator[tuple[str, np.ndarray]]]:
    """The config, tensor shapes, and a one-pass reader of a GGUF file's weights.

    Everything :func:`read_gguf` checks is checked here, before any weight is read. The
    reader dequantizes one tensor at a time and yields ``(hf_name, float32 array)``, in
    the names and orientation :func:`read_gguf` documents.
    """
    f = _GGUFFile(path)
    config = _hf_config(f)
    plan = _tensor_plan(f, config)

    def read() -> Iterator[tuple[str, np.ndarray]]:
        for hf_name, (tensor, shape) in plan.items():
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            if np.may_share_memory(w, tensor.data):  # F32 comes back as a view of the memory-mapped file
                w = w.copy()
            w = w.astype(np.float32, copy=False).reshape(shape)
            if config["model_type"] == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
                w = unpermute_rope_rows(w, heads)
            yield hf_name, w

    return config, {name: shape for name, (_, shape) in plan.items()}, read()


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo the row permutation convert_hf_to_gguf.py applies to a Llama's Q and K projections
    (Qwen2 and Qwen3 keep Hugging Face's rows: llama.cpp runs their RoPE in its NEOX mode).

    Hugging Face's ``rotate_half`` rotates dimension ``j`` of a head with ``j + head_dim/2``;
    ggml's default RoPE rotates ``2j`` with ``2j+1``. The converter therefore interleaves the
    two halves of each head's rows: GGUF row ``2j + k`` of a head is HF row ``k*head_dim/2 + j``.

    Args:
      w: ``[num_heads * head_dim, ...]`` rows in GGUF order.
    Returns:
      The same shape, rows in Hugging Face order.
    """
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_config(f: _GGUFFile) -> dict[str, Any]:
    arch = f.get("general.architecture")
    if arch not in _HF_ARCHITECTURES:
        raise f.error(f"architecture {arch!r} is not supported (only {', '.join(map(repr, _HF_ARCHITECTURES))})")
    a = f"{arch}."
    if f.get(a + "expert_count", 0):  # Mixtral's GGUFs are "llama" with experts
        raise f.error(f"a mixture of experts ({arch}.expert_count={f.get(a + 'expert_count')}) is not supported "
                      "from GGUF; load the model's Hugging Face folder")
    num_heads = _same_for_all_layers(f, a + "attention.head_count")
    num_kv_heads = _same_for_all_layers(f, a + "attention.head_count_kv", num_heads)
    hidden = int(f.get(a + "embedding_length"))
    head_dim = int(f.get(a + "attention.key_length", hidden // num_heads))
    if f.get(a + "attention.value_length", head_dim) != head_dim:
        raise f.error(f"key_length {head_dim} != value_length {f.get(a + 'attention.value_length')} is not supported")
    rotary = f.get(a + "rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise f.error(f"partial RoPE (rope.dimension_count={rotary}, head_dim={head_dim}) is not supported")
    names = {t.name: t for t in f.reader.tensors}
    vocab_size = f.get(a + "vocab_size", None)
    if vocab_size is None:  # older files; a missing embedding is reported with the other tensors
        embd = names.get("token_embd.weight")
        vocab_size = int(embd.shape[1]) if embd is not None else len(f.get("tokenizer.ggml.tokens"))
    rope_theta = f.get(a + "rope.freq_base", 10000.0)
    eos = [f.get(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(i for i in eos if i is not None))  # llama.cpp stops on all of them
    return {
        "architectures": [_HF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(f.get(a + "feed_forward_length")),
        "num_hidden_layers": int(f.get(a + "block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": f.get(a + "attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": rope_theta,
        "rope_scaling": _rope_scaling(f, a, rope_theta, head_dim),
        "max_position_embeddings": int(f.get(a + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": (eos[0] if len(eos) == 1 else eos) if eos else None,
    }


def _same_for_all_layers(f: _GGUFFile, key: str, default: Any = ...) -> int:
    value = f.get(key, default)
    if isinstance(value, list):  # some files store a per-layer list
        if len(set(value)) != 1:
            raise f.error(f"{key} differs between layers ({value}); not supported")
        value = value[0]
    return int(value)


def _rope_scaling(f: _GGUFFile, a: str, rope_theta: float, head_dim: int) -> dict | None:
    """HF ``rope_scaling`` from the metadata, or recovered from a ``rope_freqs`` tensor (llama3)."""
    kind = f.get(a + "rope.scaling.type", "none")
    if kind == "yarn":  # convert_hf_to_gguf.py writes the factor and the original context (Qwen2.5's long configs)
        scaling = {"rope_type": "yarn", "factor": f.get(a + "rope.scaling.factor"),
                   "original_max_position_embeddings": f.get(a + "rope.scaling.original_context_length")}
        for key in ("beta_fast", "beta_slow"):
            if (value := f.get(f"{a}rope.scaling.yarn_{key}", None)) is not None:
                scaling[key] = value
        return scaling
    if kind not in ("none", "llama3"):  # linear/...: passed on, LlamaConfig says what it supports
        return {"rope_type": kind, "factor": f.get(a + "rope.scaling.factor", 1.0)}
    freqs = next((t for t in f.reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        if kind == "llama3":
            raise f.error("rope.scaling.type is llama3 but there is no rope_freqs.weight tensor")
        return None
    # convert_hf_to_gguf.py writes llama3 scaling only as the per-frequency divisors, not as
    # metadata. They depend on (factor, low_freq_factor, high_freq_factor, original context):
    # take factor from the divisors, the rest from metadata or Llama 3.x's values, and check.
    factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type).astype(np.float64).ravel()
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": f.get(a + "rope.scaling.low_freq_factor", 1.0),
        "high_freq_factor": f.get(a + "rope.scaling.high_freq_factor", 4.0),
        "original_max_position_embeddings": int(f.get(a + "rope.scaling.original_context_length", 8192)),
    }
    expected = llama3_rope_divisors(rope_theta, head_dim, scaling)
    if expected.shape != factors.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise f.error(f"{_ROPE_FREQS} does not match llama3 RoPE scaling {scaling}; not supported")
    return scaling


def llama3_rope_divisors(rope_theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """``[head_dim // 2]`` divisors llama3 scaling applies to each RoPE inverse frequency."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, factor, mid))


def _tensor_plan(f: _GGUFFile, config: dict) -> dict[str, tuple[Any, tuple[int, ...]]]:
    """``{hf_name: (gguf tensor, hf shape)}``, after checking names, shapes and types all at once."""
    V, D, F = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"token_embd": (V, D), "output_norm": (D,), "output": (V, D)}
    layer_shapes = {"attn_norm": (D,), "attn_q": (q, D), "attn_k": (kv, D), "attn_v": (kv, D),
                    "attn_output": (D, q), "ffn_norm": (D,), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    layer_shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
                     "attn_q_norm.weight": (config["head_dim"],), "attn_k_norm.weight": (config["head_dim"],)}
    expected = {f"{g}.weight": (f"{h}.weight", shapes[g]) for g, h in GLOBAL_TENSORS.items()}
    for i in range(config["num_hidden_layers"]):
        for g, h in LAYER_TENSORS.items():
            expected[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{h}.weight", layer_shapes[g])
        for g, h in ARCH_LAYER_TENSORS[config["model_type"]].items():
            expected[f"blk.{i}.{g}"] = (f"model.layers.{i}.{h}", layer_shapes[g])
    if config["tie_word_embeddings"]:
        del expected["output.weight"]

    present = {t.name: t for t in f.reader.tensors}
    problems = []
    if missing := sorted(set(expected) - set(present)):
        problems.append(f"missing tensors: {', '.join(missing)}")
    consumed = {_ROPE_FREQS} if (config["rope_scaling"] or {}).get("rope_type") == "llama3" else set()
    if extra := sorted(set(present) - set(expected) - consumed):
        problems.append(f"unexpected tensors: {', '.join(extra)}")
    plan = {}
    for name, (hf_name, shape) in expected.items():
        if name not in present:
            continue
        t = present[name]
        got = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions fastest-varying first
        if got != shape:
            problems.append(f"tensor {name} has shape {list(got)}, expected {list(shape)}")
        elif not _can_dequantize(t.tensor_type):
            problems.append(f"tensor {name} has type {t.tensor_type.name}, which gguf cannot dequantize")
        plan[hf_name] = (t, shape)
    if problems:
        raise f.error("; ".join(problems))
    return plan


@functools.cache
def _can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros(type_size, np.uint8), qtype)  # one all-zero block
    except NotImplementedError:
        return False
    return True


# --- tokenizer ---------------------------------------------------------------------------------

# llama.cpp's token types (llama_token_type) that become added tokens.
_CONTROL, _USER_DEFINED = 3, 4

# How llama.cpp splits text before BPE, keyed by `tokenizer.ggml.pre` (llama-vocab.cpp).
_GPT2_FAMILY = ("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "jina-v1-en", "jina-v2-es", "jina-v2-de")
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_LLAMA3_FAMILY = ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe")
_QWEN2_FAMILY = ("qwen2", "deepseek-r1-qwen")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def tokenizer_from_gguf(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Build the tokenizer a GGUF file describes (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``).

    Vocabulary, merges, control/user-defined tokens, bos/eos/unk/pad, ``add_bos_token`` /
    ``add_eos_token`` and the chat template all come from the file's metadata, so
    ``apply_chat_template`` works on the result.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      ValueError: not a valid GGUF file, tokenizer metadata missing, or a tokenizer model
        or pre-tokenizer other than the supported byte-level BPE ones.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    f = _GGUFFile(path)
    kind = f.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise f.error(f"tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = f.get("tokenizer.ggml.pre", "gpt-2")  # files older than the key were GPT-2 style
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_FAMILY:
        pre_tokenizer = byte_level
    elif pre in _DIGITS_THEN_GPT2:
        pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _LLAMA3_FAMILY + _QWEN2_FAMILY:
        split = _LLAMA3_SPLIT if pre in _LLAMA3_FAMILY else _QWEN2_SPLIT
        pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        supported = sorted(_GPT2_FAMILY + _DIGITS_THEN_GPT2 + _LLAMA3_FAMILY + _QWEN2_FAMILY)
        raise f.error(f"pre-tokenizer {pre!r} is not supported (supported: {', '.join(supported)})")

    tokens: list[str] = f.get("tokenizer.ggml.tokens")
    token_types: list[int] = f.get("tokenizer.ggml.token_type", [1] * len(tokens))
    alphabet = _bytes_to_unicode()
    spelled = set(alphabet.values())
    # Byte-level vocabularies spell every byte as a printable character ("Ġ" is a space). A token
    # stored as raw text (some converters do that for added tokens) is respelled so BPE can reach it.
    vocab = {t if set(t) <= spelled else "".join(alphabet[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in f.get("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                               end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) and user-defined ones (<think>) are matched whole before BPE,
    # as llama.cpp does. A "control" token outside the byte alphabet is a llama.cpp mislabel (its
    # id is a normal token); adding it would create a new id beyond the model's vocabulary.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, token_types) if k == _CONTROL and set(t) <= spelled])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, token_types) if k == _USER_DEFINED and t in vocab])

    def token(key: str) -> str | None:
        i = f.get(f"tokenizer.ggml.{key}_token_id", None)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        add_bos_token=bool(f.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(f.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=f.get("tokenizer.chat_template", None),
    )


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 maps to itself, the rest to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + n)
    return table
