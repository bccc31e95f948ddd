"""The OpenAI-compatible server, run for real on 127.0.0.1 (an ephemeral port) over a tiny
model, spoken to with the official ``openai`` client and with raw HTTP (httpx)."""

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from jaxpaged import LLM, SamplingParams
from jaxpaged.async_engine import AsyncLLM
from jaxpaged.serve import Server, build_app

MODEL, KEY = "tiny-llama", "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = dict(max_num_seqs=16, num_blocks=512, block_size=16)
PROMPTS = ["The quick brown fox", "Paged attention splits the KV cache into blocks so that", "1, 2, 3, 4, 5,",
           "Bonjour, je m'appelle", "def fibonacci(n):\n", "Q: What is the capital of Japan?\nA:"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paged attention?"}]


class Running:
    """A server on its own thread: ``url``, its ``engine``, and the most requests seen running."""

    def __init__(self, llm: LLM, **app_options):
        self.llm = llm
        self.engine = AsyncLLM(llm)
        self.peak_running = 0
        self.engine.stat_loggers.append(self._record)
        app = build_app(self.engine, served_model_name=MODEL, api_key=KEY, **app_options)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % sock.getsockname()[1]
        self.server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), self.engine)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)

    def _record(self, it):
        self.peak_running = max(self.peak_running, it.scheduler.num_running)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive() and not self.engine._thread.is_alive()
        assert self.llm.bm.stats().num_used_blocks == 0 and not self.llm.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def srv(tiny_engine_model):
    s = Running(LLM(tiny_engine_model, **ENGINE))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(tiny_engine_model):
    return LLM(tiny_engine_model, **ENGINE)


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        yield c


def metrics(http) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    pairs = (line.rsplit(" ", 1) for line in r.text.splitlines() if line and not line.startswith("#"))
    return {k: float(v) for k, v in pairs}


def wait_idle(http, timeout=15.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        if m["jaxpaged:num_requests_running"] == 0 and m["jaxpaged:kv_cache_used_blocks"] == 0 \
                and m["jaxpaged:num_requests_waiting"] == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def sse(lines) -> list:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded except ``[DONE]``."""
    out = [line[len("data: "):] for line in lines if line]
    assert all(not line.startswith("data: ") for line in out)
    return [d if d == "[DONE]" else json.loads(d) for d in out]


# ---- the happy paths ----------------------------------------------------------------------


def test_models_health_metrics(srv, http, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
    m = metrics(http)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate",
                 "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count"):
        assert f"jaxpaged:{name}" in m
    assert 0 <= m["jaxpaged:kv_cache_usage_perc"] <= 1
    info = next(line for line in http.get("/metrics").text.splitlines() if line.startswith("jaxpaged:cache_config"))
    llm = srv.llm
    assert (f'block_size="{llm.block_size}"' in info and 'cache_dtype="auto"' in info and 'kv_array_dtype="float32"'
            in info and f'num_gpu_blocks="{ENGINE["num_blocks"]}"' in info and info.endswith(" 1.0")), info


def test_metrics_count_what_a_request_used(http, client):
    """The counters move by exactly one request's usage; the latency histograms record it."""
    before = wait_idle(http)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=7, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = wait_idle(http)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["jaxpaged:prompt_tokens_total"] == r.usage.prompt_tokens
    assert delta["jaxpaged:generation_tokens_total"] == r.usage.completion_tokens == 7
    assert delta["jaxpaged:time_to_first_token_seconds_count"] == 1
    assert 1 <= delta["jaxpaged:inter_token_latency_seconds_count"] <= 6
    assert after["jaxpaged:kv_cache_usage_perc"] == 0 and after["jaxpaged:num_requests_running"] == 0


def test_greedy_completions_equal_the_offline_llm(client, offline):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = offline.generate(PROMPTS[:3], greedy, use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in expected]
    assert [c.finish_reason for c in r.choices] == ["length"] * 3
    assert r.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected)
    assert r.usage.completion_tokens == 36 and r.usage.total_tokens == r.usage.prompt_tokens + 36


def test_greedy_chat_equals_the_offline_llm(client, offline):
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.outputs[0].text
    assert r.choices[0].finish_reason == {"length": "length", "stop": "stop"}[expected.outputs[0].finish_reason]
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)


def _stream_completion(client, **kw):
    texts, finish, usage = {}, {}, None
    for ch in client.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kw):
        if ch.usage is not None:
            assert ch.choices == []
            usage = ch.usage
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    return texts, finish, usage


def _stream_chat(client, **kw):
    texts, finish, usage, roles = {}, {}, None, []
    for ch in client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                             **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            roles += [c.delta.role] if c.delta.role else []
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert roles == ["assistant"] * len(texts)
    return texts, finish, usage


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_completion_deltas_concatenate_to_the_text(client, n):
    kw = dict(prompt=PROMPTS[1], max_tokens=16, temperature=0.8 if n > 1 else 0, seed=3, n=n)
    r = client.completions.create(model=MODEL, **kw)
    texts, finish, usage = _stream_completion(client, **kw)
    assert sorted(c.index for c in r.choices) == list(range(n))
    assert texts == {c.index: c.text for c in r.choices}
    assert finish == {c.index: c.finish_reason for c in r.choices}
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == r.usage.model_dump(
        exclude={"prompt_tokens_details"})  # (the second run may find the prompt cached)
    if n == 2:
        assert len({c.text for c in r.choices}) == 2  # two samples, not one twice


