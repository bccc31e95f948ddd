"""Input processing: a prompt and its sampling parameters become a validated ``Request``.

Everything a request can get wrong is caught here, before it is queued and before any
device work: the prompt's form and token ids, its length against ``max_model_len`` and
the pool, ``logit_bias`` ids, a structured output's grammar, more sequences (``n``,
``beam_width``) than one step can run, and a request id that is already live. No jax here.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Container, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxpaged.beam_search import BeamSearch
from jaxpaged.detokenizer import Detokenizer
from jaxpaged.lora import LoRARequest
from jaxpaged.pooling import PoolingParams
from jaxpaged.pooling import sampling_params as pooling_sampling_params
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import Request
from jaxpaged.structured_output import Grammars, allowed_bitmask

if TYPE_CHECKING:
    from jaxpaged.reasoning import ReasoningParser

PromptType = str | list[int] | dict[str, Any]


# vLLM's runner kinds: "auto" takes generation and embedding requests, the others one kind.
RUNNERS = ("auto", "generate", "pooling")


def is_one_prompt(prompts: PromptType | Sequence[PromptType]) -> bool:
    """Whether ``prompts`` is one prompt, not a list of them (a 2-D array is a batch of token-id rows)."""
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], (int, np.integer)))


def prompt_names(prompts: PromptType | Sequence[PromptType], what: str, one: str | None = None) -> list[str]:
    """Each prompt's name in errors: ``one`` (default ``what``) for one prompt, ``what[i]`` for the
    i-th of a list."""
    if is_one_prompt(prompts) or not isinstance(prompts, (Sequence, np.ndarray)):  # (not prompts: refused later)
        return [one or what]
    return [f"{what}[{i}]" for i in range(len(prompts))]


def pair_prompts(prompts: PromptType | Sequence[PromptType], sampling_params: SamplingParams
                 | Sequence[SamplingParams] | None) -> list[tuple[PromptType, SamplingParams]]:
    """One prompt or a list, with one ``SamplingParams`` for all or one each → pairs."""
    if is_one_prompt(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (Sequence, np.ndarray)) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    prompts = list(prompts)
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, SamplingParams):
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        return list(zip(prompts, sampling_params))
    return [(p, sampling_params) for p in prompts]  # (None: the engine's default, see InputProcessor)


def per_prompt_lora(lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                    num_prompts: int) -> list[LoRARequest | None]:
    """One LoRA request (or None) for every prompt, or a list of one each → one per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, (list, tuple)) or len(lora_request) != num_prompts:
        raise ValueError(f"lora_request must be a LoRARequest or a list of one per prompt ({num_prompts}), "
                         f"got {lora_request!r}")
    return list(lora_request)


