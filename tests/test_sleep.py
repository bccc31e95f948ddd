"""Sleep mode (vLLM's ``LLM.sleep`` / ``wake_up``, the server's ``/sleep``, ``/wake_up``,
``/is_sleeping``): the engine lets go of its weights and KV pool, refuses requests meanwhile,
and wakes up giving the tokens it gave before (level 1) or those of the checkpoint as it is
now (level 2); ``update_weights`` hands a trainer's weights over in memory. Two replicas,
dp-attention and tensor parallelism: ``dp_cases.py``, ``tp_cases.py``."""

import gc
import shutil

import httpx
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_server import AUTH, Running

from jaxpaged import LLM, SamplingParams

ENGINE = dict(max_num_seqs=8, num_blocks=64, block_size=8, enable_sleep_mode=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [9, 10, 11], "The paged cache of blocks"]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True),
          SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)]


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def live_bytes() -> int:
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays())


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_lets_go_of_weights_and_pool_and_wake_up_gives_the_same_tokens(tiny_engine_folder, level):
    llm = LLM(tiny_engine_folder, **ENGINE)
    before = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    engine_bytes = sum(a.nbytes for a in llm.runner.params) + llm.runner.kv.k.nbytes + llm.runner.kv.v.nbytes
    held = live_bytes()
    llm.sleep(level)
    assert llm.is_sleeping() and held - live_bytes() >= engine_bytes  # every array of the engine's is gone
    for tags in (["weights"], ["kv_cache"]):  # the weights first, then the pool
        with pytest.raises(RuntimeError, match=r"the engine is asleep .*call wake_up\(\) first"):
            llm.generate(PROMPTS[0], PARAMS[0], use_tqdm=False)
        with pytest.raises(RuntimeError, match="asleep"):
            llm.add_request(PROMPTS[0], PARAMS[0])
        llm.wake_up(tags)
    assert not llm.is_sleeping() and not llm.has_unfinished_requests()
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert tokens(outs) == before
    assert all(o.num_cached_tokens == 0 for o in outs)  # the cached prefixes were forgotten with the pool
    assert llm.loaded.model is not None and llm.stats()["num_used_blocks"] == 0
    llm.wake_up()  # awake already: nothing to do
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == before


def test_level_2_wakes_up_with_the_checkpoint_as_it_is_now(tiny_engine_folder, tmp_path):
    """A trainer's loop: sleep, rewrite the checkpoint, wake up on the new weights."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_engine_folder, folder)
    llm = LLM(folder, **ENGINE)
    old = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    llm.sleep(1)
    llm.sleep(2)  # deeper: the host copy of level 1 goes too
    weights = load_file(folder / "model.safetensors")
    rng = np.random.default_rng(0)
    weights = {k: (v + rng.normal(0, 0.3, v.shape)).astype(v.dtype) for k, v in weights.items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    llm.wake_up()
    new = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert new == tokens(LLM(folder, **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)) and new != old
    llm.sleep(2)
    save_file({k: v[..., :-1] if k.endswith("norm.weight") else v for k, v in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(Exception, match="norm"):  # the checkpoint is not the model's any more
        llm.wake_up()
    assert llm.is_sleeping()


def test_weights_given_as_a_loaded_model_stay_with_their_owner(tiny_engine_model):
    """Engines over the same LoadedModel share its weights: sleep frees one engine's pool only."""
    a, b = LLM(tiny_engine_model, **ENGINE), LLM(tiny_engine_model, **ENGINE)
    before = tokens(a.generate(PROMPTS, PARAMS, use_tqdm=False))
    a.sleep(2)
    assert a.runner.kv is None and a.runner.params is not None
    assert tokens(b.generate(PROMPTS, PARAMS, use_tqdm=False)) == before  # the other engine runs on
    a.wake_up()
    assert tokens(a.generate(PROMPTS, PARAMS, use_tqdm=False)) == before


def test_sleep_is_refused_while_requests_run_and_needs_sleep_mode(tiny_engine_model):
    with pytest.raises(ValueError, match="enable_sleep_mode=True"):
        LLM(tiny_engine_model, num_blocks=16).sleep()
    llm = LLM(tiny_engine_model, **ENGINE)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="sleep level must be 1"):
            llm.sleep(level)
    rid = llm.add_request(PROMPTS[0], PARAMS[0])
    llm.step()
    with pytest.raises(RuntimeError, match=r"1 request\(s\) are unfinished"):
        llm.sleep()
    assert not llm.is_sleeping()
    done = {}
    while llm.has_unfinished_requests():  # the request runs on, untouched
        done.update((o.request_id, o) for o in llm.step() if o.finished)
    assert tokens([done[rid]]) == tokens(LLM(tiny_engine_model, **ENGINE).generate(PROMPTS[0], PARAMS[0],
                                                                                  use_tqdm=False))
    with pytest.raises(ValueError, match=r"tags must be 'weights' and/or 'kv_cache', got \['kv'\]"):
        llm.wake_up(["kv"])
    llm.sleep()
    llm.wake_up("kv_cache")
    assert not llm.is_sleeping()  # the weights were the caller's: never let go


