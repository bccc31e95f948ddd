"""Iteration-level scheduling (continuous batching) with chunked prefill and preemption.

Every step, in this order, under a token budget (``max_num_batched_tokens``) and a
sequence limit (``max_num_seqs``):

1. Running requests, oldest first, get their next tokens: one per decoding sequence,
   or the next chunk of a prompt still being prefilled. A request that needs a block
   when none is free preempts the most recently admitted request (possibly itself).
2. Swapped-out requests come back when their blocks fit (swap mode).
3. Waiting requests are admitted first come, first served, while blocks (above the
   watermark) and budget remain. Nothing new is admitted in a step that preempted or
   while swapped requests wait, so preempted work is not starved (no thrashing).

Preemption frees every block of a request: ``"recompute"`` puts it back at the head of
the waiting queue (its prompt and output are prefilled again later); ``"swap"`` first
copies its blocks to the host pool, and falls back to recompute when that is full.

A request is the unit of scheduling and preemption, so the samples of ``n > 1`` and the
beams of beam search always advance together. No jax here.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from jaxpaged.block_manager import BlockManager
from jaxpaged.sequence import Request, RequestStatus, Sequence


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens)
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """This chunk reaches the end of the sequence, so the step samples its next token."""
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


@dataclasses.dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    # Block moves to apply before the model runs, in this order (a block freed by one may
    # be the target of a later one): ("copy", src, dst) copy-on-write on the device,
    # ("out", device, host) swap-out, ("in", host, device) swap-in.
    block_ops: list[tuple[str, int, int]]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str = "recompute"):
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={preemption_mode!r}; choose 'recompute' or 'swap'")
        if preemption_mode == "swap" and not block_manager.num_host_blocks:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (bytes of host memory for KV blocks)")
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.swapped: collections.deque[Request] = collections.deque()
        self.num_preemptions = 0
        self.num_swapped_out_blocks = 0  # total over the run

    # ---- queues ---------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.bm.check_fits(len(req.prompt_token_ids))  # never-fits is an error now, not a wait
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def free_seq(self, seq: Sequence) -> None:
        if seq.seq_id in self.bm:
            self.bm.free(seq.seq_id)

    def finish(self, req: Request) -> None:
        """Retire a request (finished or aborted) and free its blocks at once."""
        for q in (self.running, self.waiting, self.swapped):
            if req in q:
                q.remove(req)
        for s in req.seqs:
            self.free_seq(s)
        req.status = RequestStatus.FINISHED

    # ---- the decision ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [], [])
        budget = self.max_num_batched_tokens
        num_seqs = 0

        i = 0
        while i < len(self.running):
            req = self.running[i]
            need = sum(min(s.num_uncomputed_tokens, 1) for s in req.live_seqs())
            if budget < need:
                break  # budget spent; later requests wait one step (they keep their blocks)
            planned = self._plan(req, budget)
            if not self._reserve(req, planned, out):
                continue  # req itself was preempted; running[i] is the next one
            for seq, start, n in planned:
                out.scheduled.append(ScheduledSeq(seq, start, n))
                budget -= n
            num_seqs += len(planned)
            i += 1

        if self.preemption_mode == "swap" and not out.preempted:
            while self.swapped and budget > 0:
                req = self.swapped[0]
                seqs = req.live_seqs()
                if num_seqs + len(seqs) > self.max_num_seqs or budget < len(seqs):
                    break
                if not self._can_swap_in(seqs):
                    break
                self.swapped.popleft()
                for s in seqs:
                    out.block_ops += [("in", h, d) for h, d in self.bm.swap_in(s.seq_id)]
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                planned = self._plan(req, budget)
                if not self._reserve(req, planned, out):
                    break  # it was preempted again: wait for memory instead of looping
                for seq, start, n in planned:
                    out.scheduled.append(ScheduledSeq(seq, start, n))
                    budget -= n
                num_seqs += len(planned)

        if not out.preempted and not self.swapped:
            while self.waiting and budget > 0:
                req = self.waiting[0]
                seqs = req.live_seqs()
                if num_seqs + len(seqs) > self.max_num_seqs:
                    break
                admitted = self._admit(req, budget)
                if admitted is None:
                    break
                self.waiting.popleft()
                req.status = RequestStatus.RUNNING
                if req.metrics.first_scheduled_time is None:
                    req.metrics.first_scheduled_time = time.monotonic()
                self.running.append(req)
                for seq, start, n in admitted:
                    out.scheduled.append(ScheduledSeq(seq, start, n))
                    budget -= n
                num_seqs += len(admitted)
        return out

    def _plan(self, req: Request, budget: int) -> list[tuple[Sequence, int, int]]:
        """Next tokens of each live sequence: a decode token or a prefill chunk in the budget."""
        plan = []
        for s in req.live_seqs():
            n = min(s.num_uncomputed_tokens, budget)
            if n <= 0:
                break
            plan.append((s, s.num_computed_tokens, n))
            budget -= n
        return plan

    def _reserve(self, req: Request, planned, out: SchedulerOutput) -> bool:
        """Reserve slots for ``planned``, preempting newer requests; False if ``req`` itself was."""
        for seq, start, n in planned:
            extra = start + n - self.bm.num_tokens(seq.seq_id)
            while extra > 0 and not self.bm.can_append_slots(seq.seq_id, extra):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    return False
            if extra > 0:
                out.block_ops += [("copy", a, b) for a, b in self.bm.append_slots(seq.seq_id, extra)]
        return True

    def _admit(self, req: Request, budget: int) -> list[tuple[Sequence, int, int]] | None:
        """Allocate every live sequence of a waiting request, or none of them."""
        salt = self._salt(req)
        done: list[tuple[Sequence, int, int]] = []
        for s in req.live_seqs():
            if budget <= 0 or not self.bm.can_allocate(s.token_ids, cache_salt=salt, num_new_tokens=budget):
                for seq, _, _ in done:
                    self.bm.free(seq.seq_id)
                    seq.num_computed_tokens = 0
                return None
            cached = self.bm.allocate(s.seq_id, s.token_ids, cache_salt=salt, num_new_tokens=budget)
            s.num_computed_tokens = cached
            if s.index == 0 and s.num_output_tokens == 0:
                req.num_cached_tokens = cached
            n = self.bm.num_tokens(s.seq_id) - cached
            done.append((s, cached, n))
            budget -= n
        return done

    @staticmethod
    def _salt(req: Request) -> str | None:
        # Prompt logprobs need every prompt position computed, so such requests never hit
        # the prefix cache (as in vLLM V1): a salt of their own isolates them.
        if req.params.prompt_logprobs is not None:
            return f"{req.params.cache_salt or ''}\x00prompt-logprobs:{req.request_id}"
        return req.params.cache_salt

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.num_preemptions += 1
        req.metrics.num_preemptions += 1
        out.preempted.append(req)
        seqs = req.live_seqs()
        out.scheduled = [s for s in out.scheduled if s.seq.request is not req]
        if self.preemption_mode == "swap" and self._fits_host(seqs):
            for s in seqs:
                pairs = self.bm.swap_out(s.seq_id)
                self.num_swapped_out_blocks += len(pairs)
                out.block_ops += [("out", d, h) for d, h in pairs]
            req.status = RequestStatus.SWAPPED
            self.swapped.append(req)
            return
        for s in seqs:
            self.bm.free(s.seq_id)
            s.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _can_swap_in(self, seqs: list[Sequence]) -> bool:
        """All of a request's sequences together fit (checking each alone is not enough)."""
        bs = self.bm.block_size
        need = sum(-(-self.bm.num_tokens(s.seq_id) // bs) for s in seqs)
        reserve = self.bm.watermark_blocks if self.running else 0
        return self.bm.num_allocatable_blocks - need >= reserve

    def _fits_host(self, seqs: list[Sequence]) -> bool:
        need = sum(len(self.bm.block_table(s.seq_id)) for s in seqs)
        return need <= self.bm.num_free_host_blocks
