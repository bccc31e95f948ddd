"""OpenAI's Responses API (``/v1/responses``): the request's conversion to a chat request and its
refusals, the output items built from a reply streamed in random pieces against whole
(hypothesis), and the server on the tiny model spoken to with the official ``openai`` client:
text against the chat endpoint's, streamed events against the whole response, tool calls,
stored responses and ``previous_response_id``."""

import json

import httpx
import openai
import pytest
from openai.types.responses import (ResponseFunctionToolCallItem, ResponseFunctionToolCallOutputItem,
                                    ResponseInputMessageItem, ResponseOutputMessage)
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged import LLM
from jaxpaged.openai_protocol import APIError
from jaxpaged.openai_responses import (OutputItems, ResponsesRequest, as_responses_error, conversation_after,
                                      item_page)
from jaxpaged.tool_calling import ToolCallStream
from test_server import AUTH, ENGINE, KEY, MODEL, Running
from test_tool_calling import WEATHER, hermes_replies, pieces_of

FN_WEATHER = {"type": "function", **WEATHER["function"]}  # the Responses API's flat form


# ---- the request -----------------------------------------------------------------------------


def chat_of(**body):
    return ResponsesRequest.model_validate({"input": "Hi", **body}).chat_request([])


def test_input_items_become_chat_messages():
    chat = chat_of(instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Paris?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rain"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny in Paris."}]},
    ], tools=[FN_WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=7,
        text={"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}}})
    conv = chat.conversation()
    assert [m["role"] for m in conv] == ["system", "system", "user", "assistant", "tool", "tool", "assistant"]
    assert conv[0]["content"] == "Be brief." and conv[2]["content"] == "Weather in Paris?"
    assert [c["id"] for c in conv[3]["tool_calls"]] == ["c1", "c2"]  # parallel calls: one assistant turn
    assert (conv[4]["tool_call_id"], conv[4]["content"]) == ("c1", "sunny")
    assert chat.tools == [WEATHER] and chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.max_completion_tokens == 7 and chat.response_format["json_schema"]["schema"] == {"type": "object"}


@pytest.mark.parametrize("body, param, pattern", [
    ({"input": []}, "input", r"^input is empty"),
    ({"input": [{"type": "input_image"}]}, "input[0].type", r"^input\[0\]\.type 'input_image' is not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", r"^input\[0\]\.role must be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content",
     r"^input\[0\]\.content\[0\] must be a text part"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", r"^input\[0\]\.content must be a string"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id",
     r"^input\[0\]\.call_id must be a string"),
    ({"background": True}, "background", r"^background responses are not supported"),
    ({"truncation": "auto"}, "truncation", r"^truncation 'auto' is not supported"),
    ({"include": ["message.output_text.logprobs", "reasoning.encrypted_content"]}, "include[1]",
     r"^include\[1\] 'reasoning.encrypted_content' is not supported"),
    ({"include": ["message.output_text.logprobs"], "tools": [FN_WEATHER]}, "include", r"cannot be combined with tools"),
    ({"top_logprobs": 10**6}, "top_logprobs", r"^top_logprobs must be in \[0, "),
    ({"tools": [{"type": "web_search"}]}, "tools[0]", r"^tools\[0\] of type 'web_search' is not supported"),
    ({"tools": [FN_WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice", r"^tool_choice .* not supp"),
    ({"text": {"format": {"type": "xml"}}}, "text.format", r"^text\.format .* is not supported"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", r"needs name, a string"),
    ({"tool_choice": "sometimes"}, "tool_choice", r"^tool_choice 'sometimes' is not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text",
     r"^input\[0\]\.content\[0\]\.text must be a string"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments",
     r"^input\[0\]\.arguments must be a JSON object's text"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input[0].call_id",
     r"^input\[0\]\.call_id 'c' answers no function_call"),
    ({"user": "a\udfffb"}, "user", r"^user is not valid Unicode"),
    ({"tools": [{**FN_WEATHER, "description": "\ud800"}]}, "tools[0].description", r"is not valid Unicode"),
])
def test_what_is_not_served_is_refused_naming_the_field(body, param, pattern):
    with pytest.raises(APIError, match=pattern) as e:
        chat_of(**body)
    assert (e.value.status, e.value.param) == (400, param)


def test_a_call_answered_in_a_later_request_is_known_from_the_previous_response():
    previous = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}]
    chat = ResponsesRequest.model_validate({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}
                                           ).chat_request(previous)
    assert [m["role"] for m in chat.conversation()] == ["user", "assistant", "tool"]


def test_output_items_sent_back_are_the_conversation_previous_response_id_continues():
    """A reply's items become the same chat turns whether a client sends them back as input or
    continues with ``previous_response_id``: text, then the calls made after it, in one turn."""
    output, _ = items_of("hermes", ['Let me look. <tool_call>{"name": "f", "arguments": {}}</tool_call> Then.'])
    asked = [{"role": "user", "content": "Hi"}]
    replayed = ResponsesRequest.model_validate({"input": [{"role": "user", "content": "Hi"}, *output]}).chat_request([])
    assert conversation_after(asked, output) == replayed.conversation()
    assert [(m["role"], m["content"], len(m.get("tool_calls") or ())) for m in replayed.conversation()] == [
        ("user", "Hi", 0), ("assistant", "Let me look.", 1), ("assistant", " Then.", 0)]


def test_a_reply_without_tools_is_one_message_even_empty_and_keeps_its_last_logprobs():
    items = OutputItems(text_only=True)
    events = items.feed(ToolCallStream("hermes").feed("", False), [{"token": "a"}])  # (text held back)
    events += items.finish("completed")
    assert [(i["type"], i["content"][0]["text"], i["content"][0]["logprobs"]) for i in items.items] == [
        ("message", "", [{"token": "a"}])]
    assert [e["logprobs"] for e in events if e["type"] == "response.output_text.done"] == [[{"token": "a"}]]


def test_a_call_cut_short_is_left_out_of_the_conversation_continued():
    s, items = ToolCallStream("named", name="f"), OutputItems()
    items.feed(s.feed('{"a":', True))
    items.finish("incomplete")
    assert items.items[0]["arguments"] == '{"a":'
    assert conversation_after([{"role": "user", "content": "Hi"}], items.items) == [{"role": "user", "content": "Hi"}]


def test_a_call_whose_arguments_never_closed_is_incomplete_however_the_reply_ended():
    """A stop string inside a call's arguments, or a hermes block closed before them: the reply
    is complete, the call is not (its arguments are no JSON), and a later turn leaves it out."""
    for mode, text in [("named", '{"a": 1, "b'), ("hermes", 'Hi. <tool_call>{"name": "f", "arguments": {"a": 1,'),
                       ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> Then.')]:
        s, items = ToolCallStream(mode, name="f"), OutputItems()
        items.feed(s.feed(text, True))
        items.finish("completed")
        calls = [i for i in items.items if i["type"] == "function_call"]
        assert [c["status"] for c in calls] == ["incomplete"], text
        assert all(i["status"] == "completed" for i in items.items if i["type"] == "message")
        turns = conversation_after([{"role": "user", "content": "Hi"}], items.items)
        assert not any(t.get("tool_calls") for t in turns)


def test_only_the_item_a_reply_was_cut_in_is_incomplete():
    s, items = ToolCallStream("required"), OutputItems()
    items.feed(s.feed('[{"name":"f","parameters":{}},{"name":"g","parameters":{}},{"name":"f","parameters":{"a', True))
    items.finish("incomplete")
    assert [(i["name"], i["status"]) for i in items.items] == [("f", "completed"), ("g", "completed"),
                                                              ("f", "incomplete")]


def test_input_items_are_listed_back_with_ids_in_pages():
    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "d"}]})
    req.chat_request([])
    items = req.input_items()
    assert [i["id"].split("_")[0] for i in items] == ["msg", "msg", "fc", "fco"]
    assert items[1]["content"] == [{"type": "output_text", "text": "b", "annotations": []}]
    assert items[3]["output"] == "d"
    ids = [i["id"] for i in items]
    page = item_page(items, limit=2, order="desc", after=None, before=None)
    assert [i["id"] for i in page["data"]] == ids[::-1][:2] and page["has_more"]
    page = item_page(items, limit=2, order="desc", after=page["last_id"], before=None)
    assert [i["id"] for i in page["data"]] == ids[1::-1] and not page["has_more"]
    assert [i["id"] for i in item_page(items, limit=9, order="asc", after=ids[0], before=ids[3])["data"]] == ids[1:3]
    page = item_page(items, limit=2, order="asc", after=None, before=ids[3])  # the page before the cursor
    assert [i["id"] for i in page["data"]] == ids[1:3] and page["has_more"]
    typed = {"message": ResponseInputMessageItem, "function_call": ResponseFunctionToolCallItem,
             "function_call_output": ResponseFunctionToolCallOutputItem}
    for item in items:  # what the openai package's types take, the assistant's text as an output message
        model = ResponseOutputMessage if item.get("role") == "assistant" else typed[item["type"]]
        model.model_validate(item, strict=True)
    for kw, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "x"}, "after")):
        with pytest.raises(APIError) as e:
            item_page(items, **{"limit": 20, "order": "asc", "after": None, "before": None, **kw})
        assert e.value.param == param


