"""Tool calling: the tool choice's rules, the parsers that find calls in a reply (streamed in
random pieces against whole, hypothesis), and the server's chat endpoint calling tools for
real on the tiny model (named, required, and auto through the hermes parser)."""

import json

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged import LLM
from jaxpaged.tool_calling import ToolCallStream, ToolChoice, check_tools, resolve_tool_choice, tool_schema
from test_server import AUTH, CHAT, ENGINE, KEY, MODEL, Running

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"enum": [3, 4]}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]


# ---- the tool choice -------------------------------------------------------------------------


@pytest.mark.parametrize("tools, pattern", [
    ({"type": "function"}, r"^tools must be a list"),
    ([{"type": "retrieval"}], r"^tools\[0\] must be \{'type': 'function'"),
    ([WEATHER, {"type": "function", "function": {"name": ""}}], r"^tools\[1\]\.function\.name must be a non-empty"),
    ([WEATHER, WEATHER], r"^tools\[1\]\.function\.name 'get_weather' is given twice"),
    ([{"function": {"name": "f", "parameters": "x"}}], r"^tools\[0\]\.function\.parameters must be a JSON schema"),
    ([{"function": {"name": "f", "parameters": {"type": "string"}}}],
     r"^tools\[0\]\.function\.parameters must describe an object \(type 'object'\), got type 'string'"),
    ([WEATHER, {"function": {"name": "\ud800"}}], r"^tools\[1\]\.function\.name is not valid Unicode"),
    ([{"function": {"name": "f", "description": "a\udfffb"}}], r"^tools\[0\]\.function\.description is not valid"),
])
def test_bad_tools_are_refused_by_name(tools, pattern):
    with pytest.raises((TypeError, ValueError), match=pattern):
        check_tools(tools)


def test_tool_choice_defaults_and_refusals_follow_openai():
    assert resolve_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert resolve_tool_choice(None, None) == resolve_tool_choice("none", TOOLS) == ToolChoice("none")
    assert resolve_tool_choice("required", []) == ToolChoice("none")  # OpenAI: nothing to call
    assert resolve_tool_choice({"type": "function", "function": {"name": "add"}}, TOOLS) == ToolChoice("named", "add")
    for bad, pattern in [("always", "tool_choice must be"), ({"function": {"name": "sub"}}, "'sub', which is not"),
                         ({"type": "function"}, "tool_choice must be"), ("auto", None)]:
        with pytest.raises(ValueError, match=pattern or "needs tools"):
            resolve_tool_choice(bad, None if pattern is None else TOOLS)


def test_the_schemas_a_tool_choice_constrains_to():
    assert tool_schema(ToolChoice("named", "add"), TOOLS) == ADD["function"]["parameters"]
    assert tool_schema(ToolChoice("named", "f"), [{"function": {"name": "f"}}]) == {"type": "object",
                                                                                     "properties": {}}
    required = tool_schema(ToolChoice("required"), TOOLS)
    assert required["minItems"] == 1 and "maxItems" not in required
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["add"]]
    assert tool_schema(ToolChoice("required"), TOOLS, parallel_tool_calls=False)["maxItems"] == 1
    assert tool_schema(ToolChoice("auto"), TOOLS) is None
    assert tool_schema(ToolChoice("named", "f"), [{"function": {"name": "f", "parameters": {"properties": {}}}}]) == {
        "type": "object", "properties": {}}  # an object, as OpenAI's API takes parameters without a type


def unit_tool(name: str, unit: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"u": {"$ref": "#/$defs/unit"}}, "required": ["u"],
        "additionalProperties": False, "$defs": {"unit": unit}}}}


def test_required_moves_each_tools_definitions_to_the_top_where_their_references_point():
    same = [unit_tool("f", {"enum": ["C", "F"]}), unit_tool("g", {"enum": ["C", "F"]})]
    schema = tool_schema(ToolChoice("required"), same)
    assert schema["$defs"] == {"unit": {"enum": ["C", "F"]}}
    assert all("$defs" not in c["properties"]["parameters"] for c in schema["items"]["anyOf"])
    assert "$defs" in same[0]["function"]["parameters"]  # the request's tools are left as they were
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters\.\$defs\.unit differs from another"):
        tool_schema(ToolChoice("required"), [unit_tool("f", {"enum": ["C"]}), unit_tool("g", {"enum": ["K"]})])


# ---- finding the calls, streamed and whole ---------------------------------------------------


