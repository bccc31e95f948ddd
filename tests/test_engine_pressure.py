"""The engine under memory pressure and odd traffic: one regression test per failure of issue #14.

Each was written before its fix and failed on the engine of commit db8bdf4; the last one
(a longer random-traffic run, eleventh session) on that of commit e620ae6.
"""

import pytest

from jaxpaged import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make(model, **kw):
    kw.setdefault("debug_checks", True)
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 64)
    return LLM(model, **kw)


def drain(llm, outs=None, max_steps=2000):
    """Step until idle; the last output of every request, by id."""
    outs = {} if outs is None else outs
    for _ in range(max_steps):
        if not llm.has_unfinished_requests():
            return outs
        outs.update({o.request_id: o for o in llm.step()})
    raise AssertionError(f"still unfinished after {max_steps} steps: livelock")


def alone(model, prompt, params):
    return make(model, num_blocks=256).generate([prompt], params, use_tqdm=False)[0]


def assert_idle(llm):
    s = llm.stats()
    assert s["num_used_blocks"] == 0 and s["num_host_blocks_used"] == 0, s
    llm.bm.check_invariants()


def test_request_that_outgrows_the_pool_alone_is_finished_not_the_engine(tiny_engine_model, caplog):
    """Before: it preempted itself, and its readmission raised 'prompt has 17 tokens ... the pool has
    4 usable blocks' out of step(), killing every other request."""
    llm = make(tiny_engine_model, num_blocks=5)  # 4 usable blocks of 4 slots
    big = llm.add_request(list(range(100, 110)), GREEDY.replace(max_tokens=20))
    small = llm.add_request([5, 6], GREEDY.replace(max_tokens=3))
    with caplog.at_level("WARNING", logger="jaxpaged.scheduler"):
        outs = drain(llm)
    out = outs[big].outputs[0]
    assert outs[big].finished and out.finish_reason == "length"
    assert "KV pool (4 blocks of 4 slots)" in out.finish_detail
    assert [r.getMessage() for r in caplog.records if r.name == "jaxpaged.scheduler"] == [
        f"request {big} {out.finish_detail}"]
    assert "is more than the KV pool holds" in caplog.text  # logged when the engine was made
    # Cut when its 16 slots are full: 10 prompt positions + 6 generated ones computed, and the
    # token sampled from the last; those 7 are the ones it makes alone.
    assert len(out.token_ids) == 7
    assert out.token_ids == alone(tiny_engine_model, list(range(100, 110)), GREEDY.replace(max_tokens=20)
                                  ).outputs[0].token_ids[:len(out.token_ids)]
    assert outs[small].outputs[0].token_ids == alone(tiny_engine_model, [5, 6], GREEDY.replace(max_tokens=3)
                                                     ).outputs[0].token_ids
    assert_idle(llm)


def test_forked_request_readmitted_under_a_small_token_budget(tiny_engine_model):
    """Before: a preempted n=3 request could only come back if every sample's whole recompute fitted
    one step's token budget, so it never did: 'scheduler made no progress' escaped step()."""
    llm = make(tiny_engine_model, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4,
               enable_prefix_caching=False)
    sampled = SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    a = llm.add_request(list(range(200, 211)), GREEDY.replace(max_tokens=40))
    b = llm.add_request(list(range(300, 311)), sampled)
    outs = drain(llm)
    assert llm.stats()["num_preemptions"] > 0
    assert outs[b].outputs[0].finish_reason == "length"
    ref = alone(tiny_engine_model, list(range(300, 311)), sampled)
    assert [c.token_ids for c in outs[b].outputs] == [c.token_ids for c in ref.outputs]
    assert outs[a].outputs[0].token_ids == alone(tiny_engine_model, list(range(200, 211)),
                                                 GREEDY.replace(max_tokens=40)).outputs[0].token_ids
    assert_idle(llm)


def test_auto_ids_never_collide_with_user_ids(tiny_engine_model):
    """Before: the counter handed out "1" while a user's request "1" was live, and the second
    request replaced the first in the engine's table."""
    llm = make(tiny_engine_model)
    mine = llm.add_request([7, 8, 9], GREEDY, request_id="1")
    auto = [llm.add_request([7, 8, 9], GREEDY) for _ in range(3)]
    assert len({mine, *auto}) == 4
    with pytest.raises(ValueError, match="request id '1' is already in use"):
        llm.add_request([1, 2], GREEDY, request_id="1")
    with pytest.raises(ValueError, match=f"request id '{auto[0]}' is already in use"):
        llm.add_request([1, 2], GREEDY, request_id=auto[0])
    outs = drain(llm)
    assert set(outs) == {mine, *auto} and all(o.finished for o in outs.values())
    assert_idle(llm)