def test_chat_errors_are_told_in_the_responses_fields():
    e = as_responses_error(APIError(400, "tools[1].function.name must be a non-empty string", param="tools"))
    assert (e.message, e.param) == ("tools[1].name must be a non-empty string", "tools")
    e = as_responses_error(APIError(400, "response_format: bad schema", param="response_format"))
    assert (e.message, e.param) == ("text.format: bad schema", "text.format")
    e = as_responses_error(APIError(400, "prompt has 9000 tokens", param="prompt"))
    assert (e.message, e.param) == ("input has 9000 tokens", "input")


# ---- the output items ------------------------------------------------------------------------


def items_of(mode: str, pieces: list[str]) -> tuple[list[dict], list[dict]]:
    """The output items of a reply fed in ``pieces``, and the same rebuilt from the events alone."""
    s, items, events = ToolCallStream(mode), OutputItems(), []
    for i, piece in enumerate(pieces):
        events += items.feed(s.feed(piece, i == len(pieces) - 1))
    events += items.finish("completed")
    rebuilt: list[dict] = []
    for e in events:  # what a client that reads only the events has
        if e["type"] == "response.output_item.added":
            assert e["output_index"] == len(rebuilt)
            rebuilt.append(e["item"])
        elif e["type"] == "response.output_text.delta":
            rebuilt[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif e["type"] == "response.content_part.added":
            rebuilt[e["output_index"]]["content"].append(e["part"])
        elif e["type"] == "response.function_call_arguments.delta":
            rebuilt[e["output_index"]]["arguments"] += e["delta"]
        elif e["type"] == "response.output_item.done":
            assert rebuilt[e["output_index"]] == {**e["item"], "status": "in_progress"}
            rebuilt[e["output_index"]] = e["item"]
    assert [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"] == \
        [item["id"] for item in items.items]  # each item done once, in order
    return items.items, rebuilt


def strip(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(hermes_replies(), st.lists(st.integers(0, 200), max_size=8))
def test_output_items_streamed_in_any_pieces_are_the_whole_replys(reply, cuts):
    text, content, calls = reply
    whole, rebuilt = items_of("hermes", [text])
    assert rebuilt == whole
    streamed, rebuilt = items_of("hermes", pieces_of(text, cuts))
    assert strip(streamed) == strip(rebuilt) == strip(whole)
    assert "".join(i["content"][0]["text"] for i in whole if i["type"] == "message") == content
    assert [{"name": i["name"], "arguments": i["arguments"]} for i in whole if i["type"] == "function_call"] == calls


def test_runs_of_text_between_calls_are_items_of_their_own():
    items, _ = items_of("hermes", ['Let me look. <tool_call>{"name": "f", "arguments": {}}</tool_call> Then.'])
    assert [(i["type"], i.get("name")) for i in items] == [("message", None), ("function_call", "f"), ("message", None)]
    assert items[2]["content"][0]["text"] == " Then."


# ---- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def srv(tiny_engine_model):
    s = Running(LLM(tiny_engine_model, **ENGINE), responses_store_size=3)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def stream_of(client, **kw):
    """The events of a streamed response (as dicts) and its last response."""
    events = [e.model_dump() for e in client.responses.create(model=MODEL, stream=True, **kw)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    return events, events[-1]["response"]


def unique(r: dict) -> dict:
    """A response less what makes each one unique: its ids, time and prefix cache hits."""
    usage = {k: v for k, v in r["usage"].items() if k != "input_tokens_details"}
    return {**{k: v for k, v in r.items() if k not in ("id", "created_at")}, "output": strip(r["output"]),
            "usage": usage}


def test_a_response_is_the_chat_endpoints_reply_and_streams_to_the_same(client):
    kw = dict(instructions="Be brief.", input="What is paged attention?", max_output_tokens=12, temperature=0.8,
              extra_body={"seed": 5, "ignore_eos": True})
    r = client.responses.create(model=MODEL, **kw).model_dump()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is paged attention?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0.8, seed=5,
                                          extra_body={"ignore_eos": True})
    text = chat.choices[0].message.content
    assert [i["type"] for i in r["output"]] == ["message"] and r["output"][0]["content"][0]["text"] == text
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["usage"]["input_tokens"] == chat.usage.prompt_tokens and r["usage"]["output_tokens"] == 12
    assert r["output"][0]["status"] == "incomplete"
    events, last = stream_of(client, **kw)
    assert unique(last) == unique(r) and last["usage"]["input_tokens_details"]["cached_tokens"] > 0  # prefix cache
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == text


def test_output_text_logprobs_are_the_chat_endpoints_and_stream_alike(client):
    kw = dict(input="Hello", max_output_tokens=6, temperature=0.8, top_logprobs=2,
              include=["message.output_text.logprobs"], extra_body={"seed": 9, "ignore_eos": True})
    r = client.responses.create(model=MODEL, **kw).model_dump()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
                                          temperature=0.8, seed=9, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True}).model_dump()
    part = r["output"][0]["content"][0]
    assert part["text"] == chat["choices"][0]["message"]["content"]
    # The same tokens; their logprobs may differ in the last bits (a cached prefix, another step shape).
    assert close(part["logprobs"], chat["choices"][0]["logprobs"]["content"])
    assert len(part["logprobs"]) == 6 and all(len(t["top_logprobs"]) == 2 for t in part["logprobs"])
    events, last = stream_of(client, **kw)
    assert close(unique(last), unique(r)) and not close(unique(last), {**unique(r), "status": "x"})
    streamed = [t for e in events if e["type"] == "response.output_text.delta" for t in e["logprobs"]]
    done = [e["logprobs"] for e in events if e["type"] == "response.output_text.done"]
    assert done == [last["output"][0]["content"][0]["logprobs"]]
    assert streamed == done[0][:len(streamed)] and len(streamed) >= 5  # each delta with its tokens'


def close(a, b) -> bool:
    """``a == b`` but for floats, which may differ by 1e-4."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def test_a_required_tool_call_is_a_function_call_item_streamed_alike(client):
    kw = dict(input="Weather in Paris?", tools=[FN_WEATHER], tool_choice="required", max_output_tokens=60,
              temperature=1.0, extra_body={"seed": 3}, parallel_tool_calls=False)
    r = client.responses.create(model=MODEL, **kw).model_dump()
    (call,) = r["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and r["status"] == "completed"
    args = json.loads(call["arguments"])
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Rome")
    events, last = stream_of(client, **kw)
    assert unique(last) == unique(r)
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call["arguments"]  # the arguments stream as they come


def test_a_named_call_cut_short_is_incomplete_and_its_response_goes_on(client):
    kw = dict(input="Weather?", tools=[FN_WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              max_output_tokens=3)
    r = client.responses.create(model=MODEL, **kw)
    assert r.status == "incomplete" and [(i.type, i.status) for i in r.output] == [("function_call", "incomplete")]
    _, last = stream_of(client, **kw)
    assert last["status"] == "incomplete"
    after = client.responses.create(model=MODEL, input="Go on.", previous_response_id=r.id, max_output_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert after.status == "incomplete" and after.usage.output_tokens == 2


def test_stored_responses_continue_their_conversation_and_the_store_keeps_the_latest(client, srv):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Hello", max_output_tokens=5,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=5, temperature=0)
    # The conversation goes on from the first's input and output, not its instructions (OpenAI's rule).
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(first.id).model_dump(exclude_none=True)
    assert [(i["type"], i["role"], i["content"]) for i in items["data"]] == [
        ("message", "user", [{"type": "input_text", "text": "Hello"}])]
    assert items["first_id"] == items["last_id"] == items["data"][0]["id"] and not items["has_more"]
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.BadRequestError, match="previous response with id") as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=second.id)
    assert e.value.body["param"] == "previous_response_id"
    for _ in range(3):  # the store keeps the 3 most recent
        client.responses.create(model=MODEL, input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


@pytest.mark.parametrize("kw, param", [
    (dict(input="x", max_output_tokens=10**6), "max_output_tokens"),
    (dict(input=[]), "input"),
    (dict(input="x", tools=[{"type": "function", "name": ""}], tool_choice="required"), "tools"),
    (dict(input="x", tools=[FN_WEATHER]), "tool_choice"),  # "auto" needs a parser on the server
    (dict(input="x", text={"format": {"type": "json_schema", "name": "x"}}), "text.format.schema"),
    (dict(input="x", text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}),
     "text.format"),
    (dict(input="word " * 5000), "input"),  # past max_model_len
    (dict(input="x", temperature=-1.0), "temperature"),
    (dict(input="x", extra_body={"priority": 2}), "priority"),  # the server's engine schedules FCFS
])
def test_bad_requests_get_a_400_naming_their_field_and_leave_nothing_behind(client, srv, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **kw)
    assert e.value.body["param"] == param, e.value.body
    assert srv.llm.bm.stats().num_used_blocks == 0


@pytest.mark.parametrize("body, param", [
    ({"input": None}, "input"),  # not the union's member types ('input.str')
    ({"input": "x", "stop": [1]}, "stop"),
    ({"input": "x", "metadata": {"k": "\ud800"}}, "metadata.k"),  # sent escaped, as JSON can carry it
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "\udfff", "schema": {}}}}, "text.format.name"),
])
def test_raw_bodies_get_a_400_naming_their_field(srv, body, param):
    r = httpx.post(srv.url + "/v1/responses", content=json.dumps({"model": MODEL, **body}),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_negative_store_size_is_refused_on_the_command_line(capsys):
    from jaxpaged.serve import run

    with pytest.raises(SystemExit) as e:  # before any model is loaded
        run(["--responses-store-size", "-1"])
    assert e.value.code == 2 and "--responses-store-size must be at least 0, got -1" in capsys.readouterr().err
