"""The OpenAI API's request bodies (pydantic) and response bodies (plain dicts), for ``serve``.

Requests accept the fields people use with OpenAI's API and vLLM's extras; unknown fields
are ignored, as OpenAI and vLLM do. Types are checked strictly by pydantic, values by
``SamplingParams`` itself, so a bad value gets the engine's own message. No jax here.
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from jaxpaged.generation_config import for_request
from jaxpaged.outputs import CompletionOutput, EmbeddingRequestOutput, PositionLogprobs, RequestOutput
from jaxpaged.pooling import PoolingParams, cosine, score_pairs
from jaxpaged.reasoning import ReasoningParser, ReasoningStream
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpaged.structured_output import StructuredOutputsParams, as_structured_outputs
from jaxpaged.tool_calling import ToolCallStream, ToolChoice, check_tools, resolve_tool_choice, tool_schema


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(e: Exception, body: OpenAIRequest | None = None) -> APIError:
    """A 400 for an engine validation error; ``param`` is the field its message starts with (for
    ``structured_outputs``, the field of ``body`` that gave it: ``response_format``, ``guided_*``
    or a named or required ``tool_choice``)."""
    message = str(e)
    first = message.split(" ", 1)[0].split("[", 1)[0].split(".", 1)[0].split("'", 1)[0].rstrip(":")
    fields = {"prompt", "messages", *OpenAIRequest.model_fields, *CompletionRequest.model_fields,
              *ChatCompletionRequest.model_fields}
    if first == "structured_outputs" and body is not None:
        field = body.structured_field()
        if field is None and isinstance(body, ChatCompletionRequest) and body.tool_choice not in (None, "none", "auto"):
            # The constraint is a named or required tool choice's: the tools' schemas, or the choice itself.
            if "is not a valid constraint" in message:
                message = "tools: a function's parameters are not a usable JSON schema: " + message.split(": ", 1)[-1]
                return APIError(400, message, param="tools", code="invalid_value")
            return APIError(400, message, param="tool_choice", code="invalid_value")
        first = field or first
    return APIError(400, message, param=first if first in fields else None, code="invalid_value")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class OpenAIRequest(BaseModel):
    """The sampling fields the two generation endpoints share."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    length_penalty: float = 1.0
    cache_salt: str | None = None
    priority: int = 0  # vLLM's: lower runs first (the server's --scheduling-policy priority)
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:<id>" (None: the server's)
    return_token_ids: bool | None = None  # vLLM's: the prompt's and each choice's token ids beside the text
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    def structured_field(self) -> str | None:
        """The field that asks for a structured output (``_structured_outputs`` checks there is one at most)."""
        return next(iter(self._structured_specs()), None)

    def _structured_specs(self) -> dict[str, Any]:
        """Each field that asks for a structured output -> its ``structured_outputs`` (a dict)."""
        given = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type") if isinstance(rf, dict) else None
            if kind == "json_object":
                given["response_format"] = {"json_object": True}
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                    raise APIError(400, "response_format of type 'json_schema' needs json_schema.schema, a JSON "
                                   "schema object", param="response_format", code="invalid_value")
                given["response_format"] = {"json": spec["schema"]}
            elif kind != "text":
                raise APIError(400, f"response_format {rf!r:.200} is not supported: its type must be 'text', "
                               "'json_object' or 'json_schema'", param="response_format", code="invalid_value")
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{name}") is not None:
                given[f"guided_{name}"] = {name: getattr(self, f"guided_{name}")}
        return given

    def _structured_outputs(self, constraint: dict | None = None) -> StructuredOutputsParams | None:
        """The request's structured output, from whichever one of its fields names it, or the
        schema a named or required ``tool_choice`` constrains the reply to."""
        given = self._structured_specs()
        if constraint is not None:
            if given:
                raise APIError(400, f"{next(iter(given))} cannot be combined with a named or required tool_choice, "
                               "which constrains the reply itself", param=next(iter(given)), code="invalid_value")
            try:  # compact: a small model would otherwise pad the JSON with whitespace up to max_tokens
                return as_structured_outputs({"json": constraint, "disable_any_whitespace": True})
            except (ValueError, TypeError) as e:
                raise APIError(400, f"tools: a function's parameters are not a usable JSON schema: {e}",
                               param="tools", code="invalid_value") from None
        if len(given) > 1:
            raise APIError(400, f"give one structured output, not {', '.join(given)}", param=list(given)[1],
                           code="invalid_value")
        if not given:
            return None
        (param, spec), = given.items()
        try:
            return as_structured_outputs(spec)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"{param}: {e}", param=param, code="invalid_value") from None

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None, *,
                constraint: dict | None = None, skip_special_tokens: bool | None = None,
                defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Raises ``APIError`` (400) with SamplingParams' message for an invalid value; ``constraint``:
        the JSON schema of a named or required tool choice; ``defaults``: the model's generation
        config's fields (``LLM.default_sampling_overrides``), for those the request leaves unset,
        its ``max_tokens`` that of a request that gives none (vLLM's rules)."""
        defaults = defaults or {}
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        structured = self._structured_outputs(constraint)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be given when stream is true", param="stream_options",
                           code="invalid_value")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63:
            raise APIError(400, f"seed must be a 64-bit signed integer, got {self.seed}", param="seed",
                           code="invalid_value")
        bias = None
        if self.logit_bias is not None:
            bias = {}
            for k, v in self.logit_bias.items():
                try:
                    # OpenAI's range, which vLLM clamps to as well (NaN is left for SamplingParams to refuse).
                    bias[int(k)] = v if math.isnan(v) else min(100.0, max(-100.0, v))
                except ValueError:
                    raise APIError(400, f"logit_bias keys must be token ids, got {k!r}", param="logit_bias",
                                   code="invalid_value") from None
        sampling = for_request(defaults, beam_search=self.use_beam_search)
        given = {k: getattr(self, k) if getattr(self, k) is not None else sampling.get(k)
                 for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
        given = {k: v for k, v in given.items() if v is not None}
        if self.use_beam_search:
            given.setdefault("temperature", 0.0)  # (beam search is deterministic: vLLM takes none given so)
        try:
            return SamplingParams(
                n=self.n, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                logit_bias=bias, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
                include_stop_str_in_output=self.include_stop_str_in_output, allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens, logprobs=logprobs,
                prompt_logprobs=prompt_logprobs, truncate_prompt_tokens=self.truncate_prompt_tokens,
                use_beam_search=self.use_beam_search, length_penalty=self.length_penalty, cache_salt=self.cache_salt,
                skip_special_tokens=self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens,
                structured_outputs=structured, **given)
        except (ValueError, TypeError) as e:
            raise invalid(e, self) from None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(OpenAIRequest):
    """``POST /v1/completions``.

    ``echo`` returns each prompt before its completion, as vLLM does: the text is the prompt's
    (a prompt of token ids decoded) followed by the completion's, and with ``logprobs`` the
    prompt's tokens lead the logprobs object, the first with ``None`` (nothing precedes it).
    ``prompt_logprobs`` defaults to ``logprobs`` then. ``max_tokens = 0`` with ``echo`` scores
    the prompt alone (how lm-evaluation-harness asks for log-likelihoods): one token is sampled
    and dropped, the choice is the prompt and ``completion_tokens`` counts nothing.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens = 0``: the prompt, scored, and no completion."""
        return self.echo and self.max_tokens == 0

    @property
    def own_max_tokens(self) -> int | None:
        """The most tokens the request itself asks for (None: none given)."""
        return self.max_tokens

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_value")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo:
            prompt_logprobs = self.logprobs
        return self._params(1 if self.echo_only else self.max_tokens, self.logprobs, prompt_logprobs,
                            defaults=defaults)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise APIError(400, "prompt is empty", param="prompt", code="invalid_value")
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's reply to one
    reasoning: str | None = None  # an assistant's earlier thinking (vLLM's field; reasoning_content before it)
    reasoning_content: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            bad = [p.type for p in content if p.type != "text"]
            if bad:
                raise APIError(400, f"only text content parts are supported, got {bad[0]!r}", param="messages",
                               code="unsupported_value")
            content = "".join(p.text or "" for p in content)
        extra = {k: getattr(self, k) for k in ("name", "tool_calls", "tool_call_id") if getattr(self, k) is not None}
        thought = self.reasoning if self.reasoning is not None else self.reasoning_content
        if thought is not None:  # templates read either name
            extra.update(reasoning=thought, reasoning_content=thought)
        return {"role": self.role, "content": content or "", **extra}


class ChatTemplateFields(BaseModel):
    """vLLM's chat template options of a request (:mod:`jaxpaged.chat_template`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # only where the server trusts requests' templates
    chat_template_kwargs: dict[str, Any] | None = None

    def reply_role(self) -> str:
        """The reply's role, as vLLM gives it: the assistant's, or with no new turn opened
        (``add_generation_prompt`` false) the last message's, which the reply continues."""
        messages = getattr(self, "messages", None)
        return "assistant" if self.add_generation_prompt or not messages else messages[-1].role

    def template_options(self) -> dict[str, Any]:
        """The options as :meth:`jaxpaged.LLM.chat_prompt` takes them (unchecked)."""
        return {"add_generation_prompt": self.add_generation_prompt, "chat_template": self.chat_template,
                "chat_template_kwargs": self.chat_template_kwargs,
                "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(OpenAIRequest, ChatTemplateFields):
    """``POST /v1/chat/completions``."""

    echo: bool = False  # vLLM's: the reply's content leads with the last message's, of the same role
    include_reasoning: bool = True  # vLLM's: False leaves a reasoning parser's reasoning out of the reply

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True

    def tool_choice_of(self, tool_call_parser: str | None) -> ToolChoice:
        """The request's tool choice, checked against its tools and the server's parser
        (``None``: ``"auto"`` is refused, as vLLM refuses it without ``--enable-auto-tool-choice``)."""
        try:
            tools = None if self.tools is None else check_tools(self.tools)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="tools", code="invalid_value") from None
        try:
            choice = resolve_tool_choice(self.tool_choice, tools)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice", code="invalid_value") from None
        if choice.kind == "auto" and tool_call_parser is None:
            raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
                           "be set on the server (or send tool_choice 'none', 'required' or a named function)",
                           param="tool_choice", code="unsupported_value")
        return choice

    def tool_calls(self, tool_call_parser: str | None) -> dict | None:
        """``ToolCallStream``'s arguments for this request's replies, or None (plain text)."""
        choice = self.tool_choice_of(tool_call_parser)
        max_calls = None if self.parallel_tool_calls else 1
        if choice.kind == "named":
            return {"mode": "named", "name": choice.name}
        if choice.kind == "required":
            return {"mode": "required", "max_calls": max_calls}
        if choice.kind == "auto":  # (the tools' schemas type qwen3_coder's parameter values)
            return {"mode": tool_call_parser, "max_calls": max_calls, "tools": self.tools}
        return None

    @property
    def own_max_tokens(self) -> int | None:
        """The most tokens the request itself asks for (None: none given)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, tool_call_parser: str | None = None, defaults: dict[str, Any] | None = None,
                        reasoning: ReasoningParser | None = None) -> SamplingParams:
        """With a ``reasoning`` parser whose tags are special tokens, they stay in the text."""
        choice = self.tool_choice_of(tool_call_parser)
        try:
            schema = None if choice.kind == "none" else tool_schema(choice, self.tools,
                                                                   parallel_tool_calls=self.parallel_tool_calls)
        except ValueError as e:
            raise APIError(400, str(e), param="tools", code="invalid_value") from None
        # vLLM's hermes and mistral parsers read their tags with special tokens left in the text.
        skip = False if (choice.kind == "auto" and tool_call_parser in ("hermes", "mistral")
                         or reasoning is not None and reasoning.tags_special) else None
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                           param="top_logprobs", code="invalid_value")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.own_max_tokens, logprobs, self.prompt_logprobs, constraint=schema,
                            skip_special_tokens=skip, defaults=defaults)

    def conversation(self) -> list[dict[str, Any]]:
        return [m.as_template_dict() for m in self.messages]

    def echoed(self) -> str:
        """vLLM's chat ``echo``: the last message's content, which the reply's content leads
        with when their roles are the same (a continued message), else ''."""
        if not self.echo or self.messages[-1].role != self.reply_role():
            return ""
        return self.messages[-1].as_template_dict()["content"]


class TokenizeRequest(ChatTemplateFields):
    """vLLM's ``POST /tokenize``: a ``prompt`` (tokenized as ``/v1/completions`` would, with
    ``add_special_tokens``) or chat ``messages`` (through the chat template, as
    ``/v1/chat/completions`` would)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Any = None  # given to the chat template, as /v1/chat/completions does
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt" if self.prompt is None else "messages",
                           code="invalid_value")


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``: token ids back to text."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/load_lora_adapter`` (with runtime LoRA updating): serve the PEFT folder
    ``lora_path`` as model ``lora_name``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``POST /v1/unload_lora_adapter``: stop serving ``lora_name``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    lora_name: str


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings`` (OpenAI's; vLLM's ``truncate_prompt_tokens``, ``normalize`` and
    ``priority`` too). ``dimensions`` keeps the first that many values, normalized again
    (Matryoshka embeddings)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool = True
    priority: int = 0

    def inputs(self) -> list[str | list[int]]:
        p = self.input
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p or any(not x for x in p):
            raise APIError(400, "input is empty (give text or token ids, none of them empty)", param="input",
                           code="invalid_value")
        return list(p)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)


