"""Per-request sampling parameters, with vLLM's names, defaults and validation rules.

Pure Python: the engine validates requests here before anything reaches a device.
``__post_init__`` normalises the loose input forms vLLM accepts (``stop="x"`` becomes
``["x"]``, ``stop_token_ids=None`` becomes ``[]``, ``logprobs=True`` becomes ``1``) and
raises ``ValueError`` for an out-of-range value or ``TypeError`` for a wrong type, in a
message that names the field, the value and what is allowed.

Greedy requests (``temperature < 1e-5``) have ``top_p``, ``top_k`` and ``min_p`` reset to
their neutral values, as vLLM does, since truncating the distribution cannot change an
argmax. Beam search follows vLLM's original rule: it is deterministic, so it takes
``temperature=0`` and leaves ``top_p`` / ``top_k`` / ``min_p`` at their defaults.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jaxpaged.structured_output import StructuredOutputsParams, as_structured_outputs

SAMPLING_EPS = 1e-5  # temperatures below this mean greedy (vLLM's _SAMPLING_EPS)
_FLOAT32_MAX = 3.4028234663852886e38  # biases are added to float32 logits: beyond this they become inf
_FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32
MAX_LOGPROBS = 20  # cap on logprobs / prompt_logprobs (vLLM's default max_logprobs)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample the completion of one request (vLLM's ``SamplingParams``).

    Args:
        n: number of completions to return for the prompt.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: keep the smallest set of most likely tokens whose probability mass reaches
            ``top_p``; 1 disables.
        top_k: keep the ``top_k`` most likely tokens; -1 (or 0, as vLLM takes it) disables.
        min_p: drop tokens whose probability is below ``min_p`` times the most likely
            token's; 0 disables.
        repetition_penalty: divides positive (multiplies negative) logits of tokens seen in
            the prompt or the output so far (> 1 discourages repetition); 1 disables.
        presence_penalty: subtracted from the logit of every token already in the output.
        frequency_penalty: subtracted once per occurrence of a token in the output.
        logit_bias: token id -> value added to that token's logit before sampling.
        allowed_token_ids: sample only these tokens (a mask on the logits); not with beam search.
        bad_words: words never to generate (vLLM's): a word's last token is masked wherever
            the output so far ends with the tokens before it (each word as written and, where
            that tokenizes differently, after a space); not with beam search.
        seed: seed of this request's random stream; ``None`` lets the engine pick one.
        stop: strings that end the completion when produced (not part of the output, unless
            ``include_stop_str_in_output``).
        stop_token_ids: token ids that end the completion (the token is kept).
        include_stop_str_in_output: the stop string that ended the completion stays at the end
            of its text (what came after it in the same token does not).
        ignore_eos: keep generating after the EOS token.
        max_tokens: most tokens to generate; ``None`` runs to the model's length limit.
        min_tokens: EOS and ``stop_token_ids`` cannot be sampled before this many tokens.
        logprobs: number of top log-probabilities to return per generated token (the
            sampled token's own log-probability is always returned); ``None`` for none.
        prompt_logprobs: the same for every prompt position.
        truncate_prompt_tokens: keep only the prompt's last this many tokens (left truncation);
            -1: as many as ``max_model_len`` leaves room for (one token to generate).
        use_beam_search: beam search instead of sampling.
        beam_width: beams kept per step; defaults to ``n`` under beam search.
        length_penalty: beam score is ``logprob_sum / length ** length_penalty``.
        cache_salt: isolates this request's prefix-cache entries from other salts.
        skip_special_tokens: drop special tokens when detokenizing.
        structured_outputs: a JSON schema, regex, choice list or grammar the output must match
            (:class:`StructuredOutputsParams`, or a dict of its fields); not with beam search.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    cache_salt: str | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._check_types()
        if self.structured_outputs is not None:
            object.__setattr__(self, "structured_outputs", as_structured_outputs(self.structured_outputs))
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if self.logprobs is True:
            set_("logprobs", 1)
        if self.prompt_logprobs is True:
            set_("prompt_logprobs", 1)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "length_penalty"):
            set_(name, float(getattr(self, name)))
        if self.top_k == 0:  # vLLM's other spelling of "every token"
            set_("top_k", -1)
        set_("stop", [] if self.stop is None else [self.stop] if isinstance(self.stop, str)
             else list(self.stop))
        set_("stop_token_ids", list(dict.fromkeys(self.stop_token_ids or ())))
        if self.allowed_token_ids is not None:
            set_("allowed_token_ids", [int(i) for i in dict.fromkeys(self.allowed_token_ids)])
        if self.bad_words is not None:
            set_("bad_words", list(dict.fromkeys(self.bad_words)))
        if self.logit_bias is not None:
            set_("logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})
        self._check_values()
        if self.use_beam_search:
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs cannot be used with use_beam_search=True (as in vLLM)")
            for name in ("allowed_token_ids", "bad_words"):
                if getattr(self, name):
                    raise ValueError(f"{name} cannot be used with use_beam_search=True (beams rank the "
                                     f"model's own log-probabilities)")
            self._check_beam_search()
            if self.beam_width is None:
                set_("beam_width", self.n)
        else:
            self._check_not_beam_search()
            if self.is_greedy:
                set_("top_p", 1.0)
                set_("top_k", -1)
                set_("min_p", 0.0)
                if self.n > 1:
                    raise ValueError(f"n must be 1 when using greedy sampling (temperature=0), "
                                     f"got n={self.n}")

    def _check_types(self) -> None:
        def need(name: str, ok: bool, what: str) -> None:
            if not ok:
                value = getattr(self, name)
                raise TypeError(f"{name} must be {what}, got {value!r} ({type(value).__name__})")

        for name in ("n", "top_k", "min_tokens"):
            need(name, _is_int(getattr(self, name)), "an int")
        for name in ("max_tokens", "seed", "beam_width"):
            need(name, getattr(self, name) is None or _is_int(getattr(self, name)), "an int or None")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(name, v is None or v is True or _is_int(v), "an int or None")
        need("truncate_prompt_tokens", self.truncate_prompt_tokens is None or _is_int(self.truncate_prompt_tokens),
             "an int or None")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            need(name, _is_real(getattr(self, name)), "a real number")
        for name in ("ignore_eos", "use_beam_search", "skip_special_tokens", "include_stop_str_in_output"):
            need(name, isinstance(getattr(self, name), bool), "a bool")
        need("cache_salt", self.cache_salt is None or isinstance(self.cache_salt, str), "a str or None")
        stop = self.stop
        need("stop", stop is None or isinstance(stop, str)
             or (isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop)),
             "a str, a list of str or None")
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            need(name, ids is None or (isinstance(ids, (list, tuple)) and all(_is_int(i) for i in ids)),
                 "a list of int or None")
        need("bad_words", self.bad_words is None or (isinstance(self.bad_words, (list, tuple))
                                                     and all(isinstance(w, str) for w in self.bad_words)),
             "a list of str or None")
        bias = self.logit_bias
        need("logit_bias", bias is None or isinstance(bias, dict), "a dict[int, float] or None")
        for k, v in (bias or {}).items():
            if not _is_int(k):
                raise TypeError(f"logit_bias keys must be int token ids, got {k!r} ({type(k).__name__})")
            if not _is_real(v):
                raise TypeError(f"logit_bias[{k}] must be a real number, got {v!r} ({type(v).__name__})")

    def _check_values(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "length_penalty"):
            need(math.isfinite(getattr(self, name)), f"{name} must be finite, got {getattr(self, name)}")
        need(self.n >= 1, f"n must be at least 1, got {self.n}")
        need(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}")
        need(self.temperature <= _FLOAT32_MAX, f"temperature must be a finite float32, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.top_k == -1 or self.top_k >= 1,
             f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(_FLOAT32_TINY <= self.repetition_penalty <= _FLOAT32_MAX,  # logits are divided or multiplied by it
             f"repetition_penalty must be a positive normal float32, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            need(-2.0 <= getattr(self, name) <= 2.0, f"{name} must be in [-2, 2], got {getattr(self, name)}")
        need(self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}")
        need(self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}")
        keep = self.truncate_prompt_tokens
        need(keep is None or keep == -1 or keep >= 1, f"truncate_prompt_tokens must be -1 or at least 1, got {keep}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            need(v is None or 0 <= v <= MAX_LOGPROBS, f"{name} must be in [0, {MAX_LOGPROBS}], got {v}")
        for k, v in self.logit_bias.items() if self.logit_bias else ():
            need(k >= 0, f"logit_bias keys must be non-negative token ids, got {k}")
            need(abs(v) <= _FLOAT32_MAX, f"logit_bias[{k}] must be a finite float32, got {v}")
        need(all(s for s in self.stop), f"stop cannot contain an empty string, got {self.stop!r}")
        need(all(i >= 0 for i in self.stop_token_ids),
             f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if self.allowed_token_ids is not None:
            need(bool(self.allowed_token_ids), "allowed_token_ids must not be empty (None allows every token)")
            need(all(i >= 0 for i in self.allowed_token_ids),
                 f"allowed_token_ids must be non-negative token ids, got {self.allowed_token_ids[:8]}")
        need(all(w.strip() for w in self.bad_words or ()), f"bad_words cannot contain an empty or blank word, "
                                                          f"got {self.bad_words!r}")
        need(self.cache_salt != "", "cache_salt must be a non-empty string or None, got ''")

    def _check_beam_search(self) -> None:
        for name, value, ok, allowed in (
            ("temperature", self.temperature, self.temperature < SAMPLING_EPS, "0"),
            ("top_p", self.top_p, self.top_p == 1.0, "1.0"),
            ("top_k", self.top_k, self.top_k == -1, "-1"),
            ("min_p", self.min_p, self.min_p == 0.0, "0.0"),
        ):
            if not ok:
                raise ValueError(f"{name} must be {allowed} when use_beam_search=True (beam search "
                                 f"is deterministic), got {name}={value}")
        if self.beam_width is not None and self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.beam_width is not None and self.beam_width < self.n:
            raise ValueError(f"beam_width must be at least n={self.n}, got {self.beam_width}")

    def _check_not_beam_search(self) -> None:
        if self.beam_width is not None:
            raise ValueError(f"beam_width is only used with use_beam_search=True, got {self.beam_width}")
        if self.length_penalty != 1.0:
            raise ValueError(f"length_penalty is only used with use_beam_search=True and must be 1.0 "
                             f"otherwise, got {self.length_penalty}")

    @property
    def is_greedy(self) -> bool:
        """True when tokens are picked by argmax rather than sampled."""
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """True when sampling depends on the tokens generated so far (repetition, presence or
        frequency penalty)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a stream holds back while the sequence runs: the end of the text that could
        still begin a stop string, which would cut the text before it (none when the stop
        string stays in the text)."""
        if self.include_stop_str_in_output or not self.stop:
            return 0
        return max(len(s) for s in self.stop) - 1

    @property
    def max_num_logprobs(self) -> int:
        """The most top log-probabilities this request asks for at any position (0 if none)."""
        return max(self.logprobs or 0, self.prompt_logprobs or 0)

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def clone(self) -> SamplingParams:
        """A copy that shares no mutable containers (``stop``, ``logit_bias``…) with this one."""
        return self.replace()


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's parameters of :meth:`jaxpaged.LLM.beam_search`: ``beam_width`` beams kept and
    returned, ``max_tokens`` new tokens at most, scores ``cumulative logprob / length **
    length_penalty``. ``temperature`` must be 0 (vLLM's default): jaxpaged's beams rank the
    model's own log-probabilities. Checked when made, as the ``SamplingParams`` they run as."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.beam_width):
            raise TypeError(f"beam_width must be an int, got {self.beam_width!r}")
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if _is_real(self.temperature) and self.temperature != 0:
            raise ValueError(f"temperature must be 0 for beam search (jaxpaged ranks the beams by the model's own "
                             f"log-probabilities), got {self.temperature}")
        self.sampling_params()

    def sampling_params(self) -> SamplingParams:
        """The same search as ``SamplingParams`` (``use_beam_search``), each token's top-``2 *
        beam_width`` logprobs kept (at most :data:`MAX_LOGPROBS`), as vLLM's sequences carry them."""
        width = self.beam_width
        return SamplingParams(n=width, use_beam_search=True, beam_width=width, max_tokens=self.max_tokens,
                              ignore_eos=self.ignore_eos, temperature=0.0, length_penalty=self.length_penalty,
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              logprobs=min(2 * width, MAX_LOGPROBS))
