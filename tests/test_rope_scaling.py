"""RoPE scaling (linear position interpolation, YaRN) against transformers in float32, at positions
past the original context where the scaling matters, on a Llama and a Qwen2."""

import numpy as np
import pytest
import torch
from paged import step_metadata

from jaxpaged.config import LinearRopeScaling, LlamaConfig, YarnRopeScaling
from jaxpaged.kv_cache import init_kv_pool
from jaxpaged.loader import load_model

BS = 16
SHAPES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
              initializer_range=0.2)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-betas-untruncated": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 48,
                               "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                              "attention_factor": 1.3},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
                    "mscale_all_dim": 0.5},
}


def make(folder, arch: str, rope: dict):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config, model_cls = {"llama": (HFLlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    model = model_cls(config(**SHAPES, rope_scaling=dict(rope, rope_theta=10000.0))).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("arch,name", [("llama", n) for n in SCALINGS] + [("qwen2", "yarn")])
def test_scaled_rope_matches_transformers_past_the_original_context(tmp_path, arch, name):
    hf = make(tmp_path, arch, SCALINGS[name])
    lm = load_model(tmp_path, dtype=np.float32, attention_backend="xla")
    kind = {"linear": LinearRopeScaling}.get(name, YarnRopeScaling)
    assert isinstance(lm.config.rope_scaling, kind)
    ids = np.random.default_rng(1).integers(0, SHAPES["vocab_size"], 150).tolist()  # past 32 / 48 positions
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
    md = step_metadata([0], [len(ids)], block_size=BS, blocks_per_seq=10)
    for model in (lm.model, lm.model.unstacked()):
        logits, _ = model(np.array(ids, np.int32), init_kv_pool(2, 11, 2, BS, 16), md)
        np.testing.assert_allclose(np.asarray(logits), want, atol=1e-4, rtol=0)


def test_yarn_factors_follow_the_paper():
    """The attention factor is 0.1 ln(factor) + 1, or the ratio of two such with ``mscale`` and
    ``mscale_all_dim``, or the config's own; with no factor, the context's growth (DeepSeek's)."""
    base = dict(SHAPES, model_type="qwen2")
    yarn = {"rope_type": "yarn", "original_max_position_embeddings": 128}
    cfg = LlamaConfig.from_hf(base | {"rope_scaling": yarn | {"factor": 4.0}})
    assert cfg.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    cfg = LlamaConfig.from_hf(base | {"rope_scaling": yarn | {"factor": 4.0, "mscale": 2.0, "mscale_all_dim": 1.0}})
    assert cfg.rope_scaling.attention_factor == pytest.approx((0.2 * np.log(4.0) + 1) / (0.1 * np.log(4.0) + 1))
    cfg = LlamaConfig.from_hf(base | {"rope_scaling": yarn | {"factor": None}})
    assert cfg.rope_scaling.factor == 4.0  # 512 / 128


def test_unknown_rope_scaling_names_the_supported_ones():
    with pytest.raises(ValueError, match=r"'dynamic' \(supported: none, llama3, linear, yarn\)"):
        LlamaConfig.from_hf(dict(SHAPES, rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
