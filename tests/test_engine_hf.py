"""The engine on the real default model against Hugging Face transformers (same GGUF, float32)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from jaxpaged import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion in one sentence.",
    "List three prime numbers.", "How do airplanes fly?", "Translate 'good morning' into Spanish.",
    "What is 12 times 11?", "Name a famous painting by Leonardo da Vinci.", "Give me a tip for learning Python.",
    "Why is the sky blue?", "Write a short greeting for a birthday card.", "What does a CPU do?",
    "Suggest a name for a pet turtle.", "What is photosynthesis?", "Describe a cat in five words.",
    "What is the boiling point of water in Fahrenheit?",
]


@pytest.fixture(scope="module")
def llm(smollm):
    return LLM(smollm, attention_backend="auto", debug_checks=True, num_blocks=512)


@pytest.fixture(scope="module")
def chat_prompts(llm):
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]


def hf_generate(hf, ids, **kw):
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), **kw)
    return out[0, len(ids):].tolist()


def hf_generate_batch(hf, prompts, **kw):
    """Left-padded batched HF generate: a fast first pass (padding can shift float rounding)."""
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=mask, pad_token_id=0, **kw)
    return out[:, n:].tolist()


def test_greedy_batch_matches_transformers(llm, chat_prompts, hf_smollm):
    hf, _ = hf_smollm
    params = SamplingParams(temperature=0, max_tokens=48, min_tokens=48)  # EOS banned on both sides
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts], params, use_tqdm=False)
    kw = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False)
    batched = hf_generate_batch(hf, chat_prompts, **kw)
    for q, p, o, want in zip(QUESTIONS, chat_prompts, outs, batched):
        if o.outputs[0].token_ids != want:  # the unpadded single-prompt run is the oracle
            want = hf_generate(hf, p, **kw)
        assert o.outputs[0].token_ids == want, q
    assert llm.stats()["num_used_blocks"] == 0


def test_beam_search_matches_transformers(llm, chat_prompts, hf_smollm):
    hf, _ = hf_smollm
    params = SamplingParams(temperature=0, use_beam_search=True, beam_width=4, max_tokens=16)
    prompts = chat_prompts[:4]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        want = hf_generate(hf, p, max_new_tokens=16, num_beams=4, do_sample=False, length_penalty=1.0,
                           early_stopping=False)
        got = o.outputs[0].token_ids
        assert got == want[:len(got)] and len(got) == len(want), (got, want)
    assert llm.stats()["num_used_blocks"] == 0


def test_prompt_logprobs_match_transformers_with_and_without_cache_hit(llm, chat_prompts, hf_smollm):
    hf, _ = hf_smollm
    ids = chat_prompts[0] + chat_prompts[1]  # longer than a block (64 tokens on CPU): a cache hit needs a full one
    assert len(ids) > llm.block_size
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1).numpy()
    want = np.array([ref[i - 1, ids[i]] for i in range(1, len(ids))])
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    warm = SamplingParams(temperature=0, max_tokens=2)
    llm.generate({"prompt_token_ids": ids}, warm, use_tqdm=False)  # the prompt's blocks are now cached
    for run in range(2):
        o = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(ids)
        got = np.array([o.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        np.testing.assert_allclose(got, want, atol=1e-3)
        for i in range(1, len(ids)):
            top = sorted(o.prompt_logprobs[i].values(), key=lambda lp: -lp.logprob)[0]
            np.testing.assert_allclose(top.logprob, ref[i - 1].max(), atol=1e-3)
    # A plain request on the same prompt does hit the cache.
    assert llm.generate({"prompt_token_ids": ids}, warm, use_tqdm=False)[0].num_cached_tokens > 0


def test_cli_main_command(smollm_first_load):
    _, _, cache = smollm_first_load
    env = {**os.environ, "JAXPAGED_CACHE_DIR": str(cache)}
    r = subprocess.run([sys.executable, "-m", "jaxpaged", "--chat", "--max-tokens", "24", "--no-progress",
                        "What is the capital of France?"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "1 requests" in r.stderr and "tok/s" in r.stderr and "peak KV utilization" in r.stderr


BACKEND_GREEDY = SamplingParams(temperature=0, max_tokens=32, min_tokens=32)


@pytest.fixture(scope="module")
def reference_backend_tokens(smollm, chat_prompts):
    """The pure-jnp reference backend's 32 greedy tokens for three chat prompts (run once)."""
    prompts = [{"prompt_token_ids": p} for p in chat_prompts[:3]]
    outs = LLM(smollm, attention_backend="reference", num_blocks=64).generate(prompts, BACKEND_GREEDY, use_tqdm=False)
    return prompts, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_backends_give_reference_greedy_tokens(smollm, reference_backend_tokens, backend):
    """The default model through each attention backend: the same 32 greedy tokens as the
    pure-jnp reference backend (pallas runs in interpret mode on CPU)."""
    prompts, ref = reference_backend_tokens
    got = LLM(smollm, attention_backend=backend, num_blocks=64).generate(prompts, BACKEND_GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == ref
