"""Data parallelism on 2 simulated CPU devices: each request gets the outputs one replica gives
it, under random traffic and memory pressure too, and nothing leaks in either replica.

Needs 2 devices before jax starts, so ``tests/test_data_parallel.py`` runs this module in its
own process:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m pytest tests/dp_cases.py
"""

import os
import re

import jax
import numpy as np
import pytest
import traffic
from safetensors.numpy import load_file
from test_engine_traffic import alone_engine, assert_same_as_alone, preemption_bound

from jaxpaged import LLM, SamplingParams
from jaxpaged.dp_attention import DPAttentionRunner
from jaxpaged.loader import load_model

pytestmark = pytest.mark.skipif(jax.device_count() < 2,
                                reason="needs XLA_FLAGS=--xla_force_host_platform_device_count=2")

# Rounds of random traffic on the model with enable_dp_attention (each compiles its own shapes;
# these two abort requests, preempt, and one schedules asynchronously).
DPA_ROUNDS = (201, 209)
ENGINE = dict(block_size=4, num_blocks=32, max_num_seqs=3, max_num_batched_tokens=32, debug_checks=True)
CODE = r"[a-z]{2}-[0-9]{3}"  # a structured output's regex


@pytest.fixture(scope="module")
def model():
    """The tiny engine model (the real tokenizer): built by the parent test (torch stays there)."""
    return load_model(os.environ["JAXPAGED_DP_TINY"], attention_backend="xla")


def _requests(vocab_size: int):
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab_size, int(n)).tolist()} for n in rng.integers(3, 60, 10)]
    prompts += ["the paged cache of blocks", "a river and a stone"]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, ignore_eos=True),
              SamplingParams(use_beam_search=True, beam_width=2, temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, stop=["the", "a"], repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=20, structured_outputs=dict(regex=CODE))]
    return prompts, [params[i % len(params)] for i in range(len(prompts))]


# Two of the four pairings (suite time): the random traffic below runs separate replicas with
# and without async scheduling, and dp-attention's rounds alternate it too.
@pytest.mark.parametrize("async_scheduling, dp_attention", [(False, False), (True, True)])
def test_two_replicas_give_each_request_what_one_gives_it(model, async_scheduling, dp_attention):
    """Greedy (with logprobs), seeded top-p, n = 2, beam search, stop strings with a penalty,
    prompt logprobs and a structured output, over a pool small enough to preempt: the same completions as one replica, both
    replicas used, their pools on their own devices, and every block free at the end; the
    replicas as separate programs or, with ``enable_dp_attention``, as one (the MLP split
    between the devices sums in another order: logprobs agree to float32 rounding)."""
    prompts, params = _requests(model.config.vocab_size)
    one = LLM(model, async_scheduling=async_scheduling, **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, data_parallel_size=2, async_scheduling=async_scheduling, enable_dp_attention=dp_attention,
              **ENGINE)
    two = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(one, two):
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        if a.prompt_logprobs is not None:
            np.testing.assert_allclose([d[t].logprob for d, t in zip(a.prompt_logprobs[1:], a.prompt_token_ids[1:])],
                                       [d[t].logprob for d, t in zip(b.prompt_logprobs[1:], b.prompt_token_ids[1:])],
                                       rtol=1e-5, atol=1e-5)
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids, y.text, y.finish_reason, y.stop_reason), (a.prompt, x, y)
            if x.logprobs:
                np.testing.assert_allclose([d[t].logprob for d, t in zip(x.logprobs, x.token_ids)],
                                           [d[t].logprob for d, t in zip(y.logprobs, y.token_ids)],
                                           rtol=1e-5, atol=1e-5)
    structured = [c.text for o, p in zip(two, params) if p.structured_outputs is not None for c in o.outputs]
    assert len(structured) == 2 and all(re.fullmatch(CODE, t) for t in structured), structured
    devices = [next(iter(r.kv.k.devices())) for r in llm.runner.parts]
    assert devices == jax.devices()[:2]
    if dp_attention:  # one program ran the replicas' steps, and a replica alone the steps only it had work for
        assert isinstance(llm.runner, DPAttentionRunner) and llm.runner.compiled_shapes
        assert any(r.compiled_shapes for r in llm.runner.parts)
    else:
        assert all(r.compiled_shapes for r in llm.runner.parts)  # both replicas ran steps
    stats = llm.stats()
    assert stats["num_used_blocks"] == 0 and stats["num_blocks"] == 2 * (ENGINE["num_blocks"] - 1)
    assert stats["num_preemptions"] > 0  # the pools were small enough to matter
    llm.bm.check_invariants()


