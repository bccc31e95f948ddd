"""Iteration-level scheduling (continuous batching) and everything that changes after a step.

``schedule()`` decides a step under a token budget (``max_num_batched_tokens``) and a
sequence limit (``max_num_seqs``); ``update_from_output()`` applies what the step sampled.
The engine only moves data between the two and the runner. No jax here.

Requests are ordered by ``sort_key``: arrival (FCFS, the default), or with
``scheduling_policy="priority"`` their ``priority`` first (lower first), then arrival. A step
walks the running and the queued (waiting or preempted) requests in that order:

1. A running request gets its next tokens: one per decoding sequence, or the next chunk of
   a prompt (or of a recomputation). The sequences of one request advance to a common
   position, so samples and beams always sample in the same step. A request that needs a
   block (or, with the contiguous allocator, a region for its forks) when none is free
   preempts the last running request in that order, possibly itself.
   With ``speculative_config``, a decoding sequence's token comes with its n-gram drafts
   (:mod:`jaxpaged.spec_decode`), in the budget and only in slots the pool has to spare.
2. A queued request resumes at its place in the walk (under FCFS, after every running
   one): a swapped request when its blocks (and this step's chunk) fit, a waiting one when
   it can be admitted above the watermark; with the contiguous allocator, a request yet to
   fork also waits for its forks' regions. While it does not fit, it preempts the running
   requests after it, last first (only under priority scheduling are there any). It waits
   in a step that preempted a request no worse than it (under FCFS: in any step that
   preempted), and the first that waits stops the queue for the step. With LoRA
   (``max_loras``), a queued request whose adapter would make one more than ``max_loras``
   among the running requests is passed over instead (vLLM's rule): the walk goes on to the
   next queued request, which may start before it; it waits until a running request of
   another adapter ends.

Preemption frees every block of a request: ``"recompute"`` sends it back to the waiting
queue (its prompt and output are prefilled again later, and hit the prefix cache if it
is on); ``"swap"`` first copies its blocks to the host pool, and falls back to recompute
when that is full. Either way a request's samples or beams keep sharing the blocks they
shared: swapped, they go out and come back together; recomputed, their common prefix is
computed once and each forks from it at the last whole block they share
(``Request.pending_forks``), then takes the prefix cache's blocks of its own tokens. So the
pool a request needs does not grow with its preemptions.

Guarantees (``tests/test_engine_traffic.py`` checks them under random traffic):

- **Order.** A request is only preempted for a better one (FCFS: an older one), and while
  a preempted request waits, every running request is better than it. Under FCFS every
  running request arrived before every waiting or preempted one, so the oldest running
  request is never preempted. Under priority scheduling a request that arrives with a
  better priority than running ones preempts them when it does not fit beside them (vLLM
  V1 only preempts for running requests; its V0 did this too). The one exception to both:
  a request passed over for its LoRA adapter waits while later requests run.
- **Progress.** Every step either advances the best running request, or finishes a
  request. A request that cannot fit the pool even alone (its sequences outgrew it; never
  one that fits it alone on the same engine) is finished: its live sequences with
  ``finish_reason="length"`` and a ``finish_detail`` saying why (samples and beam
  hypotheses that finished before keep their own reason), and a warning is logged; the
  engine goes on. Nothing raises out of a step because of traffic. (A request readmitted one
  token short of its ``max_tokens`` is asked no room for a token past it, so one that held the
  whole pool comes back.)
- **Bounded preemption.** Since only better requests preempt it, a request is preempted
  at most once per block (or region) its betters allocate while it runs; once it is the
  best, never again (under priority scheduling, a better one may still arrive).
- **Sequence limit.** ``max_num_seqs`` counts every sequence, forks included: a request
  holds ``n`` (or ``beam_width``) sequence slots from admission until it forks, then one
  per live sample (every beam slot while beams run).

Async scheduling (``EngineCore(async_scheduling=True)``) calls ``schedule()`` for step N+1
before step N's ``update_from_output``: a scheduled chunk counts as computed as soon as it
is decided, and a sampled token as pending (``Sequence.num_pending``) until its update. A
request whose pending token this step would need on the host sits the step out (see
``_waits_for_tokens``), as does one that would be cut for capacity; the progress guarantee
holds for every step scheduled with nothing in flight.

After a step (``update_from_output``): register the computed blocks for prefix caching, record prompt
logprobs, keep each sequence's drafts up to the first one sampled otherwise, append each
sampled token, apply the stop rule (:func:`~jaxpaged.stopping.check_stop`),
fork ``n > 1`` samples at their first token and beams as the beam plan says (fork copies
travel in the next step's block ops), free finished sequences and retire finished
requests.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Container
from typing import Any, Protocol

import numpy as np

from jaxpaged.allocator import KVAllocator
from jaxpaged.outputs import FinishReason, Logprob
from jaxpaged.sequence import Request, RequestStatus, Sequence
from jaxpaged.spec_decode import SpeculativeConfig
from jaxpaged.stopping import check_stop, is_stop_token

log = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")


def _enqueue(queue: list[Request] | collections.deque[Request], req: Request) -> None:
    """Put ``req`` in ``queue`` (kept in ``sort_key`` order) at its place."""
    if not queue or queue[-1].sort_key < req.sort_key:
        queue.append(req)  # under FCFS, a new request; and a running one admitted
    else:  # under FCFS, a preempted request (the worst running one): before every queued one
        queue.insert(bisect.bisect(queue, req.sort_key, key=lambda r: r.sort_key), req)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens)
    num_new_tokens: int
    num_samples: int = 0  # rows this chunk samples: 0 (mid-prompt), 1, or n (the first token of n > 1)
    block_table: list[int] = dataclasses.field(default_factory=list)  # set once the step is decided
    num_slots: int = 0  # positions with a reserved slot, set with the block table
    # Speculative decoding: draft tokens that follow the sequence's last token in this chunk
    # (counted in num_new_tokens), each sampled at its position besides the last token's row.
    draft: list[int] = dataclasses.field(default_factory=list)
    # With a structured output: its matcher after each draft (the grammar's state at the next row).
    draft_matchers: list = dataclasses.field(default_factory=list)

    @property
    def samples(self) -> bool:
        return self.num_samples > 0

    @property
    def num_rows(self) -> int:
        """Sampling rows of this chunk: ``num_samples``, and one per draft."""
        return self.num_samples + len(self.draft)

    @property
    def input_ids(self) -> list[int]:
        """The chunk's tokens the host knows: the sequence's, then the drafts."""
        return self.seq.token_ids[self.start:self.start + self.num_new_tokens - len(self.draft)] + self.draft


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    # Block moves to apply before the model runs, in this order (a block freed by one may
    # be the target of a later one): ("copy", src, dst) copy-on-write or fork copies on the
    # device, ("out", device, host) swap-out, ("in", host, device) swap-in.
    block_ops: list[tuple[str, int, int]]
    preempted: list[Request]
    finished: list[Request]  # finished while scheduling (cannot fit the pool even alone)
    # A sampling row may speculate in the next step, which then needs its token on the host.
    speculates: bool = False

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def can_overlap(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host:
        not when a row forks (the first token of ``n > 1``) or ranks beams, whose new
        sequences only exist once the host has seen the tokens, nor when a sequence has
        drafts or may propose some next (``speculates``): where its next step starts depends
        on how many are accepted, and its drafts follow the token it samples. A row with a
        structured output does not stop it: the next step's forward may run ahead, its
        sampler waits for this step's tokens (:attr:`samples_structured`)."""
        return not self.speculates and not any(s.num_samples > 1 or s.seq.request.is_beam_search or s.draft
                                               for s in self.scheduled)

    @property
    def samples_structured(self) -> bool:
        """A row with a structured output samples: its mask follows the grammar's state, so with
        a runner that cannot wait to sample, the next step is not scheduled ahead of this one's
        tokens."""
        return any(s.num_samples and s.seq.structured for s in self.scheduled)

    @property
    def sampler_waits(self) -> bool:
        """A row samples whose sampler needs a token still pending from the step before (read
        right after ``schedule``): a structured output's mask follows it, penalties count it, bad
        words look at it.
        Such a step's sampler is launched once that step is applied."""
        # schedule() counts the row's own sample as pending: one more is the step before's.
        return any(s.num_samples and s.seq.num_pending > 1 and (s.seq.structured
                                                                or s.seq.request.samples_after_tokens)
                   for s in self.scheduled)


