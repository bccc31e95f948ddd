"""Speculative decoding with n-gram (prompt lookup) drafts: vLLM's ``speculative_config={"method": "ngram"}``.

Each step, a decoding sequence whose last ``n`` tokens (``prompt_lookup_max`` down to
``prompt_lookup_min``) occurred earlier in its prompt or output proposes the up to
``num_speculative_tokens`` tokens that followed that occurrence (the latest one, of the
longest ``n``). The step computes the sequence's last token and the drafts after it, and
samples at every one of those positions: draft ``j`` is accepted while the token sampled
at its position equals it, and the sequence gains the accepted drafts plus the token sampled
after the last of them (the bonus token). No draft model: proposing costs the host a
vectorized search over the sequence's tokens (:func:`propose_ngram` over
``Sequence.token_array()``, which copies only the tokens new since the last step), ~5-6 us
a sequence of 200-4,000 tokens on a 2-vCPU AMD EPYC.

Sampling at each position exactly as a step without drafts would (a row's noise depends
only on its seed and output position, ``sampler.gumbel_noise``), then comparing, is
speculative sampling's rejection rule for a draft distribution that is a point mass: a
draft ``x`` is kept with probability ``p(x)``, and when it is not, the token drawn instead
follows ``p`` without ``x``. So outputs, greedy or seeded, are the tokens decoding one at a
time gives, up to float32 rounding between a one-token step and a several-token one.

Which requests speculate (the others decode as before, in the same steps): all but beam
search, each sample of ``n > 1`` on its own (the samples' lengths part where drafts are
kept; the scheduler plans each to its own next token), and only while decoding with its last
token known on the host. Penalties at a draft's position count the drafts before it as output tokens, as
decoding one at a time would have; a structured output's drafts stop where its grammar
refuses one, and each draft's row is masked by the grammar's state after the drafts before
it (a forked matcher). A
step with drafts is not overlapped with the next under async scheduling (the next needs
to know how many were accepted). Drafts never preempt: they take slots only where the pool
has room beyond its watermark, and never more than the step's token budget, the
sequence's ``max_tokens`` or ``max_model_len`` leave.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate (vLLM's ``speculative_config``; only ``method="ngram"``).

    Args:
      num_speculative_tokens: drafts proposed per sequence and step, at most.
      prompt_lookup_max, prompt_lookup_min: the longest and shortest suffix (in tokens)
        looked up earlier in the sequence. vLLM's defaults: 5 and 5 when neither is given,
        else the given one for both.
      disable_by_batch_size: no sequence speculates in a step while at least this many
        requests are running (None: always). A step with drafts computes several tokens
        for each drafting sequence, which pays while a batch is small.
    """

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not supported; choose from {METHODS} "
                             f"(jaxpaged has no draft models)")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            v = getattr(self, name)
            if v is None and name != "num_speculative_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"speculative_config {name} must be an int, got {v!r}")
            if v < 1:
                raise ValueError(f"speculative_config {name}={v} must be >= 1")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
        if lo > hi:
            raise ValueError(f"speculative_config prompt_lookup_min={lo} is more than prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def propose(self, token_ids: Sequence[int] | np.ndarray, max_drafts: int) -> list[int]:
        """The drafts to follow ``token_ids``, at most ``max_drafts`` of them (see :func:`propose_ngram`)."""
        return propose_ngram(token_ids, min(max_drafts, self.num_speculative_tokens), self.prompt_lookup_min,
                             self.prompt_lookup_max)


def as_speculative_config(value: SpeculativeConfig | Mapping | None) -> SpeculativeConfig | None:
    """``LLM(speculative_config=...)``: a :class:`SpeculativeConfig`, a dict of its fields
    (vLLM's form), or None."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"speculative_config must be a dict or a SpeculativeConfig, got {value!r}")
    fields = {f.name for f in dataclasses.fields(SpeculativeConfig)}
    if unknown := sorted(set(value) - fields):
        raise ValueError(f"speculative_config has unknown fields {unknown}; known: {sorted(fields)}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config needs num_speculative_tokens")
    return SpeculativeConfig(**value)


def propose_ngram(token_ids: Sequence[int] | np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``token_ids`` of ``n_min`` to ``n_max`` tokens; [] when no such suffix occurred before.

    Copied as LZ77 copies, with overlap: where fewer than ``k`` tokens follow the occurrence
    (a loop shorter than ``k``), the drafts go on repeating it."""
    num = len(token_ids)
    if k < 1 or num < n_min + 1:
        return []
    tokens = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids, np.int64)
    # Where earlier occurrences could end: positions before the last that hold the last token.
    # Each round keeps those whose match reaches one token further back.
    ends = np.flatnonzero(tokens[:num - 1] == tokens[num - 1])
    best = None  # (length, end) of the longest match so far, its latest occurrence
    n = 1
    while ends.size:
        best = (n, int(ends[-1]))
        if n == n_max:
            break
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[num - 1 - n]]
        n += 1
    if best is None or best[0] < n_min:
        return []
    start = best[1] + 1
    drafts = tokens[start:start + k].tolist()
    period = num - start  # > 0: the occurrence ends before the suffix
    while len(drafts) < k:
        drafts.append(drafts[len(drafts) - period])
    return drafts
