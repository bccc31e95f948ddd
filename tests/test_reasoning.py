"""Reasoning outputs (``reasoning_parser="deepseek_r1"``): the split of a reply into reasoning and
content, streamed in random pieces against whole and against a reference (hypothesis); the
engine's structured output starting after the reasoning; the server's ``reasoning`` fields."""

import json
import re

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged import LLM, SamplingParams
from jaxpaged.reasoning import ReasoningParser, ReasoningStream
from test_server import KEY, MODEL, Running

START, END = "<think>", "</think>"


def reference_split(text: str, ended: bool) -> tuple[str, str]:
    """The rule, written plainly: reasoning up to the first end tag (the first start tag before it
    dropped), content after; no end tag: all reasoning. (vLLM's streamed deepseek_r1 split; its
    whole-text one also drops the text before a start tag.)"""
    if ended:
        return "", text
    head, found, content = text.partition(END)
    j = head.find(START)
    if j >= 0:
        head = head[:j] + head[j + len(START):]
    return head, content if found else ""


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(["a", " ", "\n", "<", "/", ">", "think", START, END, "<thi", "nk>", "</"]),
                max_size=12), st.lists(st.integers(0, 60), max_size=8), st.booleans())
def test_a_reply_streamed_in_any_pieces_splits_as_the_whole_does(parts, cuts, ended):
    text = "".join(parts)
    reasoning, content = "", ""
    pieces = pieces_of(text, cuts)
    s = ReasoningStream(ended=ended)
    for i, piece in enumerate(pieces):
        r, c = s.feed(piece, i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
        if i < len(pieces) - 1:  # nothing sent that the rest could still make a tag of
            sent = text[:sum(map(len, pieces[:i + 1]))]
            assert reference_split(sent, ended)[0].startswith(reasoning) or END in sent
    assert (reasoning, content) == reference_split(text, ended)


def test_the_parser_needs_the_tags_as_tokens(think_engine_model, tiny_engine_model):
    p = ReasoningParser("deepseek_r1", think_engine_model.tokenizer)
    tok = think_engine_model.tokenizer
    start, end = tok.convert_tokens_to_ids([START, END])
    assert (p.start_id, p.end_id) == (start, end) and not p.tags_special
    assert p.ended([5, start, 7, end, 9]) and not p.ended([5, end, start, 9]) and not p.ended([])
    assert p.num_tokens([start], [4, 5, end, 6]) == 3 and p.num_tokens([start], [4, 5]) == 2
    assert p.num_tokens([end], [4, 5, end]) == 0
    with pytest.raises(ValueError, match=r"the tokenizer has no <think> token .* is this a reasoning model"):
        ReasoningParser("deepseek_r1", tiny_engine_model.tokenizer)
    with pytest.raises(ValueError, match=r"reasoning_parser 'qwen9' is not one of \('deepseek_r1', 'qwen3'\)"):
        LLM(tiny_engine_model, reasoning_parser="qwen9")


def test_qwen3_splits_as_deepseek_r1_and_thinking_off_is_all_content(think_engine_model):
    """vLLM's ``qwen3`` name: the same tags and split; Qwen3's template with ``enable_thinking:
    false`` writes an empty think block into the prompt, after which the reply is content."""
    tok = think_engine_model.tokenizer
    r1, qwen3 = (ReasoningParser(name, tok) for name in ("deepseek_r1", "qwen3"))
    assert (qwen3.start_id, qwen3.end_id) == (r1.start_id, r1.end_id)
    prompt_off = tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)
    reply = tok.encode("No thinking here.", add_special_tokens=False)
    assert qwen3.ended(prompt_off) and qwen3.num_tokens(prompt_off, reply) == 0
    s = qwen3.stream(prompt_off)
    assert s.feed("No thinking", False) == ("", "No thinking") and s.feed(" here.", True) == ("", " here.")
    s = qwen3.stream(tok.encode("<|im_start|>assistant\n", add_special_tokens=False))
    assert s.feed("<think>\nhm</think>\n\nYes.", True) == ("\nhm", "\n\nYes.")


