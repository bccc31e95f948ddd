"""Data parallelism: one engine replica per device, requests spread over them (vLLM's
``data_parallel_size``). No jax here.

Each replica is a whole engine below the :class:`~jaxpaged.engine_core.EngineCore`: its own
scheduler with its own block manager (pool, prefix cache, swap space, preemption) and its
own model runner, on its own device. The composites here stand in for one scheduler and one
runner, so the engine core and ``LLM`` drive them unchanged:

- :class:`DataParallelScheduler` sends each new request to the replica with the fewest
  unfinished requests (vLLM's data-parallel load balancing, counted here on the host) and
  keeps it there for good; a step is every replica's schedule, and what a step sampled goes
  back to the replica that scheduled it. Each replica keeps its own guarantees
  (:mod:`jaxpaged.scheduler`): order, progress and bounded preemption hold per replica.
- :class:`DataParallelRunner` launches every replica's step before waiting for any, so the
  devices run at the same time (JAX dispatch is asynchronous), then collects them in order.

Limits and scheduling knobs (``max_num_seqs``, ``max_num_batched_tokens``, the pool's size)
are per replica, as in vLLM. A request's tokens do not depend on its replica: sampling is
seeded per request, and a row's logits depend on its batch only in float32's last bits.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jaxpaged.block_pool import MemoryStats, PrefixCacheStats
from jaxpaged.scheduler import RunnerOutput, Scheduler, SchedulerOutput
from jaxpaged.sequence import Request


def _summed(name: str) -> property:
    """The sum over ``self.parts`` of their ``name``."""
    return property(lambda self: sum(getattr(p, name) for p in self.parts))


def _joined(name: str) -> property:
    """Every part's ``name`` (a queue of requests), in part order."""
    return property(lambda self: [r for p in self.parts for r in getattr(p, name)])


@dataclasses.dataclass
class DataParallelOutput(SchedulerOutput):
    """Every replica's decision for one step; the inherited fields concatenate them (what
    the engine core and the benchmarks read), ``parts`` keeps them apart for the runners."""

    parts: list[SchedulerOutput] = dataclasses.field(default_factory=list)

    @classmethod
    def of(cls, parts: list[SchedulerOutput]) -> DataParallelOutput:
        return cls([s for p in parts for s in p.scheduled], [op for p in parts for op in p.block_ops],
                   [r for p in parts for r in p.preempted], [r for p in parts for r in p.finished],
                   speculates=any(p.speculates for p in parts), parts=parts)


@dataclasses.dataclass
class DataParallelRunnerOutput(RunnerOutput):
    """Every replica's sampled rows, one :class:`RunnerOutput` per replica."""

    parts: list[RunnerOutput] = dataclasses.field(default_factory=list)


class DataParallelKV:
    """The replicas' block managers seen as one, for accounting: counts are summed
    (``peak_used_blocks`` is the sum of each replica's peak, an upper bound of the peak of
    the sum), invariants are checked replica by replica."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        self.block_size = self.parts[0].block_size

    num_usable_blocks = _summed("num_usable_blocks")
    num_host_blocks = _summed("num_host_blocks")

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        stats = [p.prefix_cache_stats for p in self.parts]
        return PrefixCacheStats(*(sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(PrefixCacheStats)))

    def reset_prefix_cache(self) -> bool:
        """Each replica's (one whose blocks are in use keeps its cache); True when all forgot."""
        return all([p.reset_prefix_cache() for p in self.parts])

    def stats(self) -> MemoryStats:
        stats = [p.stats() for p in self.parts]
        summed = {f.name: sum(getattr(s, f.name) for s in stats) for f in dataclasses.fields(MemoryStats)}
        return MemoryStats(**{**summed, "block_size": self.block_size})

    def check_invariants(self) -> None:
        for p in self.parts:
            p.check_invariants()


