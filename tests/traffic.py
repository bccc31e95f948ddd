"""Seeded random traffic through the public engine loop: ``add_request`` / ``step`` / ``abort``.

A round draws an engine (pool geometry, block size, sequence and token limits, recompute or
swap preemption with a small host pool, prefix caching, paged or contiguous allocator, the
synchronous or the async-scheduling loop) and a
stream of requests (greedy, seeded ``n = 1..3`` sampling, beam search, stop strings,
``min_tokens`` with ``stop_token_ids``, logprobs, text and token-id prompts, shared prefixes,
user-chosen ids that collide with automatic ones) arriving over the first steps, with aborts
at random steps. ``run_round`` drives it and checks the engine's invariants after every step.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jaxpaged import LLM, SamplingParams
from jaxpaged.data_parallel import DataParallelRunner

from oracle_runner import OracleRunner

MAX_MODEL_LEN = 64
# (block_size, num_blocks): one pool geometry per block size, so rounds share compiled step shapes.
GEOMETRIES = [(4, 32), (8, 18), (16, 12)]
WORDS = ["the", "paged", "cache", "of", "blocks", "and", "a", "sequence", "tree", "river", "stone"]


@dataclasses.dataclass
class Arrival:
    step: int
    prompt: str | list[int]
    params: SamplingParams
    user_id: str | None
    priority: int = 0


@dataclasses.dataclass
class Round:
    seed: int
    engine: dict
    arrivals: list[Arrival]
    abort_rate: float


@dataclasses.dataclass
class Result:
    round: Round
    finished: list[tuple[Arrival, object]]  # (what was submitted, its final RequestOutput)
    rejected: list[tuple[Arrival, str]]  # user ids refused because they were live
    aborted: list[Arrival]
    num_steps: int
    num_preemptions: int
    max_live_seqs: int
    num_swapped_out_blocks: int = 0
    num_steps_ahead: int = 0  # async scheduling: steps scheduled while the previous one ran
    num_dropped_tokens: int = 0  # async scheduling: tokens sampled after their sequence had finished
    cut: set[int] = dataclasses.field(default_factory=set)  # id() of the final outputs of requests cut short
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed, and accepted
    num_accepted_tokens: int = 0


class _CutRequests(logging.Handler):
    """Collects the ids of the requests the scheduler finished early (it logs a warning for each)."""

    def __init__(self, ids: set[str]):
        super().__init__(logging.WARNING)
        self.ids = ids

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "request %s %s" and str(record.args[1]).startswith("finished early"):
            self.ids.add(record.args[0])


def _params(rng: np.random.Generator) -> SamplingParams:
    # Sampler options are few on purpose (logprobs 4 like beam width 2's top-4, three stop ids):
    # each distinct combination is another compilation of the step.
    max_tokens = int(rng.integers(1, 21)) if rng.random() < 0.9 else None
    kind = rng.choice(["greedy", "sampled", "beam", "stop", "min_tokens", "logprobs"], p=[.25, .25, .12, .14, .12, .12])
    if kind == "greedy":
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if kind == "sampled":
        return SamplingParams(n=int(rng.integers(1, 4)), temperature=0.8, seed=int(rng.integers(1 << 20)),
                              max_tokens=max_tokens, ignore_eos=True)
    if kind == "beam":
        return SamplingParams(n=int(rng.integers(1, 3)), use_beam_search=True, beam_width=2, temperature=0,
                              max_tokens=max_tokens or 12, ignore_eos=True, stop=["e"] if rng.random() < 0.3 else None)
    if kind == "stop":
        return SamplingParams(temperature=0, max_tokens=max_tokens, stop=[str(rng.choice(["e", "a", "in", "."]))])
    if kind == "min_tokens":
        m = max_tokens or 16
        return SamplingParams(temperature=0.8, seed=int(rng.integers(1 << 20)), max_tokens=m,
                              min_tokens=int(rng.integers(0, m + 1)), stop_token_ids=[int(t) for t in
                                                                                      rng.integers(3, 300, 3)])
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=4, ignore_eos=True)


def make_round(seed: int, *, num_requests: int, vocab_size: int, any_geometry: bool = False) -> Round:
    """A round; ``any_geometry`` draws any pool of 12-40 blocks (every one compiles anew on a model)."""
    rng = np.random.default_rng(seed)
    block_size, num_blocks = GEOMETRIES[int(rng.integers(len(GEOMETRIES)))]
    if any_geometry:
        num_blocks = int(rng.integers(12, 41))
    max_num_seqs = int(rng.integers(2, 6))
    contiguous = rng.random() < 0.15 and block_size * (num_blocks - 1) >= 2 * MAX_MODEL_LEN
    swap = not contiguous and rng.random() < 0.5
    engine = dict(block_size=block_size, num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN,
                  max_num_seqs=max_num_seqs, max_num_batched_tokens=int(rng.choice([8, 16, 32])),
                  enable_prefix_caching=not contiguous and bool(rng.integers(2)),
                  preemption_mode="swap" if swap else "recompute", debug_checks=True, seed=seed,
                  kv_allocator="contiguous" if contiguous else "paged")
    # Drawn apart, so the rest of a round's draws are those it had before this option existed.
    engine["async_scheduling"] = bool(np.random.default_rng([seed, 1]).random() < 0.5)
    if swap:  # 4..40 host blocks: often too few, so swap falls back to recompute
        engine["swap_space"] = int(rng.integers(4, 41)) * 2 * 2 * 2 * 16 * 4 * block_size
    prefixes = [rng.integers(3, vocab_size, int(n)).tolist() for n in rng.integers(4, 24, 3)]
    arrivals = []
    for i in range(num_requests):
        if rng.random() < 0.15:
            prompt = " ".join(rng.choice(WORDS, int(rng.integers(1, 12))))
        else:
            prompt = rng.integers(3, vocab_size, int(rng.integers(1, 46))).tolist()
            if rng.random() < 0.3:
                prompt = (prefixes[int(rng.integers(3))] + prompt)[:MAX_MODEL_LEN - 4]
        user_id = str(int(rng.integers(0, 2 * num_requests))) if rng.random() < 0.2 else None
        step = 0 if rng.random() < 0.4 else int(rng.integers(0, 3 * num_requests))
        arrivals.append(Arrival(step, prompt, _params(rng), user_id))
    arrivals.sort(key=lambda a: a.step)
    # Drawn apart too: priority scheduling in a third of the rounds, priorities -1..2.
    prio = np.random.default_rng([seed, 2])
    if prio.random() < 1 / 3:
        engine["scheduling_policy"] = "priority"
        for a in arrivals:
            a.priority = int(prio.integers(-1, 3))
    return Round(seed, engine, arrivals, abort_rate=float(rng.choice([0.0, 0.02, 0.08])))


def replicas(llm: LLM) -> list:
    """The engine's schedulers: one, or each data-parallel replica's."""
    return getattr(llm.scheduler, "parts", [llm.scheduler])


def check_scheduler(llm: LLM) -> None:
    """Invariants of the scheduler's queues after a step (the block manager checks its own),
    replica by replica under data parallelism."""
    for sched in replicas(llm):
        live = sum(len(r.live_seqs()) for r in sched.running)
        assert live <= sched.max_num_seqs, f"{live} sequences running; max_num_seqs={sched.max_num_seqs}"
        # A preempted request waits only while every running request is better than it (so it
        # was preempted for a better one, and the worst running request is preempted first).
        if sched.running:
            worst_running = max(r.sort_key for r in sched.running)
            for q in (sched.waiting, sched.swapped):
                for r in q:
                    assert r.metrics.num_preemptions == 0 or worst_running < r.sort_key, \
                        f"preempted request {r.request_id} {r.sort_key} waits while {worst_running} runs"
        # FCFS: waiting and preempted requests are all newer than every running one, so a request
        # is only ever preempted for an older one, and the oldest is never preempted.
        if sched.scheduling_policy == "fcfs" and sched.running and (sched.waiting or sched.swapped):
            newest_running = max(r.arrival_index for r in sched.running)
            oldest_queued = min(r.arrival_index for q in (sched.waiting, sched.swapped) for r in q)
            assert newest_running < oldest_queued, "a request runs while an older one waits"


def engine(model, *, oracle: bool, oracle_markov: int = 0, **options) -> LLM:
    """An engine over ``model``; with ``oracle``, its steps run ``OracleRunner`` instead of the model
    (``oracle_markov``: its ``markov``)."""
    llm = LLM(model, **options)
    if oracle:
        runners = [OracleRunner(num_blocks=s.kv.num_usable_blocks + 1, block_size=llm.block_size,
                                num_host_blocks=s.kv.num_host_blocks, max_model_len=llm.max_model_len,
                                vocab_size=llm.config.vocab_size, eos_ids=llm.eos_ids, markov=oracle_markov)
                   for s in replicas(llm)]
        llm.core.runner = runners[0] if len(runners) == 1 else DataParallelRunner(runners)
    return llm


def run_round(model, rnd: Round, *, oracle: bool, max_steps: int = 5000) -> Result:
    rng = np.random.default_rng(rnd.seed + 1)
    llm = engine(model, oracle=oracle, **rnd.engine)
    live: dict[str, Arrival] = {}
    res = Result(rnd, [], [], [], 0, 0, 0)
    pending = list(rnd.arrivals)
    watcher = _CutRequests(set())
    logging.getLogger("jaxpaged.scheduler").addHandler(watcher)
    try:
        _run(llm, rnd, rng, res, pending, live, max_steps, watcher.ids)
    finally:
        logging.getLogger("jaxpaged.scheduler").removeHandler(watcher)
    assert not live, f"requests never finished: {sorted(live)}"
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_host_blocks_used"] == 0, stats
    llm.bm.check_invariants()
    res.num_preemptions = stats["num_preemptions"]
    res.num_swapped_out_blocks = stats["num_swapped_out_blocks"]
    res.num_steps_ahead = llm.core.num_steps_ahead
    res.num_dropped_tokens = llm.scheduler.num_dropped_tokens
    res.num_draft_tokens = llm.scheduler.num_draft_tokens
    res.num_accepted_tokens = llm.scheduler.num_accepted_tokens
    return res


def _run(llm: LLM, rnd: Round, rng: np.random.Generator, res: Result, pending: list[Arrival],
         live: dict[str, Arrival], max_steps: int, cut_ids: set[str]) -> None:
    while pending or llm.has_unfinished_requests():
        while pending and pending[0].step <= res.num_steps:
            a = pending.pop(0)
            try:
                rid = llm.add_request(a.prompt, a.params, request_id=a.user_id, priority=a.priority)
            except ValueError as e:  # a live user id, more sequences than a step runs, more than the pool holds
                seqs = a.params.beam_width if a.params.use_beam_search else a.params.n
                assert (a.user_id in live and "already in use" in str(e)) or (seqs > 1 and "sequences" in str(e)) \
                    or "usable blocks" in str(e), e
                res.rejected.append((a, str(e)))
                continue
            assert rid not in live, f"id {rid!r} handed out while live"
            live[rid] = a
        if live and rng.random() < rnd.abort_rate:
            rid = list(live)[int(rng.integers(len(live)))]
            llm.abort(rid)  # gone at once: no further output
            res.aborted.append(live.pop(rid))
        for o in llm.step():
            assert o.request_id in live, f"output for unknown or already finished request {o.request_id!r}"
            if o.finished:
                res.finished.append((live.pop(o.request_id), o))
                if o.request_id in cut_ids:  # user ids come back: a later request may reuse this one
                    cut_ids.discard(o.request_id)
                    res.cut.add(id(o))
        check_scheduler(llm)
        res.max_live_seqs = max(res.max_live_seqs, *(sum(len(r.live_seqs()) for r in s.running)
                                                     for s in replicas(llm)))
        res.num_steps += 1
        assert res.num_steps < max_steps, f"round {rnd.seed}: unfinished after {max_steps} steps (livelock)"