def embedding_invalid(e: Exception) -> APIError:
    """A 400 for an embedding request the engine refused, ``param`` the field its message starts
    with (an input's name, e.g. ``input[2]`` or ``documents[0]``, gives its field)."""
    message = str(e)
    first = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":")
    fields = {"input", "text_1", "text_2", "query", "documents", "dimensions", "truncate_prompt_tokens"}
    return APIError(400, message, param=first if first in fields else None, code="invalid_value")


def embedding_response(rid: str, model: str, outs: list[EmbeddingRequestOutput], encoding_format: str
                       ) -> dict[str, Any]:
    """OpenAI's ``list`` of ``embedding`` objects; base64: each vector's float32 bytes, little-endian."""
    def encoded(v: list[float]):
        if encoding_format == "base64":
            return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode("ascii")
        return v

    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(o.outputs.embedding)}
                     for i, o in enumerate(outs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _texts(value: str | list[str], param: str) -> list[str]:
    texts = [value] if isinstance(value, str) else list(value)
    if not texts or any(not t for t in texts):
        raise APIError(400, f"{param} is empty (give text, none of it empty)", param=param, code="invalid_value")
    return texts


class ScoreRequest(BaseModel):
    """``POST /v1/score`` (vLLM's, for an embedding model): the cosine similarity of the
    embeddings of ``text_1`` (one text for every ``text_2`` text, or one each) and ``text_2``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def texts(self) -> tuple[list[str], list[str], list[tuple[int, int]]]:
        """The first texts, the second ones, and the (first, second) pairs to score."""
        first, second = _texts(self.text_1, "text_1"), _texts(self.text_2, "text_2")
        try:
            return first, second, score_pairs(len(first), len(second))
        except ValueError as e:
            raise APIError(400, str(e).replace("data_1", "text_1").replace("data_2", "text_2"), param="text_1",
                           code="invalid_value") from None

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)


class RerankRequest(BaseModel):
    """``POST /v1/rerank`` (vLLM's, Jina's and Cohere's API, for an embedding model): the
    ``documents`` by the cosine similarity of their embeddings to the ``query``'s, highest
    first; ``top_n`` > 0 keeps that many."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = 0
    truncate_prompt_tokens: int | None = None
    priority: int = 0

    def texts(self) -> list[str]:
        """The query, then the documents."""
        if self.top_n < 0:
            raise APIError(400, f"top_n must be >= 0 (0: every document), got {self.top_n}", param="top_n",
                           code="invalid_value")
        return _texts(self.query, "query") + _texts(self.documents, "documents")

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens)


def score_response(rid: str, model: str, outs: list[EmbeddingRequestOutput], num_first: int,
                   pairs: list[tuple[int, int]]) -> dict[str, Any]:
    """vLLM's ``ScoreResponse``: one ``score`` object per pair, in ``text_2``'s order; the usage
    counts each pair's tokens, as vLLM's (one first text for many is counted for each)."""
    first, second = outs[:num_first], outs[num_first:]
    tokens = sum(len(first[i].prompt_token_ids) + len(second[j].prompt_token_ids) for i, j in pairs)
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": k, "object": "score",
                      "score": cosine(first[i].outputs.embedding, second[j].outputs.embedding)}
                     for k, (i, j) in enumerate(pairs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}}