def run(mode: str, pieces: list[str], **kw) -> tuple[str, list[dict], ToolCallStream]:
    """Feed ``pieces`` (the last one finishes): the content and the calls the deltas add up to."""
    s = ToolCallStream(mode, **kw)
    content, calls = "", []
    for i, piece in enumerate(pieces):
        u = s.feed(piece, i == len(pieces) - 1)
        content += u.content
        for d in u.tool_calls:
            if d["index"] == len(calls):  # a call's first delta carries its id, type and name
                assert d["type"] == "function" and (d["id"].startswith("chatcmpl-tool-") or mode == "mistral")
                calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": ""})
            else:
                assert d["index"] == len(calls) - 1 and set(d) == {"index", "function"}
                assert set(d["function"]) == {"arguments"}
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert [c["id"] for c in calls] == [c.id for c in s.calls]
    return content, [{"name": c["name"], "arguments": c["arguments"]} for c in calls], s


def pieces_of(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


NAMES = st.sampled_from(["get_weather", "add", "f"])
ARGS = st.dictionaries(st.sampled_from(["city", "a", "n"]),
                       st.one_of(st.integers(-5, 5), st.text("ab}{\"\\<> \n", max_size=6), st.booleans()),
                       max_size=3)
TEXT = st.text("ab <>/_{}\"\n", max_size=12)  # text between calls, with the tags' and JSON's characters


@st.composite
def hermes_replies(draw):
    """A hermes reply: ``(text, its content, its calls)``, with text, whitespace, broken calls
    (left in the content) and calls in any order."""
    parts = draw(st.lists(st.one_of(
        st.tuples(st.just("text"), TEXT),
        st.tuples(st.just("space"), st.sampled_from(["\n", " ", "\n\n"])),
        st.tuples(st.just("call"), st.tuples(NAMES, ARGS, st.sampled_from(["", "\n"]))),
        st.tuples(st.just("broken"), st.sampled_from(["{", "{\"name\": 3}", "[]", "{\"arguments\": {}}",
                                                      "{\"name\": \"add\"}", "{\"name\": \"f\", \"parameters\": {}}",
                                                      "{\"name\": \"f\", \"arguments\": \"{}\"}"])),
    ), max_size=6))
    unterminated = draw(st.booleans())

    def call(value, last: bool) -> tuple[str, dict]:
        name, args, pad = value
        close = "" if unterminated and last else "</tool_call>"
        return (f"<tool_call>{pad}{json.dumps({'name': name, 'arguments': args})}{pad}{close}",
                {"name": name, "arguments": json.dumps(args)})

    return tagged_reply(parts, call)


def tagged_reply(parts: list[tuple[str, object]], call) -> tuple[str, str, list[dict]]:
    """hermes and qwen3_coder replies: ``(text, its content, its calls)`` of ``parts``, text, space,
    blocks with no call (``"broken"``) and calls (``call(value, last)``: the call's text and the
    call expected)."""
    text, calls, chunks = "", [], [""]  # chunks: the text before each call, and after the last
    for i, (kind, value) in enumerate(parts):
        if kind == "call":
            written, expected = call(value, i == len(parts) - 1)
            text += written
            calls.append(expected)
            chunks.append("")
        else:
            piece = value if kind in ("text", "space") else f"<tool_call>{value}</tool_call>"
            text += piece
            chunks[-1] += piece
    # The content: the text outside the calls, less the whitespace before each call and at the end.
    content = text if not calls else "".join(c.rstrip() for c in chunks)
    return text, content, calls


@settings(max_examples=300, deadline=None, derandomize=True)
@given(hermes_replies(), st.lists(st.integers(0, 200), max_size=8))
def test_hermes_calls_streamed_in_any_pieces_add_up_to_the_whole_reply(reply, cuts):
    text, content, calls = reply
    whole = run("hermes", [text])[:2]
    assert run("hermes", pieces_of(text, cuts))[:2] == whole
    assert whole == (content, calls)  # every well-formed call found, in order; broken ones left as text


LLAMA_LEADS = st.sampled_from(["", " ", "<|python_tag|>", "\n<|python_tag|>", "<|python_tag|> "])
LLAMA_NOT_CALLS = ['{"x": 1}', '{"name": "f"}', '{"name": "f", "parameters": 5}', '{"name": 3, "arguments": {}}']


@st.composite
def llama_replies(draw):
    """A llama3_json reply: ``(text, its content, its calls)``. A reply whose first object is a
    call: the run of objects separated by ``;``, calls (name first or last) and objects that are
    no call (content), then any text (content, from its first character that ends the run)."""
    calls = draw(st.lists(st.tuples(NAMES, ARGS, st.booleans()), max_size=3))
    if not calls:  # a reply whose first object is no call is content, as it is
        text = draw(st.sampled_from(["", "  ", "Hello.", " <|python", "<|python_tag|>no call", "{not json",
                                     "<|python_tag|>", *LLAMA_NOT_CALLS, '{"a": 1}; {"name": "f", "parameters": {}}',
                                     '; {"name": "f", "parameters": {}}', '[{"name": "f", "parameters": {}}]',
                                     'Sure: {"name": "f", "parameters": {}}', ' {"name": "f"} ']))
        return text, text, []
    key = draw(st.sampled_from(["parameters", "arguments"]))
    seps = st.sampled_from([";", "; ", " ;\n", ";\n\n"])
    objects, content, expected = [], [], []
    for i, (name, args, name_last) in enumerate(calls):
        if i and draw(st.booleans()):
            objects.append(draw(st.sampled_from(LLAMA_NOT_CALLS)))
            content.append(objects[-1])
        objects.append(json.dumps({key: args, "name": name} if name_last else {"name": name, key: args}))
        expected.append({"name": name, "arguments": json.dumps(args)})
    text = draw(LLAMA_LEADS) + objects[0] + "".join(draw(seps) + o for o in objects[1:])
    tail = draw(st.sampled_from(["", " and some text", ' {"name": "g", "parameters": {}}', "\n\nDone.\n", " ]",
                                 ' "x"', ";  \n", "; hello", " ; } {"]))
    rest = tail.lstrip()
    rest = rest[1:].lstrip() if rest.startswith(";") else rest  # (one ';' may follow the last object)
    return text + tail, " ".join(p for p in [*content, rest.rstrip()] if p), expected


@settings(max_examples=300, deadline=None, derandomize=True)
@given(llama_replies(), st.lists(st.integers(0, 200), max_size=8))
def test_llama3_json_calls_streamed_in_any_pieces_add_up_to_the_whole_reply(reply, cuts):
    text, content, calls = reply
    whole = run("llama3_json", [text])[:2]
    assert run("llama3_json", pieces_of(text, cuts))[:2] == whole
    assert whole == (content, calls)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3), LLAMA_LEADS, st.integers(1, 60),
       st.lists(st.integers(0, 200), max_size=8))