def test_forks_count_against_max_num_seqs(tiny_engine_model):
    """Before: the n samples of a request forked after its prompt pushed the running sequences past
    max_num_seqs (the running loop never compared)."""
    llm = make(tiny_engine_model, max_num_seqs=4)
    for i in range(3):
        llm.add_request([10 + i] * 5, SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=6, ignore_eos=True))
    llm.add_request([40] * 5, GREEDY.replace(max_tokens=6))
    while llm.has_unfinished_requests():
        llm.step()
        live = sum(len(r.live_seqs()) for r in llm.scheduler.running)
        assert live <= 4, f"{live} sequences running, max_num_seqs=4"
    assert_idle(llm)


@pytest.mark.parametrize("params, match", [
    (SamplingParams(n=3, temperature=1.0), "n=3 sequences; max_num_seqs is 2"),
    (SamplingParams(n=2, use_beam_search=True, beam_width=3, temperature=0), "beam_width=3 sequences; max_num_seqs is 2"),
], ids=["n", "beam_width"])
def test_more_sequences_than_max_num_seqs_rejected_at_submission(tiny_engine_model, params, match):
    """Before: accepted; after a preemption such a request could never be readmitted."""
    llm = make(tiny_engine_model, max_num_seqs=2)
    with pytest.raises(ValueError, match=match):
        llm.add_request([1, 2, 3], params)
    assert not llm.has_unfinished_requests()


def test_contiguous_fork_waits_for_a_free_region(tiny_engine_model):
    """Before: the contiguous baseline's fork raised 'all 3 regions are in use' after the device
    step had already run."""
    llm = make(tiny_engine_model, kv_allocator="contiguous", block_size=8, num_blocks=1 + 64 * 3)
    params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    ids = [llm.add_request([20 + i] * 6, params) for i in range(3)]
    outs = drain(llm)
    for i, rid in enumerate(ids):
        ref = alone(tiny_engine_model, [20 + i] * 6, params)
        assert [c.token_ids for c in outs[rid].outputs] == [c.token_ids for c in ref.outputs]
    llm.bm.check_invariants()
    assert llm.stats()["num_used_blocks"] == 0


def test_beam_search_honours_stop_strings_and_returns_logprobs(tiny_engine_model):
    """Before: beam search ignored ``stop`` and returned ``logprobs=None``."""
    llm = make(tiny_engine_model)
    beam = SamplingParams(n=2, use_beam_search=True, beam_width=2, temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate(["The quick brown fox"], beam, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 4
    word = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    out = llm.generate(["The quick brown fox"], beam.replace(stop=[word], logprobs=2), use_tqdm=False)[0]
    for c in out.outputs:
        assert word not in c.text
        assert (c.finish_reason, c.stop_reason) in {("stop", word), ("length", None)}
        assert len(c.logprobs) == len(c.token_ids)
        for tok, pos in zip(c.token_ids, c.logprobs):
            assert tok in pos and len(pos) >= 2 and pos[tok].logprob <= 0
        assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(c.token_ids, c.logprobs)),
                                                     abs=1e-4)
    assert any(c.finish_reason == "stop" for c in out.outputs)
    assert_idle(llm)


def test_beam_search_at_max_model_len_finishes_with_length(tiny_engine_model):
    """Before: beam outputs compared the generated length, not the sequence length, with
    max_model_len, so a beam cut there reported 'stop'."""
    llm = make(tiny_engine_model, max_model_len=24)
    beam = SamplingParams(n=2, use_beam_search=True, beam_width=2, temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate([list(range(50, 70))], beam, use_tqdm=False)[0]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert all(20 + len(c.token_ids) == 24 for c in out.outputs)


@pytest.mark.parametrize("length_penalty", [1100.0, -1100.0])
def test_beam_search_with_an_extreme_length_penalty_finishes(tiny_engine_model, length_penalty):
    """Before: ``n ** length_penalty`` overflowed (or underflowed to a division by zero) on the
    engine thread, which killed the engine for every request (found by the server fuzz)."""
    llm = make(tiny_engine_model)
    beam = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True,
                          length_penalty=length_penalty)
    out = llm.generate(["The quick brown fox", "1, 2, 3,"], beam, use_tqdm=False)
    assert [[len(c.token_ids) for c in o.outputs] for o in out] == [[6, 6], [6, 6]]
    assert_idle(llm)


def test_beam_score_never_raises_and_keeps_its_order():
    from jaxpaged.beam_search import BeamSearch

    for lp in (-1e6, -1100.0, -1.0, 0.0, 0.5, 1.0, 2.0, 1100.0, 1e6):
        beam = BeamSearch(2, lp)
        for n in (1, 2, 512, 10**6):
            assert beam.score(-3.0, n) < beam.score(-2.0, n) <= 0  # finite or not, a better sum ranks higher
        if abs(lp) <= 2:
            assert beam.score(-3.0, 7) == pytest.approx(-3.0 / 7 ** lp)