def test_server_sleeps_refuses_requests_and_wakes_up(tiny_engine_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_engine_folder, folder)
    srv = Running(LLM(folder, **ENGINE))
    try:
        def post(path, **kw):
            return httpx.post(srv.url + path, headers=AUTH, timeout=60, **kw)

        def complete():
            return post("/v1/completions", json={"model": "tiny-llama", "prompt": "The paged cache", "max_tokens": 8,
                                                 "temperature": 0})

        before = complete().json()["choices"][0]["text"]
        assert httpx.post(srv.url + "/sleep", timeout=60).status_code == 401  # the API key guards it
        assert post("/sleep", params={"level": 3}).status_code == 400
        assert post("/sleep", params={"level": 2}).status_code == 200
        assert httpx.get(srv.url + "/is_sleeping").json() == {"is_sleeping": True}
        r = complete()
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_sleeping", r.text
        assert post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert httpx.get(srv.url + "/is_sleeping").json() == {"is_sleeping": True}
        assert post("/wake_up", params={"tags": "pool"}).status_code == 400
        assert post("/wake_up").status_code == 200
        assert httpx.get(srv.url + "/is_sleeping").json() == {"is_sleeping": False}
        assert complete().json()["choices"][0]["text"] == before
        assert post("/sleep", params={"level": 2}).status_code == 200
        good = (folder / "model.safetensors").read_bytes()
        weights = load_file(folder / "model.safetensors")
        save_file({k: v for k, v in weights.items() if "layers.1." not in k}, folder / "model.safetensors")
        r = post("/wake_up")  # the checkpoint lost a layer: the weights cannot come back
        assert r.status_code == 500 and r.json()["error"]["code"] == "wake_up_failed", r.text
        assert "layers" in r.json()["error"]["message"]
        assert httpx.get(srv.url + "/is_sleeping").json() == {"is_sleeping": True}
        (folder / "model.safetensors").write_bytes(good)
        assert post("/wake_up").status_code == 200
        assert complete().json()["choices"][0]["text"] == before
    finally:
        srv.stop()


def test_the_server_has_no_sleep_endpoints_without_sleep_mode(tiny_engine_model):
    srv = Running(LLM(tiny_engine_model, num_blocks=16, block_size=8))
    try:
        assert httpx.post(srv.url + "/sleep", headers=AUTH, timeout=60).status_code == 404
        assert httpx.get(srv.url + "/is_sleeping", timeout=60).status_code == 404
    finally:
        srv.stop()


def test_async_engine_refuses_to_sleep_under_a_queued_request_and_runs_it(tiny_engine_model):
    import asyncio

    from jaxpaged.async_engine import AsyncLLM, EngineSleepingError

    llm = LLM(tiny_engine_model, **ENGINE)
    want = tokens(LLM(tiny_engine_model, **ENGINE).generate(PROMPTS[0], PARAMS[0], use_tqdm=False))
    engine = AsyncLLM(llm)

    async def main():
        stream = engine.add_request(PROMPTS[0], PARAMS[0])  # queued for the engine thread, or running
        with pytest.raises(RuntimeError, match=r"request\(s\) are (queued|unfinished)"):
            await engine.sleep()
        assert not await engine.is_sleeping()
        async with stream:
            outs = [o async for o in stream]
        await engine.sleep(1)
        with pytest.raises(EngineSleepingError, match="the engine is sleeping"):
            engine.add_request(PROMPTS[1], PARAMS[0])
        await engine.wake_up()
        await engine.update_weights(load_file(tiny_engine_model.source / "model.safetensors"))  # the same ones
        async with engine.add_request(PROMPTS[0], PARAMS[0]) as again:
            assert tokens([[o async for o in again][-1]]) == want
        return outs[-1]

    try:
        last = asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens([last]) == want and llm.bm.stats().num_used_blocks == 0