def test_a_llama3_json_reply_cut_short_keeps_the_arguments_that_came(calls, lead, cut_at, cuts):
    """A reply cut by max_tokens: every call whose arguments began, with what came of them; an
    object cut before its arguments began is content; a first object cut so is the whole reply."""
    objects = [json.dumps({"name": n, "parameters": a}) for n, a in calls]
    text = lead + "; ".join(objects)
    cut = text[:max(0, len(text) - cut_at)]
    whole = run("llama3_json", [cut])[:2]
    assert run("llama3_json", pieces_of(cut, cuts))[:2] == whole
    expected, rest, pos = [], "", len(lead)
    for (n, a), obj in zip(calls, objects):
        start = pos + obj.index('"parameters": ') + len('"parameters": ')
        if start < len(cut):
            expected.append({"name": n, "arguments": json.dumps(a)[:len(cut) - start]})
        elif pos < len(cut):
            rest = cut[pos:]  # the object cut before its arguments
        pos += len(obj) + 2
    assert whole == ((rest.rstrip(), expected) if expected else (cut, []))


def test_llama3_json_arguments_stream_as_they_come():
    s = ToolCallStream("llama3_json")
    pieces = ['<|python_tag|>{"name": "add", "param', 'eters": {"a"', ': 1, "b"', ': 3}}', '; {"parameters": {}, ',
              '"name": "f"}', "; ", '{"name": "g", "arguments": {"s": ";}"}}', " Done."]
    updates = [s.feed(p, False) for p in pieces] + [s.feed("", True)]
    assert [[d["function"]["arguments"] for d in u.tool_calls] for u in updates] == [
        [], ['{"a"'], [': 1, "b"'], [": 3}"], [], ["{}"], [], ['{"s": ";}"}'], [], []]
    assert updates[1].tool_calls[0]["function"]["name"] == "add" and updates[5].tool_calls[0]["index"] == 1
    assert "".join(u.content for u in updates) == "Done." and updates[8].content == "Done."
    assert [(c.name, c.arguments) for c in s.calls] == [("add", '{"a": 1, "b": 3}'), ("f", "{}"), ("g", '{"s": ";}"}')]
    assert s.finish_reason("stop") == "tool_calls"
    content, calls, _ = run("llama3_json", ['{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": 1}}'],
                            max_calls=1)  # parallel_tool_calls=false: the first call
    assert (content, [c["name"] for c in calls]) == ("", ["f"])


PY_VALUES = st.recursive(st.one_of(st.integers(-5, 5), st.text("ab,)]}\"'\\ \né", max_size=6), st.booleans(),
                                   st.none(), st.floats(-2, 2, allow_nan=False)),
                         lambda v: st.lists(v, max_size=2)
                         | st.dictionaries(st.sampled_from(["k", "x,y"]), v, max_size=2),
                         max_leaves=4)
PY_NOT_CALLS = ["1", "f(1)", "x", "f(a=b)", "f(**k)", "f(a={1, 2})", "f(a=1e999)", "f.g(a=1)", "f(a=1)(b=2)"]


