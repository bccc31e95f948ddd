"""``jaxpaged-serve``: an OpenAI-compatible HTTP server (also ``python -m jaxpaged.serve``).

FastAPI + uvicorn over an :class:`~jaxpaged.async_engine.AsyncLLM`:
``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or server-sent events with
``"stream": true``), ``POST /v1/embeddings``, ``GET /v1/models``, ``GET /health``, ``GET
/metrics`` (Prometheus) and vLLM's ``POST /tokenize``, ``POST /detokenize``, ``POST /v1/score``
and ``POST /v1/rerank``.
A client that disconnects aborts its requests at once, freeing their blocks.

    jaxpaged-serve --port 8000 --max-num-seqs 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import itertools
import json
import logging
import re
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from jaxpaged.async_engine import (AsyncLLM, EngineDeadError, EngineOverloadedError, EngineSleepingError,
                                   RequestStream)
from jaxpaged.chat_template import ChatTemplateError, check_syntax, load_chat_template, template_kwargs
from jaxpaged.input_processor import chat_messages, encode, prompt_names
from jaxpaged.lora import LoRARequest
from jaxpaged.openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      EmbeddingRequest, LoadLoRAAdapterRequest, RerankRequest, ScoreRequest,
                                      TokenizeRequest, UnloadLoRAAdapterRequest, chat_logprobs, chat_response,
                                      completion_response, embedding_invalid, embedding_response, invalid,
                                      rerank_response, score_response)
from jaxpaged.openai_responses import (OutputItems, ResponsesRequest, ResponseStore, Stored, as_responses_error,
                                      conversation_after, final_status, item_page, new_response_id, now, plain,
                                      reply_stream, response_body)
from jaxpaged.openai_streaming import chat_events, completion_events, response_events
from jaxpaged.outputs import RequestOutput
from jaxpaged.server_metrics import Metrics
from jaxpaged.tool_calling import TOOL_PARSERS, check_tools

PROG = "jaxpaged-serve"
log = logging.getLogger("jaxpaged.serve")

_TYPE_IN_LOC = re.compile(r"(str|int|float|bool|none|dict|list)(\[.*\])?")


# ---- the app --------------------------------------------------------------------------------


def build_app(engine: AsyncLLM, *, served_model_name: str, api_key: str | None = None,
              tool_call_parser: str | None = None, responses_store_size: int = 1024, chat_template: str | None = None,
              trust_request_chat_template: bool = False, return_tokens_as_token_ids: bool = False,
              lora_modules: Sequence[LoRARequest] = (), allow_runtime_lora_updating: bool = False):
    """The FastAPI app serving ``engine`` under the name ``served_model_name``; with
    ``api_key``, the ``/v1`` routes need ``Authorization: Bearer <api_key>``. With
    ``tool_call_parser`` (one of :data:`~jaxpaged.tool_calling.TOOL_PARSERS`), chat requests may
    let the model call tools on its own (``tool_choice`` ``"auto"``); named and required tool
    choices need no parser. ``/v1/responses`` keeps the ``responses_store_size`` most recent
    stored responses (see :mod:`jaxpaged.openai_responses`). ``chat_template`` (a Jinja
    template) replaces the model's; a request's own ``chat_template`` is refused unless
    ``trust_request_chat_template``. ``return_tokens_as_token_ids``: logprobs name tokens
    ``"token_id:<id>"`` unless a request says otherwise (vLLM's). ``lora_modules``: LoRA adapters
    served by their names beside the base model (a request's ``model`` picks one; the engine
    must have ``enable_lora``), as vLLM's ``--lora-modules``; ``allow_runtime_lora_updating``: vLLM's
    ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change them while the server runs.
    An engine with ``enable_sleep_mode`` has vLLM's ``POST /sleep?level=1``, ``POST /wake_up``
    (``?tags=weights``, ``?tags=kv_cache``: one of them) and ``GET /is_sleeping``; requests
    while it sleeps get a 503. ``POST /reset_prefix_cache`` (vLLM's) forgets the cached prefixes."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser {tool_call_parser!r} is not one of {TOOL_PARSERS}")
    if responses_store_size < 0:
        raise ValueError(f"responses_store_size must be at least 0, got {responses_store_size}")
    if chat_template is not None:
        check_syntax(chat_template)
    metrics = Metrics(engine)
    engine.stat_loggers.append(metrics.record)
    reasoning = engine.llm.reasoning  # LLM(reasoning_parser=...): replies split into reasoning and content
    responses_store = ResponseStore(responses_store_size)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        engine.shutdown()

    app = FastAPI(title="jaxpaged", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics

    def error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return error(APIError(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}",
                                  code="invalid_json"))
        # A union's member shows in loc as its type ('str', 'list[str]'): not a field of the body.
        loc = [str(x) for x in first["loc"] if x != "body" and not _TYPE_IN_LOC.fullmatch(str(x))]
        param = ".".join(loc) or None
        return error(APIError(400, f"{param or 'body'}: {first['msg']}", param=param, code="invalid_type"))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request, e: EngineDeadError):
        return error(APIError(503, str(e), type="server_error", code="engine_dead"))

    @app.exception_handler(Exception)
    async def _unexpected(request, e: Exception):  # a bug: still answer in OpenAI's shape
        log.exception("unexpected error serving %s", request.url.path)
        return error(APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return error(APIError(e.status_code, str(e.detail), code="not_found" if e.status_code == 404 else None))

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        # vLLM's guard covers /v1; the score and rerank aliases outside it run the model too, and
        # sleep mode's endpoints and the prefix cache's reset change the engine's state.
        if api_key is not None and request.url.path.startswith(("/v1", "/v2", "/score", "/rerank", "/sleep",
                                                                  "/wake_up", "/reset_prefix_cache")):
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), api_key.encode()):
                return error(APIError(401, "invalid API key: pass it as 'Authorization: Bearer <key>'",
                                      code="invalid_api_key"))
        return await call_next(request)

    adapters = {r.lora_name: r for r in lora_modules}
    if served_model_name in adapters:
        raise ValueError(f"LoRA module {served_model_name!r} has the served model's name")
    if (adapters or allow_runtime_lora_updating) and engine.llm.inputs.lora is None:
        raise ValueError("lora_modules and runtime LoRA updating need an engine with enable_lora=True")
    next_lora_id = itertools.count(max((r.lora_int_id for r in adapters.values()), default=0) + 1)

    def check_model(name: str | None) -> LoRARequest | None:
        """The LoRA adapter the request's ``model`` names (None: the base model)."""
        if name is None or name == served_model_name:
            return None
        if name in adapters:
            return adapters[name]
        served = ", ".join(map(repr, [served_model_name, *adapters]))
        raise APIError(404, f"the model {name!r} does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    def model_name(lora: LoRARequest | None) -> str:
        """The name a response gives its model: the adapter's, or the base model's."""
        return served_model_name if lora is None else lora.lora_name

    def checked_params(body: CompletionRequest | ChatCompletionRequest):
        """The request's SamplingParams, once its model and options are known to be servable."""
        check_model(body.model)
        if body.return_tokens_as_token_ids is None:
            body.return_tokens_as_token_ids = return_tokens_as_token_ids
        defaults = engine.llm.default_sampling_overrides  # the model's generation config's
        if isinstance(body, ChatCompletionRequest):
            params = body.sampling_params(tool_call_parser, defaults, reasoning)
        else:
            params = body.sampling_params(defaults)
        if body.stream and params.use_beam_search:
            raise APIError(400, "stream is not supported with use_beam_search", param="stream")
        return params

    def decode(token_ids: list[int]) -> str:
        tok = engine.tokenizer
        return tok.decode(token_ids) if tok is not None else ""

    def fits(req, param: str = "max_tokens", default: bool = False) -> None:
        """vLLM's rule: a ``max_tokens`` asked for must fit beside the prompt (the offline
        engine stops at ``max_model_len`` instead); the model's default (``default``: the
        request gave none) is cut to what fits."""
        n, asked, limit = len(req.prompt_token_ids), req.params.max_tokens, engine.max_model_len
        if asked is not None and n + asked > limit and default:
            req.params = req.params.replace(max_tokens=limit - n)  # (the prompt leaves room for one: checked)
        elif asked is not None and n + asked > limit:
            raise APIError(400, f"{param} is too large: {asked}. This model's maximum context length is {limit} "
                           f"tokens and the request has {n} input tokens ({asked} > {limit} - {n})",
                           param=param, code="invalid_value")

    async def add(prompts: list, params, request_id: str, body, *, max_tokens_param: str = "max_tokens",
                  lora: LoRARequest | None = None, names: list[str] | None = None) -> list[RequestStream]:
        """Queue every prompt, or none (``body``: the request, for the errors' ``param``; ``lora``:
        the adapter its ``model`` names; ``names``: the prompts' in errors)."""
        default = body.own_max_tokens is None and params.max_tokens is not None  # the generation config's
        try:
            return await engine.add_requests(prompts, params, [f"{request_id}-{i}" for i in range(len(prompts))],
                                             check=functools.partial(fits, param=max_tokens_param, default=default),
                                             priority=body.priority, lora_request=lora, names=names)
        except (ValueError, TypeError) as e:
            raise invalid(e, body) from None
        except (EngineOverloadedError, EngineSleepingError) as e:
            raise unavailable(e) from None

    async def respond(raw: Request, streams: list[RequestStream], events: AsyncIterator[str] | None, finish):
        """Stream ``events`` as SSE, or await the final outputs and return ``finish(outputs)``."""
        if events is not None:
            return _EngineStream(events, engine, streams)
        task = asyncio.ensure_future(_final_outputs(engine, streams))
        disconnect = asyncio.ensure_future(_disconnected(raw))
        try:
            await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            if not task.done():  # the client left: the task's cleanup aborts the requests
                task.cancel()
        if not task.done() or task.cancelled():
            return Response(status_code=499)
        return JSONResponse(finish(task.result()))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        params = checked_params(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        lora = check_model(body.model)
        model = model_name(lora)
        streams = await add(body.prompts(), params, rid, body, lora=lora, names=prompt_names(body.prompt, "prompt"))
        held = params.output_text_buffer_length
        events = completion_events(engine, rid, model, streams, body, held, decode) if body.stream else None
        return await respond(raw, streams, events, lambda outs: completion_response(rid, model, outs, body, decode))

    async def chat_token_ids(messages: list[dict[str, Any]], tools=None, options: dict[str, Any] | None = None
                             ) -> list[int]:
        """The ids of ``messages`` through the chat template: the request's (``options``, as
        ``LLM.chat_prompt`` takes them), the server's ``chat_template``, or the model's."""
        options = {"add_generation_prompt": True, **(options or {})}
        if options.get("chat_template") is not None and not trust_request_chat_template:
            raise APIError(400, "chat_template: this server does not take requests' chat templates (start it with "
                           "--trust-request-chat-template)", param="chat_template", code="invalid_value")
        if options.get("chat_template") is None:
            options["chat_template"] = chat_template
        tok = engine.tokenizer
        if tok is None or (options["chat_template"] is None and not getattr(tok, "chat_template", None)):
            raise APIError(400, "this model has no chat template; use /v1/completions, or start the server with "
                           "--chat-template", param="messages")
        try:
            template_kwargs(**options, compile=False)  # a request's template compiles on the tokenizer thread
        except (ValueError, TypeError) as e:
            raise invalid(e) from None
        try:
            chat_messages(messages)  # here, not only on the tokenizer thread: its errors name the message
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        try:
            return await engine.run_on_tokenizer_thread(
                functools.partial(engine.llm.apply_chat_template, messages, tools=tools, **options))
        except EngineDeadError:
            raise
        except ChatTemplateError as e:
            raise invalid(e) from None
        except Exception as e:  # the template's own check (e.g. roles that must alternate)
            own = options["chat_template"] is not chat_template or options.get("chat_template_kwargs")
            raise APIError(400, f"the chat template rejected the messages: {e}",
                           param=None if own else "messages") from None  # (a request's own template or variables)

    def tokenizer():
        if engine.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", code="unsupported_value")
        return engine.tokenizer

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        params = checked_params(body)
        tool_calls = body.tool_calls(tool_call_parser)
        ids = await chat_token_ids(body.conversation(), body.tools, body.template_options())
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        lora = check_model(body.model)
        model = model_name(lora)
        streams = await add([{"prompt_token_ids": ids}], params, rid, body, lora=lora, names=["messages"])
        held = params.output_text_buffer_length
        events = chat_events(engine, rid, model, streams[0], body, held, tool_calls, reasoning) if body.stream else None
        return await respond(raw, streams, events,
                             lambda outs: chat_response(rid, model, outs[0], body, tool_calls, reasoning))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, raw: Request):
        lora = check_model(body.model)
        model = model_name(lora)
        previous = []
        if body.previous_response_id is not None:
            stored = responses_store.get(body.previous_response_id)
            if stored is None:
                raise APIError(400, f"previous response with id {body.previous_response_id!r} not found (the "
                               f"server keeps the {responses_store.max_size} most recent stored responses)",
                               param="previous_response_id", code="previous_response_not_found")
            previous = stored.conversation
        try:
            chat = body.chat_request(previous)
            params = checked_params(chat)
            tool_calls = chat.tool_calls(tool_call_parser)
            ids = await chat_token_ids(chat.conversation(), chat.tools)
            rid, created = new_response_id(), now()
            streams = await add([{"prompt_token_ids": ids}], params, rid, chat, max_tokens_param="max_output_tokens",
                                lora=lora)
        except APIError as e:
            raise as_responses_error(e) from None
        messages = chat.conversation()[1 if body.instructions is not None else 0:]
        input_items = body.input_items()

        def done(response: dict) -> None:
            if body.store:
                responses_store.put(Stored(response, conversation_after(messages, response["output"]), input_items))

        if body.stream:
            return _EngineStream(response_events(engine, streams[0], rid, created, model, body,
                                                 params.output_text_buffer_length, tool_calls, done, reasoning),
                                 engine, streams)

        def finish(outs: list[RequestOutput]) -> dict:
            out, calls = outs[0], reply_stream(tool_calls)
            items, c = OutputItems(text_only=calls is None), out.outputs[0]
            thought, text = reasoning.stream(out.prompt_token_ids).feed(c.text, True) if reasoning else ("", c.text)
            thinking = reasoning.num_tokens(out.prompt_token_ids, c.token_ids) if reasoning else 0
            logprobs = chat_logprobs(c, body.top_logprobs or 0, thinking)["content"] if body.logprobs else ()
            items.feed(plain(text) if calls is None else calls.feed(text, True), logprobs, thought)
            status = final_status(out)
            items.finish(status)
            response = response_body(rid, created, model, body, status=status, output=items.items,
                                     out=out, reasoning=reasoning)
            done(response)
            return response

        return await respond(raw, streams, None, finish)

    def stored_response(response_id: str) -> Stored:
        stored = responses_store.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {response_id!r}", param="response_id",
                           code="not_found")
        return stored

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return stored_response(response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None,
                                   before: str | None = None):
        return item_page(stored_response(response_id).input_items, limit=limit, order=order, after=after,
                         before=before)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        stored_response(response_id)
        responses_store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def embed(rid: str, inputs: list, names: list[str], body: EmbeddingRequest | ScoreRequest | RerankRequest,
                    lora: LoRARequest | None) -> list[RequestStream]:
        """One embedding request per input, all queued or none (``names``: the inputs' in errors)."""
        try:
            return await engine.add_requests(inputs, None, [f"{rid}-{i}" for i in range(len(inputs))],
                                             priority=body.priority, pooling=body.pooling_params(), lora_request=lora,
                                             names=names)
        except (ValueError, TypeError) as e:
            raise embedding_invalid(e) from None
        except (EngineOverloadedError, EngineSleepingError) as e:
            raise unavailable(e) from None

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, raw: Request):
        """Each input's embedding (:mod:`jaxpaged.pooling`), run beside the generation requests."""
        lora = check_model(body.model)
        rid = f"embd-{uuid.uuid4().hex}"
        streams = await embed(rid, body.inputs(), prompt_names(body.input, "input"), body, lora)
        return await respond(raw, streams, None,
                             lambda outs: embedding_response(rid, model_name(lora), outs, body.encoding_format))

    @app.post("/score")
    @app.post("/v1/score")
    async def score(body: ScoreRequest, raw: Request):
        """vLLM's: each pair's cosine similarity; every text embedded once."""
        lora = check_model(body.model)
        first, second, pairs = body.texts()
        rid = f"score-{uuid.uuid4().hex}"
        names = prompt_names(body.text_1, "text_1") + prompt_names(body.text_2, "text_2")
        streams = await embed(rid, first + second, names, body, lora)
        return await respond(raw, streams, None,
                             lambda outs: score_response(rid, model_name(lora), outs, len(first), pairs))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank(body: RerankRequest, raw: Request):
        """vLLM's (Jina's and Cohere's API): the documents by similarity to the query."""
        lora = check_model(body.model)
        rid = f"rerank-{uuid.uuid4().hex}"
        streams = await embed(rid, body.texts(), ["query"] + prompt_names(body.documents, "documents"), body, lora)
        return await respond(raw, streams, None,
                             lambda outs: rerank_response(rid, model_name(lora), outs, body.documents, body.top_n))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: the token ids the generation endpoints would run for this prompt or chat."""
        check_model(body.model)
        body.check()
        tok = tokenizer()
        if body.messages is not None:
            if body.tools is not None:
                try:
                    check_tools(body.tools)
                except (ValueError, TypeError) as e:
                    raise APIError(400, str(e), param="tools", code="invalid_value") from None
            ids = await chat_token_ids([m.as_template_dict() for m in body.messages], body.tools,
                                       body.template_options())
        else:
            try:
                ids = await engine.run_on_tokenizer_thread(
                    lambda: encode(tok, body.prompt, add_special_tokens=body.add_special_tokens))
            except ValueError as e:
                raise APIError(400, str(e), param="prompt", code="invalid_value") from None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        tok = tokenizer()
        bad = [t for t in body.tokens if not 0 <= t < engine.llm.inputs.vocab_size]
        if bad:
            raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {engine.llm.inputs.vocab_size})",
                           param="tokens", code="invalid_value")
        return {"prompt": await engine.run_on_tokenizer_thread(tok.decode, body.tokens)}

    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            """vLLM's: serve another adapter, loaded and checked now (on the tokenizer thread, where
            requests' adapters load); running requests go on."""
            if body.lora_name in adapters or body.lora_name == served_model_name:
                raise APIError(400, f"the model {body.lora_name!r} is already served", param="lora_name",
                               code="invalid_value")
            req = LoRARequest(body.lora_name, next(next_lora_id), body.lora_path)
            try:
                await engine.run_on_tokenizer_thread(engine.llm.inputs.lora.get, req)
            except (ValueError, TypeError, OSError) as e:
                raise APIError(400, str(e), param="lora_path", code="invalid_value") from None
            adapters[req.lora_name] = req
            return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            """vLLM's: stop serving an adapter (requests already running with it finish with it)."""
            if adapters.pop(body.lora_name, None) is None:
                raise APIError(404, f"no LoRA adapter {body.lora_name!r} is served", param="lora_name",
                               code="not_found")
            return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/v1/models")
    async def models():
        base = {"id": served_model_name, "object": "model", "created": metrics.started, "owned_by": "jaxpaged",
                "root": served_model_name, "parent": None, "max_model_len": engine.max_model_len}
        # vLLM's: each LoRA adapter by its name, its folder as root, the base model as parent.
        return {"object": "list", "data": [base, *({**base, "id": r.lora_name, "root": str(r.lora_path),
                                                    "parent": served_model_name} for r in adapters.values())]}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return error(APIError(503, "the engine is not running", type="server_error", code="engine_dead"))
        return Response(status_code=200)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's: forget every cached prefix (between benchmark runs, after new weights);
        ``{"reset": false}`` while requests hold blocks."""
        return {"reset": await engine.reset_prefix_cache()}

    if engine.llm.enable_sleep_mode:
        @app.post("/sleep")
        async def sleep(level: int = 1):
            """vLLM's: free the device memory (:meth:`jaxpaged.LLM.sleep`); a 409 while requests run."""
            try:
                await engine.sleep(level)
            except ValueError as e:
                raise APIError(400, str(e), param="level", code="invalid_value") from None
            except EngineDeadError:
                raise
            except RuntimeError as e:
                raise APIError(409, str(e), code="requests_unfinished") from None
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(tags: list[str] | None = Query(None)):
            bad = sorted(set(tags or ()) - {"weights", "kv_cache"})
            if bad:
                raise APIError(400, f"tags must be 'weights' and/or 'kv_cache', got {bad}", param="tags",
                               code="invalid_value")
            try:
                await engine.wake_up(tags)
            except EngineDeadError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. a level-2 checkpoint that no longer fits the model
                raise APIError(500, f"wake_up failed: {e}", type="server_error", code="wake_up_failed") from None
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping():
            return {"is_sleeping": await engine.is_sleeping()}

    @app.get("/metrics")
    async def prometheus():
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return app


