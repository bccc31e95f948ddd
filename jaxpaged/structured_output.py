"""Structured outputs (vLLM's "guided decoding"): a grammar limits which tokens may come next.

A request's ``SamplingParams(structured_outputs=StructuredOutputsParams(...))`` names one of a
JSON schema, any JSON object, a regular expression, a list of choices, or a Lark / GBNF
grammar. `llguidance <https://github.com/guidance-ai/llguidance>`_ (one of vLLM's two
backends; the other, xgrammar, needs torch) compiles it against the model's tokenizer and
keeps a matcher per sequence:

1. in each step that samples a structured sequence, the host asks its matcher for the
   tokens the grammar allows next, as a bitmask of one bit per vocabulary entry
   (``[rows, ceil(vocab / 32)]`` int32, all ones for the other rows), while the step's
   forward runs (llguidance takes ~0.3 ms a row over SmolLM2's 49,152 tokens);
2. on the device the sampler sets every other token's logit to -inf (first, before
   ``logit_bias``, penalties and truncation: ``sampler.process_logits``), so greedy, seeded
   sampling and ``n > 1`` all pick among allowed tokens;
3. the scheduler feeds each sampled token to the sequence's matcher. Once the grammar is
   complete the mask allows only EOS, and the sequence ends on it as usual; where EOS
   cannot end it (``ignore_eos``, or fewer than ``min_tokens`` tokens), it ends there with
   ``finish_reason="stop"``. Where a grammar allows only stop ids that ``min_tokens`` still
   bans, the grammar wins.

The bitmask of step N+1 needs the token of step N: under async scheduling step N+1's
forward is launched while step N runs, its sampler once step N's tokens have reached the
grammars (``EngineCore.step``, ``SchedulerOutput.samples_structured``). A grammar is checked when the request is added, before any
work, and a bad one is refused with llguidance's message. Beam search takes no grammar (as in
vLLM). Samples forked from one prompt (``n > 1``) each get a copy of the matcher.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of

    Args:
      json: a JSON schema, as a dict or its JSON text.
      regex: a regular expression (Rust ``regex`` syntax) the whole output matches.
      choice: the output is one of these strings.
      grammar: a context-free grammar in Lark syntax (llguidance's dialect), or in GBNF
        (llama.cpp's; llguidance tells the two apart and converts it).
      json_object: True for any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
      disable_any_whitespace: JSON only: no whitespace between tokens (by default the JSON may
        hold any, as in vLLM).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {', '.join(_KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        kind = given[0]
        value = getattr(self, kind)
        ok = {"json": isinstance(value, (str, dict)), "regex": isinstance(value, str),
              "choice": isinstance(value, (list, tuple)) and all(isinstance(c, str) for c in value),
              "grammar": isinstance(value, str), "json_object": value is True}[kind]
        if not ok:
            what = {"json": "a dict or a str", "regex": "a str", "choice": "a list of str", "grammar": "a str",
                    "json_object": "True"}[kind]
            raise TypeError(f"structured_outputs.{kind} must be {what}, got {value!r:.80} ({type(value).__name__})")
        if kind == "regex" and (len(value) - len(value.rstrip("\\"))) % 2:
            # llguidance would drop it silently ("a\\" would match "a")
            raise ValueError(f"structured_outputs.regex ends in a lone backslash: {value!r:.80}")
        if kind == "choice":
            object.__setattr__(self, "choice", list(value))
            if not value or not all(value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                                 f"got {value!r:.80}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError(f"structured_outputs.disable_any_whitespace must be a bool, got "
                            f"{self.disable_any_whitespace!r}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def to_grammar(self) -> str:
        """llguidance's grammar text for this constraint (not checked yet: see ``Grammars.compile``).

        Raises:
          ValueError: JSON text that does not parse, or a GBNF grammar llguidance cannot convert.
        """
        import llguidance

        kind = self.kind
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"structured_outputs.json must be a JSON schema object, got {schema!r:.80}")
            options = {"whitespace_flexible": not self.disable_any_whitespace}
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not a valid constraint: {e}") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        try:  # Lark, or GBNF converted to Lark (llguidance tells them apart)
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:
            raise ValueError(f"structured_outputs.grammar: {e}") from None


def as_structured_outputs(value: Any) -> StructuredOutputsParams:
    """``StructuredOutputsParams`` from itself or a dict of its fields (``SamplingParams`` takes both)."""
    if isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        fields = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        if unknown := sorted(map(str, set(value) - fields)):
            raise ValueError(f"structured_outputs has unknown keys {unknown}; it takes {sorted(fields)}")
        return StructuredOutputsParams(**value)
    raise TypeError(f"structured_outputs must be StructuredOutputsParams, a dict of its fields or None, "
                    f"got {type(value).__name__}")


class Grammars:
    """One engine's link to llguidance: its tokenizer, built on first use (~0.3 s for
    SmolLM2's 49152 tokens), checks grammars and makes matchers.

    Args:
      tokenizer: the engine's Hugging Face fast tokenizer, or None (then every structured
        request is refused).
      vocab_size: the model's vocabulary (the bitmask's width; may exceed the tokenizer's).
      eos_ids: the model's end-of-sequence tokens: what a complete grammar allows next.
    """

    def __init__(self, tokenizer, *, vocab_size: int, eos_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = [int(t) for t in eos_ids]
        self._ll_tokenizer = None
        # The last params compiled and their grammar: a request is checked, then made (InputProcessor).
        self._last: tuple[StructuredOutputsParams, str] | None = None

    def _tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf

            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer; this model has none")
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=max(self.vocab_size, len(self.tokenizer)),
                    eos_token=self.eos_ids or None)
            except ValueError as e:  # a slow (Python) tokenizer
                raise ValueError(f"structured_outputs needs a fast tokenizer: {e}") from None
        return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar text of ``params``.

        Raises:
          ValueError: naming the field and what llguidance found wrong with it.
        """
        import llguidance

        if self._last is not None and self._last[0] is params:
            return self._last[1]
        grammar = params.to_grammar()
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer())
        if error:
            raise ValueError(f"structured_outputs.{params.kind} is not a valid constraint: {' '.join(error.split())}")
        self._last = params, grammar
        return grammar

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher of a grammar that ``compile`` returned."""
        import llguidance

        tok = self._tokenizer()
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        if m.is_error():  # compile checked it: a resource limit, at most
            raise ValueError(f"structured_outputs: {m.get_error()}")
        return Matcher(m, tok.vocab_size)


class Matcher:
    """One sequence's place in its grammar (an llguidance ``LLMatcher``), and the width of the
    masks it writes: its tokenizer's vocabulary, which may exceed the model's (test models
    with fewer embeddings than the tokenizer has tokens)."""

    def __init__(self, matcher, mask_vocab: int):
        self.matcher = matcher
        self.mask_vocab = mask_vocab

    def fork(self) -> Matcher:
        return Matcher(self.matcher.deep_copy(), self.mask_vocab)

    def advance(self, token: int) -> bool:
        """Take the sampled ``token``; False if the grammar does not allow it (then see ``error``)."""
        return self.matcher.consume_token(token)

    @property
    def is_complete(self) -> bool:
        """The grammar is complete: only EOS may follow."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """The first line of llguidance's message for a token the grammar did not take."""
        return (self.matcher.get_error() or "no message").split("\n", 1)[0]


