"""Embeddings (``LLM.embed``, ``AsyncLLM.encode``, ``POST /v1/embeddings``): each prompt's last
hidden state after the final norm, against transformers' ``last_hidden_state`` in float32; run
through the paged engine beside generation requests (chunked, prefix cached, preempted)."""

import base64
import re

import numpy as np
import openai
import pytest
import torch
from conftest import QWEN_SHAPES, make_tiny_qwen
from test_server import KEY, MODEL, Running

from jaxpaged import LLM, PoolingParams, SamplingParams
from jaxpaged.async_engine import AsyncLLM
from jaxpaged.loader import load_model

V = QWEN_SHAPES["vocab_size"]
PROMPTS = [np.random.default_rng(i).integers(0, V, n).tolist() for i, n in enumerate((1, 7, 23, 41, 16))]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3-embed")
    hf = make_tiny_qwen(folder, "qwen3", tie=False)
    return load_model(folder), hf


def hf_last_hidden(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf.model(torch.tensor([ids])).last_hidden_state[0, -1].numpy()


def unit(x):
    return x / np.linalg.norm(x)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_embeddings_are_transformers_last_hidden_state(qwen, async_scheduling):
    """Prompts of 1 to 41 tokens in chunks of 16 (chunked prefill), normalized, raw, cut to fewer
    dimensions; the blocks all freed after."""
    lm, hf = qwen
    llm = LLM(lm, num_blocks=64, block_size=4, max_num_batched_tokens=16, async_scheduling=async_scheduling,
              debug_checks=True)
    want = [hf_last_hidden(hf, p) for p in PROMPTS]
    outs = llm.embed(PROMPTS, use_tqdm=False)
    for p, o, w in zip(PROMPTS, outs, want):
        assert o.finished and o.prompt_token_ids == p and len(o.outputs.embedding) == QWEN_SHAPES["hidden_size"]
        np.testing.assert_allclose(o.outputs.embedding, unit(w), atol=2e-6, rtol=0)
    raw = llm.embed(PROMPTS[2], PoolingParams(normalize=False), use_tqdm=False)[0]
    np.testing.assert_allclose(raw.outputs.embedding, want[2], atol=1e-4, rtol=1e-5)
    cut = llm.embed(PROMPTS[3], PoolingParams(dimensions=24), use_tqdm=False)[0]
    np.testing.assert_allclose(cut.outputs.embedding, unit(want[3][:24]), atol=2e-6, rtol=0)
    kept = llm.embed(PROMPTS[3], truncate_prompt_tokens=10, use_tqdm=False)[0]
    assert kept.prompt_token_ids == PROMPTS[3][-10:]
    np.testing.assert_allclose(kept.outputs.embedding, unit(hf_last_hidden(hf, PROMPTS[3][-10:])), atol=2e-6, rtol=0)
    assert llm.stats()["num_used_blocks"] == 0


def test_embeddings_beside_generation_under_preemption_and_prefix_hits(qwen):
    """A pool too small for everything at once: generation requests and embeddings share the
    steps, requests are preempted, an embedding repeated hits the prefix cache; every completion
    is the one it gets alone and every embedding transformers'."""
    lm, hf = qwen
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = LLM(lm, num_blocks=128, block_size=4).generate(PROMPTS[1:], greedy, use_tqdm=False)
    llm = LLM(lm, num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=4, debug_checks=True)
    ids = [llm.add_request(p, greedy) for p in PROMPTS[1:]]
    outs = llm.embed(PROMPTS[::-1] + [PROMPTS[3]], use_tqdm=False)
    for p, o in zip(PROMPTS[::-1] + [PROMPTS[3]], outs):
        np.testing.assert_allclose(o.outputs.embedding, unit(hf_last_hidden(hf, p)), atol=2e-6, rtol=0)
    assert outs[-1].num_cached_tokens > 0  # the second time, its full blocks came from the cache
    done = {}
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert [done[i].outputs[0].token_ids for i in ids] == [a.outputs[0].token_ids for a in alone]
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["num_used_blocks"] == 0


def test_bad_pooling_params_are_refused_before_any_work(qwen):
    llm = LLM(qwen[0], num_blocks=32, block_size=4)
    for bad in (0, QWEN_SHAPES["hidden_size"] + 1, True):
        with pytest.raises(ValueError, match=r"dimensions must be an int in \[1, 64\]"):
            llm.embed(PROMPTS[:2], PoolingParams(dimensions=bad), use_tqdm=False)
    with pytest.raises(TypeError, match="pooling params must be PoolingParams"):
        llm.embed(PROMPTS[0], {"dimensions": 3}, use_tqdm=False)
    assert not llm.has_unfinished_requests()


def test_runner_takes_one_kind_of_request_or_both(qwen):
    """vLLM's ``runner``: ``"pooling"`` embeds and refuses completions, ``"generate"`` the reverse,
    ``"auto"`` (the default) takes both; a bad name fails before the engine is built."""
    lm = qwen[0]
    greedy = SamplingParams(temperature=0, max_tokens=3)
    pooling = LLM(lm, num_blocks=32, block_size=4, runner="pooling")
    assert len(pooling.embed(PROMPTS[1], use_tqdm=False)[0].outputs.embedding) == QWEN_SHAPES["hidden_size"]
    with pytest.raises(ValueError, match=r"runner='pooling': no completions"):
        pooling.generate(PROMPTS[1], greedy, use_tqdm=False)
    generate = LLM(lm, num_blocks=32, block_size=4, runner="generate")
    assert len(generate.generate(PROMPTS[1], greedy, use_tqdm=False)[0].outputs[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"runner='generate': no embeddings"):
        generate.embed(PROMPTS[1], use_tqdm=False)
    with pytest.raises(ValueError, match=r"runner='classify'; choose from \('auto', 'generate', 'pooling'\)"):
        LLM(lm, runner="classify")
    assert not pooling.has_unfinished_requests() and not generate.has_unfinished_requests()


def test_async_encode_yields_one_finished_output(qwen):
    import asyncio

    lm, hf = qwen

    async def run():
        engine = AsyncLLM(LLM(lm, num_blocks=32, block_size=4))
        try:
            return [o async for o in engine.encode({"prompt_token_ids": PROMPTS[2]})]
        finally:
            engine.shutdown()

    outs = asyncio.run(run())
    assert len(outs) == 1 and outs[0].finished
    np.testing.assert_allclose(outs[0].outputs.embedding, unit(hf_last_hidden(hf, PROMPTS[2])), atol=2e-6, rtol=0)


def test_score_is_the_cosine_of_transformers_embeddings(qwen):
    """``LLM.score`` (vLLM's, for an embedding model): one text against many, pairwise, a text
    against itself; a bad pairing is refused before any text runs."""
    lm, hf = qwen
    llm = LLM(lm, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    want = [unit(hf_last_hidden(hf, p)) for p in PROMPTS]
    one = llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in one], [want[0] @ w for w in want[1:]], atol=2e-6)
    assert one[1].prompt_token_ids == PROMPTS[0] + PROMPTS[2] and all(o.finished for o in one)
    pairwise = llm.score(PROMPTS[1:3], PROMPTS[3:5], use_tqdm=False)
    np.testing.assert_allclose([o.outputs.score for o in pairwise], [want[1] @ want[3], want[2] @ want[4]], atol=2e-6)
    assert abs(llm.score(PROMPTS[3], PROMPTS[3], use_tqdm=False)[0].outputs.score - 1) < 1e-6
    with pytest.raises(ValueError, match="data_1 has 2 texts and data_2 3: give one first text for all"):
        llm.score(PROMPTS[:2], PROMPTS[:3], use_tqdm=False)
    with pytest.raises(ValueError, match="data_2 is empty"):
        llm.score(PROMPTS[0], [], use_tqdm=False)
    assert not llm.has_unfinished_requests() and llm.stats()["num_used_blocks"] == 0


SERVED = dict(max_num_seqs=8, num_blocks=256, block_size=16)  # the offline engine's too: one geometry's programs


@pytest.fixture(scope="module")
def served(tiny_engine_model):
    s = Running(LLM(tiny_engine_model, **SERVED))
    yield s
    s.stop()


def test_server_embeddings_match_the_offline_engine(served, tiny_engine_model):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    texts = ["Paged attention splits the KV cache into blocks.", "Hello", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10"]
    offline = LLM(tiny_engine_model, **SERVED).embed(texts, use_tqdm=False)
    got = client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in got.data] == [0, 1, 2]
    for d, o in zip(got.data, offline):
        np.testing.assert_allclose(d.embedding, o.outputs.embedding, atol=1e-6, rtol=0)
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(len(o.prompt_token_ids) for o in offline)
    b64 = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="base64", dimensions=32)
    vec = np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4")
    want = np.asarray(offline[0].outputs.embedding[:32])
    # Alone against the offline batch of three: float32 sums in other orders (1.1e-6 seen on an EPYC).
    np.testing.assert_allclose(vec, want / np.linalg.norm(want), atol=1e-5, rtol=0)
    ids = client.embeddings.create(model=MODEL, input=[offline[1].prompt_token_ids])
    np.testing.assert_allclose(ids.data[0].embedding, offline[1].outputs.embedding, atol=1e-5, rtol=0)


