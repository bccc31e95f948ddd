"""AsyncLLM: the engine stepped by its own thread; asyncio callers add, read, abort and shut down."""

import asyncio
import threading

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.async_engine import AsyncLLM, EngineDeadError, EngineOverloadedError

PROMPTS = ["The quick brown fox", "1, 2, 3, 4,", "Bonjour, je m'appelle", "def f(x):"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_engine_model):
    return LLM(tiny_engine_model, max_num_seqs=8, num_blocks=128, debug_checks=True)


@pytest.fixture(scope="module")
def reference(llm):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, [GREEDY, SEEDED] * 2, use_tqdm=False)]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def _collect(engine, prompt, params, request_id=None):
    outs = [o async for o in engine.generate(prompt, params, request_id)]
    assert outs and outs[-1].finished and all(not o.finished for o in outs[:-1])
    return outs


def test_reset_prefix_cache_between_steps(llm):
    """The offline engine's and the async engine's: refused while a request holds blocks; after
    it, a repeated prompt hits nothing and gets the same tokens."""
    prompt = "word " * 70  # (over a block of 64 tokens: a prefix to cache)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0 and llm.reset_prefix_cache()
    fresh = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0 and fresh.outputs[0].token_ids == first.outputs[0].token_ids
    engine = AsyncLLM(llm)
    try:
        async def main():
            stream = engine.add_request(prompt, LONG)
            first_out = await anext(stream)  # running: it holds blocks
            refused = await engine.reset_prefix_cache()
            engine.abort(stream.request_id)
            await _collect(engine, prompt, GREEDY)
            return first_out, refused, await engine.reset_prefix_cache()

        first_out, refused, done = run(main())
    finally:
        engine.shutdown()
    assert first_out.outputs[0].token_ids and not refused and done
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    with pytest.raises(EngineDeadError):
        run(engine.reset_prefix_cache())


def test_concurrent_requests_get_their_own_tokens(llm, reference):
    engine = AsyncLLM(llm)
    try:
        async def main():
            return await asyncio.gather(*(_collect(engine, p, sp, f"r{i}")
                                          for i, (p, sp) in enumerate(zip(PROMPTS, [GREEDY, SEEDED] * 2))))

        results = run(main())
        assert [[c.token_ids for c in outs[-1].outputs] for outs in results] == reference
        for i, outs in enumerate(results):
            assert {o.request_id for o in outs} == {f"r{i}"}
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            assert lengths == sorted(lengths) and len(outs) > 1  # incremental, never going back
        assert engine.stats.num_used_blocks == 0 and engine.stats.num_running == 0
    finally:
        engine.shutdown()


def test_bad_request_raises_at_once_and_queues_nothing(llm):
    engine = AsyncLLM(llm)
    try:
        async def main():
            with pytest.raises(ValueError, match="max_model_len is 512"):
                engine.add_request(list(range(3, 600)), GREEDY)
            with pytest.raises(ValueError, match="already in use"):
                async with engine.add_request("x", LONG, request_id="same"):
                    engine.add_request("y", GREEDY, request_id="same")
            return await _collect(engine, PROMPTS[0], GREEDY)

        assert run(main())[-1].outputs[0].finish_reason == "length"
    finally:
        engine.shutdown()


def test_abort_frees_blocks_and_ends_the_stream(llm):
    engine = AsyncLLM(llm)
    try:
        async def main():
            stream = engine.add_request(PROMPTS[1], LONG)
            async for out in stream:
                if len(out.outputs[0].token_ids) >= 3:
                    break
            assert engine.stats.num_used_blocks > 0
            engine.abort(stream.request_id)
            assert [o async for o in stream] == []  # nothing after the abort
            for _ in range(1000):  # (10 s: a loaded machine)
                if engine.stats.num_running == 0:
                    break
                await asyncio.sleep(0.01)

        run(main())
        assert engine.stats.num_running == 0 and engine.stats.num_used_blocks == 0
        assert llm.bm.stats().num_used_blocks == 0
    finally:
        engine.shutdown()


def test_breaking_out_of_generate_aborts(llm):
    engine = AsyncLLM(llm)
    try:
        async def main():
            async for out in engine.generate(PROMPTS[2], LONG):
                if len(out.outputs[0].token_ids) >= 2:
                    break
            for _ in range(1000):  # (10 s: a loaded machine)
                if engine.stats.num_running == 0 and not engine.llm.core.requests:
                    return
                await asyncio.sleep(0.01)

        run(main())
        assert engine.stats.num_used_blocks == 0
    finally:
        engine.shutdown()


def test_waiting_queue_bound(tiny_engine_model):
    llm = LLM(tiny_engine_model, max_num_seqs=1, num_blocks=128)
    engine = AsyncLLM(llm, max_waiting_requests=1)
    try:
        async def main():
            running = engine.add_request(PROMPTS[0], LONG)
            await anext(running)  # admitted: the only slot is taken
            waiting = engine.add_request(PROMPTS[1], GREEDY)
            with pytest.raises(EngineOverloadedError, match="1 requests waiting, max_waiting_requests is 1"):
                engine.add_request(PROMPTS[2], GREEDY)
            engine.abort(running.request_id)
            outs = [o async for o in waiting]
            assert outs[-1].finished
            return await _collect(engine, PROMPTS[2], GREEDY)  # room again

        run(main())
    finally:
        engine.shutdown()


