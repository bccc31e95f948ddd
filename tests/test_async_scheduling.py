"""Async scheduling (issue #17): step N+1 is scheduled and dispatched while step N runs, and
the tokens are exactly the synchronous loop's.

Random traffic runs both loops too (``traffic.py`` draws the loop per round, and every
request is compared with the synchronous engine); these tests pin the named cases:
preemption by recompute and by swap, prefix caching, ``n > 1``, beams, stop strings,
penalties, ``min_tokens``, logprobs, aborts while a step is in flight, and the real model.
"""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.batch import build_batch
from jaxpaged.sampler import SamplingRow, build_sampling_metadata
from jaxpaged.scheduler import ScheduledSeq, SchedulerOutput
from jaxpaged.sequence import Request

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def mixed_requests(vocab: int):
    """Every kind of request, with shared prefixes so the prefix cache hits."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, vocab, 20).tolist()
    prompts = [prefix + rng.integers(3, vocab, int(n)).tolist() for n in rng.integers(1, 30, 9)]
    prompts += ["the paged cache of blocks", "a river and a stone", "some words"]
    params = [
        GREEDY,
        SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop=["e", "a"]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=18, repetition_penalty=1.3, presence_penalty=0.5),
        SamplingParams(temperature=0.8, seed=11, max_tokens=16, min_tokens=8, stop_token_ids=[5, 9, 17]),
        SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True),
        GREEDY.replace(max_tokens=5),
        SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=22, ignore_eos=True, frequency_penalty=0.4),
        GREEDY.replace(max_tokens=40),
        SamplingParams(temperature=0, max_tokens=25, stop=[" "]),
        # Its sampler needs the token before on the host twice over: the mask and the penalty.
        SamplingParams(temperature=0.7, seed=2, max_tokens=14, presence_penalty=0.3,
                       structured_outputs={"regex": "[a-z]{3,9}( [a-z]{2,5}){1,3}"}),
    ]
    return prompts, params


def run(model, prompts, params, **kw):
    kw = {"block_size": 4, "num_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64,
          "max_model_len": 128, "debug_checks": True, "async_scheduling": False, **kw}
    llm = LLM(model, **kw)
    outs = llm.generate(prompts, params, use_tqdm=False)
    while llm.has_unfinished_requests():  # the step dispatched after the last request finished
        llm.step()
    s = llm.stats()
    assert s["num_used_blocks"] == 0 and s["num_host_blocks_used"] == 0, s
    llm.bm.check_invariants()
    return outs, llm


def assert_same(outs, ref):
    for o, r in zip(outs, ref):
        assert len(o.outputs) == len(r.outputs), (o, r)
        for c, d in zip(o.outputs, r.outputs):
            assert (c.token_ids, c.text, c.finish_reason, c.stop_reason) == (
                d.token_ids, d.text, d.finish_reason, d.stop_reason), (o.request_id, c, d)
            if c.logprobs is not None:
                for got, want in zip(c.logprobs, d.logprobs):
                    assert got.keys() == want.keys()
                    np.testing.assert_allclose([v.logprob for v in got.values()],
                                               [v.logprob for v in want.values()], rtol=1e-4, atol=1e-4)
        if r.prompt_logprobs is not None:
            assert [p and p.keys() for p in o.prompt_logprobs] == [p and p.keys() for p in r.prompt_logprobs]


@pytest.mark.parametrize("pool", [
    dict(),  # roomy: overlap on every step it is allowed
    dict(num_blocks=40),  # recompute preemption
    dict(num_blocks=40, preemption_mode="swap", swap_space=24 * 4 * 2 * 2 * 16 * 4),  # swap preemption
    dict(num_blocks=40, enable_prefix_caching=False),
], ids=["roomy", "recompute", "swap", "no-prefix-cache"])
def test_async_gives_the_synchronous_loops_tokens(tiny_engine_model, pool):
    prompts, params = mixed_requests(tiny_engine_model.config.vocab_size)
    ref, sync = run(tiny_engine_model, prompts, params, **pool)
    outs, llm = run(tiny_engine_model, prompts, params, async_scheduling=True, **pool)
    assert_same(outs, ref)
    assert llm.core.num_steps_ahead > llm.core.num_steps // 3, (llm.core.num_steps_ahead, llm.core.num_steps)
    assert sync.core.num_steps_ahead == 0
    if "num_blocks" in pool:
        assert llm.stats()["num_preemptions"] > 0
    if pool.get("preemption_mode") == "swap":
        assert llm.stats()["num_swapped_out_blocks"] > 0
    if pool.get("enable_prefix_caching", True):
        assert llm.stats()["prefix_cache_hits"] > 0


def test_stops_are_learned_one_step_late_and_the_extra_token_dropped(tiny_engine_model):
    """A stop string ends a sequence on the host one step after the device sampled it: the
    token sampled meanwhile is dropped. Length limits are known ahead: nothing is dropped."""
    prompts, _ = mixed_requests(tiny_engine_model.config.vocab_size)
    _, llm = run(tiny_engine_model, prompts[:4], GREEDY, async_scheduling=True)
    assert llm.scheduler.num_dropped_tokens == 0  # max_tokens: no step past the last token
    stop = SamplingParams(temperature=0, max_tokens=40, stop=["e"])
    outs, llm = run(tiny_engine_model, prompts[:6], stop, async_scheduling=True)
    stopped = sum(o.outputs[0].stop_reason == "e" for o in outs)
    assert stopped > 0 and llm.scheduler.num_dropped_tokens == stopped


def test_abort_while_a_step_is_in_flight(tiny_engine_model):
    prompts, _ = mixed_requests(tiny_engine_model.config.vocab_size)
    llm = LLM(tiny_engine_model, block_size=4, num_blocks=128, max_model_len=128, debug_checks=True,
              async_scheduling=True)
    ids = [llm.add_request(p, GREEDY) for p in prompts[:4]]
    for _ in range(6):
        llm.step()
    assert llm.core._inflight is not None  # step 7 runs on the device now
    llm.abort(ids[1])
    outs = {}
    while llm.has_unfinished_requests():
        outs.update({o.request_id: o for o in llm.step()})
    assert ids[1] not in outs and set(outs) == {ids[0], ids[2], ids[3]}
    ref = LLM(tiny_engine_model, block_size=4, num_blocks=128, max_model_len=128, async_scheduling=False).generate(
        [prompts[i] for i in (0, 2, 3)], GREEDY, use_tqdm=False)
    assert [outs[i].outputs[0].token_ids for i in (ids[0], ids[2], ids[3])] == [r.outputs[0].token_ids for r in ref]
    assert llm.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("defer", [True, False], ids=["sampler waits", "request waits"])
def test_penalised_requests_get_their_tokens_counted(tiny_engine_model, defer):
    """Penalties count every generated token. By default the step runs ahead anyway and its
    sampler waits for the token (launched once the step before is applied); with a runner
    that cannot wait to sample (``defer_sampling`` off), the request is not scheduled while
    its last token is still on the device, and the others still run ahead. Either way the
    tokens are the synchronous loop's."""
    prompts, _ = mixed_requests(tiny_engine_model.config.vocab_size)
    pen = SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                         presence_penalty=0.5, frequency_penalty=0.3)
    free = GREEDY.replace(max_tokens=12)
    ref = LLM(tiny_engine_model, block_size=4, num_blocks=128, max_model_len=128, async_scheduling=False).generate(
        prompts[:2], [pen, free], use_tqdm=False)
    llm = LLM(tiny_engine_model, block_size=4, num_blocks=128, max_model_len=128, async_scheduling=True)
    assert llm.core.defer_sampling  # the model runner can wait to sample
    llm.core.defer_sampling = defer
    p_id = llm.add_request(prompts[0], pen)
    g_id = llm.add_request(prompts[1], free)
    steps, outs = [], {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
        if llm.core.last.scheduled:
            steps.append({s.seq.request.request_id for s in llm.core.last.scheduled})
    assert [outs[i].outputs[0].token_ids for i in (p_id, g_id)] == [r.outputs[0].token_ids for r in ref]
    if defer:  # both in every step, each after the first run ahead
        assert steps == [{p_id, g_id}] * 12 and llm.core.num_steps_ahead == 11
    else:  # both prefill in step 0; the other decodes in each of the next 11, the penalised
        # one in every other step while it runs ahead, then alone (an empty step between its own)
        assert [g_id in s for s in steps] == [True] * 12 + [False] * 6
        assert [p_id in s for s in steps] == [True, False] * 6 + [True] * 6


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, seed=4, max_tokens=12, ignore_eos=True, presence_penalty=0.5),
    SamplingParams(temperature=0.7, seed=4, max_tokens=12, structured_outputs={"regex": "[a-z]{20}"}),
], ids=["penalties", "structured"])
def test_an_interrupt_while_a_sampler_waits_leaves_the_engine_usable(tiny_engine_model, params):
    """Ctrl-C while step N is collected and step N+1's sampler waits for its tokens: ``generate``
    aborts its requests; the next step launches the waiting sampler (the aborted rows sample
    plainly, their tokens dropped) and the engine runs on, its next request the synchronous one's."""
    kw = dict(block_size=4, num_blocks=64, max_model_len=128)
    ref = LLM(tiny_engine_model, async_scheduling=False, **kw).generate(["a river and a stone"], params,
                                                                       use_tqdm=False)
    for at in (2, 4):
        llm = LLM(tiny_engine_model, async_scheduling=True, **kw)
        real, calls = llm.runner.collect, []

        def collect(step):
            calls.append(step)
            if len(calls) == at:
                raise KeyboardInterrupt
            return real(step)

        llm.runner.collect = collect
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["the paged cache"], params, use_tqdm=False)
        assert llm.core._inflight is not None and llm.core._inflight.sampler_waits  # the case at hand
        out = llm.generate(["a river and a stone"], params, use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref[0].outputs[0].token_ids
        assert llm.stats()["num_used_blocks"] == 0


def test_the_default_model_gives_the_same_text(smollm):
    llm = LLM(smollm, max_model_len=512, async_scheduling=False)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in (
        "What is the capital of France?", "Write a haiku about memory pages.", "Count from 1 to 10.")]
    prompts = [{"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0.7, seed=1, max_tokens=40),
              SamplingParams(temperature=0, max_tokens=40, stop=["5"])]
    ref = llm.generate(prompts, params, use_tqdm=False)
    outs = LLM(smollm, max_model_len=512, async_scheduling=True).generate(prompts, params, use_tqdm=False)
    assert_same(outs, ref)


# ---- the pieces -------------------------------------------------------------------------


def test_build_batch_points_pending_tokens_at_the_previous_rows():
    req = Request("r", None, [3, 4, 5], GREEDY, 0.0, 0)
    seq = req.seqs[0]
    seq.num_computed_tokens, seq.num_pending = 3, 1  # the 4th token is on the device
    other = Request("o", None, [7, 8], GREEDY, 0.0, 0).seqs[0]
    out = SchedulerOutput([ScheduledSeq(other, 0, 2, 1, [1], 2), ScheduledSeq(seq, 3, 1, 1, [2], 4)], [], [], [])
    batch = build_batch(out, block_size=4, max_blocks_per_seq=4, pending_rows={seq.seq_id: 5})
    assert batch.tokens[:3].tolist() == [7, 8, 0]
    assert batch.token_src[:3].tolist() == [-1, -1, 5] and (batch.token_src[3:] == -1).all()
    with pytest.raises(IndexError, match="the host knows 3 of its tokens"):
        build_batch(out, block_size=4, max_blocks_per_seq=4)


def test_sampler_rows_count_pending_tokens_and_refuse_penalties_without_them():
    p = SamplingParams(temperature=0.5, min_tokens=3)
    sm, _, _ = build_sampling_metadata([SamplingRow(p, 1, [3], [4], 2), SamplingRow(p, 1, [3], [4, 5, 6])], 2, 32, [2])
    assert sm.output_pos.tolist() == [2, 3]
    assert sm.banned_ids[0, 0] == 2 and (sm.banned_ids[1] == -1).all()  # EOS banned below min_tokens
    with pytest.raises(ValueError, match="penalties need every output token on the host"):
        build_sampling_metadata([SamplingRow(p.replace(presence_penalty=1.0), 1, [3], [4], 2)], 1, 32, [2])