@pytest.mark.parametrize("n", [1, 2])
def test_streamed_chat_deltas_concatenate_to_the_message(client, n):
    kw = dict(messages=CHAT, max_tokens=16, temperature=0.8 if n > 1 else 0, seed=5, n=n)
    r = client.chat.completions.create(model=MODEL, **kw)
    texts, finish, usage = _stream_chat(client, **kw)
    assert texts == {c.index: c.message.content for c in r.choices} and len(texts) == n
    assert finish == {c.index: c.finish_reason for c in r.choices}
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == r.usage.model_dump(exclude={"prompt_tokens_details"})


def test_raw_http_sse_and_json(http):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    assert events[-1] == "[DONE]" and all(e["object"] == "text_completion" for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length" and "usage" not in events[-2]  # not asked for
    full = http.post("/v1/completions", json={**body, "stream": False}).json()
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == full["choices"][0]["text"]
    assert full["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPTS[0], "n": 2, "temperature": 0.8, "seed": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "temperature": 0.8, "seed": 1}),
])
def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(http, path, body):
    options = {"include_usage": True, "continuous_usage_stats": True}
    with http.stream("POST", path, json={**body, "max_tokens": 5, "stream": True, "stream_options": options,
                                         "ignore_eos": True}) as r:
        events = sse(r.iter_lines())[:-1]
    *chunks, last = events
    prompt = last["usage"]["prompt_tokens"]
    seen = {0: 0, 1: 0}
    for e in chunks:  # each choice's tokens so far: growing one by one to its 5
        (c,), u = e["choices"], e["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"]
        assert u["completion_tokens"] in (seen[c["index"]], seen[c["index"]] + 1)
        seen[c["index"]] = u["completion_tokens"]
    assert seen == {0: 5, 1: 5} and last["choices"] == [] and last["usage"]["completion_tokens"] == 10
    with http.stream("POST", path, json={**body, "max_tokens": 2, "stream": True, "stream_options": {
            "continuous_usage_stats": True}}) as r:  # without include_usage: none (vLLM's)
        assert not any("usage" in e for e in sse(r.iter_lines())[:-1])


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPTS[0], "n": 2, "temperature": 0.8, "seed": 1}),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "temperature": 0.8, "seed": 1}),
])
def test_token_ids_come_back_with_the_text_when_asked(http, offline, path, body):
    """vLLM's ``return_token_ids``: the prompt's ids, and each choice's; streamed, the prompt's in
    the first chunk (a choice's, for completions) and each chunk's new tokens, which add up."""
    body = {**body, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    whole = http.post(path, json=body).json()
    chat = path.endswith("chat/completions")
    prompt = whole["prompt_token_ids"] if chat else whole["choices"][0]["prompt_token_ids"]
    assert prompt == (offline.chat_prompt(CHAT)["prompt_token_ids"] if chat else
                      offline.inputs.to_token_ids(PROMPTS[0])[1])
    ids = {c["index"]: c["token_ids"] for c in whole["choices"]}
    assert all(len(t) == 6 for t in ids.values())
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        events = sse(r.iter_lines())[:-1]
    streamed, prompts = {0: [], 1: []}, []
    for e in events:
        if chat and "prompt_token_ids" in e:
            prompts.append(e["prompt_token_ids"])
        for c in e["choices"]:
            streamed[c["index"]] += c.get("token_ids") or []
            if "prompt_token_ids" in c:
                prompts.append(c["prompt_token_ids"])
    assert streamed == ids and prompts == [prompt, prompt]  # (once for each of the two choices)
    plain = http.post(path, json={**body, "return_token_ids": None}).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings(client, offline, stream):
    base = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    k = len(base) // 2
    stop = base[k:k + 3]
    expected = base[:base.index(stop)]
    kw = dict(prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop, "never matches"])
    if stream:
        texts, finish, _ = _stream_completion(client, **kw)
        assert (texts[0], finish[0]) == (expected, "stop")
    else:
        c = client.completions.create(model=MODEL, **kw).choices[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (expected, "stop", stop)
    kept = dict(kw, extra_body={"include_stop_str_in_output": True})  # vLLM's: the stop string stays in the text
    if stream:
        texts, finish, _ = _stream_completion(client, **kept)
        assert (texts[0], finish[0]) == (expected + stop, "stop")
        chat = _stream_chat(client, messages=CHAT, max_tokens=24, temperature=0, **{k: kept[k] for k in (
            "stop", "extra_body")})[0][0]
    else:
        c = client.completions.create(model=MODEL, **kept).choices[0]
        assert (c.text, c.finish_reason, c.stop_reason) == (expected + stop, "stop", stop)
        chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                              stop=kept["stop"], extra_body=kept["extra_body"])
        chat = chat.choices[0].message.content
    free = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0).choices[0]
    at = free.message.content.find(stop)
    assert chat == (free.message.content if at < 0 else free.message.content[:at + len(stop)])
    # Under min_tokens a match neither stops nor cuts the text: "ab" (one token) is forced every step, so "ba"
    # is there from the second token on but counts only from the fourth.
    ab = offline.tokenizer.encode("ab", add_special_tokens=False)[0]
    kw = dict(prompt=PROMPTS[3], max_tokens=10, temperature=0, stop=["ba"], logit_bias={str(ab): 100},
              extra_body={"min_tokens": 4})
    if stream:
        texts, finish, usage = _stream_completion(client, **kw)
        assert (texts[0], finish[0], usage.completion_tokens) == ("ababa", "stop", 4)
    else:
        r = client.completions.create(model=MODEL, **kw)
        assert (r.choices[0].text, r.choices[0].stop_reason, r.usage.completion_tokens) == ("ababa", "ba", 4)