@st.composite
def pythonic_replies(draw):
    """A pythonic reply: ``(text, its content, its calls)``. A reply whose list's first element is a
    call: its elements, calls and elements that are no call (content), then any text (content)."""
    calls = draw(st.lists(st.tuples(NAMES, st.dictionaries(st.sampled_from(["city", "a", "n"]), PY_VALUES,
                                                           max_size=3)), max_size=3))
    if not calls:  # a reply whose list's first element is no call is content, as it is
        text = draw(st.sampled_from(["", " ", "Hello.", "[]", "[ ]", "[1, f(a=1)]", "f(a=1)", "[f(a=1)", "(f(a=1))",
                                     *(f"[{e}]" for e in PY_NOT_CALLS), "Sure: [f(a=1)]"]))
        return text, text, []
    sep = draw(st.sampled_from([", ", ",", ",\n "]))
    elements, content, expected = [], [], []
    for i, (name, args) in enumerate(calls):
        if i and draw(st.booleans()):
            elements.append(draw(st.sampled_from(PY_NOT_CALLS)))
            content.append(elements[-1])
        elements.append(f"{name}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")")
        expected.append({"name": name, "arguments": json.dumps(args, ensure_ascii=False)})
    text = draw(st.sampled_from(["", " ", "\n"])) + "[" + sep.join(elements) + draw(st.sampled_from(["", ",", " "]))
    tail = draw(st.sampled_from(["", " and some text", "\n\nDone.\n", " ]", ' "x"', "[g()]"]))
    return text + "]" + tail, " ".join(p for p in [*content, tail.strip()] if p), expected


@settings(max_examples=300, deadline=None, derandomize=True)
@given(pythonic_replies(), st.lists(st.integers(0, 200), max_size=8))
def test_pythonic_calls_streamed_in_any_pieces_add_up_to_the_whole_reply(reply, cuts):
    text, content, calls = reply
    whole = run("pythonic", [text])[:2]
    assert run("pythonic", pieces_of(text, cuts))[:2] == whole
    assert whole == (content, calls)


@st.composite
def mistral_replies(draw):
    """A Mistral reply: ``(text, its content, its calls)``: text, then ``[TOOL_CALLS]`` and the calls
    as a JSON list or each as ``name[ARGS]{...}`` after a tag of its own, then text (dropped)."""
    lead = draw(st.sampled_from(["", "Sure. ", "a [TOOL", "x\n"]))
    calls = draw(st.lists(st.tuples(NAMES, ARGS), max_size=3))
    tail = draw(st.sampled_from(["", " ", " junk", "[TOOL_CALLS]", " [ARGS]"]))
    if not calls:  # the tag and no call: content without the tag; no tag: content
        rest = draw(st.sampled_from(["", " not a call", "[1, 2]", "my name[ARGS]{}", "f[ARGS]5", "{\"a\": 1}"]))
        tagged = draw(st.booleans())
        return lead + ("[TOOL_CALLS]" if tagged else "") + rest, lead + rest, []
    if draw(st.booleans()):  # Mistral-7B-Instruct-v0.3's list
        body = json.dumps([{"name": n, "arguments": a} for n, a in calls])
    else:
        body = "[TOOL_CALLS]".join(f"{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    expected = [{"name": n, "arguments": json.dumps(a)} for n, a in calls]
    return lead + "[TOOL_CALLS]" + body + tail, lead.rstrip(), expected


@settings(max_examples=300, deadline=None, derandomize=True)
@given(mistral_replies(), st.lists(st.integers(0, 200), max_size=8))
def test_mistral_calls_streamed_in_any_pieces_add_up_to_the_whole_reply(reply, cuts):
    text, content, calls = reply
    whole = run("mistral", [text])[:2]
    assert run("mistral", pieces_of(text, cuts))[:2] == whole
    assert whole == (content, calls)
    s = ToolCallStream("mistral")
    s.feed(text, True)
    assert all(len(c.id) == 9 and c.id.isalnum() for c in s.calls)  # what Mistral's templates take


# qwen3_coder: a tool whose parameters have every type the parser converts (and one with none).
XML_TOOL = {"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "ok": {"type": "boolean"}, "s": {"type": "string"},
    "o": {"type": "object"}, "l": {"type": ["array", "null"]}, "e": {"enum": [1, "two"]}}}}}
XML_VALUES = {"n": st.integers(-99, 99), "x": st.floats(-10, 10, allow_nan=False).map(lambda v: round(v, 3)),
              "ok": st.booleans(), "s": st.text("ab <>/_{}\"\n", max_size=10), "o": st.just({"k": [1, "v"]}),
              "l": st.sampled_from([[1, 2], None]), "e": st.sampled_from([1, "two"])}