def test_requests_go_to_the_least_loaded_replica_and_an_abort_frees_its_own(model):
    llm = LLM(model, data_parallel_size=2, **ENGINE)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [llm.add_request({"prompt_token_ids": [5 + i] * (10 + i)}, sp) for i in range(5)]
    homes = [llm.scheduler.replica_of(r) for r in ids]
    assert homes == [0, 1, 0, 1, 0]
    for _ in range(3):
        llm.step()
    used = [p.kv.stats().num_used_blocks for p in llm.scheduler.parts]
    assert all(used)
    llm.abort(ids[1])  # replica 1 held requests 1 and 3
    after = [p.kv.stats().num_used_blocks for p in llm.scheduler.parts]
    assert after[0] == used[0] and after[1] < used[1]
    assert llm.scheduler.replica_of(ids[1]) is None
    nxt = llm.add_request({"prompt_token_ids": [9] * 12}, sp)  # replica 1 has one request left, replica 0 three
    assert llm.scheduler.replica_of(nxt) == 1
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats()["num_used_blocks"] == 0


def test_random_traffic_with_the_paging_oracle_on_two_replicas(model):
    """The traffic of ``test_engine_traffic`` (any pool, swap or recompute, prefix caching, the
    contiguous baseline, async or not, aborts), each replica's steps run by its own paging
    oracle: every request finishes or is aborted or rejected, with its tokens alone, each
    replica keeps its limits, FCFS and preemption bound, and no block is left in use."""
    alone = alone_engine(model, oracle=True)
    totals = dict(requests=0, compared=0, aborted=0, preemptions=0, swapped_blocks=0, rejected=0)
    for seed in range(24):
        rnd = traffic.make_round(seed, num_requests=30, vocab_size=model.config.vocab_size, any_geometry=True)
        rnd.engine["data_parallel_size"] = 2
        res = traffic.run_round(model, rnd, oracle=True)
        assert res.max_live_seqs <= rnd.engine["max_num_seqs"]
        totals["compared"] += assert_same_as_alone(res, alone)
        if not res.aborted:
            preemption_bound(res, rnd.engine["block_size"])  # a replica's requests are a subset: the bound holds
        totals["requests"] += len(rnd.arrivals)
        totals["aborted"] += len(res.aborted)
        totals["rejected"] += len(res.rejected)
        totals["preemptions"] += res.num_preemptions
        totals["swapped_blocks"] += res.num_swapped_out_blocks
    print(totals)
    assert totals["compared"] >= 500 and all(totals[k] > 0 for k in ("aborted", "rejected", "preemptions",
                                                                      "swapped_blocks"))


def test_random_traffic_on_the_model_with_dp_attention(model):
    """The engine's random traffic on the model itself, the replicas' steps as one program
    (``enable_dp_attention``): every request finishes or is aborted or rejected with the
    tokens it gets alone on one device (up to float32 ties, as the model tier of
    ``test_engine_traffic`` allows), each replica keeps its limits and FCFS, and no block is
    left in use."""
    alone = alone_engine(model, oracle=False)
    totals = dict(requests=0, compared=0, aborted=0, preemptions=0, async_rounds=0)
    for seed in DPA_ROUNDS:
        rnd = traffic.make_round(seed, num_requests=20, vocab_size=model.config.vocab_size)
        rnd.engine.update(data_parallel_size=2, enable_dp_attention=True)
        res = traffic.run_round(model, rnd, oracle=False)
        assert res.max_live_seqs <= rnd.engine["max_num_seqs"]
        totals["compared"] += assert_same_as_alone(res, alone, ties=True)
        totals["requests"] += len(rnd.arrivals)
        totals["aborted"] += len(res.aborted)
        totals["preemptions"] += res.num_preemptions
        totals["async_rounds"] += rnd.engine["async_scheduling"]
    print(totals)
    assert totals["compared"] >= 5 * len(DPA_ROUNDS) and all(totals[k] > 0 for k in ("aborted", "preemptions",
                                                                             "async_rounds"))


SPEC = {"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


def test_random_traffic_with_drafts_on_two_replicas(model):
    """Speculative decoding on each replica, under the oracle's random traffic (its outputs
    repeat themselves, so drafts are accepted): each request gets its tokens alone on one
    replica without drafts, and nothing leaks (``run_round``)."""
    alone = alone_engine(model, oracle=True, oracle_markov=1)
    totals = dict(compared=0, draft_tokens=0, accepted_tokens=0)
    for seed in range(8):
        rnd = traffic.make_round(seed, num_requests=30, vocab_size=model.config.vocab_size, any_geometry=True)
        rnd.engine.update(data_parallel_size=2, speculative_config=SPEC, oracle_markov=1)
        res = traffic.run_round(model, rnd, oracle=True)
        totals["compared"] += assert_same_as_alone(res, alone)
        totals["draft_tokens"] += res.num_draft_tokens
        totals["accepted_tokens"] += res.num_accepted_tokens
    print(totals)
    assert totals["compared"] >= 150 and 0 < totals["accepted_tokens"] < totals["draft_tokens"]


# With dp-attention only (suite time): separate replicas draft under the random traffic above.
def test_drafts_on_two_replicas_give_the_tokens_of_one_without(model):
    """Periodic prompts, greedy and seeded, on two replicas run as one program, with drafts: the
    tokens one replica gives without drafts, drafts checked on both replicas."""
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": (rng.integers(3, 300, int(p)).tolist() * 20)[:24]} for p in (1, 2, 3, 2, 1, 3)]
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)] * 3
    one = LLM(model, **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = LLM(model, data_parallel_size=2, enable_dp_attention=True, speculative_config=SPEC, **ENGINE)
    two = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in two] == [o.outputs[0].token_ids for o in one]
    assert all(p.num_draft_tokens > 0 for p in llm.scheduler.parts)
    assert llm.stats()["num_used_blocks"] == 0