def test_completion_logprobs(client):
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=8, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True})
    c = client.completions.create(**kw).choices[0]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) in (3, 4) and logprob <= 0
        assert logprob == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
    streamed = [t for ch in client.completions.create(stream=True, **kw) for x in ch.choices if x.logprobs
                for t in x.logprobs.tokens]
    assert streamed == lp.tokens


def _echo_lp(ch) -> dict:
    lp = ch.logprobs
    return dict(tokens=lp.tokens, token_logprobs=lp.token_logprobs, top_logprobs=lp.top_logprobs,
                text_offset=lp.text_offset)


def test_echo_scores_prompts_as_the_offline_llm_does(client, offline):
    """lm-evaluation-harness's log-likelihood request (``echo``, ``max_tokens`` 0, ``logprobs``): each
    choice is its prompt with the offline engine's prompt logprobs, and nothing is generated."""
    expected = offline.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                                use_tqdm=False)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], echo=True, max_tokens=0, logprobs=2)
    assert r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(o.prompt_token_ids) for o in expected)
    for c, o in zip(r.choices, expected):
        assert (c.text, c.finish_reason) == (o.prompt, "length")
        lp, ids = _echo_lp(c), o.prompt_token_ids
        assert len(lp["tokens"]) == len(lp["text_offset"]) == len(ids)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing scores the first
        want = [e[t] for t, e in zip(ids[1:], o.prompt_logprobs[1:])]
        assert lp["tokens"][1:] == [w.decoded_token for w in want]
        assert lp["token_logprobs"][1:] == pytest.approx([w.logprob for w in want], abs=1e-5)
        assert all(len(top) in (2, 3) for top in lp["top_logprobs"][1:])
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]


def test_prompt_logprobs_come_back_as_vllm_returns_them(http, offline):
    ids = offline.tokenizer.encode(PROMPTS[2])
    o = offline.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    want = [None] + [{str(t): {"logprob": pytest.approx(e.logprob, abs=1e-5), "rank": e.rank,
                               "decoded_token": e.decoded_token} for t, e in entry.items()}
                     for entry in o.prompt_logprobs[1:]]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    assert c["prompt_logprobs"] == want and len(want) == len(ids)
    plain = http.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in plain["choices"][0]
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                   "prompt_logprobs": 0}).json()
    lps = chat["prompt_logprobs"]
    assert lps[0] is None and len(lps) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in lps[1:])


def test_echo_scores_a_greedy_continuation_as_it_was_generated(client, offline, srv):
    """Scoring prompt + continuation (token ids, echoed) gives the continuation the logprobs its
    decode steps gave it: prompt scoring and decoding agree. With ``max_tokens`` > 0 the choice is
    the prompt, then the completion, and the logprobs run on from the prompt's."""
    prompt = srv.llm.tokenizer.encode(PROMPTS[1])
    gen = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, logprobs=0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    scored = client.completions.create(model=MODEL, prompt=prompt + gen.token_ids, echo=True, max_tokens=0,
                                       logprobs=0).choices[0]
    assert scored.text == srv.llm.tokenizer.decode(prompt + gen.token_ids)
    lp = _echo_lp(scored)
    assert lp["token_logprobs"][len(prompt):] == pytest.approx(
        [e[t].logprob for t, e in zip(gen.token_ids, gen.logprobs)], abs=1e-4)
    c = client.completions.create(model=MODEL, prompt=prompt, echo=True, max_tokens=6, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True}).choices[0]
    assert c.text == srv.llm.tokenizer.decode(prompt) + gen.text
    assert _echo_lp(c)["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    samples = client.completions.create(model=MODEL, prompt=PROMPTS[1], echo=True, n=2, temperature=0.8, seed=1,
                                        max_tokens=4).choices
    assert sorted(x.index for x in samples) == [0, 1] and all(x.text.startswith(PROMPTS[1]) for x in samples)