def test_generate_and_stream_keep_other_requests_outputs(tiny_engine_model):
    """Before: generate() and stream() stepped the engine and dropped every output that was not
    theirs, so a request added with add_request never delivered its final output."""
    llm = make(tiny_engine_model)
    ref = {i: alone(tiny_engine_model, [60 + i] * 4, GREEDY).outputs[0] for i in range(3)}
    a = llm.add_request([60] * 4, GREEDY)
    stream = llm.stream([61] * 4, GREEDY)
    first = next(stream)  # the stream has started; then generate() runs while it is paused
    got = llm.generate([[62] * 4], GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == ref[2].token_ids
    text = first + "".join(stream)
    assert text == ref[1].text
    outs = drain(llm)
    assert outs[a].finished and outs[a].outputs[0].token_ids == ref[0].token_ids
    assert_idle(llm)


@pytest.mark.parametrize("params", [SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
                                    SamplingParams(use_beam_search=True, beam_width=2, temperature=0, max_tokens=6,
                                                   ignore_eos=True)],
                         ids=["n2", "beam2"])
def test_contiguous_request_waits_for_its_forks_regions_instead_of_churning(tiny_engine_model, params):
    """Found by a longer random-traffic run (round 8930): with the contiguous allocator, a
    request whose prompt takes two chunks was admitted on one region while an older request
    held the other; at its first token its fork found no region, it preempted itself,
    recomputed its prompt and hit the same wall, once per step, until the older one finished
    (7 preemptions; the scheduler's bound allows one per region its elders allocate: 0 here)."""
    llm = make(tiny_engine_model, kv_allocator="contiguous", block_size=8, max_model_len=32, num_blocks=1 + 4 * 2,
               max_num_batched_tokens=16)
    older = llm.add_request([7] * 6, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    llm.step()  # the older request holds one of the two regions
    prompt = list(range(30, 50))  # 20 tokens: two chunks of the 16-token budget
    rid = llm.add_request(prompt, params)
    outs = drain(llm)
    assert outs[rid].metrics.num_preemptions == 0
    ref = make(tiny_engine_model, kv_allocator="contiguous", block_size=8, max_model_len=32,
               num_blocks=1 + 4 * 2, max_num_batched_tokens=16).generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in outs[rid].outputs] == [c.token_ids for c in ref.outputs]
    assert len(outs[older].outputs[0].token_ids) == 20
    assert_idle(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, seed=87, n=3, max_tokens=6, ignore_eos=True),
    SamplingParams(use_beam_search=True, beam_width=3, n=3, temperature=0, max_tokens=6, ignore_eos=True)],
    ids=["samples", "beams"])
def test_preempted_samples_share_their_blocks_again(tiny_engine_model, params, preemption_mode):
    """Before (the thirty-eighth session's fuzzing): preempted by recompute, the three samples
    were prefilled one by one on blocks of their own, 3 x 5 blocks where together they had
    held 9 of the pool's 11, and were cut after 3 tokens of 6 ("outgrew the KV pool"); swapped
    out, they came back as unshared copies and met the same end. Now they recompute their
    prompt once and fork from it (or swap out and in keeping what they share), and get the
    tokens they get alone on the same pool."""
    import random

    random.seed(0)
    p, q = ([random.randrange(100, 40000) for _ in range(30)] for _ in range(2))
    llm = make(tiny_engine_model, block_size=8, num_blocks=12, max_num_batched_tokens=16,
               enable_prefix_caching=False, preemption_mode=preemption_mode,
               swap_space=1 << 20 if preemption_mode == "swap" else 0)
    ref = llm.generate([p], params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in ref.outputs] == [6, 6, 6] and llm.stats()["num_preemptions"] == 0
    older = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    out = llm.generate([q, p], [older, params], use_tqdm=False)[1]
    s = llm.stats()
    assert s["num_preemptions"] > 0 and (preemption_mode == "recompute") == (s["num_swapped_out_blocks"] == 0), s
    assert [(c.token_ids, c.finish_reason, c.finish_detail) for c in out.outputs] == [
        (c.token_ids, c.finish_reason, c.finish_detail) for c in ref.outputs]
    assert_idle(llm)


def test_recomputed_samples_take_their_own_cached_blocks(tiny_engine_model):
    """With prefix caching on, a sample recomputed after a preemption forks from the first one
    at its last whole prompt block and then takes the blocks of its own output that the cache
    still holds, instead of prefilling them again; its tokens stay those it gets alone."""
    import random

    random.seed(1)
    p, q = ([random.randrange(100, 40000) for _ in range(30)] for _ in range(2))
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True)
    llm = make(tiny_engine_model, block_size=8, num_blocks=16, max_num_batched_tokens=16)
    ref = llm.generate([p], params, use_tqdm=False)[0]
    forks = []
    fork_prefix = llm.scheduler.kv.fork_prefix

    def spy(parent, child, num_tokens, token_ids):
        got = fork_prefix(parent, child, num_tokens, token_ids)
        forks.append((num_tokens, got[0], len(token_ids)))
        return got

    llm.scheduler.kv.fork_prefix = spy
    older = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([q, p], [older, params], use_tqdm=False)[1]
    assert llm.stats()["num_preemptions"] > 0
    assert forks and all(at == 24 for at, _, _ in forks), forks  # 30 prompt tokens: 3 whole blocks
    assert any(n > at for at, n, _ in forks), forks  # its own blocks from before, cached
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
    assert_idle(llm)