def rerank_response(rid: str, model: str, outs: list[EmbeddingRequestOutput], documents: list[str],
                    top_n: int) -> dict[str, Any]:
    """vLLM's ``RerankResponse``: the documents by relevance to the query, highest first; the
    usage counts the query with each document, as vLLM's."""
    query, docs = outs[0], outs[1:]
    scored = sorted(((cosine(query.outputs.embedding, d.outputs.embedding), j) for j, d in enumerate(docs)),
                    key=lambda x: (-x[0], x[1]))
    results = [{"index": j, "document": {"text": documents[j]}, "relevance_score": s}
               for s, j in (scored[:top_n] if top_n else scored)]
    tokens = sum(len(query.prompt_token_ids) + len(d.prompt_token_ids) for d in docs)
    return {"id": rid, "model": model, "usage": {"total_tokens": tokens}, "results": results}


# ---- responses ---------------------------------------------------------------------------

FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}  # the engine's are OpenAI's


def choice_usage(out: RequestOutput, c: CompletionOutput | None) -> dict[str, int]:
    """vLLM's continuous usage stats: the prompt's tokens and one choice's so far (``c`` None: none yet)."""
    prompt, completion = len(out.prompt_token_ids), 0 if c is None else len(c.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def usage(outputs: list[RequestOutput], *, echo_only: bool = False) -> dict[str, Any]:
    """OpenAI's ``usage``, with ``prompt_tokens_details.cached_tokens``: the prompt tokens whose
    K/V the prefix cache held (vLLM gives them with ``--enable-prompt-tokens-details``)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = 0 if echo_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)}}


def echo_text(out: RequestOutput, decode: Callable[[list[int]], str]) -> str:
    """The text ``echo`` returns for ``out``'s prompt: as given, or its token ids decoded."""
    return out.prompt if out.prompt is not None else decode(out.prompt_token_ids)


def token_name(token_id: int, text: str | None, as_id: bool) -> str:
    """A token as logprobs name it: its text, or (vLLM's ``return_tokens_as_token_ids``) ``"token_id:<id>"``."""
    return f"token_id:{token_id}" if as_id else text or ""


def completion_logprobs(c: CompletionOutput | None, start: int = 0, text_offset: int = 0, *,
                        echo: RequestOutput | None = None, decode: Callable[[list[int]], str] | None = None,
                        as_ids: bool = False) -> dict[str, list]:
    """The legacy completions ``logprobs`` object of ``c``'s tokens ``start:`` (none when ``c``
    is None), offsets from ``text_offset``; with ``echo``, its prompt's tokens first (their
    ``prompt_logprobs``; the first token, which nothing scores, has ``None`` and its text from
    ``decode``), as vLLM returns them; ``as_ids``: tokens named by id (:func:`token_name`), the
    offsets counting those names, as vLLM's do."""
    pairs: list[tuple[int, PositionLogprobs | None]] = []
    if echo is not None:
        pairs += zip(echo.prompt_token_ids, echo.prompt_logprobs or [None] * len(echo.prompt_token_ids))
    if c is not None:
        pairs += zip(c.token_ids[start:], c.logprobs[start:])
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = text_offset
    for tid, entry in pairs:
        if entry is None:
            tokens.append(token_name(tid, decode([tid]) if decode is not None else "", as_ids))
            token_logprobs.append(None)
            top.append(None)
        else:
            tokens.append(token_name(tid, entry[tid].decoded_token, as_ids))
            token_logprobs.append(entry[tid].logprob)
            top.append({token_name(t, e.decoded_token, as_ids): e.logprob
                        for t, e in sorted(entry.items(), key=lambda te: te[1].rank)})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, num_top: int, start: int = 0, as_ids: bool = False) -> dict[str, list]:
    """The chat ``logprobs`` object (``{"content": [...]}``) of tokens ``start:`` (``as_ids``: see
    :func:`token_name`)."""
    def item(token_id: int, e) -> dict:
        name = token_name(token_id, e.decoded_token, as_ids)
        return {"token": name, "logprob": e.logprob, "bytes": list(name.encode())}

    content = []
    for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        top = sorted(((t, e) for t, e in entry.items() if e.rank <= num_top), key=lambda te: te[1].rank)
        content.append({**item(tid, entry[tid]), "top_logprobs": [item(t, e) for t, e in top]})
    return {"content": content}