@pytest.mark.parametrize("max_tokens", [0, 6])
def test_streamed_echo_equals_the_whole_response(client, max_tokens):
    kw = dict(prompt=PROMPTS[0], echo=True, max_tokens=max_tokens, temperature=0, logprobs=1,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(model=MODEL, **kw)
    texts, finish, usage = _stream_completion(client, **kw)
    assert texts == {0: whole.choices[0].text} and texts[0].startswith(PROMPTS[0])
    assert finish == {0: "length"} and usage.model_dump() == whole.usage.model_dump()
    assert usage.completion_tokens == max_tokens
    chunks = [x.logprobs for ch in client.completions.create(model=MODEL, stream=True, **kw) for x in ch.choices
              if x.logprobs]
    assert [t for x in chunks for t in x.tokens] == whole.choices[0].logprobs.tokens
    assert [t for x in chunks for t in x.token_logprobs] == whole.choices[0].logprobs.token_logprobs
    assert [t for x in chunks for t in x.text_offset] == whole.choices[0].logprobs.text_offset


def test_usage_counts_cached_prompt_tokens_and_truncated_prompts(client, offline):
    prompt = " ".join(f"w{i}" for i in range(40)) + " unique to this test"  # ~3 blocks of 16 tokens
    first, again = (client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage for _ in range(2))
    n = first.prompt_tokens
    assert first.prompt_tokens_details.cached_tokens == 0 and again.prompt_tokens == n
    assert again.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16  # whole blocks, not the last token
    # truncate_prompt_tokens (vLLM's): the prompt's last k tokens run, as if they were the prompt.
    ids = offline.tokenizer.encode(prompt)
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    cut = client.completions.create(prompt=prompt, **kw, extra_body={"ignore_eos": True, "truncate_prompt_tokens": 5})
    alone = client.completions.create(prompt=ids[-5:], **kw, extra_body={"ignore_eos": True})
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == alone.choices[0].text


def test_tokenize_gives_the_ids_the_endpoints_run(http, client, offline):
    tok = offline.tokenizer
    r = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPTS[4], "return_token_strs": True}).json()
    assert r["tokens"] == tok(PROMPTS[4], add_special_tokens=True)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == offline.max_model_len and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    used = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=1).usage.prompt_tokens
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert used == r["count"] and chat["token_strs"] is None
    assert chat["count"] == client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage.prompt_tokens
    bare = http.post("/tokenize", json={"prompt": PROMPTS[4], "add_special_tokens": False}).json()["tokens"]
    assert http.post("/detokenize", json={"model": MODEL, "tokens": bare}).json() == {"prompt": PROMPTS[4]}


def test_chat_template_options_reach_the_template(srv, http, client, offline, tiny_engine_model):
    """``chat_template_kwargs`` are the template's variables, ``continue_final_message`` continues
    the last message, ``--chat-template`` replaces the model's template for every chat request
    (chat, Responses, /tokenize), and a request's own ``chat_template`` is taken only where the
    server trusts it: the ids each endpoint runs are the offline LLM's for the same options."""
    tok = offline.tokenizer
    flag = "{% if shout %}SHOUT {% endif %}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    r = http.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"custom_var": 1}}).json()
    assert r["tokens"] == offline.apply_chat_template(CHAT)  # a variable the template does not use: no change
    prefix = [*CHAT, {"role": "assistant", "content": "Paged attention is"}]
    cont = http.post("/tokenize", json={"messages": prefix, "continue_final_message": True,
                                        "add_generation_prompt": False}).json()["tokens"]
    assert cont == offline.apply_chat_template(prefix, False, continue_final_message=True)
    assert tok.decode(cont).endswith("Paged attention is")  # no end of turn after it
    reply = client.chat.completions.create(model=MODEL, messages=prefix, max_tokens=1, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    assert reply.usage.prompt_tokens == len(cont)
    # vLLM's echo: a continued message's reply leads with it, streamed or not; a new turn's does not.
    kw = dict(model=MODEL, messages=prefix, max_tokens=3, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "echo": True})
    whole = client.chat.completions.create(**kw).choices[0].message.content
    plain = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "echo": False}})
    assert whole == "Paged attention is" + plain.choices[0].message.content
    assert _stream_chat(client, **{k: v for k, v in kw.items() if k != "model"})[0] == {0: whole}
    new_turn = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                              extra_body={"echo": True}).choices[0].message.content
    assert not new_turn.startswith(CHAT[-1]["content"])
    served = Running(LLM(tiny_engine_model, **ENGINE), chat_template=flag, trust_request_chat_template=True)
    try:
        with httpx.Client(base_url=served.url, headers=AUTH) as h:
            shout = h.post("/tokenize", json={"messages": CHAT, "chat_template_kwargs": {"shout": True}}).json()
            assert tok.decode(shout["tokens"]) == "SHOUT <system>Be brief.<user>What is paged attention?"
            assert shout["tokens"] == offline.apply_chat_template(CHAT, chat_template=flag,
                                                                  chat_template_kwargs={"shout": True})
            plain = h.post("/tokenize", json={"messages": CHAT}).json()["tokens"]
            assert tok.decode(plain) == "<system>Be brief.<user>What is paged attention?"
            own = h.post("/tokenize", json={"messages": CHAT, "chat_template": "[{{ messages|length }}]"}).json()
            assert tok.decode(own["tokens"]) == "[2]"
            used = h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1}).json()["usage"]
            assert used["prompt_tokens"] == len(plain)
            resp = h.post("/v1/responses", json={"input": CHAT[1]["content"], "instructions": CHAT[0]["content"],
                                                 "max_output_tokens": 1}).json()
            assert resp["usage"]["input_tokens"] == len(plain)
            _check_error(h.post("/tokenize", json={"messages": CHAT, "chat_template": "{% if %}"}), 400,
                         r"^chat_template is not a valid Jinja template", "chat_template")
            deep = "{% if 1 %}" * 120 + "x" + "{% endif %}" * 120
            _check_error(h.post("/v1/chat/completions", json={"messages": CHAT, "chat_template": deep}), 400,
                         r"^chat_template is not a usable Jinja template", "chat_template")
            # No new turn: the reply continues the last message, in its role (vLLM's).
            for stream in (False, True):
                body = {"messages": CHAT, "add_generation_prompt": False, "max_tokens": 2, "stream": stream}
                r = h.post("/v1/chat/completions", json=body)
                role = (json.loads(r.text.split("\n")[0].removeprefix("data: "))["choices"][0]["delta"]["role"]
                        if stream else r.json()["choices"][0]["message"]["role"])
                assert role == "user", r.text
    finally:
        served.stop()
    with pytest.raises(ValueError, match="chat_template is not a valid Jinja template"):
        build_app(AsyncLLM(offline), served_model_name=MODEL, chat_template="{% for %}")