def test_an_earlier_turns_reasoning_goes_to_the_template_under_both_names():
    from jaxpaged.openai_protocol import ChatCompletionRequest

    for key in ("reasoning", "reasoning_content"):
        req = ChatCompletionRequest.model_validate({"messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", key: "they greet"},
            {"role": "user", "content": "Bye"}]})
        turn = req.conversation()[1]
        assert turn["reasoning"] == turn["reasoning_content"] == "they greet" and turn["content"] == "Hello"


# ---- the engine: the grammar starts after the reasoning ------------------------------------------

ENGINE = dict(max_num_seqs=8, num_blocks=256, block_size=16)
YES_NO = {"regex": "(yes|no)"}


@pytest.fixture(scope="module")
def think(think_engine_model):
    return think_engine_model.tokenizer.convert_tokens_to_ids([START, END])


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_structured_output_starts_after_the_reasoning(think_engine_model, think, async_scheduling):
    """``</think>`` pushed up by a logit bias: the reply's first token (the grammar does not hold
    yet), then the grammar's answer. Without the parser the grammar holds from the first token;
    with a prompt that ended its reasoning already, too."""
    start, end = think
    bias = SamplingParams(max_tokens=12, temperature=0, logit_bias={end: 100.0}, structured_outputs=YES_NO)
    prompt = {"prompt_token_ids": [11, 12, 13, start]}
    llm = LLM(think_engine_model, reasoning_parser="deepseek_r1", async_scheduling=async_scheduling, **ENGINE)
    n = SamplingParams(n=3, max_tokens=12, temperature=1.0, seed=5, logit_bias={end: 100.0}, structured_outputs=YES_NO)
    ended = {"prompt_token_ids": [11, start, 12, end, 13]}
    # One at a time: a batch with a fork would not run its next step ahead (the case to check).
    out, forked, after_end = (llm.generate([p], [q])[0] for p, q in [(prompt, bias), (prompt, n), (ended, bias)])
    for c in [*out.outputs, *forked.outputs]:
        assert c.token_ids[0] == end and c.text.startswith(END), c.text
        assert re.fullmatch("yes|no", c.text[len(END):]), c.text
        assert c.finish_reason == "stop"
    assert re.fullmatch("yes|no", after_end.outputs[0].text)
    plain = LLM(think_engine_model, async_scheduling=async_scheduling, **ENGINE).generate([prompt], [bias])[0]
    assert re.fullmatch("yes|no", plain.outputs[0].text)


def test_drafts_stop_short_of_the_reasoning_end(think_engine_model, think, monkeypatch):
    """Drafts that hold ``</think>`` and tokens after it (every draft here: the proposer is
    patched) are cut before it, since the rows after it would be sampled without the grammar's
    mask. A token X pushed up most, ``</think>`` next, and a repetition penalty: greedy thinks one
    X, then ends its reasoning, then answers as the grammar says (without the cut, the drafted X
    after ``</think>`` was taken and broke the grammar)."""
    from jaxpaged.spec_decode import SpeculativeConfig

    start, end = think
    x = 300
    monkeypatch.setattr(SpeculativeConfig, "propose", lambda self, tokens, k: [end, x, x][:k])
    llm = LLM(think_engine_model, reasoning_parser="deepseek_r1", speculative_config={"method": "ngram",
              "num_speculative_tokens": 3}, **ENGINE)
    params = SamplingParams(max_tokens=24, temperature=0, repetition_penalty=1.5, logit_bias={end: 30.0, x: 36.0},
                            structured_outputs=YES_NO)
    c = llm.generate([{"prompt_token_ids": [11, 12, start]}], params)[0].outputs[0]
    assert c.token_ids[:2] == [x, end], c.token_ids
    assert re.fullmatch("yes|no", c.text.split(END, 1)[1]) and c.finish_reason == "stop", (c.text, c.finish_detail)