class DataParallelScheduler:
    """Replicas' schedulers behind the interface of one :class:`~jaxpaged.scheduler.Scheduler`."""

    def __init__(self, parts: Sequence[Scheduler]):
        if len(parts) < 2:
            raise ValueError(f"data parallelism needs at least two replicas, got {len(parts)}")
        self.parts = list(parts)
        self.kv = DataParallelKV([p.kv for p in self.parts])
        self._home: dict[str, int] = {}  # unfinished request id -> its replica

    # ---- requests -------------------------------------------------------------------

    def check_request(self, num_prompt_tokens: int, params, priority: int = 0) -> None:
        self.parts[0].check_request(num_prompt_tokens, params, priority)  # the replicas are configured alike

    def _load(self, i: int) -> int:
        p = self.parts[i]
        return len(p.waiting) + len(p.running) + len(p.swapped)

    def add(self, req: Request) -> None:
        """Queue ``req`` on the least loaded replica (the first of equals)."""
        i = min(range(len(self.parts)), key=self._load)
        self.parts[i].add(req)
        self._home[req.request_id] = i

    def replica_of(self, request_id: str) -> int | None:
        return self._home.get(request_id)

    def abort(self, req: Request) -> None:
        i = self._home.pop(req.request_id, None)
        self.parts[0 if i is None else i].abort(req)  # a request never queued is only marked finished

    def has_unfinished(self) -> bool:
        return any(p.has_unfinished() for p in self.parts)

    waiting, running, swapped = _joined("waiting"), _joined("running"), _joined("swapped")
    num_preemptions = _summed("num_preemptions")
    num_swapped_out_blocks = _summed("num_swapped_out_blocks")
    num_dropped_tokens = _summed("num_dropped_tokens")
    num_drafts = _summed("num_drafts")
    num_draft_tokens = _summed("num_draft_tokens")
    num_accepted_tokens = _summed("num_accepted_tokens")

    # ---- steps ----------------------------------------------------------------------

    def schedule(self) -> DataParallelOutput:
        return DataParallelOutput.of([p.schedule() for p in self.parts])

    def update_from_output(self, out: DataParallelOutput, result: RunnerOutput) -> list[Request]:
        """Each replica applies its own part of the step; the requests that changed."""
        results = result.parts if isinstance(result, DataParallelRunnerOutput) else [RunnerOutput(None)] * len(
            self.parts)
        changed = [req for p, o, r in zip(self.parts, out.parts, results) for req in p.update_from_output(o, r)]
        for req in changed:
            if req.finished:
                self._home.pop(req.request_id, None)
        return changed


class DataParallelRunner:
    """Replicas' model runners behind the interface of one runner: every replica's step is
    launched before any is waited for."""

    def __init__(self, parts: Sequence):
        self.parts = list(parts)
        if not all(callable(getattr(r, "launch_sampler", None)) for r in self.parts):
            self.launch_sampler = None  # parts that cannot wait to sample: neither can the whole

    def dispatch(self, out: DataParallelOutput, prev: list | None = None, *, defer_sampling: bool = False) -> list:
        prev = prev or [None] * len(self.parts)
        kw = {"defer_sampling": True} if defer_sampling else {}  # (parts that cannot defer never get it)
        return [r.dispatch(o, p, **kw) for r, o, p in zip(self.parts, out.parts, prev)]

    def launch_sampler(self, handles: list) -> None:
        for r, h in zip(self.parts, handles):
            if h is not None:
                r.launch_sampler(h)

    def collect(self, handles: list) -> DataParallelRunnerOutput:
        return DataParallelRunnerOutput(None, parts=[r.collect(h) for r, h in zip(self.parts, handles)])

    @property
    def compiled_shapes(self) -> set[tuple]:
        return set().union(*(r.compiled_shapes for r in self.parts))

    def discard_weights(self) -> None:
        for r in self.parts:
            r.discard_weights()

    def load_weights(self, leaves) -> None:
        for r in self.parts:
            r.load_weights(leaves)

    def discard_kv(self) -> None:
        for r in self.parts:
            r.discard_kv()

    def restore_kv(self) -> None:
        for r in self.parts:
            r.restore_kv()

    time_batch = _summed("time_batch")
    time_device = _summed("time_device")