def xml_text(v) -> str:
    """How a Qwen3-Coder model writes a parameter's value."""
    return v if isinstance(v, str) else "null" if v is None else json.dumps(v)


@st.composite
def qwen3_coder_replies(draw):
    """A qwen3_coder reply: ``(text, its content, its calls)``, with text, whitespace, blocks with no
    function (content) and calls of typed parameters in any order, the last maybe cut short."""
    parts = draw(st.lists(st.one_of(
        st.tuples(st.just("text"), TEXT),
        st.tuples(st.just("space"), st.sampled_from(["\n", " ", "\n\n"])),
        st.tuples(st.just("call"), st.lists(st.sampled_from(sorted(XML_VALUES)), unique=True, max_size=4).flatmap(
            lambda keys: st.tuples(*(st.tuples(st.just(k), XML_VALUES[k]) for k in keys)))),
        st.tuples(st.just("broken"), st.sampled_from(["", "{}", "<parameter=n>\n1\n</parameter>", "function=f>"])),
    ), max_size=5))
    cut = draw(st.booleans())

    def call(value, last: bool) -> tuple[str, dict]:
        params = "".join(f"<parameter={k}>\n{xml_text(v)}\n</parameter>\n" for k, v in value)
        args = json.dumps(dict(value), ensure_ascii=False)
        if cut and last:  # cut short: no end tags, no closing brace
            return "<tool_call>\n<function=edit>\n" + params, {"name": "edit", "arguments": args[:-1]}
        return "<tool_call>\n<function=edit>\n" + params + "</function>\n</tool_call>", {"name": "edit",
                                                                                        "arguments": args}

    return tagged_reply(parts, call)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(qwen3_coder_replies(), st.lists(st.integers(0, 300), max_size=8))
def test_qwen3_coder_calls_streamed_in_any_pieces_add_up_to_the_whole_reply(reply, cuts):
    """Each parameter's value comes typed by the tool's schema; the arguments stream a parameter at a time."""
    text, content, calls = reply
    whole = run("qwen3_coder", [text], tools=[XML_TOOL])[:2]
    assert run("qwen3_xml", pieces_of(text, cuts), tools=[XML_TOOL])[:2] == whole
    assert whole == (content, calls)


def test_qwen3_coder_values_are_typed_as_vllm_types_them():
    from jaxpaged.tool_calling import _xml_value

    for text, schema, want in (("\n7\n", {"type": "integer"}, 7), ("seven", {"type": "integer"}, "seven"),
                               ("2", {"type": "number"}, 2), ("2.5", {"type": "number"}, 2.5),
                               ("2.0", {"type": "number"}, 2.0), ("True", {"type": "boolean"}, True),
                               ("\n\nx\n\n", {"type": "string"}, "\nx\n"), ("null", {"type": "string"}, None),
                               ("[1, 'a']", {"type": "array"}, [1, "a"]), ('{"a": 1}', {"type": "object"}, {"a": 1}),
                               ("two", {"enum": [1, "two"]}, "two"), ("1", {"enum": [1, "two"]}, 1),
                               ("3", None, 3), ("Paris", None, "Paris"), ("{bad", {"type": "object"}, "{bad")):
        got = _xml_value(text, schema)
        assert got == want and type(got) is type(want), (text, schema, got)


def test_pythonic_calls_go_out_as_their_elements_end():
    s = ToolCallStream("pythonic")
    pieces = ['[get_weather(city="Par', 'is, \\"FR\\")"), ', "add(a=1, b=[2, {'c': None}]", ")", "] Done."]
    updates = [s.feed(p, False) for p in pieces] + [s.feed("", True)]
    assert [[(d["function"]["name"], d["function"]["arguments"]) for d in u.tool_calls] for u in updates] == [
        [], [("get_weather", '{"city": "Paris, \\"FR\\")"}')], [], [], [("add", '{"a": 1, "b": [2, {"c": null}]}')], []]
    assert "".join(u.content for u in updates) == "Done." and s.finish_reason("stop") == "tool_calls"
    content, calls, _ = run("pythonic", ["[f(), g(a=1), h(b=2)]"], max_calls=1)  # parallel_tool_calls=false
    assert (content, calls) == ("", [{"name": "f", "arguments": "{}"}])
    content, calls, _ = run("pythonic", ["[f(a=1), g(b="])  # cut short: the open element is content
    assert (content, calls) == ("g(b=", [{"name": "f", "arguments": '{"a": 1}'}])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(NAMES, ARGS), max_size=3), st.sampled_from(["", " ", "\n  "]), st.booleans(),
       st.integers(0, 40), st.lists(st.integers(0, 200), max_size=8))