def test_structured_outputs_are_served_as_the_offline_llm_runs_them(client, offline):
    """OpenAI's response_format and vLLM's structured_outputs / guided_* become the offline
    LLM's ``structured_outputs`` (the tiny random model: greedy text equal to the offline one's,
    JSON that parses where whitespace is off, a choice streamed whole)."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
              "required": ["ok", "tag"], "additionalProperties": False}

    def offline_text(**so):
        params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=so)
        return offline.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text

    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    assert r.choices[0].message.content == offline_text(json=schema) and r.choices[0].message.content[0] == "{"
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content == offline_text(json_object=True)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, extra_body={
        "structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert set(json.loads(r.choices[0].message.content)) == {"ok", "tag"} and r.choices[0].finish_reason == "stop"
    stream = client.completions.create(model=MODEL, prompt="Pick one:", max_tokens=8, temperature=0.9, seed=1,
                                       stream=True, extra_body={"guided_choice": ["north", "south", "east west"]})
    assert "".join(c.choices[0].text for c in stream) in ("north", "south", "east west")
    r = client.completions.create(model=MODEL, prompt="Code:", max_tokens=12, temperature=0,
                                  extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})
    assert re.fullmatch("[A-Z]{2}[0-9]{3}", r.choices[0].text) and r.choices[0].finish_reason == "stop"


def test_plain_text_format_and_tools_left_unused_are_served(client):
    """What asks for no tool call is served as it is (the refusals: ``BAD``)."""
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, response_format={"type": "text"},
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                       tool_choice="none")
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.completion_tokens >= 1


def test_bad_words_are_served_as_the_offline_llm_runs_them(client, offline):
    plain = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    word = offline.tokenizer.decode(plain.outputs[0].token_ids[2:3]).strip()
    want = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, bad_words=[word]),
                            use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0,
                                    extra_body={"bad_words": [word]}).choices[0].text
    assert got == want.text and want.token_ids != plain.outputs[0].token_ids


def test_chat_logprobs(client):
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    content = c.logprobs.content
    assert len(content) == 8
    for item in content:
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == list(item.token.encode())


def test_logprobs_name_tokens_by_id_when_asked(client, offline):
    """vLLM's ``return_tokens_as_token_ids``: every token in logprobs is ``"token_id:<id>"``, the
    chosen ones the ids generated, with the same logprobs; completions' offsets count those names."""
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    named = client.chat.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    plain = client.chat.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0]
    ids = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    content = named.choices[0].logprobs.content
    assert [item.token for item in content] == [f"token_id:{t}" for t in ids]
    assert [item.logprob for item in content] == pytest.approx([item.logprob for item in plain.logprobs.content],
                                                               rel=1e-5)  # (the second finds the prompt cached)
    assert all(item.bytes == list(item.token.encode()) and all(t.token.startswith("token_id:") for t in
               item.top_logprobs) for item in content)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2, echo=True,
                                  extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}).choices[0]
    prompt_ids = offline.tokenizer.encode(PROMPTS[0])
    assert r.logprobs.tokens[:len(prompt_ids)] == [f"token_id:{t}" for t in prompt_ids]
    assert all(k.startswith("token_id:") for top in r.logprobs.top_logprobs[1:] for k in top)
    offsets = r.logprobs.text_offset
    assert [b - a for a, b in zip(offsets, offsets[1:])] == [len(t) for t in r.logprobs.tokens[:-1]]


