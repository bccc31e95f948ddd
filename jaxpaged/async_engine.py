"""``AsyncLLM``: the engine core stepped by its own thread, for servers (vLLM's ``AsyncLLM``).

A request is tokenized and validated before the engine sees it (so a bad request raises at
once and never reaches the engine), on the caller's thread or, for ``add_requests`` (the
server's), on a tokenizer thread that keeps long prompts and chat templates off the event
loop; it is then handed over through a locked queue. The engine thread admits queued
requests and applies aborts between steps, steps while anything is unfinished, and sleeps
on a condition variable when idle. After each step it makes the changed requests' outputs
(on the engine thread, which alone touches request state) and passes them to the callers'
event loops with ``call_soon_threadsafe``.

Outputs are cumulative, so a request's stream keeps only the latest: a slow consumer
never makes a backlog, and each output goes to the one stream registered under its id.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from jaxpaged.engine import LLM
from jaxpaged.input_processor import PromptType
from jaxpaged.lora import LoRARequest
from jaxpaged.outputs import EmbeddingRequestOutput, RequestOutput
from jaxpaged.pooling import PoolingParams
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.sequence import Request

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``); try again later."""


class EngineSleepingError(RuntimeError):
    """The engine sleeps (``sleep``): requests are refused until ``wake_up``."""


class EngineDeadError(RuntimeError):
    """The engine is shut down, or its thread failed; no request can run."""


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """The engine's state after a step (or an idle wake-up)."""

    num_running: int = 0
    num_waiting: int = 0  # queued, not admitted yet (including requests preempted by recompute)
    num_used_blocks: int = 0
    num_blocks: int = 1
    prefix_cache_hit_rate: float = 0.0
    num_preemptions: int = 0  # total over the engine's life
    # Speculative decoding, totals over the engine's life: chunks with drafts, drafts, accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # The LoRA adapters (names, sorted) of the running (swapped included) and the waiting requests.
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the KV pool's blocks in use, 0 to 1."""
        return self.num_used_blocks / self.num_blocks


def _adapter_names(requests) -> tuple[str, ...]:
    return tuple(sorted({r.lora.request.lora_name for r in requests if r.lora is not None}))


@dataclasses.dataclass
class IterationStats:
    """What one step produced, for stat loggers (Prometheus in the server)."""

    scheduler: SchedulerStats
    num_prompt_tokens: int = 0  # of the requests whose first token came in this step
    num_generation_tokens: int = 0
    time_to_first_token: list[float] = dataclasses.field(default_factory=list)  # seconds since arrival
    inter_token_latency: list[float] = dataclasses.field(default_factory=list)  # seconds since the last token


_ABORTED = object()  # ends a stream that its caller aborted


