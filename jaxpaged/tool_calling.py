"""OpenAI tool calling for ``/v1/chat/completions``, as vLLM serves it. No jax here.

``tool_choice`` decides how a reply becomes tool calls:

- a named function (``{"type": "function", "function": {"name": ...}}``): the reply is
  constrained (a structured output, compact JSON: no whitespace, which small models otherwise
  pile up until ``max_tokens``) to the function's ``parameters`` schema and is that call's
  ``arguments``;
- ``"required"``: the reply is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one per call, each a listed tool's (``parallel_tool_calls=false``: one at most); a
  call's arguments are its ``parameters`` as written, streamed as they come;
- ``"auto"`` (the default when ``tools`` are given): the reply is free and a *tool parser*
  for the model's own format (``--tool-call-parser``) finds the calls in it: ``hermes``
  (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Hermes, Qwen, SmolLM3),
  ``llama3_json`` (a reply that is ``{"name": ..., "parameters": {...}}`` objects, optionally
  after ``<|python_tag|>`` and separated by ``;``: Llama 3.1-3.3), ``pythonic`` (a Python
  list of calls with literal keyword arguments, ``[get_weather(city="Paris"), f()]``: Llama
  3.2, ToolACE) or ``mistral`` (``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``:
  Mistral-7B-Instruct-v0.3, Mistral-Nemo; or ``[TOOL_CALLS]name[ARGS]{...}`` per call: the
  newer Mistral models) or ``qwen3_coder`` (``<tool_call><function=name><parameter=key>value
  </parameter>...</function></tool_call>``, the values typed by the tool's schema: Qwen3-Coder,
  Qwen3.5; also named ``qwen3_xml``);
- ``"none"``: plain text.

A :class:`ToolCallStream` turns a reply's text into content and tool calls as it grows; the
whole response is the same machine fed the whole text at once, so a streamed reply's deltas
add up to the unstreamed one.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from jaxpaged.input_processor import check_strings

TOOL_PARSERS = ("hermes", "llama3_json", "pythonic", "mistral", "qwen3_coder", "qwen3_xml")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """Mistral's chat templates take only ids of 9 letters and digits (vLLM makes such ids too)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


@dataclass(frozen=True)
class ToolChoice:
    """A request's ``tool_choice`` resolved against its ``tools``: ``kind`` is ``"none"``,
    ``"auto"``, ``"required"`` or ``"named"`` (then ``name`` is the function's)."""

    kind: str
    name: str | None = None


def check_tools(tools: Any) -> list[dict]:
    """``tools`` (OpenAI's ``[{"type": "function", "function": {"name", "description",
    "parameters"}}]``) checked; errors name the culprit (``tools[i].function.name``). As in
    OpenAI's API, ``parameters`` describe an object (``"type": "object"``, or no type)."""
    if not isinstance(tools, list):
        raise TypeError(f"tools must be a list of tool objects, got {type(tools).__name__}")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{...}}}}, got {tool!r:.100}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ValueError(f"{where}.function must be an object with a name, got {fn!r:.100}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.function.name must be a non-empty string, got {name!r:.100}")
        if name in names:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON schema object, got {params!r:.100}")
        if params is not None and params.get("type", "object") != "object":
            raise ValueError(f"{where}.function.parameters must describe an object (type 'object'), got type "
                             f"{params['type']!r:.100}")
        check_strings(tool, where)
    return tools


def resolve_tool_choice(tool_choice: Any, tools: list[dict] | None) -> ToolChoice:
    """OpenAI's defaults: ``"auto"`` with tools, ``"none"`` without; ``"required"`` with an
    empty ``tools`` list is ``"none"``. Errors name ``tool_choice``."""
    if tool_choice is None:
        return ToolChoice("auto" if tools else "none")
    if tool_choice == "none":
        return ToolChoice("none")
    if tool_choice in ("auto", "required"):
        if tools is None:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools")
        return ToolChoice("none" if not tools else tool_choice)
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                             f"'function': {{'name': ...}}}}, got {tool_choice!r:.100}")
        listed = [t["function"]["name"] for t in tools or ()]
        if name not in listed:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools {listed}")
        return ToolChoice("named", name)
    raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                     f"{{'name': ...}}}}, got {tool_choice!r:.100}")


def _parameters(tool: dict) -> dict:
    return {"type": "object", **(tool["function"].get("parameters") or {"properties": {}})}


_DEFS = ("$defs", "definitions")  # where a schema's "#/$defs/..." references point