def perturbed(folder, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {k: (v + rng.normal(0, 0.3, v.shape)).astype(v.dtype)
            for k, v in load_file(folder / "model.safetensors").items()}


def test_update_weights_gives_the_new_checkpoints_tokens(tiny_engine_folder, tiny_engine_model, tmp_path):
    """A trainer's weights handed over in memory: the tokens of an engine loaded from them, the
    prefix cache forgotten; an engine over the same LoadedModel keeps the old weights; a bad set
    is refused, naming the tensor, with the weights left as they were."""
    new = perturbed(tiny_engine_folder)
    folder = tmp_path / "model"
    shutil.copytree(tiny_engine_folder, folder)
    save_file(new, folder / "model.safetensors", metadata={"format": "pt"})
    want = tokens(LLM(folder, **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False))
    llm, other = LLM(tiny_engine_model, **ENGINE), LLM(tiny_engine_model, **ENGINE)
    old = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    llm.update_weights(new)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    assert tokens(outs) == want != old and all(o.num_cached_tokens == 0 for o in outs)
    assert tokens(other.generate(PROMPTS, PARAMS, use_tqdm=False)) == old  # the LoadedModel's own are untouched
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=r"update_weights: missing tensor model\.layers\.\{1\}\.mlp\.down_proj"):
        llm.update_weights({k: v for k, v in new.items() if k != name})
    with pytest.raises(ValueError, match=name):
        llm.update_weights({**new, name: new[name][:, :-1]})
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == want  # the refused sets changed nothing
    llm.update_weights([(k, jax.numpy.asarray(v)) for k, v in load_file(tiny_engine_folder / "model.safetensors")
                        .items()])  # (name, jax array) pairs: the original weights again
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == old


def test_update_weights_while_asleep_and_refused_under_requests(tiny_engine_folder, tmp_path):
    """The RL loop without a checkpoint: sleep(2), new weights in memory, wake_up."""
    new = perturbed(tiny_engine_folder, seed=1)
    folder = tmp_path / "model"
    shutil.copytree(tiny_engine_folder, folder)
    save_file(new, folder / "model.safetensors", metadata={"format": "pt"})
    want = tokens(LLM(folder, **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False))
    llm = LLM(tiny_engine_folder, **ENGINE)
    llm.sleep(2)
    llm.update_weights(new)
    assert llm.is_sleeping()  # the KV cache is still let go
    llm.wake_up()
    assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == want
    llm.add_request(PROMPTS[0], PARAMS[0])
    with pytest.raises(RuntimeError, match=r"update_weights: 1 request\(s\) are unfinished"):
        llm.update_weights(new)


def test_nothing_reaches_the_device_while_asleep(tiny_engine_folder):
    """A stream made before sleep() and started after it, an AsyncLLM made around an engine
    asleep, an engine over the weights let go: each refused, the engine intact; a refused
    request draws no seed (later unseeded samples are those of an engine never refused)."""
    import asyncio

    from jaxpaged.async_engine import AsyncLLM, EngineSleepingError

    sampled = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)  # unseeded: the engine's seed
    ref = LLM(tiny_engine_folder, **ENGINE)
    ref.stream(PROMPTS[2], PARAMS[0])  # made while awake: a request drawn, as below
    want = tokens(ref.generate(PROMPTS, sampled, use_tqdm=False))
    llm = LLM(tiny_engine_folder, **ENGINE)
    pending = llm.stream(PROMPTS[2], PARAMS[0])
    llm.sleep(1)
    with pytest.raises(RuntimeError, match="asleep"):
        next(pending)
    for refused in (lambda: llm.generate(PROMPTS, sampled, use_tqdm=False), lambda: llm.add_request(PROMPTS[0]),
                    lambda: llm.stream(PROMPTS[0]), lambda: llm.embed(PROMPTS[0], use_tqdm=False)):
        with pytest.raises(RuntimeError, match="asleep"):
            refused()
    with pytest.raises(ValueError, match="let go by its engine's sleep"):
        LLM(llm.loaded, **ENGINE)
    engine = AsyncLLM(llm)
    try:
        async def main():
            assert await engine.is_sleeping()
            with pytest.raises(EngineSleepingError):
                engine.add_request(PROMPTS[0], PARAMS[0])
            await engine.wake_up()
            assert not await engine.is_sleeping()
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens(llm.generate(PROMPTS, sampled, use_tqdm=False)) == want
    assert llm.stats()["num_used_blocks"] == 0