# ---- the server: reasoning and content apart -----------------------------------------------------

CITY = {"regex": "(Paris|Rome)"}


@pytest.fixture(scope="module")
def served(think_engine_model, think):
    server = Running(LLM(think_engine_model, reasoning_parser="deepseek_r1", **ENGINE))
    yield server, openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    server.stop()


def thinking(think, **kw) -> dict:
    """A reply that thinks one token X (pushed up most, then held back by the repetition
    penalty), ends its reasoning (pushed up next), then answers as ``kw`` say."""
    _, end = think
    return dict(logit_bias={"300": 36, str(end): 30}, temperature=0, max_tokens=24,
                extra_body={"repetition_penalty": 1.5, **kw.pop("extra_body", {})}, **kw)


def test_a_chat_reply_comes_as_reasoning_and_content_streamed_or_whole(served, think, think_engine_model):
    _, client = served
    kw = thinking(think, messages=[{"role": "user", "content": "Where?"}], extra_body={"structured_outputs": CITY})
    message = client.chat.completions.create(model=MODEL, **kw).choices[0].message.model_dump()
    x_text = think_engine_model.tokenizer.decode([300])
    assert message["reasoning"] == x_text and message["content"] in ("Paris", "Rome"), message
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        delta = chunk.choices[0].delta.model_dump()
        assert delta.get("reasoning") or delta["content"] is not None or chunk.choices[0].finish_reason, chunk
        reasoning += delta.get("reasoning") or ""
        content += delta["content"] or ""
    assert (reasoning, content) == (message["reasoning"], message["content"])
    # include_reasoning=false (vLLM's): the reasoning left out, the content the same.
    kw["extra_body"]["include_reasoning"] = False
    hidden = client.chat.completions.create(model=MODEL, **kw).choices[0].message.model_dump()
    assert hidden["reasoning"] is None and hidden["content"] == message["content"]
    chunks = [c.choices[0].delta.model_dump() for c in client.chat.completions.create(model=MODEL, stream=True, **kw)]
    assert not any(d.get("reasoning") for d in chunks) and "".join(d["content"] or "" for d in chunks) == content
    # A required tool choice: the calls after the reasoning.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}}}
    choice = client.chat.completions.create(model=MODEL, **thinking(
        think, messages=[{"role": "user", "content": "Where?"}], tools=[tool], tool_choice="required")).choices[0]
    assert choice.message.model_dump()["reasoning"] == x_text and choice.finish_reason == "tool_calls"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_a_response_has_a_reasoning_item_before_its_message(served, think, think_engine_model):
    _, client = served
    kw = thinking(think, input="Where?", text={"format": {"type": "json_schema", "name": "city", "schema": {
        "type": "string", "enum": ["Paris", "Rome"]}}})
    kw["max_output_tokens"], kw["extra_body"]["logit_bias"] = kw.pop("max_tokens"), kw.pop("logit_bias")
    kw.update(include=["message.output_text.logprobs"], top_logprobs=0)
    r = client.responses.create(model=MODEL, **kw).model_dump()
    reasoning, message = r["output"]
    x_text = think_engine_model.tokenizer.decode([300])
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": x_text}]
    text = message["content"][0]
    assert message["type"] == "message" and text["text"] in ('"Paris"', '"Rome"')
    assert "".join(lp["token"] for lp in text["logprobs"]).startswith(text["text"])  # the answer's tokens only
    assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 2  # X and </think>
    events = list(client.responses.create(model=MODEL, stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == x_text
    final = events[-1].response.model_dump()
    assert [[c.get("text") for c in item["content"]] for item in final["output"]] == \
        [[c.get("text") for c in item["content"]] for item in r["output"]]
    # The reasoning item goes back as input (it is left out of the prompt).
    later = client.responses.create(model=MODEL, previous_response_id=r["id"], input="And then?", max_output_tokens=4)
    assert later.status in ("completed", "incomplete")