def test_embeddings_on_two_replicas_and_refused_with_dp_attention(model):
    """Two replicas embed as one engine does (each replica's runner returns its hidden states);
    the joint dp-attention program returns none, so embedding requests are refused there."""
    prompts = _requests(model.config.vocab_size)[0][:6]
    want = LLM(model, **ENGINE).embed(prompts, use_tqdm=False)
    got = LLM(model, data_parallel_size=2, **ENGINE).embed(prompts, use_tqdm=False)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.outputs.embedding, b.outputs.embedding, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="not supported with enable_dp_attention"):
        LLM(model, data_parallel_size=2, enable_dp_attention=True, **ENGINE).embed(prompts, use_tqdm=False)


def test_errors_name_the_setting(model):
    with pytest.raises(ValueError, match="data_parallel_size=3 needs 3 devices, but only 2"):
        LLM(model, data_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="tensor_parallel_size=2: replicas of several devices are not supported"):
        LLM(model, data_parallel_size=2, tensor_parallel_size=2, **ENGINE)


def test_cli_flag(capsys):
    from jaxpaged.cli import main as cli_main

    folder = os.environ["JAXPAGED_DP_TINY"]
    assert cli_main(["the river", "a stone", "--model", folder, "-dp", "2", "--max-tokens", "5", "--temperature", "0",
                     "--no-progress"]) == 0
    assert capsys.readouterr().out.strip()
    assert cli_main(["the river", "--model", folder, "-dp", "2", "--enable-dp-attention", "--max-tokens", "5",
                     "--no-progress"]) == 0
    assert capsys.readouterr().out.strip()
    assert cli_main(["hi", "--model", folder, "--data-parallel-size", "4", "--no-progress"]) == 1
    assert "data_parallel_size=4 needs 4 devices" in capsys.readouterr().err


def test_lora_on_two_replicas_gives_what_one_engine_gives(model, tmp_path):
    """Each replica holds the adapters its requests use (its own slots; max_loras per replica):
    the tokens one engine gives, with two adapters for one slot a replica."""
    from paged import write_lora_adapter

    from jaxpaged import LoRARequest

    loras = [LoRARequest(name, i, str(write_lora_adapter(tmp_path / name, model.config, rank=2, alpha=4, seed=i,
                                                             modules=("k_proj", "gate_proj"))))
             for i, name in enumerate("ab", 1)]
    prompts = _requests(model.config.vocab_size)[0][:6]
    per_prompt = [(None, *loras)[i % 3] for i in range(len(prompts))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(model, enable_lora=True, **ENGINE).generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
    llm = LLM(model, data_parallel_size=2, enable_lora=True, **ENGINE)
    got = llm.generate(prompts, params, lora_request=per_prompt, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.stats()["num_used_blocks"] == 0
    base = LLM(model, **ENGINE).generate(prompts[1:3], params, use_tqdm=False)  # the adapters do change the tokens
    assert all(a.outputs[0].token_ids != b.outputs[0].token_ids for a, b in zip(base, want[1:3]))


# With dp-attention only (suite time): its runner sleeps and wakes the replicas as the plain
# replicas' runner does (each part in turn), and the joint step's split weights besides.
def test_sleep_and_wake_up_on_two_replicas(model):
    """Sleep mode (levels 1 and 2) lets go of every replica's weights and pool, and of the joint
    step's split weights; both come back on their devices and give the same tokens."""
    prompts, params = _requests(model.config.vocab_size)
    llm = LLM(os.environ["JAXPAGED_DP_TINY"], data_parallel_size=2, enable_dp_attention=True,
              enable_sleep_mode=True, **ENGINE)
    before = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts[:6], params[:6], use_tqdm=False)]
    for level in (1, 2):
        llm.sleep(level)
        assert all(r.params is None and r.kv is None for r in llm.runner.parts)
        assert llm.runner.params is None and llm.runner.head is None
        llm.wake_up()
        for r, device in zip(llm.runner.parts, jax.devices()[:2]):
            assert {d for a in (*r.params, r.kv.k, r.kv.v) for d in a.devices()} == {device}
        after = llm.generate(prompts[:6], params[:6], use_tqdm=False)
        assert [[c.token_ids for c in o.outputs] for o in after] == before
    llm.update_weights(load_file(os.path.join(os.environ["JAXPAGED_DP_TINY"], "model.safetensors")))  # the same
    for r, device in zip(llm.runner.parts, jax.devices()[:2]):
        assert {d for a in r.params for d in a.devices()} == {device}
    after = llm.generate(prompts[:6], params[:6], use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in after] == before
    assert llm.stats()["num_used_blocks"] == 0
