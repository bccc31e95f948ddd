"""Beam search over the paged pool: candidate selection on the host, beams as forked sequences.

Each step every live beam returns its top ``2 * width`` raw log-probabilities (the
global top ``2 * width`` candidates are always among them). Selection follows Hugging
Face ``generate(num_beams=width, do_sample=False)`` with its default
``early_stopping=False``:

- candidates are ranked by cumulative log-probability; the best ``width`` that do not
  stop become the next beams;
- a candidate that stops (EOS, a stop token, or the length limit) and ranks within the
  first ``width`` becomes a finished hypothesis scored ``logprob / generated_len ** length_penalty``;
  the ``width`` best hypotheses are kept;
- the search ends when every candidate stops, or when the best running beam, scored at
  its current length, can no longer beat the worst kept hypothesis.

New beams reuse their parent's sequence when they are its first child and fork it
(sharing every block; copy-on-write on the partial last block) otherwise; parents with
no child are freed at once.
"""

from __future__ import annotations

import dataclasses

from jaxpaged.sequence import Sequence


@dataclasses.dataclass
class Hypothesis:
    token_ids: list[int]  # prompt + output
    cumulative_logprob: float
    score: float


@dataclasses.dataclass
class Candidate:
    parent: Sequence
    token: int
    cumulative_logprob: float
    stops: bool = False


class BeamState:
    """Finished hypotheses and the early-stop flag of one beam-search request."""

    def __init__(self, width: int, length_penalty: float):
        self.width = width
        self.length_penalty = length_penalty
        self.hypotheses: list[Hypothesis] = []
        self.improvable = True

    def score(self, cumulative_logprob: float, generated_len: int) -> float:
        return cumulative_logprob / (generated_len ** self.length_penalty)

    def select(self, beams: list[tuple[Sequence, list[int], list[float]]], stops, num_prompt_tokens: int):
        """Rank the continuations of every beam; return (next beams' candidates, done).

        Args:
          beams: (sequence, top token ids, their raw logprobs) of every live beam.
          stops: ``stops(sequence, token) -> bool`` whether appending ``token`` ends it.
        """
        cands = [Candidate(seq, t, seq.cumulative_logprob + lp)
                 for seq, ids, lps in beams for t, lp in zip(ids, lps)]
        cands.sort(key=lambda c: -c.cumulative_logprob)
        cands = cands[:2 * self.width]
        for c in cands:
            c.stops = stops(c.parent, c.token)
        generated = beams[0][0].num_output_tokens + 1
        if self.improvable:
            for c in cands[:self.width]:
                if c.stops:
                    self.hypotheses.append(Hypothesis(c.parent.token_ids + [c.token], c.cumulative_logprob,
                                                      self.score(c.cumulative_logprob, generated)))
            self.hypotheses.sort(key=lambda h: -h.score)
            del self.hypotheses[self.width:]
        running = [c for c in cands if not c.stops][:self.width]
        if running and len(self.hypotheses) == self.width:
            best = self.score(running[0].cumulative_logprob, generated)
            self.improvable = best > self.hypotheses[-1].score
        return running, not running or not self.improvable
