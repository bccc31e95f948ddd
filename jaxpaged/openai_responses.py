"""OpenAI's Responses API (``POST /v1/responses``) for ``serve``, over the chat endpoint's machinery.
No jax here.

A request becomes a chat request: ``instructions`` a system message, ``input`` (a string, or
items: messages, earlier ``function_call`` items and their ``function_call_output``) the
messages, ``tools`` (function tools), ``tool_choice`` and ``text.format`` (a JSON schema or
object) as the chat endpoint takes them, so named, required and parsed (``--tool-call-parser``)
tool calls and structured outputs work as there. The reply's text becomes output items in the
order it has them: a ``message`` item per run of text, a ``function_call`` item per call.
Streamed, the same machine sends OpenAI's events (``response.created``, ...
``response.output_text.delta``, ``response.function_call_arguments.delta``, ...
``response.completed`` or ``response.incomplete``), so the last event's response is the
unstreamed one (but for its ids).

With ``store`` (OpenAI's default) a response is kept, so that ``GET /v1/responses/{id}``
returns it (and ``.../input_items`` its request's input items) and a later request's
``previous_response_id`` continues its conversation (its input and output, not its
``instructions``, as OpenAI has it; the same chat turns as the output items sent back as
input). The store keeps the most recent responses only (:class:`ResponseStore`): an old id is
then not found, never a leak. Output
text carries its tokens' logprobs with ``include: ["message.output_text.logprobs"]`` (and
``top_logprobs``), in a reply without tools. Not served: ``background``, ``truncation: "auto"``,
other ``include`` values and tools other than functions (each refused with a 400 naming the field).
"""

from __future__ import annotations

import collections
import copy
import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from jaxpaged.input_processor import check_strings
from jaxpaged.openai_protocol import APIError, ChatCompletionRequest
from jaxpaged.outputs import RequestOutput
from jaxpaged.reasoning import ReasoningParser
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.tool_calling import ToolCallStream, Update

# A chat request's field -> the Responses request's field, for the errors' ``param``.
_PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
           "structured_outputs.json": "text.format.schema", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens"}