def unavailable(e: EngineOverloadedError | EngineSleepingError) -> APIError:
    """The 503 of a request the engine cannot take now (its queue is full, or it sleeps)."""
    code = "engine_sleeping" if isinstance(e, EngineSleepingError) else "engine_overloaded"
    return APIError(503, str(e), type="server_error", code=code)


class _EngineStream(StreamingResponse):
    """An SSE response that aborts its requests when it ends, however it ends: the body
    generator's own ``finally`` runs only if the generator is closed, and a client that
    goes away while the response waits on ``send`` would leave that to the garbage collector."""

    def __init__(self, events: AsyncIterator[str], engine: AsyncLLM, streams: list[RequestStream]):
        super().__init__(events, media_type="text/event-stream")
        self.engine, self.streams = engine, streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            for s in self.streams:
                if not s.finished:
                    self.engine.abort(s.request_id)


async def _disconnected(raw) -> None:
    """Return once the client has gone (the body is already read: only a disconnect comes)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _final_outputs(engine: AsyncLLM, streams: list[RequestStream]) -> list[RequestOutput]:
    try:
        return await asyncio.gather(*(_last(s) for s in streams))
    finally:
        for s in streams:
            if not s.finished:
                engine.abort(s.request_id)


async def _last(stream: RequestStream) -> RequestOutput:
    out = None
    async for out in stream:
        pass
    if out is None or not out.finished:
        raise APIError(503, "the request was aborted", type="server_error", code="aborted")
    return out


# ---- the command line ------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from jaxpaged.cli import add_engine_args

    p = argparse.ArgumentParser(prog=PROG, description="Serve a model over an OpenAI-compatible HTTP API.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key",
                   help="require 'Authorization: Bearer <key>' on /v1 routes (and /v2/rerank, /score, /rerank)")
    p.add_argument("--max-waiting-requests", type=int,
                   help="most requests queued and not yet running; beyond, requests get 503 (default: no limit)")
    p.add_argument("--responses-store-size", type=int, default=1024,
                   help="most recent /v1/responses responses kept for GET and previous_response_id (default 1024; "
                        "0 keeps none)")
    add_app_args(p)
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING); needs --enable-lora")
    add_engine_args(p)
    return p


def add_app_args(p: argparse.ArgumentParser) -> None:
    """The options of what the API serves, shared with ``jaxpaged.run_batch``."""
    p.add_argument("--model", help="HF folder or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model, or the embedded name)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let chat requests leave tool calls to the model (tool_choice "auto"); needs --tool-call-parser')
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS,
                   help="the model's tool call format: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen), "
                        "llama3_json (Llama 3.1-3.3's JSON calls), pythonic ([f(a=1), g()]: Llama 3.2), mistral "
                        "([TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}: Mistral) or qwen3_coder (alias "
                        "qwen3_xml: <tool_call><function=f><parameter=a>1</parameter></function></tool_call>: "
                        "Qwen3-Coder, Qwen3.5)")
    p.add_argument("--chat-template",
                   help="the chat template to use instead of the model's: a file, or the Jinja template itself")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let chat requests bring their own chat_template (refused by default)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='logprobs name tokens "token_id:<id>" (a request\'s return_tokens_as_token_ids wins)')
    p.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served by name beside the base model, a request's model "
                        'picking one: name=path, or JSON {"name": ..., "path": ..., "base_model_name": ...}; '
                        "needs --enable-lora")


def lora_module(value: str) -> dict:
    """A ``--lora-modules`` entry, vLLM's forms: ``name=path`` or a JSON object with ``name`` and ``path``."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
        if not isinstance(entry, dict) or not {"name", "path"} <= set(entry) or set(entry) - {
                "name", "path", "base_model_name"}:
            raise argparse.ArgumentTypeError(f"{value!r}: a JSON entry has a name, a path and maybe a base_model_name")
        return entry
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r} is not name=path")
    return {"name": name, "path": path}


