"""The Flax Llama over the paged pool equals Hugging Face's PyTorch Llama in float32."""

import numpy as np
import pytest
import torch

from jaxpaged.kv_cache import init_kv_pool
from jaxpaged.loader import load_model
from paged import dot_precisions, step_metadata

BS = 4  # small blocks, so sequences span many blocks


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def new_pool(cfg, num_blocks):
    return init_kv_pool(cfg.num_layers, num_blocks, cfg.num_kv_heads, BS, cfg.head_dim)


def test_prefill_logits_match_hf(tiny_hf):
    folder, hf = tiny_hf
    lm = load_model(folder, dtype=np.float32, attention_backend="reference")  # not the GPU default, bf16
    ids = np.random.default_rng(1).integers(0, lm.config.vocab_size, 23).tolist()
    md = step_metadata([0], [len(ids)], block_size=BS, blocks_per_seq=8)
    logits, _ = lm.model(np.array(ids, np.int32), new_pool(lm.config, 9), md)
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_batched_prefill_then_decode_matches_each_sequence_alone(tiny_hf):
    """Three sequences of different lengths share one pool: a packed prefill, then decode steps."""
    folder, hf = tiny_hf
    lm = load_model(folder, dtype=np.float32, attention_backend="reference")  # not the GPU default, bf16
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, lm.config.vocab_size, n).tolist() for n in (5, 11, 2)]
    per_seq = 8
    kv = new_pool(lm.config, 1 + per_seq * len(seqs))
    # Prefill all three in one step, with padding tokens and a padding row, as the engine pads.
    md = step_metadata([0] * 3, [len(s) for s in seqs], block_size=BS, blocks_per_seq=per_seq,
                       pad_tokens=3, pad_seqs=1)
    tokens = np.array(sum(seqs, []) + [0, 0, 0], np.int32)
    last = np.cumsum([len(s) for s in seqs]) - 1
    logits, kv = lm.model(tokens, kv, md, logits_indices=np.asarray(last, np.int32))
    for step in range(5):
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(np.asarray(logits[i]), hf_logits(hf, s)[-1], atol=1e-4, rtol=0,
                                       err_msg=f"sequence {i}, step {step}")
        nxt = [int(rng.integers(0, lm.config.vocab_size)) for _ in seqs]
        md = step_metadata([len(s) for s in seqs], [1] * 3, block_size=BS, blocks_per_seq=per_seq)
        logits, kv = lm.model(np.array(nxt, np.int32), kv, md)
        for s, t in zip(seqs, nxt):
            s.append(t)


def test_chunked_prefill_matches_hf(tiny_hf):
    """A prompt fed in chunks that start mid-block attends to its cached prefix."""
    folder, hf = tiny_hf
    lm = load_model(folder, dtype=np.float32, attention_backend="reference")  # not the GPU default, bf16
    ids = np.random.default_rng(3).integers(0, lm.config.vocab_size, 19).tolist()
    kv = new_pool(lm.config, 9)
    done = 0
    for chunk in (6, 7, 6):
        md = step_metadata([done], [chunk], block_size=BS, blocks_per_seq=8)
        logits, kv = lm.model(np.array(ids[done:done + chunk], np.int32), kv, md)
        done += chunk
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids)[-6:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_float32_matmuls_ask_for_full_precision(tiny_hf, dtype):
    """On GPU the default multiplies float32 in TF32 (~1e-3 relative error); a float32
    model must ask for HIGHEST in every projection and the LM head (and the attention
    it calls). bfloat16 leaves the choice to ``jax.default_matmul_precision``."""
    import jax
    import jax.numpy as jnp

    folder, _ = tiny_hf
    lm = load_model(folder, dtype=getattr(jnp, dtype), attention_backend="xla")
    md = step_metadata([0], [5], block_size=BS, blocks_per_seq=2)
    pool = init_kv_pool(lm.config.num_layers, 3, lm.config.num_kv_heads, BS, lm.config.head_dim,
                        getattr(jnp, dtype))
    jaxpr = jax.make_jaxpr(lambda t, kv: lm.model(t, kv, md))(np.arange(5, dtype=np.int32), pool).jaxpr
    kinds = [None if p is None else set(p) for p in dot_precisions(jaxpr)]
    highest = {jax.lax.Precision.HIGHEST}
    # The scanned layer body's 7 projections and the LM head; the xla attention path's own
    # dots compute in float32 whatever the pool's dtype.
    if dtype == "float32":
        assert len(kinds) >= 8 and all(k == highest for k in kinds), kinds
    else:  # the model's 8 dots follow jax.default_matmul_precision
        assert kinds.count(None) == 8 and all(k in (None, highest) for k in kinds), kinds