class SampledRows(Protocol):
    """What a step sampled, ``num_rows`` rows per scheduled sequence, in order."""

    tokens: np.ndarray  # [R] int
    logprobs: np.ndarray  # [R] float: of the sampled token, under the raw distribution
    ranks: np.ndarray  # [R] int: 1 = the most likely token
    top_ids: np.ndarray  # [R, K] int: the K most likely tokens, best first
    top_logprobs: np.ndarray  # [R, K] float


@dataclasses.dataclass
class PromptLogprobs:
    """Logprobs of prompt positions ``start + 1 .. start + count`` of one request's prompt."""

    request: Request
    start: int
    logprobs: np.ndarray  # [count]
    ranks: np.ndarray  # [count]
    top_ids: np.ndarray  # [count, K]
    top_logprobs: np.ndarray  # [count, K]


@dataclasses.dataclass
class RunnerOutput:
    sampled: SampledRows | None  # None when nothing sampled
    prompt_logprobs: list[PromptLogprobs] = dataclasses.field(default_factory=list)
    hidden: np.ndarray | None = None  # [rows, D]: each sampling row's hidden state, where embeddings sampled


class Scheduler:
    def __init__(self, kv: KVAllocator, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 eos_ids: tuple[int, ...] = (), preemption_mode: str = "recompute",
                 speculative_config: SpeculativeConfig | None = None, scheduling_policy: str = "fcfs",
                 max_loras: int | None = None):
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={scheduling_policy!r}; choose from {SCHEDULING_POLICIES}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={preemption_mode!r}; choose 'recompute' or 'swap'")
        if preemption_mode == "swap" and not kv.num_host_blocks:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (bytes of host memory for KV blocks)")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.preemption_mode = preemption_mode
        self.scheduling_policy = scheduling_policy
        self.speculative_config = speculative_config
        self.max_loras = max_loras  # most LoRA adapters among the running requests (None: no LoRA)
        # A penalised request sits a step out while its last token is on the device (async
        # scheduling); the engine core turns this off when its runner can wait to sample.
        self.penalties_wait = True
        # Each queue in sort_key order (arrival under FCFS).
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: collections.deque[Request] = collections.deque()
        self._arrivals = itertools.count()
        self._pending_ops: list[tuple[str, int, int]] = []  # fork copies for the next step
        self._forks = 0  # forks this step's samples will make (contiguous regions to keep)
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0  # total over the run
        self.num_dropped_tokens = 0  # sampled for sequences that had finished meanwhile (async scheduling)
        # Speculative decoding, totals over the run: chunks with drafts, drafts, drafts accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- requests -------------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, params, priority: int = 0) -> None:
        """Raise ``ValueError`` for a request that could never run here, before it is queued."""
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' (this engine's is "
                             f"{self.scheduling_policy!r})")
        name, num_seqs = ("beam_width", params.beam_width) if params.use_beam_search else ("n", params.n)
        # All of a request's sequences advance in the same step: each needs a slot and a token.
        for limit, value in (("max_num_seqs", self.max_num_seqs), ("max_num_batched_tokens",
                                                                   self.max_num_batched_tokens)):
            if num_seqs > value:
                raise ValueError(f"the request runs {name}={num_seqs} sequences; {limit} is {value}")
        self.kv.check_fits(num_prompt_tokens, num_seqs)

    def add(self, req: Request) -> None:
        self.check_request(len(req.prompt_token_ids), req.params, req.priority)
        req.arrival_index = next(self._arrivals)
        req.sort_key = (req.priority, req.arrival_index)
        _enqueue(self.waiting, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, req: Request) -> None:
        """Retire a request now; its blocks are freed and it produces no further output."""
        for s in req.live_seqs():
            s.finish_reason = "abort"
        req.aborted = True
        self._finish(req)

    # ---- deciding a step ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], self._pending_ops, [], [])
        self._pending_ops, self._forks = [], 0
        budget = self.max_num_batched_tokens
        # Running and queued requests in one walk, best first (under FCFS every running request
        # comes before every queued one). A running request preempts the worst running one
        # (running[-1]); a queued one, the running ones worse than itself: never one already
        # walked past, whose chunk this step holds.
        i, admitting, running_done = 0, True, False
        passed_over: set[int] = set()  # queued requests whose LoRA adapter would be one too many now
        while True:
            runs = not running_done and i < len(self.running)
            head = self._head(passed_over) if admitting else None
            if head is not None and (not runs or head.sort_key < self.running[i].sort_key):
                if not self._adapter_fits(head):  # (vLLM's rule: later requests may start meanwhile)
                    passed_over.add(id(head))
                    continue
                used = self._resume(head, out, budget)
                if used is None:
                    admitting = False  # the first that does not fit stops the queue
                elif not head.finished:  # (finished: it can never fit)
                    budget -= used
                    i += 1  # it runs at i, its place in the walk
                continue
            if not runs:
                break
            req = self.running[i]
            if req.pending_forks and not (forked := self._refork(req, out)):
                i += forked is None
                continue  # req was preempted or finished; running[i] is the next one
            live = req.running_seqs()
            if budget < len(live):
                running_done = True  # budget spent; later requests wait one step (they keep their blocks)
                continue
            if self._waits_for_tokens(req, live):
                i += 1
                continue
            plan = self._plan(req, live, budget)
            reserved = self._reserve(req, plan, out)
            if reserved is None:  # it would be cut, but a token it sampled is still pending
                i += 1
                continue
            if not reserved:
                continue  # req was preempted or finished; running[i] is the next one
            first = len(out.scheduled)
            budget -= self._add(out, req, plan)
            if self.speculative_config is not None:
                for s in out.scheduled[first:]:  # each of the request's sequences
                    budget -= self._speculate(s, budget, out)
            i += 1
        out.speculates = self.speculative_config is not None and any(map(self._may_speculate, out.scheduled))
        for s in out.scheduled:
            s.block_table = self.kv.block_table(s.seq.seq_id)
            s.num_slots = self.kv.num_tokens(s.seq.seq_id)
            # Computed as far as the host is concerned: the step is decided and runs before
            # any later one, so the next schedule() may start where this one ends (drafts
            # included, until update_from_output learns how many were accepted).
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
            if s.samples:
                s.seq.num_pending += 1  # 2 while the step before this one is still running
        return out

    def _head(self, passed_over: Container[int] = ()) -> Request | None:
        """The best queued request: the first of the swapped or the waiting queue, but for those
        ``passed_over`` (by ``id``)."""
        swapped = next((r for r in self.swapped if id(r) not in passed_over), None)
        waiting = next((r for r in self.waiting if id(r) not in passed_over), None)
        if swapped is not None and (waiting is None or swapped.sort_key < waiting.sort_key):
            return swapped
        return waiting

    def _adapter_fits(self, req: Request) -> bool:
        """Whether ``req`` may run beside the running requests: its LoRA adapter (if any) is one of
        theirs, or they use fewer than ``max_loras`` (the device's slots, jaxpaged.lora)."""
        if req.lora is None or self.max_loras is None:
            return True
        ids = {r.lora.id for r in self.running if r.lora is not None}
        return req.lora.id in ids or len(ids) < self.max_loras

    def _speculate(self, s: ScheduledSeq, budget: int, out: SchedulerOutput) -> int:
        """Give the chunk ``s`` just planned its drafts (see :mod:`jaxpaged.spec_decode`), if its
        request may speculate; returns the budget they take."""
        seq, req, spec = s.seq, s.seq.request, self.speculative_config
        p = req.params
        if not self._may_speculate(s) or s.num_new_tokens != 1 or seq.num_pending:
            return 0
        # Every position computed stays below max_model_len, and every token gained within max_tokens.
        limit = min(budget, self.max_model_len - len(seq.token_ids) - 1)
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - seq.num_output_tokens - 1)
        draft = spec.propose(seq.token_array(), limit) if limit > 0 else []
        matchers = []
        if seq.matcher is not None:  # drafts only as far as the grammar takes them
            m = seq.matcher
            for t in draft:
                m = m.fork()
                if not m.advance(t):
                    break
                matchers.append(m)
            del draft[len(matchers):]
        elif seq.pending_matcher is not None and req.grammar_after in draft:  # no draft past the reasoning's end:
            del draft[draft.index(req.grammar_after):]                        # the grammar masks what follows it
        # Only slots the pool has to spare: drafts never preempt, nor take the blocks running
        # sequences grow into (the watermark admission keeps free for them).
        bs = self.kv.block_size
        while draft:
            extra = s.start + 1 + len(draft) - self.kv.num_tokens(seq.seq_id)  # slots beyond those reserved
            spare = self.kv.num_allocatable_blocks - (-(-extra // bs) + 1) >= self.kv.watermark_blocks
            if extra <= 0 or (spare and self.kv.can_append_slots(seq.seq_id, extra)):
                break
            draft.pop()
        if not draft:
            return 0
        if extra > 0:
            out.block_ops += [("copy", a, b) for a, b in self.kv.append_slots(seq.seq_id, extra)]
        s.draft, s.draft_matchers = draft, matchers[:len(draft)]
        s.num_new_tokens += len(draft)
        return len(draft)

    def _may_speculate(self, s: ScheduledSeq) -> bool:
        """Whether the chunk ``s`` samples one row for a request that speculates (any but beam
        search) while the batch is small enough."""
        spec, req = self.speculative_config, s.seq.request
        return (spec is not None and s.num_samples == 1 and not req.is_beam_search
                and (spec.disable_by_batch_size is None or len(self.running) < spec.disable_by_batch_size))

    def _waits_for_tokens(self, req: Request, live: list[Sequence]) -> bool:
        """Whether ``req`` sits this step out because a token it sampled is still on the device
        (async scheduling) and this step would need it on the host: to fork samples or rank
        beams, to count it in penalties or match it against bad words (unless the step's sampler
        may wait for it: ``penalties_wait`` off), or because it ends ``req`` by length anyway."""
        if not any(s.num_pending for s in live):
            return False
        p = req.params
        if req.is_beam_search or (p.n > 1 and live[0].num_output_tokens == 0) or (req.samples_after_tokens
                                                                                 and self.penalties_wait):
            return True
        return any(s.num_tokens >= self.max_model_len or
                   (p.max_tokens is not None and s.num_output_tokens + s.num_pending >= p.max_tokens) for s in live)

    @staticmethod
    def _plan(req: Request, live: list[Sequence], budget: int) -> list[tuple[Sequence, int, int]]:
        """Next tokens of ``req``'s running sequences ``live``, within an even share of ``budget``:
        all of them up to a common end where they must stop together (the position of the next
        pending fork; for beam search the next token, since one beam step ranks every beam's
        candidates), or else each up to its own next token to sample (a request's samples differ
        in length where drafts were accepted)."""
        share = budget // len(live)
        if req.pending_forks or req.is_beam_search:
            stop = req.pending_forks[0][0] if req.pending_forks else live[0].num_tokens
            end = min(stop, min(s.num_computed_tokens for s in live) + share)
            return [(s, s.num_computed_tokens, end - s.num_computed_tokens) for s in live
                    if end > s.num_computed_tokens]
        return [(s, s.num_computed_tokens, min(s.num_tokens, s.num_computed_tokens + share) - s.num_computed_tokens)
                for s in live if s.num_tokens > s.num_computed_tokens and share > 0]

    def _num_forks(self, req: Request, plan=None) -> int:
        """Forks ``req``'s samples make when ``plan`` runs (if its chunk reaches a token to
        sample); with no plan, every fork it has yet to make, pending recompute forks included."""
        if req.params.n == 1 and not req.is_beam_search:
            return 0
        if plan is None:
            return req.max_live_seqs - len(req.live_seqs()) + len(req.pending_forks)
        if not any(start + n == seq.num_tokens for seq, start, n in plan):
            return 0
        return req.max_live_seqs - len(req.live_seqs())

    def _add(self, out: SchedulerOutput, req: Request, plan) -> int:
        fan_out = req.params.n if not req.is_beam_search and req.seqs[0].num_output_tokens == 0 else 1
        for seq, start, n in plan:
            out.scheduled.append(ScheduledSeq(seq, start, n, fan_out if start + n == seq.num_tokens else 0))
        return sum(n for _, _, n in plan)

    def _reserve(self, req: Request, plan, out: SchedulerOutput) -> bool | None:
        """Reserve slots (and fork room) for ``plan``, preempting worse requests; False if
        ``req`` itself was preempted or finished instead, None if it must first learn its
        pending tokens (see ``_make_room``)."""
        for seq, start, n in plan:
            extra = start + n - self.kv.num_tokens(seq.seq_id)
            while extra > 0 and not self.kv.can_append_slots(seq.seq_id, extra):
                if not (made := self._make_room(req, out)):
                    return made
            if extra > 0:
                out.block_ops += [("copy", a, b) for a, b in self.kv.append_slots(seq.seq_id, extra)]
        forks = self._num_forks(req, plan)
        while forks and not self.kv.can_fork(self._forks + forks):
            if not (made := self._make_room(req, out)):
                return made
        self._forks += forks
        return True

    def _refork(self, req: Request, out: SchedulerOutput) -> bool | None:
        """Make the pending forks whose parent has computed their position (its K/V there is
        written, or will be by the steps already scheduled): each child shares the parent's
        blocks up to there and takes prefix-cache hits for its own tokens after them. False if
        ``req`` was preempted or finished instead, None if nothing was done (see ``_make_room``)."""
        while self._fork_due(req):
            while not self.kv.can_fork(self._forks + 1):
                if not (made := self._make_room(req, out)):
                    return made
            self._fork_next(req, out)
        return True

    @staticmethod
    def _fork_due(req: Request) -> bool:
        return bool(req.pending_forks) and req.pending_forks[0][1].num_computed_tokens >= req.pending_forks[0][0]

    def _fork_next(self, req: Request, out: SchedulerOutput, *, cache_hits: bool = True) -> None:
        at, parent, child = req.pending_forks.pop(0)
        # Without cache hits: its tokens up to the fork position only (hits would take free blocks).
        tokens = child.token_ids if cache_hits else child.token_ids[:at + 1]
        child.num_computed_tokens, copies = self.kv.fork_prefix(parent.seq_id, child.seq_id, at, tokens)
        out.block_ops += [("copy", a, b) for a, b in copies]

    def _make_room(self, req: Request, out: SchedulerOutput) -> bool | None:
        """Preempt the worst running request (the last). When that is ``req`` alone, nothing else holds
        memory: it can never fit, so finish it. False when ``req`` is gone either way; None
        (nothing done) when it would be finished while a token it sampled is still on the
        device (async scheduling): the cut waits a step, so it keeps every sampled token."""
        victim = self.running[-1]
        if victim is req and len(self.running) == 1:
            if any(s.num_pending for s in req.live_seqs()):
                return None
            live = req.live_seqs()
            self._finish_for_capacity(req, out, f"its {len(live)} sequence(s) of {len(live[0].token_ids)} tokens "
                                                f"outgrew the KV pool ({self.kv.num_usable_blocks} blocks of "
                                                f"{self.kv.block_size} slots) with no other request running")
            return False
        self._preempt(victim, out)
        return victim is not req

    def _resume(self, req: Request, out: SchedulerOutput, budget: int) -> int | None:
        """Bring back ``req``, the best queued request (swapped or waiting), if it fits, first
        preempting the running requests worse than it (priority scheduling) while it does not;
        returns the tokens its chunk takes (0 if it was finished instead: it can never fit), or
        None if it waits, as it does in a step that preempted a request no worse than it (so a
        request never comes back in the step that preempted it, nor runs before a better one)."""
        if any(r.sort_key <= req.sort_key for r in out.preempted):
            return None
        while True:
            swapped = req.status is RequestStatus.SWAPPED
            if budget < len(req.running_seqs()):
                return None
            plan = None
            if sum(r.max_live_seqs for r in self.running) + req.max_live_seqs <= self.max_num_seqs:
                plan = self._swap_in(req, budget, out) if swapped else self._admit(req, budget, out)
            if plan is not None:
                break
            if req.finished:  # it can never fit: _admit finished it
                return 0
            if self.running and self.running[-1].sort_key > req.sort_key:
                self._preempt(self.running[-1], out)  # a worse request makes room for it
                continue
            if self.running or not swapped:
                return None  # wait for memory
            # Alone, and its copies still do not fit: recompute it instead (it stays the best).
            self.swapped.remove(req)
            self._free_for_recompute(req)
        (self.swapped if swapped else self.waiting).remove(req)
        req.status = RequestStatus.RUNNING
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
        _enqueue(self.running, req)
        return self._add(out, req, plan)

    def _swap_in(self, req: Request, budget: int, out: SchedulerOutput):
        """Swap ``req`` in with its next chunk's slots, or None if that does not fit now."""
        live = req.running_seqs()
        plan = self._plan(req, live, budget)
        ends = {seq.seq_id: start + n for seq, start, n in plan}
        ids = [s.seq_id for s in live]
        need = self.kv.swap_in_blocks(ids, [max(ends.get(i, 0) - self.kv.num_tokens(i), 0) for i in ids])
        reserve = self.kv.watermark_blocks if self.running else 0
        if self.kv.num_allocatable_blocks - need < reserve or not self.kv.can_fork(self._forks + self._num_forks(req)):
            return None
        out.block_ops += [("in", h, d) for h, d in self.kv.swap_in(*ids)]
        for seq, start, n in plan:
            extra = start + n - self.kv.num_tokens(seq.seq_id)
            if extra > 0:
                out.block_ops += [("copy", a, b) for a, b in self.kv.append_slots(seq.seq_id, extra)]
        self._forks += self._num_forks(req, plan)
        return plan

    def _admit(self, req: Request, budget: int, out: SchedulerOutput):
        """Allocate a waiting request and plan its first chunk, or None.

        A request preempted by recompute with several live sequences (samples, beams)
        recomputes what they share once: a sequence that shares whole blocks with an earlier
        one forks from it at the last such block boundary once that one has computed it
        (``pending_forks``), and takes prefix-cache hits for its own tokens after it; only
        the others are allocated now. So they share the blocks they shared before the
        preemption, and fit the pool as they did.
        """
        live = req.live_seqs()
        assert not any(s.num_pending for s in live), "admitted before its tokens reached the host"
        # One token short of max_tokens (readmitted after a preemption), it samples its last from
        # what it holds: it needs no slot past them, so it fits wherever it ran before.
        final = req.params.max_tokens is not None and live[0].num_output_tokens + 1 >= req.params.max_tokens
        try:
            self.kv.check_fits(len(live[0].token_ids), len(live), final=final)
        except ValueError as e:  # grown past the pool while it ran, then preempted
            self._finish_for_capacity(req, out, str(e))
            return None
        salt = self._salt(req)
        forks = self._fork_plan(live)
        # Sequences that share no whole block with an earlier one are allocated now, the others
        # fork later (pending_forks).
        roots = [live[0]] + [c for at, _, c in forks if at == 0]
        req.pending_forks = [f for f in forks if f[0] > 0]
        first_fork: dict[int, int] = {}
        for at, parent, _ in req.pending_forks:
            first_fork.setdefault(id(parent), at)
        chunk = budget // len(roots)
        allocated = []
        for s in roots:
            # Up to its first fork only, so that its first chunk leads there (its prefix hits stop
            # short of it): a plan with nothing to compute would make the step an empty one.
            tokens = s.token_ids[:first_fork.get(id(s), len(s.token_ids))]
            if not self.kv.can_allocate(tokens, cache_salt=salt, num_new_tokens=chunk, final=final):
                break
            s.num_computed_tokens = self.kv.allocate(s.seq_id, tokens, cache_salt=salt, num_new_tokens=chunk,
                                                     final=final)
            allocated.append(s)
        plan = self._plan(req, roots, budget) if len(allocated) == len(roots) else None
        # Room for every fork it has yet to make, not only this chunk's: admitted on its prompt's
        # region alone while older requests hold the rest (contiguous allocator), a request whose
        # first token comes in a later chunk would preempt itself there, recompute its prompt and
        # meet the same wall, once per step until they finish.
        if plan is None or not self.kv.can_fork(self._forks + self._num_forks(req)):
            for s in allocated:
                self.kv.free(s.seq_id)
                s.num_computed_tokens = 0
            req.pending_forks = []
            if not self.running:  # nothing else holds memory: it will never fit
                self._finish_for_capacity(req, out, f"its {len(live)} sequence(s) of {len(live[0].token_ids)} "
                                                    f"tokens do not fit the KV pool ({self.kv.num_usable_blocks} "
                                                    f"blocks of {self.kv.block_size} slots) even alone")
            return None
        self._forks += self._num_forks(req, plan)
        if live[0].num_output_tokens == 0 and req.metrics.num_preemptions == 0:  # (later, its own blocks hit)
            req.num_cached_tokens = live[0].num_computed_tokens
        return plan

    def _fork_plan(self, live: list[Sequence]) -> list[tuple[int, Sequence, Sequence]]:
        """The forks that rebuild several live sequences from the first: each forks from the
        earliest one it shares its longest prefix with, at the last block boundary before they
        part (and before its last token, which it computes itself to sample its next): the
        blocks they shared before. In order of position: a parent's own fork is never later
        than its children's."""
        bs, forks = self.kv.block_size, []
        for i, seq in enumerate(live[1:], 1):
            shared = [_common_prefix(seq.token_ids, p.token_ids) for p in live[:i]]
            j = shared.index(max(shared))
            at = min(shared[j], len(seq.token_ids) - 1, len(live[j].token_ids) - 1) // bs * bs
            forks.append((at, live[j], seq))
        return sorted(forks, key=lambda f: f[0])  # stable: a parent before its children at one position

    @staticmethod
    def _salt(req: Request) -> str | None:
        # Prompt logprobs need every prompt position computed, so such requests never hit
        # the prefix cache (as in vLLM V1): a salt of their own isolates them.
        # A LoRA adapter's K/V differs from the base model's: its prefixes are its own.
        salt = req.params.cache_salt
        if req.lora is not None:
            salt = f"{salt or ''}\x00lora:{req.lora.id}:{req.lora.request.lora_path}"
        if req.params.prompt_logprobs is not None:
            return f"{salt or ''}\x00prompt-logprobs:{req.request_id}"
        return salt

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.num_preemptions += 1
        req.metrics.num_preemptions += 1
        out.preempted.append(req)
        out.scheduled = [s for s in out.scheduled if s.seq.request is not req]
        if self.preemption_mode == "swap":
            # Forks it would have made this step first (they only share blocks): swapped back
            # in at its fork position with them unmade, it would have nothing to compute.
            while self._fork_due(req):
                self._fork_next(req, out, cache_hits=False)
        ids = [s.seq_id for s in req.running_seqs()]
        if self.preemption_mode == "swap" and self.kv.can_swap_out(*ids):  # blocks they share stay shared
            pairs = self.kv.swap_out(*ids)
            self.num_swapped_out_blocks += len(pairs)
            out.block_ops += [("out", d, h) for d, h in pairs]
            req.status = RequestStatus.SWAPPED
            _enqueue(self.swapped, req)
            return
        self._free_for_recompute(req)

    def _free_for_recompute(self, req: Request) -> None:
        for s in req.running_seqs():
            self.kv.free(s.seq_id)
        for s in req.live_seqs():
            s.num_computed_tokens = 0
        req.pending_forks = []
        req.status = RequestStatus.WAITING
        _enqueue(self.waiting, req)

    def _finish_for_capacity(self, req: Request, out: SchedulerOutput, why: str) -> None:
        detail = f"finished early: {why}"
        log.warning("request %s %s", req.request_id, detail)
        live = req.live_seqs()  # the ones the cut ends; samples that finished before keep their reason
        for s in live:
            s.finish_reason, s.finish_detail = "length", detail
        if req.beam is not None:  # the beams so far compete with the finished hypotheses
            for s in live:
                req.beam.add(list(s.token_ids), s.cumulative_logprob, max(s.num_output_tokens, 1),
                             s.detok.text if s.detok is not None else "", list(s.logprobs), "length", None,
                             detail)
        out.preempted = [r for r in out.preempted if r is not req]
        out.finished.append(req)
        self._finish(req)

    def _finish(self, req: Request) -> None:
        """Retire a request: out of every queue, every block freed."""
        for q in (self.running, self.waiting, self.swapped):
            if req in q:
                q.remove(req)
        for s in req.seqs:
            if s.seq_id in self.kv:
                self.kv.free(s.seq_id)
        req.status = RequestStatus.FINISHED
        req.metrics.finished_time = time.monotonic()

    # ---- applying a step's results --------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply what the step computed and sampled; returns the requests it changed.

        With async scheduling the next step has been scheduled already: a request may have
        been aborted, finished or preempted since ``out`` was decided. The tokens of finished
        ones are dropped (the one extra token a finished sequence may get); preempted ones
        keep theirs.
        """
        # A request preempted while deciding ``out`` may have finished since, and one ``out``
        # finished (cut) may have been aborted since: an aborted request shows nothing more
        # (async scheduling).
        touched = {r.request_id: r for r in [*out.preempted, *out.finished]
                   if not r.aborted and (r in out.finished or not r.finished)}
        for s in out.scheduled:
            seq, req = s.seq, s.seq.request
            if seq.finished:
                continue
            touched[req.request_id] = req
            if req.status is RequestStatus.RUNNING:  # its blocks are on the device
                # Only positions whose token the host knows can be hashed for the prefix cache.
                self.kv.mark_computed(seq.seq_id, min(seq.num_computed_tokens, len(seq.token_ids)), seq.token_ids)
        for chunk in result.prompt_logprobs:
            if not chunk.request.finished:
                self._record_prompt_logprobs(chunk)
        row = 0
        now = time.monotonic()
        sampled = result.sampled
        # Python scalars once for the whole step: numpy scalar reads cost ~100 ns each.
        tokens, logprobs, ranks = (x.tolist() for x in (sampled.tokens, sampled.logprobs, sampled.ranks)) \
            if sampled is not None else ((), (), ())
        for req, entries in itertools.groupby(out.scheduled, key=lambda s: s.seq.request):
            runs, forks = [], False  # each sequence and the rows it keeps
            for s in entries:
                if s.seq.finished:
                    self.num_dropped_tokens += s.num_rows
                    row += s.num_rows
                    continue
                kept = list(range(row, row + s.num_rows))
                if s.draft:  # one row per position: keep the drafts sampled there
                    accepted = 0
                    while accepted < len(s.draft) and tokens[row + accepted] == s.draft[accepted]:
                        accepted += 1
                    self.num_drafts += 1
                    self.num_draft_tokens += len(s.draft)
                    self.num_accepted_tokens += accepted
                    # K/V holds the last token and the accepted drafts; the rejected ones' slots are
                    # written again by the next step (they stay reserved).
                    s.seq.num_computed_tokens = s.start + 1 + accepted
                    kept = kept[:accepted + 1]
                    s.seq.num_pending += accepted  # _append counts one pending token off per token
                forks |= s.num_samples > 1  # the first token of n > 1: n rows of one sequence
                if kept:  # (none mid-prompt)
                    runs.append((s.seq, kept))
                row += s.num_rows
            if not runs:
                continue
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.is_beam_search:
                self._step_beams(req, [(seq, i) for seq, kept in runs for i in kept], sampled)
                continue
            if forks:
                (parent, kept), = runs
                req.seqs = [parent] + [self._fork(parent, k) for k in range(1, len(kept))]
                runs = [(seq, [i]) for seq, i in zip(req.seqs, kept)]
            for seq, kept in runs:
                for i in kept:
                    if seq.finished:  # a stop among the sequence's accepted drafts: the rest are dropped
                        seq.num_pending = 0
                        break
                    if req.pooling is not None:  # an embedding: its prompt's last hidden state; it ends here
                        req.hidden = result.hidden[i]
                    self._append(seq, tokens[i], logprobs[i],
                                 self._entry(req, sampled, i, tokens[i], ranks[i], logprobs[i]))
            if not req.live_seqs():
                self._finish(req)
        return list(touched.values())

    def _fork(self, parent: Sequence, index: int) -> Sequence:
        child = parent.fork(index)
        self._pending_ops += [("copy", a, b) for a, b in self.kv.fork(parent.seq_id, child.seq_id)]
        return child

    def _append(self, seq: Sequence, token: int, logprob: float, entry) -> None:
        """Append a sampled token to ``seq``; apply the stop rule; free the sequence if it ended."""
        seq.num_pending -= 1
        params = seq.request.params
        text = not is_stop_token(params, token, num_output_tokens=seq.num_output_tokens + 1, eos_ids=self.eos_ids)
        stop_string = seq.append(token, logprob, entry, text=text)
        stop = check_stop(params, token, num_output_tokens=seq.num_output_tokens,
                          num_tokens=len(seq.token_ids), stop_string=stop_string, eos_ids=self.eos_ids,
                          max_model_len=self.max_model_len)
        if stop is None and seq.matcher is not None:
            stop = self._advance_grammar(seq, token)
        elif seq.pending_matcher is not None and token == seq.request.grammar_after:  # the next token is the grammar's
            seq.matcher, seq.pending_matcher = seq.pending_matcher, None
        if stop is not None:
            seq.finish_reason, seq.stop_reason = stop
            if seq.seq_id in self.kv:  # not when preempted by recompute while its token was pending
                self.kv.free(seq.seq_id)

    def _advance_grammar(self, seq: Sequence, token: int) -> tuple[FinishReason, None] | None:
        """Feed ``token`` to the sequence's structured-output matcher: a stop once the grammar is
        complete and EOS cannot end the sequence (``ignore_eos``, or ``min_tokens`` not reached),
        or if the token broke the grammar (only a token outside the mask can: a bug)."""
        m = seq.matcher
        if not m.advance(token):
            seq.finish_detail = f"structured output: token {token} broke the grammar ({m.error})"
            return "stop", None
        params = seq.request.params
        if m.is_complete and (params.ignore_eos or not self.eos_ids  # min_tokens bans EOS as the sampler does
                               or seq.num_output_tokens < params.min_tokens):
            return "stop", None
        return None

    @staticmethod
    def _entry(req: Request, sampled: SampledRows, row: int, token: int, rank: int, logprob: float):
        """The logprobs recorded for one position: the token's own and the top ``params.logprobs``."""
        k = req.params.logprobs
        if k is None:
            return None
        entry = {token: Logprob(logprob, rank)}
        for r in range(k):
            entry.setdefault(int(sampled.top_ids[row, r]), Logprob(float(sampled.top_logprobs[row, r]), r + 1))
        return entry

    def _step_beams(self, req: Request, rows: list[tuple[Sequence, int]], sampled: SampledRows) -> None:
        beam, k = req.beam, 2 * req.beam.width
        # Every beam samples in the same step (_plan): one left out would be dropped unfreed.
        assert len(rows) == len(req.live_seqs()), f"request {req.request_id}: {len(rows)} of its beams sampled"
        for seq, _ in rows:
            seq.num_pending -= 1
        cands = beam.top_candidates([(seq, sampled.top_ids[i, :k].tolist(), sampled.top_logprobs[i, :k].tolist())
                                     for seq, i in rows])
        row_of = {id(seq): i for seq, i in rows}
        for c in cands:
            i = row_of[id(c.parent)]
            rank = sampled.top_ids[i, :k].tolist().index(c.token) + 1
            c.entry = self._entry(req, sampled, i, c.token, rank, c.logprob)
            detok = c.parent.detok.fork() if c.parent.detok is not None else None
            c.keeps_text = not is_stop_token(req.params, c.token, num_output_tokens=c.parent.num_output_tokens + 1,
                                             eos_ids=self.eos_ids)
            stop_string = detok.add(c.token) if detok is not None and c.keeps_text else None
            c.text = detok.text if detok is not None else ""
            c.finish = check_stop(req.params, c.token, num_output_tokens=c.parent.num_output_tokens + 1,
                                  num_tokens=len(c.parent.token_ids) + 1, stop_string=stop_string,
                                  eos_ids=self.eos_ids, max_model_len=self.max_model_len)
        plan = beam.plan(cands, [seq for seq, _ in rows])
        if plan.done:
            for seq, _ in rows:
                seq.finish_reason = "stop"
            self._finish(req)
            return
        for seq in plan.drop:  # first, so a contiguous region is free for the forks
            seq.finish_reason = "stop"
            self.kv.free(seq.seq_id)
        forks = [(self._fork(c.parent, 0), c) for c in plan.fork]  # from the parents as they are
        beams = [(c.parent, c) for c in plan.keep] + forks
        for j, (seq, c) in enumerate(beams):
            seq.index = j
            seq.append(c.token, c.logprob, c.entry, text=c.keeps_text)
        req.seqs = [seq for seq, _ in beams]

    def _record_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        req = chunk.request
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * req.num_prompt_tokens
        k = req.params.prompt_logprobs
        for j in range(len(chunk.logprobs)):
            target = req.prompt_token_ids[chunk.start + j + 1]
            entry: dict[int, Any] = {target: Logprob(float(chunk.logprobs[j]), int(chunk.ranks[j]))}
            for r in range(k):
                entry.setdefault(int(chunk.top_ids[j, r]), Logprob(float(chunk.top_logprobs[j, r]), r + 1))
            req.prompt_logprobs[chunk.start + j + 1] = entry