class RequestStream:
    """The outputs of one request, read on the caller's event loop: ``async for out in stream``.

    Yields cumulative ``RequestOutput``s, the last one finished; after ``abort`` it just
    ends. Use it as an async
    context manager (or call ``AsyncLLM.abort``) so that a caller who stops early frees
    the request's blocks.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        # The engine thread's bookkeeping for this request's stats.
        self._num_steps = 0  # that sampled a token for this request
        self._num_tokens = 0  # generated, over all its sequences
        self._last_token_time: float | None = None

    def _put(self, item: RequestOutput | BaseException | object) -> None:  # on the event loop
        if not self.finished and self._latest is not _ABORTED:  # nothing comes after an abort
            self._latest = item
            self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if item is _ABORTED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        if not self.finished:
            self.engine.abort(self.request_id)


class AsyncLLM:
    """An engine that runs requests while others arrive, for asyncio callers.

    Args:
      llm: the engine to drive (an ``LLM``); it belongs to this object from now on: call
        nothing on it directly.
      max_waiting_requests: most requests queued and not yet running; beyond it
        ``add_request`` raises ``EngineOverloadedError``. None: no limit.
      stat_loggers: callables given an ``IterationStats`` after every step, on the
        engine thread.

    Example::

        engine = AsyncLLM(LLM(model))
        async for out in engine.generate("Hello", SamplingParams(max_tokens=8)):
            print(out.outputs[0].text)
        engine.shutdown()
    """

    def __init__(self, llm: LLM, *, max_waiting_requests: int | None = None,
                 stat_loggers: list[Callable[[IterationStats], None]] = ()):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be non-negative or None, got {max_waiting_requests}")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.max_model_len = llm.max_model_len
        self.max_waiting_requests = max_waiting_requests
        self.stat_loggers = list(stat_loggers)
        self._cond = threading.Condition()
        # Guarded by _cond: the hand-over queues, the live streams, the published stats.
        self._adds: list[tuple[Request, RequestStream]] = []
        self._tokenizing = 0  # requests on the tokenizer thread: they count as waiting
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], object], concurrent.futures.Future]] = []  # run between steps
        self._streams: dict[str, RequestStream] = {}
        self._stats = SchedulerStats(num_blocks=llm.bm.stats().num_blocks)
        self._stopping = False
        self._sleeping = llm.is_sleeping()  # set by sleep() under _cond: from then on, requests are refused
        self._error: BaseException | None = None
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jaxpaged-tokenizer")
        # The waiting count goes out once a step is dispatched, not only after it: the
        # requests that step admitted no longer count against max_waiting_requests.
        llm.core.on_dispatch = self._publish_queue_lengths
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    # ---- the caller's side ----------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def stats(self) -> SchedulerStats:
        """The latest published state; requests handed over but not admitted count as waiting."""
        with self._cond:
            return dataclasses.replace(self._stats, num_waiting=self._waiting())

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> RequestStream:
        """Validate and queue a request; returns the stream of its outputs. Call it on the
        event loop that will read the stream. It tokenizes on the caller's thread: a server
        uses ``add_requests``, which does not.

        Raises:
          ValueError, TypeError: the request is invalid (nothing is queued).
          EngineOverloadedError: ``max_waiting_requests`` requests are already waiting.
          EngineSleepingError: the engine sleeps (:meth:`sleep`).
          EngineDeadError: the engine is shut down.
        """
        loop = asyncio.get_running_loop()
        self._check_room()
        # Tokenizing and validating outside the lock never stalls the engine thread.
        return self._hand_over([self.llm.inputs.process(prompt, params, request_id, self._streams, priority,
                                                        lora_request=lora_request)], loop)[0]

    async def add_requests(self, prompts: list[PromptType], params: SamplingParams | None,
                           request_ids: list[str], check: Callable[[Request], None] | None = None,
                           priority: int = 0, pooling: PoolingParams | None = None,
                           lora_request: LoRARequest | None = None, names: list[str] | None = None
                           ) -> list[RequestStream]:
        """``add_request`` for a batch of prompts, all queued or none: the batch is admitted
        whole when fewer than ``max_waiting_requests`` requests wait as it arrives, and its
        prompts are tokenized on the tokenizer thread, so a long prompt never stalls the
        event loop (other requests' streams) or the engine thread. ``check``, if given, sees
        each validated request there and may raise to refuse the batch. ``pooling``: embedding
        requests (``params`` None; their one output is an ``EmbeddingRequestOutput``).
        ``lora_request``: the prompts' LoRA adapter (:mod:`jaxpaged.lora`). ``names``: each
        prompt's name in errors (default ``prompt``).

        Raises: as ``add_request``, and what ``check`` raises.
        """
        names = ["prompt"] * len(prompts) if names is None else names
        if len(request_ids) != len(prompts) or len(names) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(request_ids)} request ids and {len(names)} names")
        loop = asyncio.get_running_loop()
        self._check_room(reserve=len(prompts))

        def process():
            reqs = [self.llm.inputs.process(p, params, rid, self._streams, priority, pooling=pooling,
                                            lora_request=lora_request, what=name)
                    for p, rid, name in zip(prompts, request_ids, names)]
            for req in reqs if check is not None else ():
                check(req)
            return reqs

        try:
            reqs = await self.run_on_tokenizer_thread(process)
        except BaseException:
            with self._cond:
                self._tokenizing -= len(prompts)
            raise
        return self._hand_over(reqs, loop, reserved=len(prompts))

    async def run_on_tokenizer_thread(self, fn: Callable[..., T], *args) -> T:
        """``fn(*args)`` on the one thread that tokenizes requests (chat templates,
        ``/tokenize``), off the event loop; one thread, since a tokenizer is not safe to
        share between concurrent calls."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)
        except (RuntimeError, asyncio.CancelledError):
            # The executor is shut down, or shutdown cancelled this call's work (not the caller).
            task = asyncio.current_task()
            if self._stopping and (task is None or not task.cancelling()):
                raise EngineDeadError("the engine is shut down") from None
            raise

    def _waiting(self) -> int:  # under _cond
        return self._stats.num_waiting + len(self._adds) + self._tokenizing

    def _check_room(self, reserve: int = 0) -> None:
        """Raise unless fewer than ``max_waiting_requests`` wait; then count ``reserve``
        requests as waiting (on the tokenizer thread) until ``_hand_over``."""
        with self._cond:
            self._check_alive()
            self._check_awake()
            waiting = self._waiting()
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise EngineOverloadedError(f"the engine is overloaded: {waiting} requests waiting, "
                                            f"max_waiting_requests is {self.max_waiting_requests}; retry later")
            self._tokenizing += reserve

    def _hand_over(self, reqs: list[Request], loop: asyncio.AbstractEventLoop, reserved: int = 0
                   ) -> list[RequestStream]:
        """Register a stream for each validated request and queue them for the engine thread;
        ``reserved``: what ``_check_room`` counted for them."""
        with self._cond:
            self._tokenizing -= reserved
            self._check_alive()
            self._check_awake()
            for req in reqs:
                if req.request_id in self._streams:  # taken by another caller meanwhile
                    raise ValueError(f"request id {req.request_id!r} is already in use")
            streams = [RequestStream(self, req.request_id, loop) for req in reqs]
            for req, stream in zip(reqs, streams):
                self._streams[req.request_id] = stream
                self._adds.append((req, stream))
            self._cond.notify()
        return streams

    async def generate(self, prompt: PromptType, params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative outputs as they change; the last one is finished.

        Stopping the iteration early (``break``, cancellation) aborts the request.
        """
        async with self.add_request(prompt, params, request_id=request_id, priority=priority,
                                    lora_request=lora_request) as stream:
            async for out in stream:
                yield out

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                     request_id: str | None = None, priority: int = 0,
                     lora_request: LoRARequest | None = None) -> AsyncIterator[EmbeddingRequestOutput]:
        """An embedding request (vLLM's ``AsyncLLM.encode``): yields its one output, finished."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        rid = request_id if request_id is not None else f"embd-{uuid.uuid4().hex}"
        streams = await self.add_requests([prompt], None, [rid], priority=priority, pooling=params,
                                          lora_request=lora_request)
        async with streams[0] as stream:
            async for out in stream:
                yield out

    async def reset_prefix_cache(self) -> bool:
        """:meth:`LLM.reset_prefix_cache <jaxpaged.LLM.reset_prefix_cache>` on the engine thread,
        between two steps: False while requests hold blocks."""
        return await self._on_engine_thread(self.llm.reset_prefix_cache)

    async def sleep(self, level: int = 1) -> None:
        """:meth:`LLM.sleep <jaxpaged.LLM.sleep>` on the engine thread, between two steps: from
        then on until :meth:`wake_up`, requests are refused (``EngineSleepingError``).

        Raises: as ``LLM.sleep`` (``RuntimeError`` while requests are unfinished or queued).
        """
        def sleep_now():
            with self._cond:  # what is queued after this is refused; what was queued before is unfinished
                if self._adds:
                    raise RuntimeError(f"sleep: {len(self._adds)} request(s) are queued; let them finish or abort "
                                       f"them first")
                self.llm.check_can_sleep(level)  # before the flag: a sleep refused never refuses requests
                self._sleeping = True
            try:
                self.llm.sleep(level)
            finally:
                with self._cond:
                    self._sleeping = self.llm.is_sleeping()

        await self._on_engine_thread(sleep_now)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """:meth:`LLM.wake_up <jaxpaged.LLM.wake_up>` on the engine thread; requests run again
        once the weights and the KV cache are both back."""
        def wake_now():
            try:
                self.llm.wake_up(tags)
            finally:
                with self._cond:
                    self._sleeping = self.llm.is_sleeping()

        await self._on_engine_thread(wake_now)

    async def is_sleeping(self) -> bool:
        return self._sleeping

    async def update_weights(self, weights) -> None:
        """:meth:`LLM.update_weights <jaxpaged.LLM.update_weights>` on the engine thread,
        between two steps (``RuntimeError`` while requests are unfinished)."""
        await self._on_engine_thread(lambda: self.llm.update_weights(weights))

    def _check_awake(self) -> None:  # under _cond
        if self._sleeping:
            raise EngineSleepingError("the engine is sleeping: wake it up first (wake_up, POST /wake_up)")

    async def _on_engine_thread(self, fn: Callable[[], T]) -> T:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            self._check_alive()
            self._calls.append((fn, future))
            self._cond.notify()
        return await asyncio.wrap_future(future)

    def abort(self, request_id: str) -> None:
        """Stop a request: its blocks are freed and its stream gets nothing more. Thread-safe."""
        with self._cond:
            stream = self._streams.pop(str(request_id), None)
            if stream is not None:
                self._aborts.append(stream.request_id)
                self._cond.notify()
        if stream is not None:  # wake a reader, if any: its stream ends
            _deliver_threadsafe(stream.loop, [(stream, _ABORTED)])

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort every request (their streams end with ``finish_reason="abort"``), free every
        block and stop the engine thread. Idempotent."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)  # its callers get EngineDeadError
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine failed: {self._error!r}") from self._error
        if self._stopping:
            raise EngineDeadError("the engine is shut down")

    # ---- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        core = self.llm.core
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._adds or self._aborts or self._calls
                                        or core.has_unfinished())
                    if self._stopping:
                        break
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                    self._stats = dataclasses.replace(self._stats, num_waiting=self._stats.num_waiting + len(adds))
                for req, stream in adds:  # before the aborts: an abort may name a request just added
                    if self.llm.is_sleeping():  # (the hand-over refuses these; an LLM put to sleep directly)
                        with self._cond:
                            self._streams.pop(req.request_id, None)
                        _deliver_threadsafe(stream.loop, [(stream, EngineSleepingError("the engine is sleeping"))])
                        continue
                    try:
                        core.add(req)
                    except ValueError as e:  # InputProcessor checked it; only a bug lands here
                        with self._cond:
                            self._streams.pop(req.request_id, None)
                        _deliver_threadsafe(stream.loop, [(stream, e)])
                for rid in aborts:
                    core.abort(rid)
                for fn, future in calls:
                    try:
                        future.set_result(fn())
                    except Exception as e:  # the caller's to see
                        future.set_exception(e)
                changed = core.step() if core.has_unfinished() else []
                self._publish(changed)
        except BaseException as e:  # the engine is unusable: fail every stream, free what we can
            log.exception("the engine thread failed")
            self._error = e
        finally:
            self._stop()

    def _publish_queue_lengths(self) -> None:
        sched = self.llm.scheduler
        with self._cond:
            self._stats = dataclasses.replace(self._stats, num_running=len(sched.running) + len(sched.swapped),
                                              num_waiting=len(sched.waiting))

    def _publish(self, changed: list[Request], *, error: BaseException | None = None) -> None:
        """Publish the stats and hand each changed request's output to its stream."""
        sched = self.llm.scheduler
        mem = sched.kv.stats()
        stats = SchedulerStats(
            num_running=len(sched.running) + len(sched.swapped), num_waiting=len(sched.waiting),
            num_used_blocks=mem.num_used_blocks, num_blocks=mem.num_blocks,
            prefix_cache_hit_rate=self.llm.bm.prefix_cache_stats.hit_rate, num_preemptions=sched.num_preemptions,
            spec_num_drafts=sched.num_drafts, spec_num_draft_tokens=sched.num_draft_tokens,
            spec_num_accepted_tokens=sched.num_accepted_tokens,
            running_lora_adapters=_adapter_names([*sched.running, *sched.swapped]),
            waiting_lora_adapters=_adapter_names(sched.waiting))
        it = IterationStats(stats)
        now = time.monotonic()
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cond:
            self._stats = stats
            streams = [(r, self._streams.get(r.request_id)) for r in changed]
            for r, s in streams:
                if s is not None and r.finished:
                    del self._streams[r.request_id]
        for req, stream in streams:
            if stream is None:  # aborted meanwhile
                continue
            out = self.llm.outputs.make_output(req)
            if req.pooling is not None:  # an embedding: its prompt counts once it is done, no token does
                it.num_prompt_tokens += len(out.prompt_token_ids) if req.hidden is not None else 0
                by_loop.setdefault(stream.loop, []).append((stream, out))
                continue
            num_steps = max((len(c.token_ids) for c in out.outputs), default=0)
            if num_steps > stream._num_steps:
                if stream._last_token_time is None:
                    it.num_prompt_tokens += len(out.prompt_token_ids)
                    it.time_to_first_token.append(now - req.metrics.arrival_time)
                else:
                    it.inter_token_latency.append((now - stream._last_token_time) / (num_steps - stream._num_steps))
                num_tokens = sum(len(c.token_ids) for c in out.outputs)
                it.num_generation_tokens += max(0, num_tokens - stream._num_tokens)  # beams can shrink
                stream._num_steps, stream._num_tokens, stream._last_token_time = num_steps, num_tokens, now
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _deliver_threadsafe(loop, items)
        for logger in self.stat_loggers:
            logger(it)

    def _stop(self) -> None:
        """Abort every request and end every stream (on the engine thread, at exit)."""
        core = self.llm.core
        core.on_dispatch = None
        with self._cond:
            self._stopping = True
            adds, self._adds = self._adds, []
            streams, self._streams = self._streams, {}
            self._aborts.clear()
            calls, self._calls = self._calls, []
        for _, future in calls:
            future.set_exception(EngineDeadError("the engine stopped"))
        for req, _ in adds:
            self.llm.scheduler.abort(req)  # never admitted: just mark it finished
        aborted = [core.requests[rid] for rid in list(core.requests)]
        for req in aborted:
            try:
                core.abort(req.request_id)
            except Exception:  # after a failed step the state may be broken: end the streams anyway
                log.exception("could not abort request %s", req.request_id)
        aborted += [req for req, _ in adds]
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req in aborted:
            stream = streams.pop(req.request_id, None)
            if stream is not None:
                item = EngineDeadError(f"the engine failed: {self._error!r}") if self._error is not None \
                    else self.llm.outputs.make_output(req)
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for stream in streams.values():  # finished in the failed step
            by_loop.setdefault(stream.loop, []).append((stream, EngineDeadError("the engine stopped")))
        for loop, items in by_loop.items():
            _deliver_threadsafe(loop, items)
        try:
            self._publish([])
        except Exception:
            log.exception("could not publish the final stats")


def _deliver(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream._put(item)


def _deliver_threadsafe(loop: asyncio.AbstractEventLoop, items: list) -> None:
    try:
        loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:  # the caller's loop is closed: nobody is reading these streams
        pass