def prompt_logprobs(out: RequestOutput) -> list[dict | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt position ``None`` (the first) or ``{token id:
    {"logprob", "rank", "decoded_token"}}``; None where the request did not ask for them."""
    if out.prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token} for t, e in entry.items()}
            for entry in out.prompt_logprobs]


def completion_response(request_id: str, model: str, outputs: list[RequestOutput], req: CompletionRequest,
                        decode: Callable[[list[int]], str]) -> dict:
    """The ``text_completion`` body; ``decode`` turns token ids into text (``echo``)."""
    choices = []
    for i, o in enumerate(outputs):
        prompt = echo_text(o, decode) if req.echo else ""
        for c in o.outputs:
            shown = None if req.echo_only else c
            choices.append({
                "index": i * req.n + c.index, "text": prompt + (shown.text if shown is not None else ""),
                "logprobs": (completion_logprobs(shown, echo=o if req.echo else None, decode=decode,
                                                 as_ids=bool(req.return_tokens_as_token_ids))
                             if req.logprobs is not None else None),
                "finish_reason": FINISH_REASONS.get(c.finish_reason), "stop_reason": c.stop_reason,
                **({"prompt_logprobs": prompt_logprobs(o)} if o.prompt_logprobs is not None else {}),
                **({"prompt_token_ids": list(o.prompt_token_ids),
                    "token_ids": [] if req.echo_only else list(c.token_ids)} if req.return_token_ids else {})})
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outputs, echo_only=req.echo_only)}


def chat_message(c: CompletionOutput, tool_calls: dict | None, role: str = "assistant",
                 reasoning: ReasoningStream | None = None) -> tuple[dict, str | None]:
    """A choice's ``message`` and ``finish_reason``; with ``tool_calls`` (``ToolCallStream``'s
    arguments) the calls found in its text, as the streamed deltas give them; with ``reasoning``
    (the choice's splitter) its thinking as ``reasoning``, the rest as its content (vLLM's)."""
    reason = FINISH_REASONS.get(c.finish_reason)
    thought, text = reasoning.feed(c.text, True) if reasoning is not None else (None, c.text)
    if tool_calls is None:
        message = {"role": role, "content": text if reasoning is None else text or None}
        if reasoning is not None:
            message["reasoning"] = thought or None
        return message, reason
    stream = ToolCallStream(**tool_calls)
    update = stream.feed(text, True)
    message = {"role": role, "content": update.content or None}
    if reasoning is not None:
        message["reasoning"] = thought or None
    if stream.calls:
        message["tool_calls"] = [call.as_dict() for call in stream.calls]
    return message, stream.finish_reason(reason)


def chat_response(request_id: str, model: str, out: RequestOutput, req: ChatCompletionRequest,
                  tool_calls: dict | None = None, reasoning: ReasoningParser | None = None) -> dict:
    choices = []
    for c in out.outputs:
        split = reasoning.stream(out.prompt_token_ids) if reasoning is not None else None
        message, reason = chat_message(c, tool_calls, req.reply_role(), split)
        if not req.include_reasoning and "reasoning" in message:
            message["reasoning"] = None
        if echo := req.echoed():
            message["content"] = echo + (message["content"] or "")
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c, req.top_logprobs or 0, as_ids=bool(req.return_tokens_as_token_ids))
                        if req.logprobs else None,
                        "finish_reason": reason, "stop_reason": c.stop_reason,
                        **({"token_ids": list(c.token_ids)} if req.return_token_ids else {})})
    body = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out])}
    if req.return_token_ids:
        body["prompt_token_ids"] = list(out.prompt_token_ids)
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(out)
    return body


def chunk(request_id: str, model: str, kind: Literal["completion", "chat"], choices: list[dict],
          usage_: dict[str, Any] | None = None) -> dict:
    obj = {"id": request_id, "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
           "created": int(time.time()), "model": model, "choices": choices}
    if usage_ is not None:
        obj["usage"] = usage_
    return obj
