"""The engine core: validated requests in, one step at a time, changed requests out. No jax here.

A step is ``scheduler.schedule()`` → ``runner.execute()`` → ``scheduler.update_from_output()``.
The core only moves data between the scheduler (which owns every request's lifecycle)
and a runner: the model runner, or any object that returns sampled tokens for a
``SchedulerOutput`` (the benchmark scripts simulate memory and concurrency with one that
runs no model).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Protocol

from jaxpaged.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from jaxpaged.sequence import Request


class Runner(Protocol):
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Apply ``out.block_ops``, run the scheduled chunks, sample ``num_samples`` rows each."""


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
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, *, debug_checks: bool = False):
        self.scheduler = scheduler
        self.runner = runner
        self.debug_checks = debug_checks
        self.requests: dict[str, Request] = {}  # unfinished, by id
        self.num_steps = 0  # steps that ran the model
        self.peak_kv_utilization = 0.0
        self.timers = Timers()
        self.last: SchedulerOutput | None = None  # the last step's decision (benchmarks read it)

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
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """One iteration; returns the requests it changed (finished ones are forgotten)."""
        t0 = time.perf_counter()
        out = self.last = self.scheduler.schedule()
        t1 = time.perf_counter()
        result = self.runner.execute(out) if out.scheduled or out.block_ops else RunnerOutput(None)
        t2 = time.perf_counter()
        changed = self.scheduler.update_from_output(out, result)
        if self.scheduler.has_unfinished() and not out.scheduled and not out.finished:
            raise RuntimeError("the scheduler made no progress (a bug: see the guarantees in scheduler.py)")
        self.num_steps += bool(out.scheduled)
        stats = self.scheduler.kv.stats()
        if stats.slots_allocated:
            self.peak_kv_utilization = max(self.peak_kv_utilization, stats.utilization)
        if self.debug_checks:
            self.scheduler.kv.check_invariants()
        for req in changed:
            if req.finished:
                self.requests.pop(req.request_id, None)
        t3 = time.perf_counter()
        self.timers.schedule += t1 - t0
        self.timers.update += t3 - t2
        return changed