_executor = None


def allowed_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """``[ceil(vocab_size / 32)]`` int32 with the bits of ``token_ids`` set, as
    :func:`token_bitmask` lays a row out (``SamplingParams.allowed_token_ids``)."""
    words = -(-vocab_size // 32)
    bits = np.zeros(words * 32, bool)
    bits[np.asarray(token_ids, np.int64)] = True
    return np.packbits(bits.reshape(words, 32), axis=1, bitorder="little").view("<i4").reshape(words)


def token_bitmask(matchers: Sequence[tuple[int, Matcher]], num_rows: int, vocab_size: int) -> np.ndarray:
    """``[num_rows, ceil(vocab_size / 32)]`` int32: bit ``t % 32`` of word ``t // 32`` of row ``i``
    is set when token ``t`` may come next; ``matchers`` gives ``(row, matcher)`` of the
    structured rows, every other row allows every token."""
    import llguidance
    import llguidance.numpy

    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = -(-vocab_size // 32)
    mask = np.full((num_rows, -(-max(vocab_size, *(m.mask_vocab for _, m in matchers)) // 32)), -1, np.int32)
    first: dict[int, tuple[int, Matcher]] = {}  # each matcher's first row: the samples of n > 1 share
    for i, m in matchers:                       # their parent's at the fork
        first.setdefault(id(m), (i, m))
    llguidance.numpy.fill_next_token_bitmask_par(_executor, [(m.matcher, i) for i, m in first.values()], mask)
    for i, m in matchers:
        if (j := first[id(m)][0]) != i:
            mask[i] = mask[j]
    return np.ascontiguousarray(mask[:, :words])