class SleepMachine:
    """Random interleavings of requests, steps, aborts, sleeps, wake-ups and weight updates on one
    engine (hypothesis): a request is refused exactly while the engine sleeps, sleep and
    update_weights exactly while requests are unfinished; every request that finishes has the
    tokens an engine with the weights of its admission gives it alone; no block leaks."""

    GREEDY_AND_SEEDED = [PARAMS[0], PARAMS[1], PARAMS[2]]

    @classmethod
    def build(cls, folder, weights: list[dict], alone: dict):
        from hypothesis import strategies as st
        from hypothesis.stateful import RuleBasedStateMachine, rule

        class Machine(RuleBasedStateMachine):
            def __init__(self):
                super().__init__()
                self.llm = LLM(folder, max_num_seqs=3, num_blocks=14, block_size=4, max_num_batched_tokens=16,
                               enable_sleep_mode=True, debug_checks=True)
                self.current = 0  # the weights in the engine: the checkpoint's (0) or the other set (1)
                self.live: dict[str, tuple[int, int, int]] = {}

            def busy(self) -> bool:
                return self.llm.core.scheduler.has_unfinished()

            def collect(self, outs):
                for o in outs:
                    if o.finished and o.request_id in self.live:
                        p, s, w = self.live.pop(o.request_id)
                        if not any(c.finish_reason == "abort" for c in o.outputs):
                            assert tokens([o]) == alone[p, s, w], (p, s, w)

            @rule(p=st.integers(0, len(PROMPTS) - 1), s=st.integers(0, len(cls.GREEDY_AND_SEEDED) - 1))
            def add(self, p, s):
                if self.llm.is_sleeping():
                    with pytest.raises(RuntimeError, match="asleep"):
                        self.llm.add_request(PROMPTS[p], cls.GREEDY_AND_SEEDED[s])
                else:
                    self.live[self.llm.add_request(PROMPTS[p], cls.GREEDY_AND_SEEDED[s])] = (p, s, self.current)

            @rule(n=st.integers(1, 8))
            def step(self, n):
                for _ in range(n):
                    self.collect(self.llm.step())

            @rule()
            def drain(self):  # so that sleep and update_weights find the engine idle often enough
                if not self.llm.is_sleeping():
                    while self.llm.has_unfinished_requests():
                        self.collect(self.llm.step())

            @rule(data=st.data())
            def abort(self, data):
                if self.live:
                    rid = data.draw(st.sampled_from(sorted(self.live)))
                    self.llm.abort(rid)
                    self.live.pop(rid)

            @rule(level=st.sampled_from([1, 2]))
            def sleep(self, level):
                if self.busy():
                    with pytest.raises(RuntimeError, match="unfinished"):
                        self.llm.sleep(level)
                else:
                    self.llm.sleep(level)
                    assert self.llm.is_sleeping() and self.llm.runner.kv is None and self.llm.runner.params is None
                    if level == 2:
                        self.current = 0  # wake_up reads the checkpoint again

            @rule(tags=st.sampled_from([None, ["weights"], ["kv_cache"]]))
            def wake_up(self, tags):
                self.llm.wake_up(tags)
                assert (self.llm.runner.params is None) == ("weights" in self.llm._asleep)

            @rule(which=st.sampled_from([0, 1]))
            def update_weights(self, which):
                if self.busy():
                    with pytest.raises(RuntimeError, match="unfinished"):
                        self.llm.update_weights(weights[which])
                else:
                    self.llm.update_weights(weights[which])
                    self.current = which

            def teardown(self):
                self.llm.wake_up()
                while self.llm.has_unfinished_requests():
                    self.collect(self.llm.step())
                assert not self.live and self.llm.stats()["num_used_blocks"] == 0
                self.llm.bm.check_invariants()

        return Machine


def test_random_sleep_wake_and_update_traffic(tiny_engine_folder, tmp_path):
    from hypothesis import HealthCheck, settings
    from hypothesis.stateful import run_state_machine_as_test

    weights = [load_file(tiny_engine_folder / "model.safetensors"), perturbed(tiny_engine_folder, seed=2)]
    folder = tmp_path / "other"
    shutil.copytree(tiny_engine_folder, folder)
    save_file(weights[1], folder / "model.safetensors", metadata={"format": "pt"})
    alone = {}
    for w, source in enumerate((tiny_engine_folder, folder)):
        ref = LLM(source, **ENGINE)
        for p, prompt in enumerate(PROMPTS):
            for s, params in enumerate(SleepMachine.GREEDY_AND_SEEDED):
                alone[p, s, w] = tokens(ref.generate(prompt, params, use_tqdm=False))
    machine = SleepMachine.build(tiny_engine_folder, weights, alone)
    run_state_machine_as_test(machine, settings=settings(max_examples=8, stateful_step_count=25, deadline=None,
                                                         suppress_health_check=list(HealthCheck)))
