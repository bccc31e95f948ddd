"""Host state of a request and of each of its sequences (samples or beams). No jax here."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import numpy as np

from jaxpaged.outputs import FinishReason, PositionLogprobs, RequestMetrics
from jaxpaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from jaxpaged.beam_search import BeamSearch
    from jaxpaged.detokenizer import Detokenizer
    from jaxpaged.structured_output import Matcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its blocks are in the host pool
    FINISHED = "finished"


_seq_ids = itertools.count()


class Sequence:
    """One stream of tokens: the prompt plus one sample's (or beam's) output.

    ``num_computed_tokens`` counts the positions whose K/V the device has written, or will
    have written once the steps already scheduled have run; the scheduler computes the rest.
    Preemption by recompute resets it to 0. ``num_pending`` counts tokens that scheduled
    steps sample and the host has not seen yet: with async scheduling the next step is
    scheduled before the previous one's tokens reach the host. Only the scheduler changes a sequence after it is
    created.
    """

    def __init__(self, request: Request, index: int, token_ids: list[int]):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_computed_tokens = 0
        self.num_pending = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list[PositionLogprobs] = []
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.finish_detail: str | None = None  # set when the engine, not the model, ended it
        self.detok: Detokenizer | None = None
        self.matcher: Matcher | None = None  # its structured output's grammar state
        # The grammar that starts once its reasoning ends (the request's grammar_after token).
        self.pending_matcher: Matcher | None = None
        self._array: np.ndarray | None = None  # token_ids mirrored as they grow (token_array)
        self._filled = 0  # how many of them the mirror holds

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens

    @property
    def structured(self) -> bool:
        """It has a structured output, started or waiting for its reasoning to end: its mask
        depends on the tokens before."""
        return self.matcher is not None or self.pending_matcher is not None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Tokens including the pending one: where the next step starts."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_array(self) -> np.ndarray:
        """``token_ids`` as an int32 array: a view of a buffer that copies only the tokens
        appended since the last call (the n-gram lookup reads it every step, and converting a
        list of thousands of tokens costs ~70 us)."""
        n, have = len(self.token_ids), self._filled
        if self._array is None or n > len(self._array):
            grown = np.empty(max(2 * n, 64), np.int32)
            if have:
                grown[:have] = self._array[:have]
            self._array = grown
        if n > have:
            self._array[have:n] = self.token_ids[have:n]
            self._filled = n
        return self._array[:n]

    def append(self, token: int, logprob: float, entry: PositionLogprobs | None, *, text: bool = True) -> str | None:
        """Append a sampled token; returns the stop string it completed, if any. ``text``:
        whether the token's text joins the output (not for a stop token id)."""
        self.token_ids.append(token)
        self.cumulative_logprob += logprob
        if entry is not None:
            self.logprobs.append(entry)
        return self.detok.add(token) if self.detok is not None and text else None

    def fork(self, index: int) -> Sequence:
        child = Sequence(self.request, index, list(self.token_ids))
        child.num_computed_tokens = self.num_computed_tokens
        child.num_pending = self.num_pending
        child.cumulative_logprob = self.cumulative_logprob
        child.logprobs = list(self.logprobs)
        child.detok = self.detok.fork() if self.detok is not None else None
        child.matcher = self.matcher.fork() if self.matcher is not None else None
        child.pending_matcher = self.pending_matcher.fork() if self.pending_matcher is not None else None
        return child


class Request:
    """A prompt with its sampling parameters and its live and finished sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, seed: int, beam: BeamSearch | None = None,
                 priority: int = 0):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.num_prompt_tokens = len(prompt_token_ids)  # read per sequence per step: not a property
        self.params = params
        self.seed = seed  # drawn by the engine when params.seed is None
        self.status = RequestStatus.WAITING
        self.priority = priority  # lower runs first (scheduling_policy="priority"); 0 under FCFS
        self.arrival_index = -1  # the order the scheduler got it in
        self.sort_key = (priority, -1)  # (priority, arrival_index): the scheduler's order of requests
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.num_cached_tokens = 0
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        # One sequence until the prompt is computed; then n samples or beam_width beams.
        self.seqs: list[Sequence] = [Sequence(self, 0, list(prompt_token_ids))]
        self.beam = beam  # beam search state: finished hypotheses; None when sampling
        # allowed_token_ids (and single-token bad_words, cleared) as a token bitmask (structured_output.allowed_bitmask)
        self.allowed_mask = None
        # A reasoning model's end-of-thinking token: its structured output's grammar starts after it
        # (a sequence's pending_matcher until then); None where the grammar starts at once.
        self.grammar_after: int | None = None
        # The bad_words of more than one token: (the tokens before the last, the last), the last masked
        # where the output ends with the others.
        self.bad_word_prefixes: list[tuple[tuple[int, ...], int]] = []
        self.aborted = False
        # Recomputing several live sequences after a preemption: the forks still to make, as
        # (position, parent, child) in order of position. A child holds no blocks until its
        # parent has computed ``position`` tokens (a block boundary); then it shares the
        # parent's blocks up to there (see ``Scheduler._admit``).
        self.pending_forks: list[tuple[int, Sequence, Sequence]] = []
        # An embedding request (jaxpaged.pooling): its prompt's last hidden state, set by the step
        # that computes it (the request then ends, its one sampled token unused).
        self.pooling = None  # PoolingParams
        self.hidden: np.ndarray | None = None
        self.lora = None  # its LoRA adapter (jaxpaged.lora.LoRAAdapter), or None: the base model

    @property
    def is_beam_search(self) -> bool:
        return self.beam is not None

    @property
    def samples_after_tokens(self) -> bool:
        """Whether sampling its next token reads the output so far: penalties count it, bad words of
        more than one token look at its end (so a pending token must reach the host first)."""
        return self.params.has_penalties or bool(self.bad_word_prefixes)

    @property
    def max_live_seqs(self) -> int:
        """Sequences this request may run at once: its beams, or its samples once forked."""
        if self.is_beam_search:
            return self.params.beam_width
        if self.params.n == 1:
            return 1
        return self.params.n if self.seqs[0].num_output_tokens == 0 else len(self.live_seqs())

    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    def running_seqs(self) -> list[Sequence]:
        """The live sequences that hold KV blocks and get scheduled: all of them, except
        children still waiting for their fork (``pending_forks``)."""
        if not self.pending_forks:
            return self.live_seqs()
        waiting = {id(c) for _, _, c in self.pending_forks}
        return [s for s in self.seqs if not s.finished and id(s) not in waiting]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
