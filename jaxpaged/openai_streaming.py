"""Server-sent events for ``serve``'s streaming responses: OpenAI's chunks, and the Responses API's events.

Outputs are cumulative; each chunk carries what a choice gained since the last one. Text
that could still turn out to be the start of a stop string is held back until it cannot
(vLLM does the same), so the streamed deltas always concatenate to the final text.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

from jaxpaged.async_engine import AsyncLLM, EngineDeadError, RequestStream
from jaxpaged.detokenizer import stream_end
from jaxpaged.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, chat_logprobs, choice_usage,
                                      chunk, completion_logprobs, echo_text, usage)
from jaxpaged.openai_responses import OutputItems, final_status, plain, reply_stream, response_body, sse_event
from jaxpaged.outputs import RequestOutput
from jaxpaged.reasoning import ReasoningParser, ReasoningStream
from jaxpaged.tool_calling import ToolCallStream


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """``(index of the stream, output)`` as each stream's outputs come."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, out
    finally:
        for task in pending:
            task.cancel()


class _Deltas:
    """What each choice has sent so far; text that could still become a stop string is held back."""

    def __init__(self, held: int):
        self.held = held  # SamplingParams.output_text_buffer_length
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()  # choices whose finish_reason went out: nothing more to send

    def next(self, key: int, text: str, num_tokens: int, finished: bool) -> tuple[str, int] | None:
        """``(new text, index of the first new token)``, or None when there is nothing new."""
        if key in self.done:
            return None
        if finished:
            self.done.add(key)
        sent, first = self.text.get(key, 0), self.tokens.get(key, 0)
        end = stream_end(text, sent, self.held, finished)
        if end == sent and num_tokens == first and not finished:
            return None
        self.text[key], self.tokens[key] = end, num_tokens
        return text[sent:end], first


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def _events(engine: AsyncLLM, streams: list[RequestStream], make_chunks, final_usage) -> AsyncIterator[str]:
    """The SSE body: ``make_chunks(i, out)`` per output, usage if asked, then ``[DONE]``.

    Cancellation (the client went away) or any error aborts the requests still running.
    """
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in _merged(streams):
            for obj in make_chunks(i, out):
                yield _sse(obj)
            if out.finished:
                finals[i] = out
        if final_usage is not None and len(finals) == len(streams):
            yield _sse(final_usage([finals[i] for i in range(len(streams))]))
    except EngineDeadError as e:
        yield _sse(APIError(503, str(e), type="server_error", code="engine_dead").body())
    finally:
        for s in streams:
            if not s.finished:
                engine.abort(s.request_id)
    yield _sse("[DONE]")


