"""Incremental detokenization and stop-string detection for one sequence.

Decoding only a short window of recent tokens keeps the cost per token constant. The
window starts a few tokens back (``prefix_offset``) because byte-level BPE tokens can
join into one character, and text is released only once it no longer ends in an
incomplete UTF-8 sequence (U+FFFD).
"""

from __future__ import annotations

import copy


def stream_end(text: str, sent: int, held: int, finished: bool) -> int:
    """How far a stream may send ``text`` (``sent`` characters out so far).

    While the sequence runs its last ``held`` characters are held back
    (``SamplingParams.output_text_buffer_length``: ``len(longest stop string) - 1``): they
    could still start a stop string, which would cut the text before it, and what was sent
    stays sent. Used by ``LLM.stream`` and the server's streams alike.
    """
    if finished:
        return len(text)
    return max(sent, len(text) - held)


class Detokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool, stop: list[str], min_tokens: int = 0,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def fork(self) -> Detokenizer:
        other = copy.copy(self)
        other.ids = list(self.ids)
        return other

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str | None:
        """Append a token; return the stop string it completed, if any.

        On a stop string the text is truncated before it (vLLM's default; after it with
        ``include_stop``); of several in the new text, at the earliest. Stop strings count only once ``min_tokens``
        tokens are out, as in ``check_stop``: a match before that neither truncates the
        text nor stops the sequence.
        """
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None
        new = full[len(prefix):]
        start = len(self.text)
        self.text += new
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        if len(self.ids) < self.min_tokens:
            return None
        # Only a match that ends in the new text: earlier text was already checked. The
        # earliest match wins (vLLM takes the first in the list that matches anywhere, which
        # can leave another stop string in the text).
        found = [(i, k) for k, s in enumerate(self.stop) if (i := self.text.find(s, max(0, start - len(s) + 1))) != -1]
        if not found:
            return None
        i, k = min(found)
        self.text = self.text[:i + len(self.stop[k]) if self.include_stop else i]
        return self.stop[k]
