"""Reasoning outputs, as vLLM serves them (``--reasoning-parser``). No jax here.

A reasoning model thinks between ``<think>`` and ``</think>`` before it answers. With a
reasoning parser the server returns the thinking as the reply's ``reasoning`` (chat
``message.reasoning``, streamed as ``delta.reasoning``; a ``reasoning`` item in the Responses
API) and the answer as its ``content``; tool parsers read the content only. vLLM names the
field ``reasoning`` (``reasoning_content`` before it).

``deepseek_r1`` (DeepSeek-R1 and its distillations, e.g. DeepSeek-R1-Distill-Llama-8B): the
reply is reasoning up to the first ``</think>`` and content after it; the first ``<think>``
before it is dropped (the R1 chat templates end the prompt with one, so the model seldom
writes it); a reply without ``</think>`` is all reasoning. A prompt that has ended reasoning
already (its last think tag is ``</think>``, as a template with thinking switched off writes
it) makes the reply all content.

``qwen3`` (Qwen3, and QwQ-style Qwen2.5 reasoning models): the same split. Qwen3's template
with ``enable_thinking: false`` (``chat_template_kwargs``) ends the prompt with an empty
``<think>\n\n</think>``, so that reply is all content, as in vLLM; vLLM's parser also ends
reasoning at a ``<tool_call>`` followed by ``<function=`` (Qwen3.5's XML tool calls, a tool
format jaxpaged does not parse).

A structured output, and so a named or required tool choice, constrains the content only: the
grammar starts after the ``</think>`` token (vLLM's default), so the model thinks freely first
(the engine's side: ``LLM(reasoning_parser=...)``, :class:`~jaxpaged.sequence.Sequence`'s
``pending_matcher``).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpaged.tool_calling import partial_suffix

REASONING_PARSERS = ("deepseek_r1", "qwen3")


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {name!r} is not one of {REASONING_PARSERS}")


class ReasoningParser:
    """A model's think tags: their text, and their token ids, which must be single tokens of the
    tokenizer (as in vLLM, the grammar's start is found by the end tag's id).

    Raises:
      ValueError: an unknown name, no tokenizer, or a tokenizer without the tags.
    """

    def __init__(self, name: str, tokenizer):
        check_reasoning_parser(name)
        if tokenizer is None:
            raise ValueError(f"reasoning_parser {name!r} needs the model's tokenizer; this model has none")
        self.name = name
        self.start, self.end = "<think>", "</think>"
        ids = []
        for tag in (self.start, self.end):
            found = tokenizer.encode(tag, add_special_tokens=False)
            if len(found) != 1:
                raise ValueError(f"reasoning_parser {name!r}: the tokenizer has no {tag} token (it reads {tag!r} "
                                 f"as {len(found)} tokens); is this a reasoning model?")
            ids.append(found[0])
        self.start_id, self.end_id = ids
        # Special tags would be left out of the text (skip_special_tokens); the server keeps them in.
        self.tags_special = bool({self.start, self.end} & set(tokenizer.all_special_tokens))

    def ended(self, token_ids: Sequence[int]) -> bool:
        """Whether reasoning is over at the end of ``token_ids``: their last think tag is the end."""
        for t in reversed(token_ids):
            if t == self.end_id:
                return True
            if t == self.start_id:
                return False
        return False

    def num_tokens(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int]) -> int:
        """How many of a reply's ``token_ids`` are its reasoning, the think tags included: those up
        to the first ``</think>``, all without one, none where the prompt ended reasoning."""
        if self.ended(prompt_token_ids):
            return 0
        return next((i + 1 for i, t in enumerate(token_ids) if t == self.end_id), len(token_ids))

    def stream(self, prompt_token_ids: Sequence[int] = ()) -> ReasoningStream:
        """A reply's splitter, the reply following ``prompt_token_ids``."""
        return ReasoningStream(self.start, self.end, ended=self.ended(prompt_token_ids))


class ReasoningStream:
    """A reply's text, fed as it grows (``feed(piece, finished)``), split into ``(reasoning,
    content)`` pieces; the pieces add up to the split of the whole text. Text that may be the
    start of a tag is held back until it is not (or the reply ends)."""

    def __init__(self, start: str = "<think>", end: str = "</think>", *, ended: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = not ended
        self.dropped_start = False  # the first <think> is gone
        self.pending = ""  # reasoning held back: it may begin a tag

    def feed(self, piece: str, finished: bool) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", piece
        self.pending += piece
        reasoning = ""
        while True:
            end = self.pending.find(self.end)
            start = -1 if self.dropped_start else self.pending.find(self.start)
            if start >= 0 and (end < 0 or start < end):
                reasoning += self.pending[:start]
                self.pending = self.pending[start + len(self.start):]
                self.dropped_start = True
                continue
            if end >= 0:
                reasoning += self.pending[:end]
                content, self.pending, self.in_reasoning = self.pending[end + len(self.end):], "", False
                return reasoning, content
            keep = 0 if finished else max(partial_suffix(self.pending, self.end),
                                          0 if self.dropped_start else partial_suffix(self.pending, self.start))
            reasoning += self.pending[:len(self.pending) - keep]
            self.pending = self.pending[len(self.pending) - keep:]
            return reasoning, ""
