"""Beam search on the host: a step's top-k continuations in, a keep/fork/drop/finish plan out.

Each step every live beam returns its top ``2 * width`` raw log-probabilities (the global
top ``2 * width`` candidates are always among them). Selection follows Hugging Face
``generate(num_beams=width, do_sample=False)`` with its default ``early_stopping=False``:

- candidates are ranked by cumulative log-probability; the best ``width`` that do not
  stop become the next beams;
- a candidate that stops (the stop rule of :mod:`jaxpaged.stopping`: EOS, a stop token, a
  stop string, the length limit) and ranks within the first ``width`` becomes a finished
  hypothesis scored ``logprob / generated_len ** length_penalty``; the ``width`` best
  hypotheses are kept;
- the search ends when every candidate stops, or when the best running beam, scored at
  its current length, can no longer beat the worst kept hypothesis.

The scheduler applies the plan: a parent's first continuation keeps the parent's own
sequence, further ones fork it (sharing every block; copy-on-write on the partial last
block), and parents with no continuation are freed. No jax here.
"""

from __future__ import annotations

import dataclasses
import math

from jaxpaged.outputs import FinishReason, PositionLogprobs
from jaxpaged.sequence import Sequence


@dataclasses.dataclass
class Candidate:
    parent: Sequence
    token: int
    logprob: float  # of the token under the parent's distribution
    cumulative_logprob: float  # the parent's plus ``logprob``
    entry: PositionLogprobs | None = None  # the logprobs to record for this position, if asked
    finish: tuple[FinishReason, int | str | None] | None = None  # set when appending the token ends it
    text: str = ""  # the parent's text plus the token's (none for a stop token id), cut before a stop string
    keeps_text: bool = True  # False for a stop token id or EOS: its text stays out of the output


@dataclasses.dataclass
class Hypothesis:
    token_ids: list[int]  # prompt + output
    cumulative_logprob: float
    score: float
    text: str
    logprobs: list[PositionLogprobs]
    finish_reason: FinishReason
    stop_reason: int | str | None
    finish_detail: str | None = None  # why the engine cut this beam short, if it did


@dataclasses.dataclass
class BeamPlan:
    keep: list[Candidate]  # continue in the parent's own sequence
    fork: list[Candidate]  # continue in a fork of the parent (made before the parent appends)
    drop: list[Sequence]  # parents with no continuation
    done: bool  # the search is over: free every beam

    @property
    def beams(self) -> list[Candidate]:
        return self.keep + self.fork


class BeamSearch:
    """Finished hypotheses and the early-stop flag of one beam-search request."""

    def __init__(self, width: int, length_penalty: float):
        self.width = width
        self.length_penalty = length_penalty
        self.hypotheses: list[Hypothesis] = []
        self.improvable = True

    def score(self, cumulative_logprob: float, generated_len: int) -> float:
        """``cumulative_logprob / generated_len ** length_penalty``, which never raises: the
        power's exponent is clamped inside the float range, so a huge ``length_penalty``
        (either sign) ranks as its limit instead of overflowing on the engine thread."""
        exponent = self.length_penalty * math.log(max(generated_len, 1))
        return cumulative_logprob / math.exp(min(max(exponent, -700.0), 700.0))

    def top_candidates(self, beams: list[tuple[Sequence, list[int], list[float]]]) -> list[Candidate]:
        """The best ``2 * width`` continuations of every live beam, best first.

        Args:
          beams: (sequence, its top token ids, their raw logprobs) of every live beam.
        """
        cands = [Candidate(seq, int(t), float(lp), seq.cumulative_logprob + float(lp))
                 for seq, ids, lps in beams for t, lp in zip(ids, lps)]
        cands.sort(key=lambda c: -c.cumulative_logprob)
        return cands[:2 * self.width]

    def plan(self, cands: list[Candidate], live: list[Sequence]) -> BeamPlan:
        """Select the next beams from ``top_candidates`` whose ``finish`` is set.

        Args:
          cands: the output of ``top_candidates``, with ``finish``, ``text`` and ``entry`` filled.
          live: the beams that produced them.
        """
        generated = live[0].num_output_tokens + 1
        if self.improvable:
            for c in cands[:self.width]:
                if c.finish is not None:
                    self.add(c.parent.token_ids + [c.token], c.cumulative_logprob, generated, c.text,
                             c.parent.logprobs + ([c.entry] if c.entry is not None else []), *c.finish)
        running = [c for c in cands if c.finish is None][:self.width]
        if running and len(self.hypotheses) == self.width:
            self.improvable = self.score(running[0].cumulative_logprob, generated) > self.hypotheses[-1].score
        if not running or not self.improvable:
            return BeamPlan([], [], list(live), True)
        keep, fork, parents = [], [], set()
        for c in running:
            (fork if id(c.parent) in parents else keep).append(c)
            parents.add(id(c.parent))
        return BeamPlan(keep, fork, [s for s in live if id(s) not in parents], False)

    def add(self, token_ids: list[int], cumulative_logprob: float, generated_len: int, text: str,
            logprobs: list[PositionLogprobs], finish_reason: FinishReason, stop_reason: int | str | None,
            finish_detail: str | None = None) -> None:
        """Add a finished hypothesis; keep the ``width`` best."""
        self.hypotheses.append(Hypothesis(token_ids, cumulative_logprob, self.score(cumulative_logprob, generated_len),
                                          text, logprobs, finish_reason, stop_reason, finish_detail))
        self.hypotheses.sort(key=lambda h: -h.score)
        del self.hypotheses[self.width:]