def test_the_server_may_name_tokens_by_id_by_default(tiny_engine_model):
    served = Running(LLM(tiny_engine_model, **ENGINE), return_tokens_as_token_ids=True)
    try:
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as h:
            body = {"prompt": PROMPTS[0], "max_tokens": 2, "logprobs": 1}
            assert h.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["tokens"][0].startswith(
                "token_id:")
            off = h.post("/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
            assert not off["choices"][0]["logprobs"]["tokens"][0].startswith("token_id:")  # the request's wins
    finally:
        served.stop()


def test_requests_carry_their_priority_to_a_priority_scheduling_engine(tiny_engine_model):
    """``priority`` (vLLM's request field) reaches the scheduler of an engine that schedules by
    priority, from completions and chat alike; the texts are the offline engine's."""
    llm = LLM(tiny_engine_model, **ENGINE, scheduling_policy="priority")
    served = Running(llm)
    seen = []
    add = llm.core.add

    def spy(req):
        seen.append(req.priority)
        add(req)

    llm.core.add = spy
    try:
        with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as h:
            bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0, "priority": prio}
                      for p, prio in zip(PROMPTS, (0, 5, -1))]
            texts = [h.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
            chat = h.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "priority": 7})
            assert chat.status_code == 200, chat.text
        assert seen == [0, 5, -1, 7]
        want = LLM(tiny_engine_model, **ENGINE).generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6),
                                                         use_tqdm=False)
        assert texts == [o.outputs[0].text for o in want]
    finally:
        served.stop()


def test_16_concurrent_streaming_clients_get_exactly_what_they_get_alone(srv, client):
    specs = [dict(prompt=PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), max_tokens=8 + i % 5,
                  temperature=0 if i % 2 else 0.9, seed=i) for i in range(16)]
    alone = [client.completions.create(model=MODEL, **s).choices[0] for s in specs]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

        async def one(spec):
            text, finish = "", None
            async for ch in await aclient.completions.create(model=MODEL, stream=True, **spec):
                for c in ch.choices:
                    text += c.text
                    finish = c.finish_reason or finish
            return text, finish

        try:
            return await asyncio.gather(*(one(s) for s in specs))
        finally:
            await aclient.close()

    srv.peak_running = 0
    together = asyncio.run(main())
    assert together == [(c.text, c.finish_reason) for c in alone]
    assert srv.peak_running >= 8  # they really ran together


# ---- disconnects, bad input, overload, shutdown ---------------------------------------------


def test_client_disconnecting_mid_stream_frees_its_blocks(srv, http):
    before = wait_idle(http)["jaxpaged:generation_tokens_total"]
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                                 json=body) as r:
        lines = r.iter_lines()
        assert sum(1 for _, line in zip(range(6), lines) if line.startswith("data: ")) >= 3
        assert metrics(http)["jaxpaged:num_requests_running"] == 1
    m = wait_idle(http)
    assert m["jaxpaged:num_requests_running"] == 0 and m["jaxpaged:kv_cache_used_blocks"] == 0
    assert m["jaxpaged:kv_cache_usage_perc"] == 0
    assert m["jaxpaged:generation_tokens_total"] - before < 400  # aborted, not run to the end
    assert srv.llm.bm.stats().num_used_blocks == 0 and not srv.llm.core.requests


def test_client_disconnecting_while_waiting_for_json_frees_its_blocks(srv, http):
    before = wait_idle(http)["jaxpaged:generation_tokens_total"]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=srv.url, headers=AUTH, timeout=0.3) as c:
        c.post("/v1/completions", json=body)
    m = wait_idle(http)
    assert m["jaxpaged:num_requests_running"] == 0 and m["jaxpaged:kv_cache_used_blocks"] == 0
    assert m["jaxpaged:generation_tokens_total"] - before < 400