LOGPROBS = "message.output_text.logprobs"  # the one value of ``include`` served
# The fields whose strings are checked up front (a lone surrogate, which JSON can carry, would
# fail only when the response echoing them is written).
_STRING_FIELDS = ("input", "instructions", "tools", "tool_choice", "text", "metadata", "user", "stop", "cache_salt",
                  "previous_response_id")


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def as_responses_error(e: APIError) -> APIError:
    """A chat request's error in the Responses request's terms (its fields' names)."""
    param = _PARAMS.get(e.param, e.param)
    message = e.message.replace("].function.", "].")  # tools[i].function.name -> tools[i].name
    for chat, ours in sorted(_PARAMS.items(), key=lambda kv: -len(kv[0])):
        if message.startswith(chat + " ") or message.startswith(chat + ":"):
            message = ours + message[len(chat):]
            break
    return APIError(e.status, message, type=e.type, param=param, code=e.code)


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``: OpenAI's fields, and vLLM's sampling extras."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    truncation: str | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    # vLLM's extras
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    priority: int = 0

    def check(self) -> None:
        """Refuse what is not served, and strings that are not Unicode, naming the field."""
        for name in _STRING_FIELDS:
            try:
                check_strings(getattr(self, name), name)
            except ValueError as e:
                raise _bad(str(e), str(e).split(" ", 1)[0]) from None
        if self.background:
            raise _bad("background responses are not supported", "background", "unsupported_value")
        if self.truncation not in (None, "disabled"):
            raise _bad(f"truncation {self.truncation!r} is not supported: only 'disabled' (a conversation "
                       "longer than the model's context is refused)", "truncation", "unsupported_value")
        for i, x in enumerate(self.include or ()):
            if x != LOGPROBS:
                raise _bad(f"include[{i}] {x!r:.100} is not supported: only {LOGPROBS!r}", f"include[{i}]",
                           "unsupported_value")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise _bad(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        if self.logprobs and self.tools and self.tool_choice != "none":
            raise _bad(f"include {LOGPROBS!r} cannot be combined with tools here: give tool_choice 'none' or "
                       "no tools", "include", "unsupported_value")

    @property
    def logprobs(self) -> bool:
        """Whether the output text carries its tokens' logprobs (OpenAI's ``include``)."""
        return LOGPROBS in (self.include or ())

    def input_messages(self, known_calls: set[str] = frozenset()) -> list[dict[str, Any]]:
        """``input`` as chat messages; ``known_calls``: the ids of the calls made before it."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        if not self.input:
            raise _bad("input is empty", "input")
        return items_to_messages(self.input, "input", set(known_calls))

    def input_items(self) -> list[dict]:
        """``input`` as OpenAI lists it back (``GET /v1/responses/{id}/input_items``): items with ids,
        a message's content as parts. Call after :meth:`chat_request` has checked it."""
        given = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        items = []
        for item in given:
            kind = item.get("type", "message")
            if kind == "message":
                content = item["content"]
                texts = [content] if isinstance(content, str) else [part["text"] for part in content]
                parts = ([{"type": "output_text", "text": t, "annotations": []} for t in texts]
                         if item["role"] == "assistant" else [{"type": "input_text", "text": t} for t in texts])
                item = {"type": "message", "role": item["role"], "content": parts}
            else:
                keys = ("call_id", "name", "arguments") if kind == "function_call" else ("call_id", "output")
                item = {"type": kind, **{k: item[k] for k in keys}}
            prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]
            items.append({"id": f"{prefix}_{uuid.uuid4().hex}", **item, "status": "completed"})
        return items

    def chat_tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        tools = []
        for i, t in enumerate(self.tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else t
                raise _bad(f"tools[{i}] of type {kind!r:.100} is not supported: only function tools "
                           "({'type': 'function', 'name': ..., 'parameters': ...})", f"tools[{i}]",
                           "unsupported_value")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                            if k in t}})
        return tools

    def chat_tool_choice(self) -> Any:
        c = self.tool_choice
        if c is None or c in ("auto", "none", "required"):
            return c
        if not isinstance(c, dict) or c.get("type") != "function" or not isinstance(c.get("name"), str):
            raise _bad(f"tool_choice {c!r:.200} is not supported: give 'auto', 'none', 'required' or "
                       "{'type': 'function', 'name': ...}", "tool_choice", "unsupported_value")
        return {"type": "function", "function": {"name": c["name"]}}

    def response_format(self) -> dict | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            for key, kind_of, what in (("name", str, "a string"), ("schema", dict, "a JSON schema object")):
                if not isinstance(fmt.get(key), kind_of):
                    raise _bad(f"text.format of type 'json_schema' needs {key}, {what}; got {fmt.get(key)!r:.100}",
                               f"text.format.{key}")
            return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict")
                                                           if k in fmt}}
        if kind in ("text", "json_object"):
            return {"type": kind}
        raise _bad(f"text.format {fmt!r:.200} is not supported: its type must be 'text', 'json_object' or "
                   "'json_schema'", "text.format")

    def chat_request(self, previous: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one amounts to, after the ``previous`` response's conversation."""
        self.check()
        system = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        known_calls = {c["id"] for m in previous for c in m.get("tool_calls") or ()}
        fields = {
            "messages": system + copy.deepcopy(previous) + self.input_messages(known_calls),
            "max_completion_tokens": self.max_output_tokens, "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(), "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self.response_format(), "user": self.user, "logprobs": self.logprobs,
            "top_logprobs": (self.top_logprobs or 0) if self.logprobs else None,
            **{k: getattr(self, k) for k in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                                             "logit_bias", "stop", "ignore_eos", "cache_salt", "priority")},
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:  # an input item's content of the wrong type
            err = e.errors()[0]
            where = ".".join(str(x) for x in err["loc"])
            raise _bad(f"{where}: {err['msg']}", "input") from None


def items_to_messages(items: list[dict], what: str, known_calls: set[str]) -> list[dict[str, Any]]:
    """Input items (``what[i]``) as chat messages: each message item one (``developer`` a system
    message), a ``function_call`` joined to the assistant turn just before it (else a turn of its
    own), a ``function_call_output`` a tool message, which must answer a call made before it
    (``known_calls``, which this extends)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message" if "role" in item else None)
        where = f"{what}[{i}]"
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call_id, arguments = _string(item, "call_id", where), _string(item, "arguments", where)
            if not _json_object(arguments):
                raise _bad(f"{where}.arguments must be a JSON object's text, got {arguments!r:.100}",
                           f"{where}.arguments")
            call = {"id": call_id, "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": arguments}}
            known_calls.add(call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the turn's text, then its calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "reasoning":  # earlier thinking: a reasoning model's template leaves it out
            continue
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            if call_id not in known_calls:
                raise _bad(f"{where}.call_id {call_id!r:.100} answers no function_call of the conversation",
                           f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _string(item, "output", where)})
        else:
            raise _bad(f"{where}.type {kind!r:.100} is not supported: input items are messages, function_call, "
                       "function_call_output and reasoning", f"{where}.type", "unsupported_value")
    return messages


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(f"{where}.{key} must be a string, got {value!r:.100}", f"{where}.{key}")
    return value


def _message(item: dict, where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _bad(f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r:.100}",
                   f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise _bad(f"{where}.content[{k}] must be a text part ({{'type': 'input_text', 'text': ...}}); "
                           f"got type {kind!r:.100}", f"{where}.content", "unsupported_value")
            texts.append(_string(part, "text", f"{where}.content[{k}]"))
        content = "".join(texts)
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of text parts, got {content!r:.100}",
                   f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


class OutputItems:
    """A response's output items as its reply grows, and the stream's events for them.

    ``feed`` takes a :class:`~jaxpaged.tool_calling.Update` (its ``parts`` in the reply's order):
    a run of content is a ``message`` item, each call a ``function_call`` item; an item is done
    when the next begins or at ``finish``. Each returns the events it makes (without their
    ``sequence_number``). A reply without tools (``text_only``) is one message item, empty if
    its text is, and may carry its tokens' logprobs (``feed``'s ``logprobs``: those of the tokens
    since the last feed, each text delta taking those that came before it)."""

    def __init__(self, text_only: bool = False):
        self.text_only = text_only
        self.items: list[dict] = []
        self.open: dict | None = None  # the item the reply is writing
        self.by_call: dict[int, dict] = {}  # a tool call's index -> its item
        self.logprobs: list[dict] = []  # not yet sent with a text delta

    def feed(self, update: Update, logprobs: list[dict] = (), reasoning: str = "") -> list[dict]:
        """``reasoning``: thinking that came before ``update`` (a reasoning model's), a ``reasoning``
        item's text."""
        events: list[dict] = []
        self.logprobs += logprobs
        if reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                self._begin({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress",
                             "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}, events)
            self.open["content"][0]["text"] += reasoning
            events.append({"type": "response.reasoning_text.delta", **self._where(), "content_index": 0,
                           "delta": reasoning})
        for part in update.parts:
            if isinstance(part, str):
                self._message(events)
                text = self.open["content"][0]
                text["text"] += part
                text["logprobs"] += self.logprobs
                events.append({"type": "response.output_text.delta", **self._where(), "content_index": 0,
                               "delta": part, "logprobs": self.logprobs})
                self.logprobs = []
            elif part["index"] not in self.by_call:
                fn = part["function"]
                self._begin({"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                             "call_id": part["id"], "name": fn["name"], "arguments": ""}, events)
                self.by_call[part["index"]] = self.open
                self._arguments(fn["arguments"], events)
            else:
                self._arguments(part["function"]["arguments"], events)
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the last item with ``status`` (``completed``, or ``incomplete`` when the reply was cut
        in it); the items before it are complete. A call whose arguments are no JSON object is
        ``incomplete`` whatever ended it."""
        events: list[dict] = []
        if self.text_only:
            self._message(events)  # (an empty reply is an empty message)
            self.open["content"][0]["logprobs"] += self.logprobs  # tokens after the last text: EOS
        return events + self._end(status)

    def _message(self, events: list[dict]) -> None:
        """Make sure the open item is a message."""
        if self.open is None or self.open["type"] != "message":
            self._begin({"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress",
                         "role": "assistant", "content": []}, events)
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0,
                           "part": _text_part("")})
            self.open["content"].append(_text_part(""))

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _begin(self, item: dict, events: list[dict]) -> None:
        events += self._end("completed")
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})

    def _arguments(self, piece: str, events: list[dict]) -> None:
        if piece:
            self.open["arguments"] += piece
            events.append({"type": "response.function_call_arguments.delta", **self._where(), "delta": piece})

    def _end(self, status: str) -> list[dict]:
        item, events = self.open, []
        if item is None:
            return events
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", **self._where(), "content_index": 0,
                        "text": part["text"], "logprobs": copy.deepcopy(part["logprobs"])},
                       {"type": "response.content_part.done", **self._where(), "content_index": 0,
                        "part": copy.deepcopy(part)}]
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", **self._where(), "content_index": 0,
                           "text": item["content"][0]["text"]})
        else:
            events.append({"type": "response.function_call_arguments.done", **self._where(),
                           "name": item["name"], "arguments": item["arguments"]})
            if not _json_object(item["arguments"]):  # cut by a stop string, or its block closed early
                status = "incomplete"
        item["status"] = status
        events.append({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                       "item": copy.deepcopy(item)})
        self.open = None
        return events


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def plain(text: str) -> Update:
    """A reply without tools: all content."""
    u = Update()
    u.add_content(text)
    return u


def response_body(rid: str, created: int, model: str, req: ResponsesRequest, *, status: str,
                  output: list[dict], out: RequestOutput | None = None,
                  reasoning: ReasoningParser | None = None) -> dict:
    """The response object (``status``: ``in_progress``, ``completed`` or ``incomplete``); with
    ``reasoning`` (the model's parser) its usage counts the reasoning's tokens."""
    usage = None
    if out is not None:
        n_in, n_out = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
        thinking = sum(reasoning.num_tokens(out.prompt_token_ids, c.token_ids) for c in out.outputs) \
            if reasoning is not None else 0
        usage = {"input_tokens": n_in,
                 "input_tokens_details": {"cached_tokens": out.num_cached_tokens, "cache_write_tokens": 0},
                 "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": thinking},
                 "total_tokens": n_in + n_out}
    return {
        "id": rid, "object": "response", "created_at": created, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": req.previous_response_id, "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": "auto" if req.tool_choice is None else req.tool_choice, "tools": req.tools or [],
        "text": req.text if req.text is not None else {"format": {"type": "text"}}, "store": req.store,
        "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user, "background": False,
        "usage": usage,
    }


def final_status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def conversation_after(messages: list[dict[str, Any]], output: list[dict]) -> list[dict[str, Any]]:
    """``messages`` (without the system message of ``instructions``) and the reply's ``output``
    as chat messages: what a later request's ``previous_response_id`` continues, the same as a
    client sending the output items back as input; but a call cut short (``max_output_tokens``, a
    stop string, a block closed before its arguments), ``incomplete`` since its arguments are no
    JSON object, is left out."""
    complete = [item for item in output if item["type"] != "function_call" or item["status"] != "incomplete"]
    return [*messages, *items_to_messages(complete, "output", set())]


@dataclass
class Stored:
    """A stored response: what ``GET`` returns, the chat turns ``previous_response_id`` continues,
    and its request's input items."""

    response: dict
    conversation: list[dict[str, Any]]
    input_items: list[dict]


class ResponseStore:
    """The ``max_size`` most recently stored responses (``max_size`` 0: none is kept). Used from
    the event loop alone, but locked all the same."""

    def __init__(self, max_size: int = 1024):
        self.max_size = max_size
        self._entries: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, stored: Stored) -> None:
        if self.max_size <= 0:
            return
        with self._lock:
            self._entries[stored.response["id"]] = stored
            while len(self._entries) > self.max_size:
                self._entries.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            return self._entries.get(rid)

    def delete(self, rid: str) -> bool:
        with self._lock:
            return self._entries.pop(rid, None) is not None


def item_page(items: list[dict], *, limit: int, order: str, after: str | None, before: str | None) -> dict:
    """OpenAI's list object of ``items`` (oldest first): ``order`` ``desc`` newest first, at most
    ``limit`` of them after the item ``after`` (the first ones) and before the item ``before`` (the
    last ones, when ``after`` is not given); ``has_more``: more lie beyond the page that way."""
    if not 1 <= limit <= 100:
        raise _bad(f"limit must be in [1, 100], got {limit}", "limit")
    if order not in ("asc", "desc"):
        raise _bad(f"order must be 'asc' or 'desc', got {order!r:.100}", "order")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    lo, hi = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None:
            if cursor not in ids:
                raise _bad(f"{name} {cursor!r:.100} is not an input item of this response", name)
            if name == "after":
                lo = ids.index(cursor) + 1
            else:
                hi = ids.index(cursor)
    if before is not None and after is None:  # the page just before the cursor
        start = max(lo, hi - limit)
        page, has_more = ordered[start:hi], start > lo
    else:
        page = ordered[lo:hi][:limit]
        has_more = lo + len(page) < hi
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": has_more}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse_event(event: dict, sequence_number: int) -> str:
    event = {**event, "sequence_number": sequence_number}
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


def reply_stream(tool_calls: dict | None) -> ToolCallStream | None:
    return None if tool_calls is None else ToolCallStream(**tool_calls)