def tool_schema(choice: ToolChoice, tools: list[dict], *, parallel_tool_calls: bool = True) -> dict | None:
    """The JSON schema a named or required tool choice constrains the reply to (None otherwise).
    For ``"required"`` each tool's definitions (``$defs``) move to the top of the array's schema,
    where its references point; two tools defining one name differently are refused."""
    if choice.kind == "named":
        return next(_parameters(t) for t in tools if t["function"]["name"] == choice.name)
    if choice.kind != "required":
        return None
    calls, defs = [], {key: {} for key in _DEFS}
    for i, t in enumerate(tools):
        params = _parameters(t)
        for key in _DEFS:
            for name, definition in (params.pop(key, None) or {}).items():
                if defs[key].setdefault(name, definition) != definition:
                    raise ValueError(f"tools[{i}].function.parameters.{key}.{name} differs from another tool's "
                                     "definition of that name; give them distinct names")
        calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                       "parameters": params},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    schema.update({key: d for key, d in defs.items() if d})
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


# ---- finding the calls in a reply ------------------------------------------------------------


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=tool_call_id)

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _JsonScanner:
    """JSON text read as it arrives (``feed``), a character at a time: strings skipped (escapes
    included), brackets counted in ``level``. What a subclass wants of the structure it takes in
    ``_string`` (a string's span, at ``level``), ``_open`` (a bracket, before ``level`` rises),
    ``_close`` (after it falls) and ``_other`` (any other character outside strings)."""

    def __init__(self):
        self.buf = ""
        self.pos = 0
        self.level = 0
        self.in_string = self.escaped = False
        self.string_start = 0

    def feed(self, piece: str) -> None:
        self.buf += piece
        for i in range(self.pos, len(self.buf)):
            ch = self.buf[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    self._string(self.string_start, i + 1)
            elif ch == '"':
                self.in_string, self.string_start = True, i
            elif ch in "{[":
                self._open(i, ch)
                self.level += 1
            elif ch in "}]":
                self.level = max(0, self.level - 1)
                self._close(i, ch)
            else:
                self._other(i, ch)
        self.pos = len(self.buf)

    def _string(self, start: int, end: int) -> None:
        pass

    def _open(self, i: int, ch: str) -> None:
        pass

    def _close(self, i: int, ch: str) -> None:
        pass

    def _other(self, i: int, ch: str) -> None:
        pass


class _Calls(_JsonScanner):
    """Calls ``{"name": ..., <one of args_keys>: {...}}`` read as their text arrives, the objects
    at ``item_level`` (2: the items of a ``required`` reply's array; 1: the object of a hermes
    block, a llama3_json reply's objects): ``feed`` returns every call found so far as ``[name,
    start, end]``, the span of its arguments object in the text (``end`` None while the object
    is open). A call counts from its arguments object's first bracket once its name is read (the
    constraint and the models' formats write the name first); an item without both is no call."""

    def __init__(self, item_level: int, args_keys: tuple[str, ...]):
        super().__init__()
        self.item, self.args_keys = item_level, args_keys
        self.expect_key = True  # inside an item: the next string is a key
        self.key: str | None = None
        self.name: str | None = None
        self.open_call: list | None = None  # the item's call while its arguments are read
        self.calls: list[list] = []

    def feed(self, piece: str) -> list[list]:
        super().feed(piece)
        return self.calls

    def _string(self, start: int, end: int) -> None:
        if self.level != self.item:
            return
        try:
            value = json.loads(self.buf[start:end])
        except ValueError:  # not JSON's string (the constraint writes none such)
            value = None
        if self.expect_key:
            self.key = value
        elif self.key == "name":
            self.name = value

    def _other(self, i: int, ch: str) -> None:
        if self.level == self.item and ch in ":,":
            self.expect_key = ch == ","

    def _open(self, i: int, ch: str) -> None:
        if self.level == self.item - 1 and ch == "{":  # an item
            self.expect_key, self.key, self.name = True, None, None
        elif (self.level == self.item and ch == "{" and not self.expect_key and self.key in self.args_keys
              and self.name is not None):
            self.open_call = [self.name, i, None]
            self.calls.append(self.open_call)

    def _close(self, i: int, ch: str) -> None:
        if self.level == self.item and self.open_call is not None:
            self.open_call[2] = i + 1
            self.open_call = None


_LLAMA_TAG, _LLAMA_KEYS = "<|python_tag|>", ("parameters", "arguments")


class _LlamaRun(_Calls):
    """A llama3_json reply after its ``<|python_tag|>``, read as it arrives: the run of top-level
    objects, separated by ``;`` (whitespace around allowed), that its calls are. ``objects``:
    ``[start, end, call]`` for each object of the run (``end`` None while it is open, ``call``
    the ``[name, start, end]`` of the call it streams, if any); ``over``: where the run ended,
    the first character that is not part of it (None while it goes on)."""

    def __init__(self):
        super().__init__(1, _LLAMA_KEYS)
        self.objects: list[list] = []
        self.over: int | None = None
        self.separated = True  # a ';' since the last object (the first needs none)

    def _string(self, start: int, end: int) -> None:
        if self.over is None and self.level == 0:
            self.over = start
        elif self.over is None:
            super()._string(start, end)

    def _other(self, i: int, ch: str) -> None:
        if self.over is not None:
            return
        if self.level > 0:
            super()._other(i, ch)
        elif ch == ";" and not self.separated:
            self.separated = True
        elif not ch.isspace():
            self.over = i

    def _open(self, i: int, ch: str) -> None:
        if self.over is not None:
            return
        if self.level == 0 and not (ch == "{" and self.separated):
            self.over = i
            return
        if self.level == 0:
            self.objects.append([i, None, None])
            self.separated = False
        n = len(self.calls)
        super()._open(i, ch)
        if len(self.calls) > n and self.objects[-1][2] is None:  # (an object's first arguments are its call's)
            self.objects[-1][2] = self.calls[-1]

    def _close(self, i: int, ch: str) -> None:
        if self.over is not None:
            return
        if self.level > 0:
            super()._close(i, ch)
        elif self.objects and self.objects[-1][1] is None:
            self.objects[-1][1] = i + 1
        else:  # a closing bracket with nothing open
            self.over = i


_MISTRAL_TAG = "[TOOL_CALLS]"


class _ObjectEnd(_JsonScanner):
    """A JSON object's text as it arrives: ``end``, the length of the object once it closed."""

    def __init__(self):
        super().__init__()
        self.end: int | None = None

    def _close(self, i: int, ch: str) -> None:
        if self.level == 0 and self.end is None:
            self.end = i + 1


class _TaggedCalls:
    """The newer Mistral calls, ``name[ARGS]{...}``, each after a ``[TOOL_CALLS]`` (the text fed
    begins after the first), read as their text arrives: ``feed`` returns every call found so far
    as ``[name, start, end]``, the span of its arguments object in the text (``end`` None while it
    is open), as :class:`_Calls` does. A name with whitespace, arguments that are no object, or
    anything but a tag after a call ends the calls."""

    def __init__(self):
        self.buf = ""
        self.calls: list[list] = []
        self.next: int | None = 0  # where the text still to read begins; None once the calls are over
        self.args: _ObjectEnd | None = None  # the last call's arguments while they are open
        self.need_tag = False  # a call ended: the next must follow a tag

    def feed(self, piece: str) -> list[list]:
        self.buf += piece
        while self.next is not None:
            if self.args is not None:
                call = self.calls[-1]
                self.args.feed(self.buf[call[1] + len(self.args.buf):])
                if self.args.end is None:
                    break
                call[2] = self.next = call[1] + self.args.end
                self.args, self.need_tag = None, True
                continue
            rest = self.buf[self.next:]
            head = rest.lstrip()
            if self.need_tag:
                if head.startswith(_MISTRAL_TAG):
                    self.next += len(rest) - len(head) + len(_MISTRAL_TAG)
                    self.need_tag = False
                    continue
                if head and not _MISTRAL_TAG.startswith(head):
                    self.next = None
                break
            j = rest.find("[ARGS]")
            if j < 0:
                break
            name, args = rest[:j].strip(), rest[j + len("[ARGS]"):].lstrip()
            if not name or any(c.isspace() for c in name) or args[:1] not in ("", "{"):
                self.next = None
            elif args:
                self.calls.append([name, len(self.buf) - len(args), None])
                self.args = _ObjectEnd()
                continue
            break
        return self.calls


def _call(text: str, args_keys: tuple[str, ...]) -> ToolCall | None:
    """``{"name": str, <one of args_keys>: object}`` as a call (arguments re-serialized), or None
    (also for arguments holding NaN or an infinity, which Python reads and JSON has not)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), None)
    if not isinstance(args, dict):
        return None
    try:
        return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False))
    except ValueError:
        return None


class _PythonList:
    """A pythonic reply's list ``[f(a=1), g(b="x")]`` read as it arrives (the text starts at its
    ``[``): ``elements`` holds the span of each element the list has finished (at a ``,`` or
    the closing ``]`` of the list's own level), ``open`` where the element being read begins,
    ``end`` where the list's text ends (None while it is open). Python strings (either quote,
    escapes) are skipped; brackets of any kind count as one level."""

    def __init__(self):
        self.buf = ""
        self.pos = self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        self.open = 1
        self.elements: list[tuple[int, int]] = []
        self.end: int | None = None

    def feed(self, piece: str) -> None:
        self.buf += piece
        for i in range(self.pos, len(self.buf)):
            if self.end is not None:
                break
            ch = self.buf[i]
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.depth += 1
            elif ch in ")]}":
                self.depth -= 1
                if self.depth == 0:
                    self.elements.append((self.open, i))
                    self.end = i + 1
            elif ch == "," and self.depth == 1:
                self.elements.append((self.open, i))
                self.open = i + 1
        self.pos = len(self.buf)


def _python_call(text: str) -> ToolCall | None:
    """``name(key=literal, ...)`` as a call, its keywords as a JSON object (vLLM's), or None: no
    positional or ``**`` arguments, no keyword twice, every value a literal that JSON can write."""
    try:
        with warnings.catch_warnings():  # (an invalid escape such as "\d" warns, and is a string)
            warnings.simplefilter("ignore")
            node = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
            or any(k.arg is None for k in node.keywords)
            or len({k.arg for k in node.keywords}) < len(node.keywords)):
        return None
    try:
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None


_BLOCK_START, _BLOCK_END = "<tool_call>", "</tool_call>"  # hermes's and qwen3_coder's blocks
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class _XmlCall:
    """A qwen3_coder block's call as its text comes (``feed``, the block's text so far): ``name``
    once ``<function=name>`` is read, ``arguments`` the JSON object of the parameters read so far
    (``{"key": value, ...``), closed with ``}`` at ``</function>`` or the block's end."""

    def __init__(self, parameters: dict[str, dict]):
        self.parameters = parameters  # tool name -> its parameters' schemas
        self.name: str | None = None
        self.arguments = ""
        self.pos = 0  # where the next parameter may begin
        self.done = False

    def feed(self, body: str, *, closed: bool) -> None:
        if self.name is None:
            m = _XML_FUNCTION.search(body)
            if m is None:
                return
            self.name, self.pos, self.arguments = m.group(1).strip(), m.end(), "{"
        schemas = self.parameters.get(self.name, {})
        while not self.done:
            m = _XML_PARAMETER.search(body, self.pos)
            f = body.find("</function>", self.pos)
            if m is not None and (f < 0 or m.start() < f):
                key = m.group(1).strip()
                value = _xml_value(m.group(2), schemas.get(key))
                self.arguments += ("" if self.arguments == "{" else ", ") + f"{_json(key)}: {_json(value)}"
                self.pos = m.end()
            else:
                self.done = f >= 0 or closed
                if self.done:
                    self.arguments += "}"
                break


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def _xml_value(text: str, schema: dict | None) -> Any:
    """A qwen3_coder parameter's value (its text less one newline at each end) as its schema
    types it (vLLM's rules): ``string`` as written, ``integer`` / ``number`` / ``boolean`` parsed
    (as written where they do not parse), ``object`` / ``array`` and others JSON (or a Python
    literal); ``null`` is None. Without a type: the value of ``enum`` it spells, else JSON, else
    the text."""
    text = text[1:] if text.startswith("\n") else text
    text = text[:-1] if text.endswith("\n") else text
    if text.strip().lower() == "null":
        return None
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    kind = next((k for k in kind if k != "null"), None) if isinstance(kind, list) else kind
    if kind in ("string", "str", "text", "varchar", "char", "enum"):
        return text
    if kind in ("integer", "int"):
        try:
            return int(text.strip())
        except ValueError:
            return text
    if kind in ("number", "float"):
        try:
            x = float(text.strip())
        except ValueError:
            return text
        return int(x) if x.is_integer() and "." not in text and "e" not in text.lower() else x
    if kind in ("boolean", "bool"):
        return {"true": True, "false": False}.get(text.strip().lower(), text)
    if kind is None and isinstance(schema.get("enum"), list):
        for v in schema["enum"]:
            if text.strip() in (str(v), json.dumps(v)):
                return v
    try:
        return json.loads(text)
    except ValueError:
        pass
    if kind is not None:
        try:
            return ast.literal_eval(text.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return text


@dataclass
class Update:
    """What a reply gained: content text and tool-call deltas (OpenAI's ``delta.tool_calls`` items),
    and both in ``parts`` in the order the text has them (a str a piece of content)."""

    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    parts: list[str | dict] = field(default_factory=list)

    def add_content(self, text: str) -> None:
        if text:
            self.content += text
            self.parts.append(text)

    def add_call(self, delta: dict) -> None:
        self.tool_calls.append(delta)
        self.parts.append(delta)


class ToolCallStream:
    """A reply's text, fed as it grows (``feed(piece, finished)``), as content and tool calls.

    ``named`` (a function's name): the text is that call's arguments, streamed as they come.
    ``required``: the calls of the constrained JSON array, each sent once its name is read, its
    arguments (its ``parameters`` as written) as they come; a call cut short keeps what came.
    ``"hermes"``: each ``<tool_call>`` block that holds ``{"name", "arguments"}`` a call, sent
    once its name is read and its arguments object opens, its arguments as they come (as
    written; a block cut short, or closed before its arguments are, keeps what came; an end tag
    inside a string of the open arguments is theirs); the text around them (blocks that are no
    call included) content, less the whitespace before each call and at the end.
    ``"llama3_json"``: a reply whose first object (after whitespace and ``<|python_tag|>``) is a
    call is calls, each object of the run ``{...}; {...}`` a call, sent as hermes calls are (a
    call cut short keeps what came; one whose name follows its arguments goes out whole at its
    end); objects of the run that are no call, and the text after the run, are content. Any other
    reply is content.
    ``"pythonic"``: a reply whose list's first element is a call is calls, each sent whole when
    its element ends; elements that are no call, one cut short, and the text after the list are
    content. Any other reply is content. A reply with no call is its own content, unchanged.
    ``"qwen3_coder"`` (``"qwen3_xml"``): text outside ``<tool_call>`` blocks is content, as for
    hermes; a block's ``<function=name>`` is a call, sent once its name is read, its arguments a
    JSON object of its ``<parameter=key>value</parameter>`` pairs, each value typed by ``tools``
    (:func:`_xml_value`), the object sent a pair at a time as each ends (closed at
    ``</function>``, or at the block's end). A block with no function is content, tags and all.
    """

    def __init__(self, mode: str, *, name: str | None = None, max_calls: int | None = None,
                 tools: list[dict] | None = None):
        if mode not in ("named", "required", *TOOL_PARSERS):
            raise ValueError(f"unknown tool call mode {mode!r}; known: named, required, {', '.join(TOOL_PARSERS)}")
        self.mode, self.name, self.max_calls = mode, name, max_calls
        # qwen3_coder: each tool's parameter schemas, to type the values of its calls' parameters.
        self.parameters = {t["function"]["name"]: _parameters(t).get("properties") or {} for t in tools or ()}
        self.xml: _XmlCall | None = None  # qwen3_coder: the open block's call
        self.calls: list[ToolCall] = []
        self.pending = ""  # text not yet sent as content or taken into a call
        self.held_space = ""  # whitespace-only content held back
        self.in_call = False  # hermes: inside <tool_call>
        self.block, self.block_call = _Calls(1, ("arguments",)), None  # hermes: the block's call (-1: over max_calls)
        self.reply_mode: str | None = None  # llama3_json, pythonic: None (undecided), "calls" or "content"
        self.lead: int | None = None  # llama3_json, pythonic: where the run or list begins in the text
        self.llama, self.llama_next = _LlamaRun(), 0  # llama3_json: the run, the object to read next
        self.llama_call = None  # llama3_json: that object's call (an index, -1 over max_calls), once read
        self.llama_tail = 0  # llama3_json: the text after the run sent as content so far
        self.pieces = False  # llama3_json, pythonic: a piece of content was sent (_piece)
        self.py_list, self.py_next = _PythonList(), 0  # pythonic: the list, the element to read next
        self.py_tail: int | None = None  # pythonic: the text after the list sent as content up to here
        self.array = _Calls(2, ("parameters",))  # required
        self.raw = ""  # required / llama3_json: all text, for when no call is found
        self.tagged: str | None = None  # mistral: the text after the first [TOOL_CALLS], once it came
        self.mistral_calls: _Calls | _TaggedCalls | None = None  # mistral: what reads the calls in it
        self.finished = False

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """vLLM's: ``"tool_calls"`` when a required or parsed reply stopped with calls."""
        if engine_reason == "stop" and self.calls and self.mode != "named":
            return "tool_calls"
        return engine_reason

    def feed(self, piece: str, finished: bool) -> Update:
        if self.finished:
            return Update()
        self.finished = finished
        u = Update()
        if self.mode == "named":
            if not self.calls:
                self.calls.append(ToolCall(self.name, ""))
                u.add_call({**self._delta(0), "function": {"name": self.name, "arguments": piece}})
            elif piece:
                u.add_call({"index": 0, "function": {"arguments": piece}})
            self.calls[0].arguments += piece
            return u
        if self.mode == "hermes":
            self._hermes(piece, u)
        elif self.mode == "required":
            self._required(piece, u)
        elif self.mode == "llama3_json":
            self._llama(piece, u)
        elif self.mode == "pythonic":
            self._pythonic(piece, u)
        elif self.mode in ("qwen3_coder", "qwen3_xml"):
            self._qwen3_coder(piece, u)
        else:
            self._mistral(piece, u)
        if finished:
            if not self.calls:  # whitespace that led nowhere is the reply's own
                u.add_content(self.held_space)
            self.held_space = ""
        return u

    def _delta(self, index: int) -> dict:
        return {"index": index, "id": self.calls[index].id, "type": "function"}

    def _add_call(self, call: ToolCall | None, u: Update) -> bool:
        if call is None:
            return False
        if self.max_calls is None or len(self.calls) < self.max_calls:
            if self.mode == "mistral":
                call.id = mistral_tool_call_id()
            self.calls.append(call)
            i = len(self.calls) - 1
            u.add_call({**self._delta(i), "function": {"name": call.name, "arguments": call.arguments}})
        self.held_space = ""  # whitespace before a call is not content
        return True

    def _content(self, text: str, u: Update) -> None:
        """Content up to its last non-space character; trailing whitespace waits for more (a
        call drops it), so where the pieces break does not matter."""
        text = self.held_space + text
        k = len(text.rstrip())
        u.add_content(text[:k])
        self.held_space = text[k:]

    def _stream_call(self, slot: int | None, name: str, args: str, u: Update) -> int:
        """A call read as it comes, its ``args`` so far: added if new (``slot`` None; returns its
        index, -1 for a call past ``max_calls``, dropped), else what its arguments gained sent."""
        if slot is None:
            n = len(self.calls)
            self._add_call(ToolCall(name, args), u)
            return n if len(self.calls) > n else -1
        if slot >= 0 and len(args) > len(self.calls[slot].arguments):
            u.add_call({"index": slot, "function": {"arguments": args[len(self.calls[slot].arguments):]}})
            self.calls[slot].arguments = args
        return slot

    def _required(self, piece: str, u: Update) -> None:
        """Each object of the constrained array a call, its ``parameters`` as written. A reply with
        no call is content."""
        self.raw += piece
        self._stream_calls(self.array, piece, u)
        if self.finished and not self.calls:
            u.add_content(self.raw)

    def _stream_calls(self, reader: _Calls | _TaggedCalls, piece: str, u: Update) -> None:
        """Feed ``piece`` to ``reader``; each call it has found so far (up to ``max_calls``)
        added, or what its arguments gained sent."""
        for k, (name, start, end) in enumerate(reader.feed(piece)[:self.max_calls]):
            self._stream_call(k if k < len(self.calls) else None, name, reader.buf[start:end], u)

    def _content_to(self, tag: str, u: Update) -> bool:
        """Send ``self.pending`` as content up to ``tag`` (an end that may begin it is held back
        until the reply ends); True once the tag came, ``self.pending`` then what follows it."""
        i = self.pending.find(tag)
        if i < 0:
            keep = 0 if self.finished else partial_suffix(self.pending, tag)
            self._content(self.pending[:len(self.pending) - keep], u)
            self.pending = self.pending[len(self.pending) - keep:]
            return False
        self._content(self.pending[:i], u)
        self.pending = self.pending[i + len(tag):]
        return True

    def _llama(self, piece: str, u: Update) -> None:
        """A reply whose first object (after whitespace and ``<|python_tag|>``) is a call is
        calls: each object of the run ``{...}; {...}`` a call, sent once its name is read and its
        arguments object opens, its arguments (as written) as they come, or parsed whole at its
        end (name last); an object of the run that is no call, and whatever follows the run, is
        content. Any other reply is content, as it comes once that shows."""
        if not self._reply_begun(piece, u, "{", tag=_LLAMA_TAG):
            return
        run = self.llama
        run.feed(self.raw[self.lead + len(run.buf):])
        if self.reply_mode is None:  # the first object tells
            first = run.objects[0] if run.objects else None
            if first is None or (first[1] is None and first[2] is None):
                if run.over is not None or self.finished:
                    self._all_content(u)
                return
            if first[2] is None and _call(run.buf[first[0]:first[1]], _LLAMA_KEYS) is None:
                return self._all_content(u)
            self.reply_mode = "calls"
        while self.llama_next < len(run.objects):
            start, end, call = run.objects[self.llama_next]
            if call is not None:
                self.llama_call = self._stream_call(self.llama_call, call[0], run.buf[call[1]:call[2]], u)
            if end is None:  # open: more to come, or cut short (what came of a call is the call)
                if self.finished and call is None:
                    self._piece(run.buf[start:], u)
                return
            if call is None and not self._add_call(_call(run.buf[start:end], _LLAMA_KEYS), u):
                self._piece(run.buf[start:end], u)
            self.llama_next, self.llama_call = self.llama_next + 1, None
        if run.over is not None:  # the text after the run: a piece of content, then more of it as it comes
            if self.llama_tail < run.over:
                self._piece(run.buf[run.over:], u)
            else:
                self._content(run.buf[self.llama_tail:], u)
            self.llama_tail = len(run.buf)

    def _reply_begun(self, piece: str, u: Update, opening: str, tag: str | None = None) -> bool:
        """llama3_json, pythonic: take ``piece``; True once the reply (after whitespace, and ``tag``
        if it comes first) begins with ``opening``, then ``self.lead`` is where (past the tag).
        False while it still may, or once it cannot: then the reply is content, sent as it comes."""
        self.raw += piece
        if self.reply_mode == "content":
            self._content(piece, u)
            return False
        if self.lead is None:
            head = self.raw.lstrip()
            skip = len(tag) if tag is not None and head.startswith(tag) else 0
            if not (skip or head.startswith(opening)):
                if self.finished or not (opening.startswith(head) or tag is not None and tag.startswith(head)):
                    self._all_content(u)
                return False
            self.lead = len(self.raw) - len(head) + skip
        return True

    def _piece(self, text: str, u: Update) -> None:
        """llama3_json, pythonic: a piece of content apart from the calls (an object or element that
        is no call, the text after the run or list), a space between it and the piece before."""
        self._content((" " if self.pieces else "") + text, u)
        self.pieces = True

    def _all_content(self, u: Update) -> None:
        """llama3_json, pythonic: the reply is no calls, all content: what came so far goes out."""
        self.reply_mode = "content"
        self._content(self.raw, u)

    def _pythonic(self, piece: str, u: Update) -> None:
        """A reply whose first element (after whitespace and the list's ``[``) is a call is calls:
        each element of the list a call, sent whole once the element ends (its arguments are
        Python, not JSON, so there is nothing to stream before); an element that is no call, one
        cut short, and the text after the list are content. Any other reply is content, as it
        comes once that shows."""
        if not self._reply_begun(piece, u, "["):
            return
        lst = self.py_list
        lst.feed(self.raw[self.lead + len(lst.buf):])
        if self.reply_mode is None:  # the first element tells
            if not lst.elements:
                if self.finished:
                    self._all_content(u)
                return
            start, end = lst.elements[0]
            if _python_call(lst.buf[start:end]) is None:
                return self._all_content(u)
            self.reply_mode = "calls"
        for start, end in lst.elements[self.py_next:]:
            text = lst.buf[start:end].strip()
            if text and not self._add_call(_python_call(text), u):
                self._piece(text, u)
        self.py_next = len(lst.elements)
        if lst.end is None:
            if self.finished and lst.buf[lst.open:].strip():  # cut short
                self._piece(lst.buf[lst.open:].lstrip(), u)
            return
        if self.py_tail is None and lst.buf[lst.end:].strip():  # the text after the list: a piece of content
            rest = lst.buf[lst.end:].lstrip()
            self._piece(rest, u)
            self.py_tail = len(lst.buf)
        elif self.py_tail is not None:  # then more of it as it comes
            self._content(lst.buf[self.py_tail:], u)
            self.py_tail = len(lst.buf)

    def _mistral(self, piece: str, u: Update) -> None:
        """The text before ``[TOOL_CALLS]`` is content; after it, the calls: a JSON list (or one
        object) of ``{"name", "arguments"}``, each sent once its name is read and its arguments
        open, or ``name[ARGS]{...}`` each after a tag of its own, sent once its arguments open;
        the arguments as written. What follows the calls is dropped; a reply with the tag and no
        call is content without the tag (vLLM's)."""
        if self.tagged is None:
            self.pending += piece
            if not self._content_to(_MISTRAL_TAG, u):
                return
            self.tagged, self.pending = self.pending, ""
        else:
            self.tagged += piece
        body = self.tagged
        if self.mistral_calls is None:
            head = body.lstrip()
            if head:
                self.mistral_calls = _Calls(2 if head[0] == "[" else 1, ("arguments",)) if head[0] in "[{" \
                    else _TaggedCalls()
        if self.mistral_calls is not None:
            self._stream_calls(self.mistral_calls, body[len(self.mistral_calls.buf):], u)
        if self.finished and not self.calls:
            self._content(body, u)

    def _hermes(self, piece: str, u: Update) -> None:
        """Text outside ``<tool_call>`` blocks is content; a block's call goes out once its name
        is read and its ``arguments`` object opens, its arguments (as written) as they come. A
        block that never gets that far is parsed whole at its end: a call if it holds ``{"name",
        "arguments"}`` (in any order), else content, tags and all."""

        def begin():
            self.block, self.block_call = _Calls(1, ("arguments",)), None

        def end_at() -> int:
            j = self.pending.find(_BLOCK_END, len(self.block.buf))  # (the tags in what the block read are its text)
            while j >= 0:  # an end tag inside a string of the call's open arguments is the arguments' text
                self._stream_block(self.pending[:j], u)
                if self.block.open_call is None or not self.block.in_string:
                    break
                j = self.pending.find(_BLOCK_END, j + 1)
            return j

        def finish(body: str) -> bool:
            return self.block_call is not None or self._add_call(_call(body, ("arguments",)), u)

        self._blocks(piece, u, begin, end_at, lambda body, closed: self._stream_block(body, u), finish)

    def _qwen3_coder(self, piece: str, u: Update) -> None:
        """Text outside ``<tool_call>`` blocks is content; a block's function is a call (see the
        class docstring), a block without one content, tags and all."""

        def begin():
            self.xml, self.block_call = _XmlCall(self.parameters), None

        def read(body: str, closed: bool):
            self.xml.feed(body, closed=closed)
            if self.xml.name is not None:
                self.block_call = self._stream_call(self.block_call, self.xml.name, self.xml.arguments, u)

        def has_call(body: str) -> bool:  # (read sent the call as soon as its name came)
            return self.xml.name is not None

        self._blocks(piece, u, begin, lambda: self.pending.find(_BLOCK_END), read, has_call)

    def _blocks(self, piece: str, u: Update, begin, end_at, read, finish) -> None:
        """hermes, qwen3_coder: text outside ``<tool_call>`` blocks is content (an opening tag that
        may be coming held back); a block's text goes to ``read(body, closed)`` as it comes, up to
        its end tag (``end_at()``: where it is, or -1) or the reply's end, then to ``finish(body)``:
        False if the block held no call, which is then content, tags and all. ``begin()`` starts
        each block."""
        self.pending += piece
        while True:
            if not self.in_call:
                if not self._content_to(_BLOCK_START, u):
                    return
                self.in_call = True
                begin()
            j = end_at()
            keep = 0 if j >= 0 or self.finished else partial_suffix(self.pending, _BLOCK_END)
            body = self.pending[:j] if j >= 0 else self.pending[:len(self.pending) - keep]
            read(body, j >= 0)
            if j < 0 and not self.finished:
                return
            if not finish(body):
                self._content(_BLOCK_START + body + ("" if j < 0 else _BLOCK_END), u)
            self.pending = "" if j < 0 else self.pending[j + len(_BLOCK_END):]
            self.in_call = False
            if j < 0:
                return

    def _stream_block(self, body: str, u: Update) -> None:
        """Send what ``body`` (a hermes block's text so far) adds to the block's call."""
        found = self.block.feed(body[len(self.block.buf):])
        if not found:
            return
        name, s, e = found[0]  # (a block holds one call)
        self.block_call = self._stream_call(self.block_call, name, self.block.buf[s:e], u)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that ``marker`` starts with (0 if none)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
