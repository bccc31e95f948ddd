"""The engine core: validated requests in, one step at a time, changed requests out. No jax here.

A step is ``scheduler.schedule()`` → ``runner.dispatch()`` → ``runner.collect()`` →
``scheduler.update_from_output()``. The core only moves data between the scheduler (which
owns every request's lifecycle) and a runner: the model runner, or any object that returns
sampled tokens for a ``SchedulerOutput`` (the benchmark scripts simulate memory and
concurrency with one that runs no model, the tests check paging with another).

With ``async_scheduling`` the host works while the device computes, as in vLLM V1's async
scheduling: each ``step()`` schedules and dispatches step N+1 while step N runs, then
collects step N and applies it. Step N+1 reads the tokens step N sampled on the device;
the scheduler learns them (and so stops) one step late and drops the one extra token a
finished sequence may get. Tokens are the synchronous loop's. A step whose rows fork
samples or rank beams is not overlapped: the next step needs the new sequences. Where the
next step's sampler needs this step's tokens (a structured output's mask follows them,
penalties count them), its forward is still launched ahead and its sampler once this step
is applied, with a runner that can wait to sample (``launch_sampler``); with one that cannot,
a step that samples a structured row is not overlapped and a penalised request sits a step out.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, Protocol

from jaxpaged.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from jaxpaged.sequence import Request


class Runner(Protocol):
    def dispatch(self, out: SchedulerOutput, prev: Any = None) -> Any:
        """Apply ``out.block_ops`` and start the scheduled chunks; a handle for ``collect``, or
        None when nothing is scheduled. ``prev``: the previous step's handle when it has not
        been collected (its rows hold the pending tokens this step reads). A runner that can
        wait to sample also takes ``defer_sampling=True``: the forward alone, its sampler
        launched by ``launch_sampler(handle)``."""

    def collect(self, step: Any) -> RunnerOutput:
        """Wait for a dispatched step: ``num_samples`` sampled rows per scheduled chunk."""


@dataclasses.dataclass
class _InFlight:
    out: SchedulerOutput
    handle: Any  # the runner's, None when nothing ran
    ahead: bool  # scheduled while the step before was still running
    sampler_waits: bool = False  # its sampler is launched once the step before is applied


@dataclasses.dataclass
class Timers:
    schedule: float = 0.0
    update: float = 0.0  # the runner times batch building and the device step itself


class EngineCore:
    """Steps a scheduler and a runner.

    Args:
      scheduler: owns the queues, the KV allocator and every change to a request.
      runner: executes scheduled steps.
      debug_checks: check the allocator's invariants after every step.
      async_scheduling: schedule and dispatch each step while the previous one runs.
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, *, debug_checks: bool = False,
                 async_scheduling: bool = False):
        self.scheduler = scheduler
        self.runner = runner
        self.debug_checks = debug_checks
        self.async_scheduling = async_scheduling
        self._inflight: _InFlight | None = None
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.num_steps = 0  # steps that ran the model
        self.num_steps_ahead = 0  # of which scheduled while the previous step ran (async scheduling)
        self.peak_kv_utilization = 0.0
        self.timers = Timers()
        self.last: SchedulerOutput | None = None  # the decision of the step last applied (benchmarks read it)
        self.on_dispatch: Callable[[], None] | None = None  # called once a step is scheduled and dispatched
        self.defer_sampling = callable(getattr(runner, "launch_sampler", None))

    @property
    def defer_sampling(self) -> bool:
        """Whether a step may run ahead of the tokens its sampler needs (a structured output's
        mask, penalties), its sampler launched once they are applied: on with a runner that can
        wait to sample (``launch_sampler``). Off, such steps are not overlapped and penalised
        requests sit a step out instead (what benchmarks compare against)."""
        return self._defer_sampling

    @defer_sampling.setter
    def defer_sampling(self, on: bool) -> None:
        if on and not callable(getattr(self.runner, "launch_sampler", None)):
            raise ValueError(f"{type(self.runner).__name__} cannot wait to sample (it has no launch_sampler)")
        self._defer_sampling = on
        for part in getattr(self.scheduler, "parts", [self.scheduler]):
            part.penalties_wait = not on

    def add(self, req: Request) -> None:
        """Queue a request that ``InputProcessor`` validated."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.scheduler.add(req)
        self.requests[req.request_id] = req

    def abort(self, request_id: str) -> bool:
        """Retire a request now, freeing its blocks; False if it is not running here."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.abort(req)
        return True

    def has_unfinished(self) -> bool:
        """Requests to run, or a dispatched step to collect."""
        return self.scheduler.has_unfinished() or self._inflight is not None

    def _dispatch(self, prev: Any = None) -> _InFlight:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.timers.schedule += time.perf_counter() - t0
        # Its sampler waits for the step before to be applied (never with a runner that cannot wait:
        # step does not run it ahead of a structured row's token, and penalised requests sit out).
        waits = prev is not None and self.defer_sampling and out.sampler_waits
        handle = None
        if out.scheduled or out.block_ops:
            handle = (self.runner.dispatch(out, prev, defer_sampling=True) if waits else
                      self.runner.dispatch(out, prev))
        if self.on_dispatch is not None:
            self.on_dispatch()
        return _InFlight(out, handle, prev is not None, waits and handle is not None)

    def _launch_waiting_sampler(self) -> None:
        """Launch the in-flight step's sampler, which waited for the step before to be applied."""
        self._inflight.sampler_waits = False
        self.runner.launch_sampler(self._inflight.handle)

    def step(self) -> list[Request]:
        """One iteration; returns the requests it changed (finished ones are forgotten).

        Synchronous: schedule, run, apply. Async: apply the step the previous call
        dispatched, after dispatching the next one."""
        if self._inflight is not None and self._inflight.sampler_waits:  # an exception cut the last step short
            self._launch_waiting_sampler()
        cur = self._inflight or self._dispatch()
        self._inflight = None
        if self.async_scheduling and cur.handle is not None and cur.out.can_overlap and (
                self.defer_sampling or not cur.out.samples_structured):
            self._inflight = self._dispatch(prev=cur.handle)
        result = self.runner.collect(cur.handle) if cur.handle is not None else RunnerOutput(None)
        t2 = time.perf_counter()
        out = self.last = cur.out
        changed = self.scheduler.update_from_output(out, result)
        if self._inflight is not None and self._inflight.sampler_waits:  # cur's tokens are applied
            self._launch_waiting_sampler()
        # A step scheduled ahead may be empty: every running request waited for its tokens.
        if not cur.ahead and self.scheduler.has_unfinished() and not out.scheduled and not out.finished:
            raise RuntimeError("the scheduler made no progress (a bug: see the guarantees in scheduler.py)")
        self.num_steps += bool(out.scheduled)
        self.num_steps_ahead += bool(out.scheduled) and cur.ahead
        stats = self.scheduler.kv.stats()
        if stats.slots_allocated:
            self.peak_kv_utilization = max(self.peak_kv_utilization, stats.utilization)
        if self.debug_checks:
            self.scheduler.kv.check_invariants()
        for req in changed:
            if req.finished:
                self.requests.pop(req.request_id, None)
        self.timers.update += time.perf_counter() - t2
        return changed