def test_required_calls_streamed_in_any_pieces_add_up_to_the_whole_reply(calls, space, compact, cut_at, cuts):
    seps = (",", ":") if compact else (", ", ": ")  # the constraint writes compact JSON; any JSON is read
    heads = [json.dumps({"name": n, "parameters": None}, separators=seps)[:-len("null}")] for n, _ in calls]
    args = [json.dumps(a, separators=seps) for _, a in calls]
    items = [h + a + "}" for h, a in zip(heads, args)]
    text = f"[{space}" + f",{space}".join(items) + f"{space}]"
    expected = [{"name": n, "arguments": a} for (n, _), a in zip(calls, args)]  # the parameters as written
    whole = run("required", [text])[:2]
    assert run("required", pieces_of(text, cuts))[:2] == whole == ("" if calls else text, expected)
    # A reply cut short (max_tokens): each call whose arguments began, with what came of them.
    cut = text[:len(text) - cut_at]
    starts = [len(f"[{space}") + sum(len(i) + 1 + len(space) for i in items[:k]) + len(heads[k])
              for k in range(len(items))]
    begun = [{**c, "arguments": c["arguments"][:len(cut) - start]} for c, start in zip(expected, starts)
             if start < len(cut)]
    assert run("required", pieces_of(cut, cuts))[:2] == ("" if begun else cut, begun)


def test_required_arguments_stream_as_they_come():
    content, calls, _ = run("required", ['[{"name":"add","param', 'eters":{"a"', ':1,"b":3}}', ',{"name":"f",',
                                         '"parameters":{}}]'])
    assert (content, calls) == ("", [{"name": "add", "arguments": '{"a":1,"b":3}'}, {"name": "f", "arguments": "{}"}])
    s = ToolCallStream("required")
    deltas = [s.feed(piece, False).tool_calls for piece in ['[{"name":"add","parameters":{"a"', ':1', ',"b":3}}]']]
    assert [[d["function"]["arguments"] for d in ds] for ds in deltas] == [['{"a"'], [":1"], [',"b":3}']]
    assert deltas[0][0]["function"]["name"] == "add"


def test_hermes_arguments_stream_as_they_come():
    s = ToolCallStream("hermes")
    pieces = ['Sure. <tool_', 'call>\n{"name": "add", "argu', 'ments": {"a"', ': 1, "b"', ': 3}}\n</tool', '_call>',
              '<tool_call>{"name": "f", "arguments": {}}</tool_call>']
    updates = [s.feed(p, False) for p in pieces] + [s.feed("", True)]
    assert [[d["function"]["arguments"] for d in u.tool_calls] for u in updates] == [
        [], [], ['{"a"'], [': 1, "b"'], [": 3}"], [], ["{}"], []]
    assert updates[2].tool_calls[0]["function"]["name"] == "add" and updates[6].tool_calls[0]["index"] == 1
    assert "".join(u.content for u in updates) == "Sure."
    assert [(c.name, c.arguments) for c in s.calls] == [("add", '{"a": 1, "b": 3}'), ("f", "{}")]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3), st.integers(1, 60),
       st.lists(st.integers(0, 200), max_size=8))
def test_a_hermes_reply_cut_short_keeps_the_arguments_that_came(calls, cut_at, cuts):
    """A reply cut by max_tokens: every call whose arguments began, with what came of them,
    streamed or whole; a block cut before its arguments began is content."""
    blocks = [f'<tool_call>{json.dumps({"name": n, "arguments": a})}</tool_call>' for n, a in calls]
    text = "".join(blocks)
    cut = text[:max(0, len(text) - cut_at)]
    whole = run("hermes", [cut])[:2]
    assert run("hermes", pieces_of(cut, cuts))[:2] == whole
    expected, rest, pos = [], "", 0
    for (n, a), block in zip(calls, blocks):
        start = pos + block.index('"arguments": ') + len('"arguments": ')
        if start < len(cut):
            expected.append({"name": n, "arguments": json.dumps(a)[:len(cut) - start]})
        elif pos < len(cut):
            rest = cut[pos:]  # the block cut before its arguments: content, as the text was
        pos += len(block)
    assert whole == (rest.rstrip() if expected else rest, expected)  # (trailing space after calls dropped)


def test_a_hermes_end_tag_inside_the_open_arguments_strings_is_theirs():
    text = ('<tool_call>{"name": "f", "arguments": {"s": "a</tool_call>b"}}</tool_call> after '
            '<tool_call>{"name": "g", "arguments": {"a": 1</tool_call> rest')  # closed before its arguments
    whole = run("hermes", [text])[:2]
    assert whole == (" after rest", [{"name": "f", "arguments": '{"s": "a</tool_call>b"}'},
                               {"name": "g", "arguments": '{"a": 1'}])  # (the second: what came; no JSON)
    for k in range(1, len(text)):
        assert run("hermes", [text[:k], text[k:]])[:2] == whole, k
    assert run("hermes", list(text))[:2] == whole