LONG_PROMPT = list(range(5, 605))
BAD = [  # (path, body, status, message pattern, param)
    ("/v1/completions", b'{"prompt": "hi",', 400, r"not valid JSON", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, r"^temperature must be non-negative, got -1\.0$",
     "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, r"top_p must be in \(0, 1\], got 1\.5", "top_p"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "8"}, 400, r"max_tokens: .*valid integer", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, r"max_tokens must be at least 1, got 0",
     "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "temperature": 0}, 400, r"n must be 1 when using greedy", "n"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, r"^max_tokens is too large: 600\. This model's "
     r"maximum context length is 512 tokens and the request has 1 input tokens \(600 > 512 - 1\)$", "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 512}, 400,
     r"max_tokens is too large: 512\. .* and the request has \d+ input tokens", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "n": 40}, 400, r"runs n=40 sequences; max_num_seqs is 16", None),
    ("/v1/completions", {"prompt": LONG_PROMPT}, 400, r"prompt has 600 tokens; max_model_len is 512", "prompt"),
    ("/v1/completions", {"prompt": []}, 400, r"prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": [[5], LONG_PROMPT]}, 400, r"^prompt\[1\] has 600 tokens", "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 600}]}, 400,
     r"^messages has \d+ tokens; max_model_len is 512", "messages"),
    ("/v1/completions", {"prompt": [99999999]}, 400, r"prompt token ids \[99999999\] are outside the vocabulary",
     "prompt"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}, 400,
     r"logit_bias token ids \[99999999\] are outside the vocabulary \[0, 49152\)", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 5}}, 400, r"logit_bias keys must be token ids",
     "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 1, "--5": 5}}, 400,
     r"logit_bias keys must be token ids, got '--5'", "logit_bias"),
    ("/v1/chat/completions", {"messages": CHAT, "logit_bias": {"\u00b2": 5}}, 400,
     r"logit_bias keys must be token ids, got '\u00b2'", "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, r"logprobs must be in \[0, 20\], got 21", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "use_beam_search": True, "temperature": 0}, 400,
     r"stream is not supported with use_beam_search", "stream"),
    ("/v1/completions", {"prompt": "hi", "suffix": " world"}, 400, r"suffix is not supported", "suffix"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     r"stream_options can only be given when stream is true", "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 1 << 63}, 400,
     r"seed must be a 64-bit signed integer, got 9223372036854775808", "seed"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, r"the model 'gpt-4' does not exist", "model"),
    ("/v1/chat/completions", {"messages": []}, 400, r"messages: .*at least 1", "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, r"top_logprobs needs logprobs=true",
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400,
     r"top_logprobs must be in \[0, 20\], got 21", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     r"only text content parts are supported", "messages"),
    ("/tokenize", {"prompt": "hi", "messages": CHAT}, 400, r"give either prompt or messages", "messages"),
    ("/tokenize", {}, 400, r"give either prompt or messages", "prompt"),
    ("/tokenize", b'{"prompt": "a\\ud800"}', 400, r"prompt is not valid Unicode: surrogates not allowed at position 1",
     "prompt"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, r"prompt is not valid Unicode", "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}', 400,
     r"messages\[0\]\.content is not valid Unicode: surrogates not allowed at position 3", "messages"),
    ("/tokenize", {"prompt": "hi", "model": "gpt-4"}, 404, r"the model 'gpt-4' does not exist", "model"),
    ("/detokenize", {"tokens": [1, 99999999]}, 400, r"tokens \[99999999\] are outside the vocabulary", "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, r"tokens: .*valid list", "tokens"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, 400,
     r"response_format .* not supported: its type must be 'text', 'json_object' or 'json_schema'", "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     r"needs json_schema\.schema", "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "guided_choice": ["yes"], "guided_regex": "a"}, 400,
     r"give one structured output, not guided_regex, guided_choice", "guided_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "guided_choice": []}, 400,
     r"guided_choice: structured_outputs\.choice must be a non-empty list", "guided_choice"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a(b"}}, 400,
     r"structured_outputs\.regex is not a valid constraint: .*unclosed group", "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "guided_json": {"type": "nonsense"}}, 400,
     r"structured_outputs\.json is not a valid constraint", "guided_json"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "wrong"}}}}}}, 400,
     r"structured_outputs\.json is not a valid constraint", "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}, "use_beam_search": True,
                         "temperature": 0}, 400, r"cannot be used with use_beam_search", "response_format"),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "ab\\"}, 400, r"ends in a lone backslash", "guided_regex"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     r'^"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser', "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}], "tool_choice": "required"}, 400,
     r"^tools\[0\]\.function must be an object with a name", "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     r"^tool_choice names the function 'g', which is not among the tools \['f'\]", "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, 400, r"^tool_choice 'required' needs tools",
     "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     r"^response_format cannot be combined with a named or required tool_choice", "response_format"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": "required", "use_beam_search": True, "n": 2, "temperature": 0}, 400,
     r"^structured_outputs cannot be used with use_beam_search", "tool_choice"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "strin"}}}}}]}, 400,
     r"^tools: a function's parameters are not a usable JSON schema", "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": n, "parameters": {"$defs": {"u": {"enum": [n]}}}}} for n in "fg"]},
     400, r"^tools\[1\]\.function\.parameters\.\$defs\.u differs from another tool's definition", "tools"),
    ("/tokenize", {"messages": CHAT, "tools": [{"type": "function", "function": {"name": 3}}]}, 400,
     r"^tools\[0\]\.function\.name must be a non-empty string", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments is not JSON", "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template": "{{ messages[0].content }}"}, 400,
     r"^chat_template: this server does not take requests' chat templates", "chat_template"),
    ("/v1/chat/completions", {"messages": CHAT, "continue_final_message": True}, 400,
     r"^continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}}, 400,
     r"^chat_template_kwargs\['tokenize'\]: tokenize is not the template's to take", "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": CHAT, "chat_template_kwargs": ["x"]}, 400,
     r"chat_template_kwargs", "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "hi", "allowed_token_ids": []}, 400, r"^allowed_token_ids must not be empty",
     "allowed_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [10 ** 9]}, 400,
     r"^allowed_token_ids \[1000000000\] are outside the vocabulary", "allowed_token_ids"),
    ("/v1/completions", {"prompt": "hi", "priority": 1}, 400,
     r"^priority 1 needs scheduling_policy='priority' \(this engine's is 'fcfs'\)", "priority"),
    ("/v1/chat/completions", {"messages": CHAT, "priority": -2}, 400, r"^priority -2 needs", "priority"),
    ("/v1/chat/completions", {"messages": CHAT, "priority": "high"}, 400, r"priority", "priority"),
    ("/v1/completions", {"prompt": "hi", "bad_words": ["x"], "use_beam_search": True, "n": 2, "temperature": 0}, 400,
     r"^bad_words cannot be used with use_beam_search", "bad_words"),
    ("/v1/chat/completions", {"messages": CHAT, "bad_words": "x"}, 400, r"bad_words", "bad_words"),
    ("/v1/nowhere", {}, 404, r"Not Found", None),
]


