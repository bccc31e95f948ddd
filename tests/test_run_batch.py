"""``jaxpaged-run-batch`` (vLLM's ``run_batch``): OpenAI batch files run offline through the
server's app, every answer against the offline engine, every bad line answered in its place."""

import asyncio
import json

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.async_engine import AsyncLLM
from jaxpaged.run_batch import main, run_lines
from jaxpaged.serve import build_app

MODEL = "tiny"
ENGINE = dict(max_num_seqs=8, num_blocks=256, block_size=16)
PROMPTS = ["Paged attention splits", "Hello there", "1, 2, 3,"]


def line(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def batch_lines():
    good = [line(f"c{i}", "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 6, "temperature": 0})
            for i, p in enumerate(PROMPTS)]
    good += [
        line("chat", "/v1/chat/completions", {"model": MODEL, "max_tokens": 5, "temperature": 0,
                                               "messages": [{"role": "user", "content": "Hi"}]}),
        line("emb", "/v1/embeddings", {"model": MODEL, "input": PROMPTS}),
        line("score", "/v1/score", {"model": MODEL, "text_1": PROMPTS[0], "text_2": PROMPTS[1:]}),
        line("rerank", "/v1/rerank", {"model": MODEL, "query": PROMPTS[0], "documents": PROMPTS[1:]}),
    ]
    bad = [
        "{not json",
        line("get", "/v1/completions", {"prompt": "x"}, method="GET"),
        line("url", "/v1/models", {}),
        line("stream", "/v1/completions", {"model": MODEL, "prompt": "x", "stream": True}),
        line("tokens", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}),
        line("model", "/v1/completions", {"model": "other", "prompt": "x"}),
    ]
    return good, bad


def test_a_batch_gives_the_offline_engines_answers_and_each_bad_line_its_error(tiny_engine_model):
    llm = LLM(tiny_engine_model, **ENGINE)
    engine = AsyncLLM(llm)
    try:
        good, bad = batch_lines()
        outs = asyncio.run(run_lines(build_app(engine, served_model_name=MODEL), bad[:3] + good + bad[3:]))
    finally:
        engine.shutdown()
    assert llm.bm.stats().num_used_blocks == 0
    errors, ok, more_errors = outs[:3], outs[3:3 + len(good)], outs[3 + len(good):]
    assert [o["custom_id"] for o in ok] == ["c0", "c1", "c2", "chat", "emb", "score", "rerank"]
    assert all(o["error"] is None and o["response"]["status_code"] == 200 for o in ok)
    assert len({o["id"] for o in outs}) == len(outs)

    offline = LLM(tiny_engine_model, **ENGINE)
    texts = [o.outputs[0].text for o in offline.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0),
                                                          use_tqdm=False)]
    assert [o["response"]["body"]["choices"][0]["text"] for o in ok[:3]] == texts
    chat = offline.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=5, temperature=0),
                        use_tqdm=False)[0].outputs[0].text
    assert ok[3]["response"]["body"]["choices"][0]["message"]["content"] == chat
    vectors = [o.outputs.embedding for o in offline.embed(PROMPTS, use_tqdm=False)]
    np.testing.assert_allclose([d["embedding"] for d in ok[4]["response"]["body"]["data"]], vectors, atol=1e-6)
    want = [float(np.dot(vectors[0], v)) for v in vectors[1:]]  # unit vectors: the cosine
    np.testing.assert_allclose([d["score"] for d in ok[5]["response"]["body"]["data"]], want, atol=1e-6)
    assert [r["index"] for r in ok[6]["response"]["body"]["results"]] == list(np.argsort(want)[::-1])

    assert [(o["custom_id"], o["response"]["status_code"], o["response"]["body"]) for o in errors + more_errors] == [
        (None, 400, None), ("get", 400, None), ("url", 400, None), ("stream", 400, None), ("tokens", 400, None),
        ("model", 404, None)]
    messages = [o["error"] for o in errors + more_errors]
    assert messages[0].startswith("the line is not JSON") and messages[1] == "method must be 'POST', got 'GET'"
    assert messages[2].startswith("url '/v1/models' is not supported") and "stream" in messages[3]
    assert "max_tokens" in messages[4] and "the model 'other' does not exist" in messages[5]


def test_lines_the_app_cannot_take_are_answered_in_their_place(tiny_engine_model, monkeypatch):
    """JSON that Python reads but no JSON encoder writes (NaN, a lone surrogate), an internal
    error (a 500, as the server answers it), a custom_id that is no string: each is its line's
    answer and the other lines run."""
    import jaxpaged.serve

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(jaxpaged.serve, "rerank_response", broken)
    llm = LLM(tiny_engine_model, **ENGINE)
    engine = AsyncLLM(llm)
    good = line("ok", "/v1/completions", {"model": MODEL, "prompt": "a\u2028b", "max_tokens": 2})
    lines = ['{"custom_id": "nan", "method": "POST", "url": "/v1/completions", '
             '"body": {"model": "tiny", "prompt": "x", "temperature": NaN}}',
             '{"custom_id": "surrogate", "method": "POST", "url": "/v1/completions", '
             '"body": {"model": "tiny", "prompt": "\\ud800"}}',
             line("boom", "/v1/rerank", {"model": MODEL, "query": "q", "documents": ["d"]}),
             json.dumps({"custom_id": 5, "method": "POST", "url": "/v1/completions", "body": {}}), good]
    try:
        outs = asyncio.run(run_lines(build_app(engine, served_model_name=MODEL), lines))
    finally:
        engine.shutdown()
    got = [(o["custom_id"], o["response"]["status_code"]) for o in outs]
    assert got == [("nan", 400), ("surrogate", 400), ("boom", 500), (None, 400), ("ok", 200)], outs
    assert "ZeroDivisionError" in outs[2]["error"] and "custom_id must be a string" in outs[3]["error"]
    assert llm.bm.stats().num_used_blocks == 0


def test_the_command_line_writes_one_result_per_line(tiny_engine_folder, tmp_path, capsys):
    good, bad = batch_lines()
    src = tmp_path / "in.jsonl"
    chat = json.loads(good[3])
    chat["body"]["messages"][0]["content"] = "Hi\u2028there"  # unescaped, a line separator to str.splitlines
    src.write_text("\ufeff" + "\r\n".join([good[0], "", bad[1], json.dumps(chat, ensure_ascii=False)]) + "\n",
                   encoding="utf-8")  # a byte-order mark and Windows line ends too
    dst = tmp_path / "out.jsonl"
    args = ["-i", str(src), "-o", str(dst), "--model", str(tiny_engine_folder), "--served-model-name", MODEL,
            "--num-blocks", "64", "--block-size", "16", "--max-num-seqs", "4", "--log-level", "warning"]
    assert main(args) == 0
    outs = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [(o["custom_id"], o["response"]["status_code"]) for o in outs] == [("c0", 200), ("get", 400), ("chat", 200)]
    assert "3 requests, 1 failed" in capsys.readouterr().err
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.jsonl")]  # the temporary file renamed
    for bad_args, message in (([str(tmp_path / "missing.jsonl"), str(dst)], "--input-file"),
                              ([str(src), str(tmp_path / "no" / "out.jsonl")], "--output-file"),
                              ([str(src), str(tmp_path)], "is a folder")):
        with pytest.raises(SystemExit):
            main(["-i", bad_args[0], "-o", bad_args[1]])
        assert message in capsys.readouterr().err
