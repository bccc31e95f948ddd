"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm) against Hugging Face's PyTorch models in
float32: the model in its three forms, the engine's greedy tokens, a GGUF of each, and what is
refused (sliding-window attention)."""

import json

import numpy as np
import pytest
import torch
from conftest import QWEN_SHAPES as SHAPES
from conftest import make_tiny_qwen
from paged import assert_prefill_then_decode_match_hf, hf_logits, step_metadata

from jaxpaged import LLM, SamplingParams
from jaxpaged.config import LlamaConfig
from jaxpaged.kv_cache import init_kv_pool
from jaxpaged.loader import CheckpointError, load_model

BS = 4  # small blocks: sequences span many


@pytest.fixture(scope="module", params=[("qwen2", True), ("qwen3", False)], ids=["qwen2-tied", "qwen3-untied"])
def tiny_qwen(request, tmp_path_factory):
    arch, tie = request.param
    folder = tmp_path_factory.mktemp(arch)
    return arch, folder, make_tiny_qwen(folder, arch, tie=tie)


def test_config_says_what_the_architecture_adds(tiny_qwen):
    arch, folder, _ = tiny_qwen
    cfg = LlamaConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert (cfg.qkv_bias, cfg.qk_norm) == ((True, False) if arch == "qwen2" else (False, True))


@pytest.mark.parametrize("form", ["stacked", "in_out", "out_in"])
def test_prefill_then_decode_match_hf(tiny_qwen, form):
    """Two sequences prefilled in one step, then decoded a token a step, in the stacked form
    (GPU, TPU, tensor parallelism) and the CPU form in both weight layouts."""
    arch, folder, hf = tiny_qwen
    lm = load_model(folder, dtype=np.float32, attention_backend="xla")
    model = lm.model if form == "stacked" else lm.model.unstacked(form)
    assert_prefill_then_decode_match_hf(model, lm.config, hf, label=arch, block_size=BS)


def test_engine_greedy_tokens_match_hf_generate(tiny_qwen):
    arch, folder, hf = tiny_qwen
    llm = LLM(load_model(folder, dtype=np.float32), num_blocks=64, block_size=BS, debug_checks=True)
    prompts = [np.random.default_rng(10 + i).integers(0, SHAPES["vocab_size"], 4 + 5 * i).tolist() for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=12, min_new_tokens=12, do_sample=False)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want, arch
    assert llm.stats()["num_used_blocks"] == 0


def test_a_missing_bias_or_norm_is_named(tiny_qwen, tmp_path):
    from safetensors.numpy import load_file, save_file

    arch, folder, _ = tiny_qwen
    gone = "model.layers.1.self_attn.k_proj.bias" if arch == "qwen2" else "model.layers.1.self_attn.k_norm.weight"
    tensors = load_file(folder / "model.safetensors")
    del tensors[gone]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match=gone.replace("1", r"\{1\}").replace(".", r"\.")):
        load_model(tmp_path)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_of_each_matches_transformers(tmp_path, arch):
    """A GGUF laid out as llama.cpp's converter writes Qwen2 / Qwen3 (HF row order, biases and
    q/k norms under their GGUF names), loaded by jaxpaged, against transformers' model holding the
    same tensors."""
    from test_gguf import D, F, H, HD, KVH, LAYERS, tiny_hf_tensors, tiny_tokens, write_tiny_gguf
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tensors = tiny_hf_tensors(seed=3, tied=False, arch=arch)
    for name in tensors:  # products of N(0, 1) weights overflow a 256-wide model's softmax into ties
        tensors[name] = (1.0 + 0.1 * tensors[name]) if "norm" in name else 0.05 * tensors[name]
    write_tiny_gguf(tmp_path / "tiny.gguf", tensors, arch=arch)
    config, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    hf = model_cls(config(vocab_size=len(tiny_tokens()[0]), hidden_size=D, intermediate_size=F,
                          num_hidden_layers=LAYERS, num_attention_heads=H, num_key_value_heads=KVH, head_dim=HD,
                          rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)).eval()
    hf.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    lm = load_model(tmp_path / "tiny.gguf", dtype=np.float32, cache_dir=tmp_path / "cache", attention_backend="xla")
    assert lm.config.max_position_embeddings == 512 and (lm.config.qkv_bias, lm.config.qk_norm) == (
        arch == "qwen2", arch == "qwen3")
    ids = np.random.default_rng(2).integers(0, len(tiny_tokens()[0]), 9).tolist()
    md = step_metadata([0], [len(ids)], block_size=BS, blocks_per_seq=4)
    for model in (lm.model, lm.model.unstacked()):
        logits, _ = model(np.array(ids, np.int32), init_kv_pool(LAYERS, 5, KVH, BS, HD), md)
        np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=2e-4, rtol=0)


@pytest.mark.parametrize("extra", [{"use_sliding_window": True, "sliding_window": 64},
                                   {"layer_types": ["full_attention", "sliding_attention"]}])
def test_sliding_window_attention_is_refused(extra):
    d = dict(SHAPES, model_type="qwen2", **extra)
    with pytest.raises(ValueError, match="unsupported sliding-window attention"):
        LlamaConfig.from_hf(d)


def test_mistral_matches_transformers_within_its_window(tmp_path):
    """A Mistral with a sliding window of 32 keys: up to 32 tokens that is full attention, so the
    logits are transformers'; the engine's length stops there."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    hf = MistralForCausalLM(MistralConfig(**SHAPES, sliding_window=32)).eval()
    hf.save_pretrained(tmp_path)
    lm = load_model(tmp_path, dtype=np.float32, attention_backend="xla")
    assert lm.config.max_position_embeddings == 32
    ids = np.random.default_rng(5).integers(0, SHAPES["vocab_size"], 30).tolist()
    md = step_metadata([0], [len(ids)], block_size=BS, blocks_per_seq=8)
    for model in (lm.model, lm.model.unstacked()):
        logits, _ = model(np.array(ids, np.int32), init_kv_pool(2, 9, 2, BS, 16), md)
        np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=1e-4, rtol=0)
    llm = LLM(lm, num_blocks=32, block_size=BS)
    with pytest.raises(ValueError, match="max_model_len is 32"):
        llm.generate([ids + ids[:5]], SamplingParams(max_tokens=1), use_tqdm=False)


def test_mistral_with_a_window_runs_up_to_it():
    """Mistral-7B-v0.1 attends to the last 4,096 keys in every layer: exactly full attention up to
    that length, which becomes the model's maximum."""
    d = dict(SHAPES, model_type="mistral", max_position_embeddings=32768)
    assert LlamaConfig.from_hf(d | {"sliding_window": 4096}).max_position_embeddings == 4096
    assert LlamaConfig.from_hf(d | {"sliding_window": None}).max_position_embeddings == 32768


def test_other_architectures_name_the_supported_ones():
    with pytest.raises(ValueError, match=r"model_type='gemma'.*supported: llama, mistral, qwen2, qwen3"):
        LlamaConfig.from_hf(dict(SHAPES, model_type="gemma", architectures=["GemmaForCausalLM"]))