def default_model_name(model: str | None) -> str:
    """The API's name of ``--model``: as given, or the embedded model's file name."""
    from jaxpaged.default_model import DEFAULT_MODEL_FILE

    return model if model is not None else DEFAULT_MODEL_FILE.removesuffix(".gguf")


def start(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[AsyncLLM, FastAPI, str]:
    """The engine and the app that ``args`` (:func:`build_parser`'s, or ``jaxpaged.run_batch``'s)
    ask for, and the served model's name; a bad option stops it through ``parser.error``."""
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        parser.error("--enable-auto-tool-choice and --tool-call-parser go together")
    store = getattr(args, "responses_store_size", 1024)
    if store < 0:
        parser.error(f"--responses-store-size must be at least 0, got {store}")
    runtime_lora = getattr(args, "allow_runtime_lora_updating", False)
    for flag, given in (("--lora-modules", args.lora_modules), ("--allow-runtime-lora-updating", runtime_lora)):
        if given and not args.enable_lora:
            parser.error(f"{flag} needs --enable-lora")
    names = [m["name"] for m in args.lora_modules]
    if len(set(names)) < len(names):
        parser.error(f"--lora-modules: a name twice in {names}")
    try:
        template = None if args.chat_template is None else load_chat_template(args.chat_template)
    except (OSError, ValueError, TypeError) as e:
        parser.error(str(e))
    from jaxpaged.cli import engine_kwargs
    from jaxpaged.engine import LLM

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(args.model, **engine_kwargs(args))
    loras = [LoRARequest(m["name"], i, m["path"], m.get("base_model_name"))
             for i, m in enumerate(args.lora_modules, 1)]
    for r in loras:  # loaded and checked now, as vLLM's static adapters: a bad one stops the start
        llm.inputs.lora.get(r)
    engine = AsyncLLM(llm, max_waiting_requests=getattr(args, "max_waiting_requests", None))
    name = args.served_model_name or default_model_name(args.model)
    app = build_app(engine, served_model_name=name, api_key=getattr(args, "api_key", None),
                    tool_call_parser=args.tool_call_parser, responses_store_size=store, chat_template=template,
                    trust_request_chat_template=args.trust_request_chat_template,
                    return_tokens_as_token_ids=args.return_tokens_as_token_ids, lora_modules=loras,
                    allow_runtime_lora_updating=runtime_lora)
    return engine, app, name


def run(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    engine, app, name = start(parser, args)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    host, port = sock.getsockname()[:2]
    print(f"{PROG}: serving {name} on http://{host}:{port}", file=sys.stderr, flush=True)
    server = Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5), engine)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    return 0


class Server(uvicorn.Server):
    """A ``uvicorn.Server`` that aborts every request of ``engine`` before uvicorn waits for
    open connections to close, so that streams end at once, then stops the engine."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM):
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets=None):
        self.engine.shutdown()
        await super().shutdown(sockets)
        stats = self.engine.stats
        print(f"{PROG}: shut down with {stats.num_running} running requests, {stats.num_waiting} waiting, "
              f"{stats.num_used_blocks} KV blocks in use", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from jaxpaged.cli import exit_code

    return exit_code(run, PROG, argv)


if __name__ == "__main__":
    sys.exit(main())