def completion_events(engine, rid: str, model: str, streams, body: CompletionRequest,
                      held: int, decode) -> AsyncIterator[str]:
    """With ``echo``, a choice's first chunk leads with its prompt's text (and logprobs); with
    ``echo`` and ``max_tokens = 0`` that chunk, sent when the request finishes, is all of it."""
    deltas = _Deltas(held)
    echoed: set[int] = set()
    offsets: dict[int, int] = {}  # where each choice's next logprob token's text_offset starts
    started: set[int] = set()  # choices whose first chunk went out (return_token_ids: the prompt's ids)

    def make_chunks(i: int, out: RequestOutput):
        for c in out.outputs:
            index = i * body.n + c.index
            finished = c.finish_reason is not None
            if body.echo_only:
                d = deltas.next(index, "", 0, finished)
            else:
                d = deltas.next(index, c.text, len(c.token_ids), finished)
            if d is None:
                continue
            text, first = d
            echo = body.echo and index not in echoed
            if echo:
                echoed.add(index)
                text = echo_text(out, decode) + text
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(None if body.echo_only else c, first, offsets.get(index, 0),
                                               as_ids=bool(body.return_tokens_as_token_ids),
                                               echo=out if echo else None, decode=decode)
                if logprobs["tokens"]:  # offsets run on as in the whole response's logprobs
                    offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choice = {"index": index, "text": text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:  # vLLM's: the prompt's ids in a choice's first chunk, then each new token's
                if index not in started:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                choice["token_ids"] = [] if body.echo_only else list(c.token_ids[first:])
            started.add(index)
            yield chunk(rid, model, "completion", [choice],
                        choice_usage(out, None if body.echo_only else c) if body.continuous_usage else None)

    final = None
    if body.include_usage:
        final = lambda outs: chunk(rid, model, "completion", [], usage(outs, echo_only=body.echo_only))  # noqa: E731
    return _events(engine, streams, make_chunks, final)


def chat_events(engine, rid: str, model: str, stream, body: ChatCompletionRequest,
                held: int, tool_calls: dict | None = None,
                reasoning: ReasoningParser | None = None) -> AsyncIterator[str]:
    """With ``tool_calls`` (``ToolCallStream``'s arguments) each choice's text goes through its
    own stream of calls: content deltas and ``tool_calls`` deltas, as the whole response has them;
    with ``reasoning`` (the model's parser) its thinking first goes out as ``reasoning`` deltas."""
    deltas = _Deltas(held)
    started: set[int] = set()
    calls: dict[int, ToolCallStream] = {}
    splits: dict[int, ReasoningStream] = {}

    def make_chunks(_: int, out: RequestOutput):
        for c in out.outputs:
            if c.index not in started:  # OpenAI's first delta of a choice carries the role
                started.add(c.index)
                first_chunk = chunk(rid, model, "chat", [{"index": c.index, "delta": {"role": body.reply_role(),
                                                                                       "content": ""},
                                                          "logprobs": None, "finish_reason": None}],
                                    choice_usage(out, None) if body.continuous_usage else None)
                if body.return_token_ids:  # vLLM's: the prompt's ids in the first chunk
                    first_chunk["prompt_token_ids"] = list(out.prompt_token_ids)
                yield first_chunk
                if echo := body.echoed():
                    yield chunk(rid, model, "chat", [{"index": c.index, "delta": {"content": echo},
                                                      "logprobs": None, "finish_reason": None}],
                                choice_usage(out, None) if body.continuous_usage else None)
            d = deltas.next(c.index, c.text, len(c.token_ids), c.finish_reason is not None)
            if d is None:
                continue
            text, first = d
            reason, thought = c.finish_reason, ""
            if reasoning is not None:
                if c.index not in splits:
                    splits[c.index] = reasoning.stream(out.prompt_token_ids)
                thought, text = splits[c.index].feed(text, reason is not None)
            delta = {"content": text} if text else {}
            if tool_calls is not None:
                if c.index not in calls:
                    calls[c.index] = ToolCallStream(**tool_calls)
                s = calls[c.index]
                update = s.feed(text, reason is not None)
                delta = {"content": update.content} if update.content else {}
                if update.tool_calls:
                    delta["tool_calls"] = update.tool_calls
                reason = s.finish_reason(reason)
            if thought and body.include_reasoning:
                delta = {"reasoning": thought, **delta}
            if (not delta and reason is None and not body.logprobs and not body.return_token_ids
                    and (tool_calls is not None or reasoning is not None)):  # text held back (vLLM sends none)
                continue
            choice = {"index": c.index, "delta": delta,
                      "logprobs": chat_logprobs(c, body.top_logprobs or 0, first, bool(body.return_tokens_as_token_ids))
                      if body.logprobs else None,
                      "finish_reason": reason, "stop_reason": c.stop_reason}
            if body.return_token_ids:  # the new tokens' ids
                choice["token_ids"] = list(c.token_ids[first:])
            yield chunk(rid, model, "chat", [choice], choice_usage(out, c) if body.continuous_usage else None)

    final = (lambda outs: chunk(rid, model, "chat", [], usage(outs))) if body.include_usage else None
    return _events(engine, [stream], make_chunks, final)


async def response_events(engine, stream: RequestStream, rid: str, created: int, model: str, body,
                          held: int, tool_calls: dict | None, done,
                          reasoning: ReasoningParser | None = None) -> AsyncIterator[str]:
    """The Responses API's events for one reply (``body``: the ``ResponsesRequest``); ``done(response)``
    is called with the finished response before its last event (to store it). With ``reasoning``
    (the model's parser) its thinking is a ``reasoning`` item before the others (its tokens'
    logprobs left out of the message's)."""
    seq = itertools.count()
    deltas, calls = _Deltas(held), reply_stream(tool_calls)
    split = None
    items = OutputItems(text_only=calls is None)
    try:
        started = response_body(rid, created, model, body, status="in_progress", output=[])
        yield sse_event({"type": "response.created", "response": started}, next(seq))
        yield sse_event({"type": "response.in_progress", "response": started}, next(seq))
        async for out in stream:
            c = out.outputs[0]
            finished = c.finish_reason is not None
            d = deltas.next(0, c.text, len(c.token_ids), finished)
            if d is None:
                continue
            text, first = d
            thought = ""
            if reasoning is not None:
                split = split or reasoning.stream(out.prompt_token_ids)
                thought, text = split.feed(text, finished)
            update = plain(text) if calls is None else calls.feed(text, finished)
            thinking = reasoning.num_tokens(out.prompt_token_ids, c.token_ids) if reasoning is not None else 0
            logprobs = (chat_logprobs(c, body.top_logprobs or 0, max(first, thinking))["content"]
                        if body.logprobs else ())
            for event in items.feed(update, logprobs, thought):
                yield sse_event(event, next(seq))
            if finished:
                status = final_status(out)
                for event in items.finish(status):
                    yield sse_event(event, next(seq))
                final = response_body(rid, created, model, body, status=status, output=items.items, out=out,
                                      reasoning=reasoning)
                done(final)
                yield sse_event({"type": f"response.{status}", "response": final}, next(seq))
                return
        yield sse_event({"type": "error", "code": "aborted", "message": "the request was aborted", "param": None},
                        next(seq))
    except EngineDeadError as e:
        yield sse_event({"type": "error", "code": "engine_dead", "message": str(e), "param": None}, next(seq))
    finally:
        if not stream.finished:
            engine.abort(stream.request_id)