def test_server_score_and_rerank_match_the_offline_engine(served, tiny_engine_model):
    import httpx

    def post(path, body):
        r = httpx.post(served.url + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    query = "Where does the KV cache live?"
    docs = ["In blocks on the device.", "Paris is the capital of France.", "Hello", "The pool of KV blocks."]
    offline = LLM(tiny_engine_model, **SERVED).embed([query] + docs, use_tqdm=False)
    q, d = unit(offline[0].outputs.embedding), [unit(o.outputs.embedding) for o in offline[1:]]
    want = [float(q @ x) for x in d]
    # vLLM's usage: each pair's tokens (the query counted with every document)
    tokens = sum(len(offline[0].prompt_token_ids) + len(o.prompt_token_ids) for o in offline[1:])
    for path in ("/v1/score", "/score"):
        got = post(path, {"text_1": query, "text_2": docs})
        assert [x["index"] for x in got["data"]] == [0, 1, 2, 3] and got["object"] == "list"
        np.testing.assert_allclose([x["score"] for x in got["data"]], want, atol=1e-6)
        assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] == tokens
    pairwise = post("/v1/score", {"text_1": docs[:2], "text_2": docs[2:]})
    np.testing.assert_allclose([x["score"] for x in pairwise["data"]], [d[0] @ d[2], d[1] @ d[3]],
                               atol=1e-5)  # a batch of four against the offline five: float32 sums may differ
    assert pairwise["usage"]["total_tokens"] == sum(len(o.prompt_token_ids) for o in offline[1:])
    order = np.argsort(want)[::-1]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        got = post(path, {"query": query, "documents": docs, "top_n": 2})
        assert [r["index"] for r in got["results"]] == order[:2].tolist(), got
        assert [r["document"]["text"] for r in got["results"]] == [docs[i] for i in order[:2]]
        np.testing.assert_allclose([r["relevance_score"] for r in got["results"]], np.asarray(want)[order[:2]],
                                   atol=1e-6)
        assert got["usage"]["total_tokens"] == tokens
    assert len(post("/v1/rerank", {"query": query, "documents": docs})["results"]) == 4  # top_n 0: all
    assert len(post("/v1/rerank", {"query": query, "documents": docs, "top_n": 9})["results"]) == 4
    for path in ("/score", "/rerank", "/v2/rerank"):  # the aliases outside /v1 run the model too: the key guards them
        r = httpx.post(served.url + path, json={"model": MODEL, "text_1": "a", "text_2": "b", "query": "a",
                                                 "documents": ["b"]}, timeout=60)
        assert r.status_code == 401, (path, r.text)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
    ("/v1/score", {"text_1": "", "text_2": "b"}, "text_1"),
    ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "a", "documents": ["b"], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_server_refuses_bad_score_and_rerank_requests_naming_the_field(served, path, body, param):
    import httpx

    r = httpx.post(served.url + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert served.llm.bm.stats().num_used_blocks == 0


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/embeddings", {"input": [[5], [5] * 600]}, "input", r"input\[1\] has 600 tokens; max_model_len is 512"),
    ("/v1/score", {"text_1": "a", "text_2": ["b", "a" + " hello" * 600]}, "text_2", r"text_2\[1\] has \d+ tokens"),
    ("/v1/score", {"text_1": "a" + " hello" * 600, "text_2": ["b"]}, "text_1", r"text_1 has \d+ tokens"),
    ("/v1/rerank", {"query": "a", "documents": ["b", "c", "a" + " hello" * 600]}, "documents",
     r"documents\[2\] has \d+ tokens"),
    ("/v1/rerank", {"query": "a" + " hello" * 600, "documents": ["b"]}, "query", r"query has \d+ tokens"),
])
def test_server_names_the_text_that_is_too_long(served, path, body, param, message):
    import httpx

    r = httpx.post(served.url + path, json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"},
                   timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and re.match(message, err["message"]), r.text
    assert served.llm.bm.stats().num_used_blocks == 0


def test_embed_and_score_name_the_prompt_that_is_too_long(qwen):
    lm, _ = qwen
    llm = LLM(lm, num_blocks=64, block_size=4, max_model_len=64)
    long = [5] * 64
    with pytest.raises(ValueError, match=r"^prompts\[2\] has 64 tokens; max_model_len is 64"):
        llm.embed([PROMPTS[0], PROMPTS[1], long], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^data_2\[1\] has 64 tokens"):
        llm.score(PROMPTS[0], [PROMPTS[1], long], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^data_1 has 64 tokens"):
        llm.score(long, [PROMPTS[1]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"^prompt has 64 tokens"):
        llm.embed(long, use_tqdm=False)
    assert not llm.has_unfinished_requests() and llm.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("body,param", [({"input": "hi", "dimensions": 10_000}, "dimensions"),
                                        ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
                                        ({"input": [[5] * 600]}, "input"),
                                        ({"input": "hi", "encoding_format": "bytes"}, "encoding_format")])
def test_server_refuses_bad_embedding_requests_naming_the_field(served, body, param):
    import httpx

    r = httpx.post(served.url + "/v1/embeddings", json={"model": MODEL, **body},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert served.llm.bm.stats().num_used_blocks == 0


def test_the_runner_flag_reaches_the_engine():
    from jaxpaged.cli import build_parser, engine_kwargs
    from jaxpaged.serve import build_parser as serve_parser

    assert engine_kwargs(build_parser().parse_args(["hi", "--runner", "pooling"]))["runner"] == "pooling"
    assert engine_kwargs(serve_parser().parse_args(["--runner", "generate"]))["runner"] == "generate"
    assert engine_kwargs(build_parser().parse_args(["hi"]))["runner"] == "auto"
