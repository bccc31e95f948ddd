"""Priority scheduling (vLLM's ``scheduling_policy="priority"``): requests run in order of
their priority (lower first), then of arrival, and a better request preempts worse running ones
to make room for itself. The random-traffic tiers (``traffic.py``) run it too, and check
after every step that a preempted request never waits while a worse one runs."""

import random

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make(model, **kw):
    kw.setdefault("debug_checks", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    kw.setdefault("scheduling_policy", "priority")
    return LLM(model, **kw)


def drain(llm, max_steps=2000):
    """Step until idle: the final outputs in the order they finished, and the ids scheduled
    in each step (in the scheduler's order)."""
    done, steps = [], []
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            return done, steps
        done += [o for o in llm.step() if o.finished]
        steps.append([r.request_id for r in llm.scheduler.running])
    raise AssertionError(f"still unfinished after {max_steps} steps: livelock")


def prompts(n, length, seed):
    rnd = random.Random(seed)
    return [[rnd.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def test_priority_is_checked_before_any_work(tiny_engine_model):
    fcfs = make(tiny_engine_model, scheduling_policy="fcfs")
    with pytest.raises(ValueError, match="priority 3 needs scheduling_policy='priority'.*'fcfs'"):
        fcfs.add_request([5, 6], GREEDY, priority=3)
    with pytest.raises(ValueError, match="priority -1 needs"):
        fcfs.generate([[5, 6], [7]], GREEDY, priority=[0, -1], use_tqdm=False)
    assert not fcfs.has_unfinished_requests()  # the good prompt before the bad one was not queued either
    fcfs.add_request([5, 6], GREEDY, priority=0)  # 0 is every request's priority under FCFS
    llm = make(tiny_engine_model)
    with pytest.raises(TypeError, match="priority must be an int, got True"):
        llm.add_request([5, 6], GREEDY, priority=True)
    with pytest.raises(TypeError, match="priority must be an int, got 1.5"):
        llm.add_request([5, 6], GREEDY, priority=1.5)
    with pytest.raises(ValueError, match=r"one int per prompt \(2\), got \[1\]"):
        llm.generate([[5, 6], [7]], GREEDY, priority=[1], use_tqdm=False)
    with pytest.raises(ValueError, match=r"one int per prompt \(2\), got array\(\[\[1, 0\]\]\)"):
        llm.generate([[5, 6], [7]], GREEDY, priority=np.array([[1, 0]]), use_tqdm=False)
    with pytest.raises(ValueError, match="scheduling_policy='lifo'; choose from"):
        make(tiny_engine_model, scheduling_policy="lifo")
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_requests_run_in_order_of_priority_then_arrival(tiny_engine_model, async_scheduling):
    """One sequence at a time: the queue empties in (priority, arrival) order, whatever the
    order the requests came in; under FCFS, in arrival order."""
    ps = prompts(5, 6, seed=0)
    order = [2, 0, 2, -3, 0]
    for policy, want in (("priority", [3, 1, 4, 0, 2]), ("fcfs", [0, 1, 2, 3, 4])):
        llm = make(tiny_engine_model, max_num_seqs=1, async_scheduling=async_scheduling, scheduling_policy=policy)
        ids = [llm.add_request(p, GREEDY, priority=prio if policy == "priority" else 0)
               for p, prio in zip(ps, order)]
        done, _ = drain(llm)
        assert [o.request_id for o in done] == [ids[i] for i in want]
        assert all(o.metrics.num_preemptions == 0 for o in done)
    # generate() takes one priority per prompt (a list or an array) and returns its outputs in input order.
    llm = make(tiny_engine_model, max_num_seqs=1, async_scheduling=async_scheduling)
    outs = llm.generate(ps, GREEDY, priority=np.array(order) if async_scheduling else order, use_tqdm=False)
    firsts = [o.metrics.first_scheduled_time for o in outs]
    assert sorted(range(5), key=firsts.__getitem__) == [3, 1, 4, 0, 2]
    alone = make(tiny_engine_model, async_scheduling=async_scheduling, scheduling_policy="fcfs")
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in alone.generate(ps, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_a_better_request_preempts_worse_running_ones_to_fit(tiny_engine_model, preemption_mode, async_scheduling):
    """Two requests of priority 1 hold most of the pool; one of priority 0 that does not fit
    beside them arrives: it preempts the newer of them (the worse) and runs at once, beside
    the older; the preempted one resumes when there is room, last, and gets its tokens
    alone. Under FCFS the same arrival waits for both instead."""
    low1, low2, high = prompts(3, 20, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for policy in ("priority", "fcfs"):
        llm = make(tiny_engine_model, num_blocks=17, max_num_batched_tokens=64, enable_prefix_caching=False,
                   preemption_mode=preemption_mode, swap_space=1 << 20 if preemption_mode == "swap" else 0,
                   async_scheduling=async_scheduling, scheduling_policy=policy)
        a = llm.add_request(low1, params, priority=1 if policy == "priority" else 0)
        b = llm.add_request(low2, params, priority=1 if policy == "priority" else 0)
        done, steps = [], []
        for _ in range(3):  # both prefilled and decoding: 2 x 6 of the 16 usable blocks (8 each at the end)
            done += [o for o in llm.step() if o.finished]
        assert {r.request_id for r in llm.scheduler.running} == {a, b} and not done
        c = llm.add_request(high, params, priority=0)  # needs 6 blocks: only with one of them out
        more, steps = drain(llm)
        s = llm.stats()
        assert s["num_used_blocks"] == 0 and s["num_host_blocks_used"] == 0, s
        llm.bm.check_invariants()
        assert (s["num_preemptions"] > 0) == (policy == "priority")
        assert (s["num_swapped_out_blocks"] > 0) == (policy == "priority" and preemption_mode == "swap")
        results[policy] = {o.request_id: o for o in done + more}, [o.request_id for o in done + more], steps
    outs, finished, steps = results["priority"]
    assert finished == [a, c, b]  # (a had a head start)
    assert outs[b].metrics.num_preemptions >= 1 and outs[a].metrics.num_preemptions == 0
    assert outs[c].metrics.num_preemptions == 0
    assert c in steps[0] and b not in steps[0]  # admitted in the first step after it came, in b's place
    outs_fcfs, finished_fcfs, _ = results["fcfs"]
    assert finished_fcfs == [a, b, c] and all(o.metrics.num_preemptions == 0 for o in outs_fcfs.values())
    for rid, want in ((a, a), (b, b), (c, c)):
        assert outs[rid].outputs[0].token_ids == outs_fcfs[want].outputs[0].token_ids


def test_a_better_request_takes_a_sequence_slot_from_a_worse_one(tiny_engine_model):
    """``max_num_seqs`` full of worse requests: the better one preempts the last of them."""
    ps = prompts(3, 5, seed=2)
    llm = make(tiny_engine_model, max_num_seqs=2, async_scheduling=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    low = [llm.add_request(p, params, priority=5) for p in ps[:2]]
    llm.step()
    high = llm.add_request(ps[2], params, priority=-5)
    llm.step()
    assert [r.request_id for r in llm.scheduler.running] == [high, low[0]]
    assert [r.request_id for r in llm.scheduler.waiting] == [low[1]]
    done, _ = drain(llm)
    assert [o.request_id for o in done] == [low[0], high, low[1]]  # (low[0] had a head start)
    ref = make(tiny_engine_model, scheduling_policy="fcfs").generate(ps, params, use_tqdm=False)
    assert {o.request_id: o.outputs[0].token_ids for o in done} == {
        rid: r.outputs[0].token_ids for rid, r in zip([*low, high], ref)}


def test_equal_priorities_keep_fcfs_and_never_preempt_for_a_newer_request(tiny_engine_model):
    """Within one priority the order is arrival: a newer request of the same priority waits
    for room as under FCFS, and never preempts."""
    low1, low2, new = prompts(3, 20, seed=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = make(tiny_engine_model, num_blocks=17, max_num_batched_tokens=64, enable_prefix_caching=False,
               async_scheduling=False)
    a, b = (llm.add_request(p, params, priority=2) for p in (low1, low2))
    for _ in range(3):
        llm.step()
    c = llm.add_request(new, params, priority=2)
    done, _ = drain(llm)
    assert [o.request_id for o in done] == [a, b, c]
    assert all(o.metrics.num_preemptions == 0 for o in done)


def test_a_request_preempted_one_token_short_of_max_tokens_comes_back_whole(tiny_engine_model):
    """A request that fills the whole pool with its last step to go is preempted by a better
    one: readmitted, it samples its last token from what it holds and needs no slot past it,
    so it finishes with all its tokens, as alone (found by fuzzing: it was cut by length)."""
    prompt = list(range(100, 134))  # 34 + 14 outputs = 48 slots: 12 blocks, the whole pool
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)
    kw = dict(block_size=4, num_blocks=13, max_model_len=64, enable_prefix_caching=False, async_scheduling=False)
    alone = make(tiny_engine_model, **kw).generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert len(alone.token_ids) == 15 and alone.finish_reason == "length"
    llm = make(tiny_engine_model, **kw)
    a = llm.add_request(prompt, params, priority=1)
    while len(llm.core.requests[a].seqs[0].token_ids) < 48:
        llm.step()
    b = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), priority=0)
    done, _ = drain(llm)
    outs = {o.request_id: o for o in done}
    assert [o.request_id for o in done] == [b, a] and outs[a].metrics.num_preemptions == 1
    assert outs[a].outputs[0].token_ids == alone.token_ids and outs[a].outputs[0].finish_detail is None
    assert llm.stats()["num_used_blocks"] == 0