def test_hermes_blocks_that_stream_no_call_are_read_whole():
    text = ('<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'  # name last: a call at its end
            '<tool_call>{"name": "f", "arguments": {"x": 2}, oops</tool_call>')  # arguments read: a call
    content, calls, _ = run("hermes", [text])
    assert (content, calls) == ("", [{"name": "add", "arguments": '{"a": 1}'}, {"name": "f", "arguments": '{"x": 2}'}])
    s = ToolCallStream("hermes", max_calls=1)  # a call past max_calls sends nothing, not even content
    deltas = [s.feed(p, False).tool_calls for p in ['<tool_call>{"name": "f", "arguments": {}}</tool_call>',
                                                    '<tool_call>{"name": "g", "arg', 'uments": {"a"', ': 1}}']]
    assert [len(d) for d in deltas] == [1, 0, 0, 0] and s.feed("</tool_call>", True).content == ""
    assert [c.name for c in s.calls] == ["f"]


def test_named_arguments_stream_as_they_come_and_one_call_at_most():
    content, calls, s = run("named", ['{"a"', "", ': 1}'], name="add")
    assert (content, calls) == ("", [{"name": "add", "arguments": '{"a": 1}'}])
    assert s.finish_reason("stop") == "stop" and s.finish_reason("length") == "length"
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls, s = run("hermes", [text], max_calls=1)
    assert (content, [c["name"] for c in calls]) == ("", ["f"])  # parallel_tool_calls=false: the first
    assert s.finish_reason("stop") == "tool_calls" and s.finish_reason("length") == "length"
    assert run("hermes", ["no calls"])[2].finish_reason("stop") == "stop"


# ---- through the server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tiny_engine_model):
    """The tiny model served without a tool parser and with hermes."""
    plain, hermes = Running(LLM(tiny_engine_model, **ENGINE)), Running(LLM(tiny_engine_model, **ENGINE),
                                                                      tool_call_parser="hermes")
    yield plain, hermes
    plain.stop()
    hermes.stop()


def clients(servers):
    return [openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60) for s in servers]


def streamed(client, **kw) -> tuple[str | None, list[dict], str]:
    """A streamed chat reply's content, tool calls (their deltas added up) and finish reason."""
    content, calls, reason = None, [], None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        assert delta.role or delta.content or delta.tool_calls or chunk.choices[0].finish_reason, chunk  # no empty ones
        if delta.content:
            content = (content or "") + delta.content
        for d in delta.tool_calls or []:
            if d.index == len(calls):
                calls.append({"id": d.id, "name": d.function.name, "arguments": ""})
            else:
                assert d.id is None and d.function.name is None
            calls[d.index]["arguments"] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def whole(client, **kw) -> tuple[str | None, list[dict], str]:
    choice = client.chat.completions.create(model=MODEL, **kw).choices[0]
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
             for c in choice.message.tool_calls or []]
    return choice.message.content, calls, choice.finish_reason


def check_weather(arguments: str) -> None:
    args = json.loads(arguments)
    assert set(args) == {"city", "unit"} and args["city"] in ("Paris", "Rome") and args["unit"] in ("C", "F")


def same(a, b) -> bool:
    """Two replies alike but for the calls' ids (each response has its own)."""
    strip = lambda r: (r[0], [(c["name"], c["arguments"]) for c in r[1]], r[2])  # noqa: E731
    return strip(a) == strip(b)


def test_a_named_tool_choice_calls_that_function_with_arguments_of_its_schema(servers):
    client, _ = clients(servers)
    kw = dict(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, max_tokens=40,
              temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    w = whole(client, **kw)
    content, calls, reason = w
    assert content is None and reason == "stop" and [c["name"] for c in calls] == ["get_weather"]
    check_weather(calls[0]["arguments"])
    assert calls[0]["id"].startswith("chatcmpl-tool-")
    assert same(streamed(client, **kw), w)


def test_a_required_tool_choice_makes_one_or_more_calls_of_the_listed_tools(servers):
    client, _ = clients(servers)
    for seed in range(3):
        kw = dict(messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0, seed=seed)
        w = whole(client, **kw)
        content, calls, reason = w
        assert content is None and reason == "tool_calls" and calls, w
        for c in calls:
            assert c["name"] in ("get_weather", "add")
            if c["name"] == "get_weather":
                check_weather(c["arguments"])
            else:
                assert set(json.loads(c["arguments"])) == {"a", "b"}
        assert len({c["id"] for c in calls}) == len(calls)
        assert same(streamed(client, **kw), w)
    one = whole(client, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=1.0, seed=0,
                parallel_tool_calls=False)
    assert len(one[1]) == 1 and one[2] == "tool_calls"
    defs = whole(client, messages=CHAT, tools=[unit_tool("f", {"enum": ["C", "F"]}), unit_tool("g", {"enum": ["C", "F"]})],
                 tool_choice="required", max_tokens=80, temperature=1.0, seed=1, parallel_tool_calls=False)
    assert defs[2] == "tool_calls" and json.loads(defs[1][0]["arguments"])["u"] in ("C", "F")  # $refs resolved


HERMES_REPLY = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                r'"unit": "C"\}\}\n</tool_call>')