def test_shutdown_aborts_everything_and_frees_every_block(llm):
    engine = AsyncLLM(llm)

    async def main():
        streams = [engine.add_request(p, LONG) for p in PROMPTS]
        await anext(streams[0])
        engine.shutdown()
        finals = [[o async for o in s] for s in streams]
        return finals

    finals = run(main())
    assert not engine._thread.is_alive() and not engine.is_running
    for outs in finals:
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert llm.bm.stats().num_used_blocks == 0 and not llm.core.requests and not llm.scheduler.has_unfinished()
    llm.bm.check_invariants()

    async def after():
        engine.add_request(PROMPTS[0], GREEDY)

    with pytest.raises(EngineDeadError, match="shut down"):
        run(after())
    engine.shutdown()  # idempotent


def test_a_batch_is_admitted_whole_and_tokenized_off_the_event_loop(tiny_engine_model):
    llm = LLM(tiny_engine_model, max_num_seqs=1, num_blocks=128)
    engine = AsyncLLM(llm, max_waiting_requests=1)
    tokenize, threads = llm.inputs.tokenizer, set()

    class Gated:  # tokenizes only once the event loop has run a coroutine meanwhile
        def __getattr__(self, name):
            return getattr(tokenize, name)

        def __call__(self, *args, **kw):
            threads.add(threading.current_thread().name)
            assert loop_ran.wait(30), "the event loop was blocked while a prompt was tokenized"
            return tokenize(*args, **kw)

    loop_ran = threading.Event()
    llm.inputs.tokenizer = Gated()
    try:
        async def main():
            async def tick():
                await asyncio.sleep(0.05)
                loop_ran.set()

            ticker = asyncio.ensure_future(tick())
            # Three prompts with room for one waiting request: the batch goes in whole.
            streams = await engine.add_requests(PROMPTS[:3], GREEDY, ["a", "b", "c"])
            await ticker
            with pytest.raises(EngineOverloadedError):  # two of the batch still wait
                await engine.add_requests(PROMPTS[3:], GREEDY, ["d"])
            finals = [[o async for o in s][-1] for s in streams]
            with pytest.raises(ValueError, match="prompt is empty"):  # all or none: "e" is not queued
                await engine.add_requests([PROMPTS[0], ""], GREEDY, ["e", "f"])
            return finals

        finals = run(main())
        assert [o.request_id for o in finals] == ["a", "b", "c"] and all(o.finished for o in finals)
        assert [len(o.outputs[0].token_ids) for o in finals] == [GREEDY.max_tokens] * 3
        assert threads == {"jaxpaged-tokenizer_0"} and "e" not in llm.core.requests
    finally:
        engine.shutdown()
        llm.inputs.tokenizer = tokenize


def test_requests_a_running_step_admitted_no_longer_count_as_waiting(tiny_engine_model):
    # The queue bound must see the admissions as soon as a step is dispatched, not only
    # after its (possibly long) run: hold the step in collect and add one more request.
    llm = LLM(tiny_engine_model, max_num_seqs=4, num_blocks=128)
    engine = AsyncLLM(llm, max_waiting_requests=2)
    collect, release = llm.runner.collect, threading.Event()

    def held(step):
        assert release.wait(30)
        return collect(step)

    llm.runner.collect = held
    try:
        async def main():
            streams = await engine.add_requests(PROMPTS[:2], GREEDY, ["a", "b"])  # handed over together
            for _ in range(500):
                if engine.stats.num_running == 2:
                    break
                await asyncio.sleep(0.01)
            assert (engine.stats.num_running, engine.stats.num_waiting) == (2, 0)
            streams.append(engine.add_request(PROMPTS[2], GREEDY))  # was refused: 2 counted as waiting
            release.set()
            return [[o async for o in s][-1] for s in streams]

        assert all(o.finished for o in run(main()))
    finally:
        release.set()
        engine.shutdown()
        llm.runner.collect = collect


def test_requests_being_tokenized_count_as_waiting_and_shutdown_ends_them(tiny_engine_model):
    llm = LLM(tiny_engine_model, max_num_seqs=1, num_blocks=128)
    engine = AsyncLLM(llm, max_waiting_requests=1)
    tokenize, entered, release = llm.inputs.tokenizer, threading.Event(), threading.Event()

    class Held:  # holds the tokenizer thread until released
        def __getattr__(self, name):
            return getattr(tokenize, name)

        def __call__(self, *args, **kw):
            entered.set()
            assert release.wait(30)
            return tokenize(*args, **kw)

    llm.inputs.tokenizer = Held()
    try:
        async def main():
            first = asyncio.ensure_future(engine.add_requests([PROMPTS[0]], GREEDY, ["a"]))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            # "a" is still being tokenized, and already counts against the bound (before: not at all,
            # so a burst behind a long prompt all got in).
            assert engine.stats.num_waiting == 1
            with pytest.raises(EngineOverloadedError, match="1 requests waiting"):
                await engine.add_requests([PROMPTS[1]], GREEDY, ["b"])
            engine.max_waiting_requests = None
            queued = asyncio.ensure_future(engine.add_requests([PROMPTS[2]], GREEDY, ["c"]))
            await asyncio.sleep(0.05)
            engine.shutdown()  # "c" waits behind "a": cancelled, and both callers hear the engine is gone
            with pytest.raises(EngineDeadError, match="shut down"):
                await queued
            release.set()
            with pytest.raises(EngineDeadError, match="shut down"):
                await first

        run(main())
        assert engine._tokenizing == 0 and not llm.core.requests
    finally:
        release.set()
        engine.shutdown()
        llm.inputs.tokenizer = tokenize