def check_unicode(text: str, what: str) -> None:
    """A ValueError naming ``what`` for text that is not valid Unicode (a lone surrogate, which
    JSON can carry), where a tokenizer would raise an unhelpful TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {e.reason} at position {e.start}") from None


def check_strings(value: Any, where: str) -> None:
    """:func:`check_unicode` on every string (keys too) in JSON-like ``value``, named by their path."""
    if isinstance(value, str):
        check_unicode(value, where)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_strings(k, where)
            check_strings(v, f"{where}.{k}")
    elif isinstance(value, list):
        for k, v in enumerate(value):
            check_strings(v, f"{where}[{k}]")


def encode(tokenizer, text: str, *, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids, after :func:`check_unicode`."""
    check_unicode(text, "prompt")
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def _template_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as chat templates read them: each call's
    ``function.arguments`` (a JSON string in OpenAI's API) parsed into an object, as vLLM does."""
    if not isinstance(calls, list):
        raise TypeError(f"{where}.tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}.tool_calls[{k}] must be {{'function': {{'name': str, 'arguments': str}}, ...}}, "
                             f"got {call!r:.100}")
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise ValueError(f"{where}.tool_calls[{k}].function.arguments is not JSON: {e}") from None
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def chat_messages(conversation: Any, what: str = "messages") -> list[dict[str, Any]]:
    """A conversation checked for a chat template: a list of dicts, each with a str ``role``
    and a ``content`` that is a str, None or a list of OpenAI text parts (joined into one
    str, as vLLM does); an assistant's ``tool_calls`` get their arguments as objects. Errors
    name the message (``what[i]``)."""
    if not isinstance(conversation, list) or not conversation:
        got = repr(conversation) if isinstance(conversation, list) else type(conversation).__name__
        raise TypeError(f"{what} must be a non-empty list of message dicts, got {got}")
    out = []
    for i, m in enumerate(conversation):
        where = f"{what}[{i}]"
        if not isinstance(m, dict):
            raise TypeError(f"{where} must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"{where} needs a str 'role', got {m.get('role')!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for k, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"{where}.content[{k}]: only text parts "
                                     f"({{'type': 'text', 'text': str}}) are supported, got {part!r:.80}")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise TypeError(f"{where}.content must be a str or a list of text parts, got {type(content).__name__}")
        m = {**m, "content": content or ""}
        if m.get("tool_calls") is not None:
            m["tool_calls"] = _template_tool_calls(m["tool_calls"], where)
        for key, value in m.items():
            if isinstance(value, str):
                check_unicode(value, f"{where}.{key}")
        out.append(m)
    return out


class InputProcessor:
    """Tokenizes and validates prompts; hands out request ids and per-request seeds.

    Args:
      tokenizer: a Hugging Face tokenizer, or None (prompts must then be token ids).
      vocab_size: the model's vocabulary size.
      max_model_len: most tokens (prompt + output) per sequence.
      check_request: ``(num_prompt_tokens, params, priority)`` raising ``ValueError`` if the
        engine could never run such a request (the scheduler's ``check_request``).
      seed: seeds the seeds of requests that do not set one.
      eos_ids: the model's end-of-sequence tokens (what a complete structured output allows).
      default_params: a request's parameters when it gives none (the model's generation config's,
        see :mod:`jaxpaged.generation_config`).
      reasoning: the model's reasoning parser: a structured output's grammar starts once the
        reasoning ends (:mod:`jaxpaged.reasoning`).
      hidden_size: the model's; an embedding request's ``dimensions`` must not exceed it.
    """

    def __init__(self, tokenizer, *, vocab_size: int, max_model_len: int,
                 check_request: Callable[[int, SamplingParams, int], None], seed: int = 0,
                 eos_ids: Sequence[int] = (), default_params: SamplingParams | None = None,
                 reasoning: ReasoningParser | None = None, hidden_size: int | None = None):
        self.tokenizer = tokenizer
        self.hidden_size = hidden_size  # what an embedding's dimensions may be (None: any)
        self.no_pooling: str | None = None  # why this engine cannot run embedding requests, if it cannot
        self.lora = None  # the engine's LoRA adapters (jaxpaged.lora.LoRAManager); None: it serves none
        self.runner = "auto"  # the engine's (RUNNERS): which kinds of request it takes
        self.reasoning = reasoning
        self.default_params = SamplingParams() if default_params is None else default_params
        self.grammars = Grammars(tokenizer, vocab_size=vocab_size, eos_ids=eos_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.check_request = check_request
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()

    def to_token_ids(self, prompt: PromptType, what: str = "prompt") -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt: a str, a sequence of token ids, or a dict
        with ``"prompt"`` (text) or ``"prompt_token_ids"`` or both (the ids are used, the text
        goes to the output's ``prompt``, as in vLLM's ``TokensPrompt``). ``what``: the prompt's
        name in errors (in a batch, which one: ``prompts[3]``)."""
        if isinstance(prompt, dict):
            unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
            if unknown or not prompt:
                raise ValueError(f"{what}: a prompt dict takes 'prompt' and/or 'prompt_token_ids', got keys {unknown}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"{what} dict's 'prompt' must be a str, got {type(text).__name__}")
            if "prompt_token_ids" not in prompt:
                return self.to_token_ids(text, what)
            return text, self.check_token_ids(prompt["prompt_token_ids"], f"{what}'s 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{what} is empty")
            if self.tokenizer is None:
                raise ValueError(f"{what}: this model has no tokenizer; pass prompts as token ids")
            return prompt, encode(self.tokenizer, prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, self.check_token_ids(prompt, what)
        raise TypeError(f"{what} must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def check_token_ids(self, ids: Any, what: str) -> list[int]:
        """``ids`` as a list of ints, refused unless every one is an int (not a bool, float or
        str) inside the vocabulary."""
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
                raise TypeError(f"{what} must be a 1-D integer array, got {ids.ndim}-D {ids.dtype}")
            ids = ids.tolist()
        elif not isinstance(ids, (list, tuple)):
            raise TypeError(f"{what} must be a list of token ids, got {type(ids).__name__}")
        wrong = [t for t in ids if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
        if wrong:
            raise TypeError(f"{what} must hold int token ids, got {wrong[0]!r} ({type(wrong[0]).__name__})")
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError(f"{what} is empty (no token ids)")
        self._check_in_vocab(ids, f"{what} token ids")
        return ids

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """The token ids of ``params.bad_words``, as vLLM takes them: each word with its leading
        spaces stripped, and again after one space where that gives other tokens as many (a
        word in the middle of a text)."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer (the model was loaded without one)")
        out = []
        for i, word in enumerate(params.bad_words):
            check_unicode(word, f"bad_words[{i}]")
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if not bare or not spaced:
                raise ValueError(f"bad_words[{i}] {word!r} is no tokens")
            out.append(bare)
            if spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        self._check_in_vocab({t for w in out for t in w}, "bad_words token ids")
        return out

    def _check_in_vocab(self, ids, what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def check(self, prompt: PromptType, params: SamplingParams | None, priority: int = 0, what: str = "prompt"
              ) -> tuple[str | None, list[int], SamplingParams]:
        """``(text or None, token ids, params)`` of a request that the engine can run; no side
        effects (no request id or seed drawn), so a caller can check many before queuing any.

        Raises:
          ValueError, TypeError: naming what is wrong with the request.
        """
        return self._check(prompt, params, priority, what)[:3]

    def _check(self, prompt: PromptType, params: SamplingParams | None, priority: int, what: str):
        """:meth:`check`'s result, and the bad words' token ids (tokenized once a request)."""
        params = self.default_params if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.to_token_ids(prompt, what)
        if (keep := params.truncate_prompt_tokens) is not None:
            if keep > self.max_model_len:
                raise ValueError(f"truncate_prompt_tokens must be at most max_model_len={self.max_model_len} "
                                 f"(-1 keeps what leaves room to generate), got {keep}")
            keep = self.max_model_len - 1 if keep == -1 else keep
            if len(ids) > keep:  # the last tokens kept (vLLM's left truncation); the text is theirs
                ids = list(ids[len(ids) - keep:])
                text = None if text is None or self.tokenizer is None else self.tokenizer.decode(ids)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"{what} has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(the prompt plus at least one generated token must fit)")
        self._check_in_vocab(params.logit_bias or {}, "logit_bias token ids")
        self._check_in_vocab(params.stop_token_ids, "stop_token_ids")
        self._check_in_vocab(params.allowed_token_ids or (), "allowed_token_ids")
        bad_words = self.bad_words_token_ids(params)
        self.check_request(len(ids), params, priority)
        if params.structured_outputs is not None:
            self.grammars.compile(params.structured_outputs)
        return text, ids, params, bad_words

    def process(self, prompt: PromptType, params: SamplingParams | None, request_id: str | None,
                live: Container[str], priority: int = 0, pooling: PoolingParams | None = None,
                lora_request: LoRARequest | None = None, what: str = "prompt") -> Request:
        """A validated request (:meth:`check`), not queued yet.

        Args:
          live: ids in use; a user id among them is refused, an automatic id skips them.
          pooling: an embedding request's (:mod:`jaxpaged.pooling`; ``params`` are then its own).
          lora_request: its LoRA adapter (:mod:`jaxpaged.lora`), loaded and checked here.
          what: the prompt's name in errors (in a batch, which one: ``prompts[3]``).

        Raises:
          ValueError, TypeError: naming what is wrong with the request.
        """
        if (pooling is None and self.runner == "pooling") or (pooling is not None and self.runner == "generate"):
            kind, other = ("completions", "LLM.embed, /v1/embeddings") if pooling is None else \
                ("embeddings", "generate, chat, the completion endpoints")
            raise ValueError(f"this engine runs with runner={self.runner!r}: no {kind} (it serves {other} only)")
        if pooling is not None:
            if self.no_pooling is not None:
                raise ValueError(self.no_pooling)
            if not isinstance(pooling, PoolingParams):
                raise TypeError(f"pooling params must be PoolingParams, got {type(pooling).__name__}")
            pooling.verify(self.hidden_size)
            params = pooling_sampling_params(pooling)
        text, ids, params, bad_words = self._check(prompt, params, priority, what)
        lora = None
        if lora_request is not None:
            if self.lora is None:
                raise ValueError(f"lora_request {getattr(lora_request, 'lora_name', lora_request)!r}: this engine "
                                 f"serves no LoRA adapters (start it with enable_lora=True)")
            lora = self.lora.get(lora_request)
        if request_id is not None:
            request_id = str(request_id)
            if not request_id:
                raise ValueError("request id is empty")
            if request_id in live:
                raise ValueError(f"request id {request_id!r} is already in use")
        else:
            request_id = next(i for i in map(str, self._ids) if i not in live)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 1 << 63))
        beam = BeamSearch(params.beam_width, params.length_penalty) if params.use_beam_search else None
        req = Request(request_id, text, ids, params, time.monotonic(), seed, beam, int(priority))
        req.pooling, req.lora = pooling, lora
        if params.allowed_token_ids is not None:
            req.allowed_mask = allowed_bitmask(params.allowed_token_ids, self.vocab_size)
        if bad_words:
            banned = [w[0] for w in bad_words if len(w) == 1]  # banned everywhere: in the request's own mask
            if banned:
                if req.allowed_mask is None:
                    req.allowed_mask = allowed_bitmask(range(self.vocab_size), self.vocab_size)
                req.allowed_mask = req.allowed_mask & ~allowed_bitmask(banned, self.vocab_size)
            req.bad_word_prefixes = [(tuple(w[:-1]), w[-1]) for w in bad_words if len(w) > 1]
        if self.tokenizer is not None:
            req.seqs[0].detok = Detokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                            stop=params.stop, min_tokens=params.min_tokens,
                                            include_stop=params.include_stop_str_in_output)
        if params.structured_outputs is not None:
            matcher = self.grammars.matcher(self.grammars.compile(params.structured_outputs))
            if self.reasoning is not None and not self.reasoning.ended(ids):  # the grammar follows the thinking
                req.grammar_after, req.seqs[0].pending_matcher = self.reasoning.end_id, matcher
            else:
                req.seqs[0].matcher = matcher
        return req