def test_auto_tool_choice_finds_the_models_own_calls_with_the_hermes_parser(servers):
    """The reply is forced into hermes' format with a regex (the random model would not write
    it); the parser takes the call out of it, streamed and whole alike."""
    _, client = clients(servers)
    kw = dict(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=60, temperature=0.8,
              seed=3, extra_body={"structured_outputs": {"regex": HERMES_REPLY}})
    w = whole(client, **kw)
    content, calls, reason = w
    assert content == "Checking." and reason == "tool_calls" and [c["name"] for c in calls] == ["get_weather"]
    check_weather(calls[0]["arguments"])
    assert same(streamed(client, **kw), w)
    plain = whole(client, messages=CHAT, tools=TOOLS, max_tokens=5, temperature=0)  # no call: plain text
    assert plain[0] and plain[1] == [] and plain[2] in ("length", "stop")


def test_earlier_calls_and_tool_replies_go_to_the_template(servers, tiny_engine_model):
    """A conversation that carries an assistant's calls and a tool's reply is served; the
    template gets the tools and the calls' arguments as objects (the offline ``LLM.chat``)."""
    client, _ = clients(servers)
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "C"}'}}
    messages = [{"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": None,
                                                                   "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=3)
    assert r.usage.completion_tokens >= 1
    with httpx.Client(base_url=servers[0].url, headers=AUTH) as http:
        tokenized = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tokenized["count"] == r.usage.prompt_tokens
    llm = servers[0].llm
    saved = llm.tokenizer.chat_template
    llm.tokenizer.chat_template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
                                   "{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
                                   "({{ c.function.name }} {{ c.function.arguments.city }}){% endfor %};{% endfor %}")
    try:
        prompt = llm.chat_prompt(messages, tools=TOOLS)["prompt"]
    finally:
        llm.tokenizer.chat_template = saved
    assert prompt == "[get_weather][add]user:Weather in Rome?;assistant:(get_weather Rome);tool:21 C;"
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.name"):
        llm.chat(CHAT, tools=[{"type": "function", "function": {"name": 7}}])


def test_auto_tool_choice_and_its_parser_go_together_on_the_command_line(capsys):
    from jaxpaged.serve import run

    for argv in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        with pytest.raises(SystemExit) as e:  # refused before any model is loaded
            run(argv)
        assert e.value.code == 2
        assert "--enable-auto-tool-choice and --tool-call-parser go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["--enable-auto-tool-choice", "--tool-call-parser", "granite"])
    assert "invalid choice: 'granite'" in capsys.readouterr().err


# Each parser's reply forced with a regex (the random model would write none): a call, then text.
PARSED_REPLIES = {
    "llama3_json": r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "(Paris|Rome)", "unit": "C"\}\}'
                   r'; \{"name": "add", "parameters": \{"a": 1, "b": 3\}\} Done\.',
    "pythonic": r'\[get_weather\(city="(Paris|Rome)", unit="C"\), add\(a=1, b=3\)\] Done\.',
    "mistral": r'Done\.\[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "(Paris|Rome)", "unit": "C"\}'
               r'\[TOOL_CALLS\]add\[ARGS\]\{"a": 1, "b": 3\}',
    "qwen3_coder": r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n"
                   r"<parameter=unit>\nC\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n"
                   r"<parameter=a>\n1\n</parameter>\n<parameter=b>\n3\n</parameter>\n</function>\n</tool_call>Done\.",
}


@pytest.mark.parametrize("parser", sorted(PARSED_REPLIES))
def test_auto_tool_choice_finds_the_models_own_calls_with_the_other_parsers(tiny_engine_model, parser):
    server = Running(LLM(tiny_engine_model, **ENGINE), tool_call_parser=parser)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        kw = dict(messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=120, temperature=0.8,
                  seed=3, extra_body={"structured_outputs": {"regex": PARSED_REPLIES[parser]}})
        w = whole(client, **kw)
        content, calls, reason = w
        assert content == "Done." and reason == "tool_calls" and [c["name"] for c in calls] == ["get_weather", "add"]
        check_weather(calls[0]["arguments"])
        assert json.loads(calls[1]["arguments"]) == {"a": 1, "b": 3}
        assert same(streamed(client, **kw), w)
    finally:
        server.stop()