def _check_error(r, status, pattern, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert re.search(pattern, err["message"]), err["message"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize("path, body, status, pattern, param", BAD,
                         ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_its_status_and_message(http, path, body, status, pattern, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    _check_error(r, status, pattern, param)


def test_wrong_or_missing_api_key_is_401(srv, client):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}):
        _check_error(httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=headers), 401,
                     r"invalid API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_bad_requests_never_disturb_a_running_one(srv, client, http):
    kw = dict(prompt=PROMPTS[4], max_tokens=40, temperature=0.7, seed=11, extra_body={"ignore_eos": True})
    alone = client.completions.create(model=MODEL, **kw).choices[0].text
    result = {}
    t = threading.Thread(target=lambda: result.update(_stream_completion(client, **kw)[0]))
    t.start()
    for path, body, status, pattern, param in BAD:
        r = http.post(path, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) \
            else http.post(path, json=body)
        _check_error(r, status, pattern, param)
    t.join(60)
    assert result == {0: alone}
    assert httpx.get(srv.url + "/health").status_code == 200


def test_full_waiting_queue_is_503(srv, client):
    srv.engine.max_waiting_requests = 0  # every new request would wait beyond the bound
    try:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi"}, headers=AUTH)
        _check_error(r, 503, r"the engine is overloaded: 0 requests waiting, max_waiting_requests is 0")
        assert r.json()["error"]["type"] == "server_error"
    finally:
        srv.engine.max_waiting_requests = None
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_a_batch_beyond_the_queue_bound_is_served_and_templates_run_off_the_event_loop(srv, client, monkeypatch):
    # One completion of four prompts is admitted whole while the queue has room (it used to
    # be refused: each prompt counted the ones before it as waiting).
    monkeypatch.setattr(srv.engine, "max_waiting_requests", 1)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:4], max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 4 and r.usage.completion_tokens == 12
    # Chat templates and tokenization run on the engine's tokenizer thread: a huge prompt
    # never stalls the other streams.
    threads, template = [], srv.engine.llm.apply_chat_template

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return template(*args, **kwargs)

    monkeypatch.setattr(srv.engine.llm, "apply_chat_template", spy)
    assert client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2).usage.completion_tokens == 2
    assert threads == ["jaxpaged-tokenizer_0"]


def test_shutdown_ends_streams_and_leaves_nothing_running(tiny_engine_model):
    s = Running(LLM(tiny_engine_model, **ENGINE))
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=s.url, headers=AUTH, timeout=60) as c, c.stream("POST", "/v1/completions",
                                                                               json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None
        s.server.should_exit = True
        rest = sse(lines)
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "abort"
    s.stop()  # the server thread and the engine thread are gone, no block is in use, no request left
    with pytest.raises(httpx.ConnectError):
        httpx.get(s.url + "/health")


@pytest.mark.slow
def test_greedy_text_equals_the_offline_llm_on_the_default_model(smollm):
    offline = LLM(smollm, max_num_seqs=4, num_blocks=64)
    expected = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    s = Running(LLM(smollm, max_num_seqs=4, num_blocks=64))
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
        r = c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
        texts, _, _ = _stream_chat(c, messages=CHAT, max_tokens=24, temperature=0)
    finally:
        s.stop()
    assert r.choices[0].message.content == texts[0] == expected
    assert len(expected) > 20


def test_command_line_server_serves_and_stops_cleanly_on_sigint(tiny_engine_folder):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "jaxpaged.serve", "--model", str(tiny_engine_folder), "--port", "0",
                             "--served-model-name", MODEL, "--api-key", KEY, "--max-num-seqs", "4",
                             "--num-blocks", "64", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 90
        while not any("serving" in line for line in log):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)
            time.sleep(0.1)
        url = re.search(r"on (http://127\.0\.0\.1:\d+)", "".join(log)).group(1)
        c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=3).usage.completion_tokens == 3
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            proc.send_signal(signal.SIGINT)  # Ctrl-C with a stream in flight
            rest = sse(lines)
        assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert "shut down with 0 running requests, 0 waiting, 0 KV blocks in use" in "".join(log)


def test_a_finished_choice_is_sent_once():
    """With n > 1 a choice that finished early must not repeat its finish_reason while the
    other choices run on (the stream would show it finishing again every step)."""
    from jaxpaged.openai_streaming import _Deltas

    d = _Deltas(len("STOP") - 1)
    assert d.next(0, "abcdef", 3, False) == ("abc", 0)  # 3 characters held back: could start "STOP"
    assert d.next(0, "abcdefg", 4, True) == ("defg", 3)
    assert d.next(0, "abcdefg", 4, True) is None
    assert d.next(1, "xy", 2, False) == ("", 0)  # the other choice goes on


def test_reset_prefix_cache_endpoint_forgets_cached_prompts(srv):
    import httpx

    body = {"model": MODEL, "prompt": "A prompt long enough to fill whole blocks of sixteen tokens: " * 3,
            "max_tokens": 2, "temperature": 0}

    def cached():
        r = httpx.post(srv.url + "/v1/completions", json=body, headers=AUTH, timeout=60)
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0  # the second time its full blocks come from the cache
    assert httpx.post(srv.url + "/reset_prefix_cache", timeout=60).status_code == 401  # the key guards it
    r = httpx.post(srv.url + "/reset_prefix_cache", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json() == {"reset": True}
    assert cached() == 0
