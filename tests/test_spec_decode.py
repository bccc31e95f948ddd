"""Speculative decoding with n-gram drafts (``speculative_config``, :mod:`jaxpaged.spec_decode`).

What must hold: the proposer finds what a plain search finds; a drafting engine gives every
request the tokens it gets without drafts (greedy and seeded, logprobs, stops, min_tokens)
under random traffic with small pools, preemption (recompute and swap), aborts and async
scheduling, and leaks nothing; drafts are really proposed and accepted (and rejected); the
requests that must not speculate do not; bad configs are refused by name.
"""

import numpy as np
import pytest
import test_engine_traffic as traffic_tests
from hypothesis import given, settings, strategies as st

from jaxpaged import LLM, SamplingParams, SpeculativeConfig
from jaxpaged.engine_args import EngineArgs
from jaxpaged.sequence import Request
from jaxpaged.spec_decode import propose_ngram


def naive_ngram(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest suffix of n_min..n_max tokens, its latest earlier occurrence, then k tokens
    copied from after it one at a time (the copy may run into the tokens it copies)."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        for i in range(len(tokens) - 1 - n, -1, -1):
            if tokens[i:i + n] == tokens[len(tokens) - n:]:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[i + n + j])
                return ext[len(tokens):]
    return []


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 6), st.integers(1, 4), st.integers(0, 3))
def test_the_proposer_finds_what_a_plain_search_finds(tokens, k, n_min, extra):
    assert propose_ngram(tokens, k, n_min, n_min + extra) == naive_ngram(tokens, k, n_min, n_min + extra)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 3), max_size=20), st.lists(st.lists(st.integers(0, 3), max_size=40), max_size=6),
       st.integers(0, 2))
def test_a_sequences_token_array_follows_its_tokens_as_they_grow(prompt, growths, fork_after):
    """The lookup reads ``Sequence.token_array()``: the tokens so far whatever was appended
    since (the buffer regrows), a fork's its own; proposals from it equal the list's."""
    seq = Request("r", None, prompt, SamplingParams(max_tokens=1), 0.0, 0).seqs[0]
    for i, grown in enumerate(growths):
        for t in grown:
            seq.append(t, 0.0, None)
        if i == fork_after:
            seq, parent = seq.fork(1), seq
            parent.append(3, 0.0, None)  # the parent's later tokens are not the child's
        arr = seq.token_array()
        assert arr.tolist() == seq.token_ids
        assert propose_ngram(arr, 3, 1, 3) == propose_ngram(seq.token_ids, 3, 1, 3)


def test_proposals_by_hand():
    assert propose_ngram([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert propose_ngram([5, 1, 2, 9, 1, 2, 7, 2], 2, 1, 3) == [7, 2]  # the latest occurrence of [2]
    assert propose_ngram([7, 7, 7], 4, 1, 2) == [7, 7, 7, 7]  # a loop shorter than k goes on
    assert propose_ngram([1, 2, 3], 3, 1, 2) == []
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []


@pytest.mark.parametrize("config, error, pattern", [
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "method='eagle'"),
    ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens=0"),
    ({"num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens must be an int"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, ValueError,
     "prompt_lookup_min=4 is more than prompt_lookup_max=2"),
    ({"num_speculative_tokens": 2, "prompt_lookup_maxx": 2}, ValueError, "unknown fields"),
    ({"method": "ngram"}, ValueError, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, ValueError, "disable_by_batch_size=0"),
    ("ngram", TypeError, "must be a dict"),
])
def test_bad_configs_are_refused_by_name(config, error, pattern):
    with pytest.raises(error, match=pattern):
        EngineArgs(speculative_config=config)


def test_lookup_defaults_follow_vllm():
    assert SpeculativeConfig(3).prompt_lookup_min == SpeculativeConfig(3).prompt_lookup_max == 5
    c = SpeculativeConfig(3, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    assert EngineArgs(speculative_config={"num_speculative_tokens": 3}).speculative_config == SpeculativeConfig(3)


def _spec_options(seed: int) -> dict:
    rng = np.random.default_rng([seed, 7])
    n_min = int(rng.integers(1, 3))
    config = {"num_speculative_tokens": int(rng.integers(1, 6)), "prompt_lookup_min": n_min,
              "prompt_lookup_max": n_min + int(rng.integers(0, 3))}
    if rng.random() < 0.2:
        config["disable_by_batch_size"] = int(rng.integers(1, 4))
    return {"speculative_config": config, "oracle_markov": 1}


def test_random_traffic_with_drafts_and_the_paging_oracle(tiny_engine_model):
    """Rounds of ``traffic.py``'s traffic (small pools, preemption by recompute and swap,
    prefix caching, aborts, async scheduling, every kind of request) on drafting engines;
    the oracle reads every context back, the drafts' included, and each request must get the
    tokens it gets alone on an engine without drafts. The oracle's distribution follows the
    last token, over a few ids, so outputs repeat and drafts are accepted."""
    t = traffic_tests.run_rounds(tiny_engine_model, oracle=True, rounds=range(3000, 3040), num_requests=30,
                                 options=_spec_options, alone_options={"oracle_markov": 1})
    assert t["requests"] >= 1000 and t["compared"] >= 700 and t["cut_alone_too"] == t["cut"]
    assert 0 < t["accepted_tokens"] < t["draft_tokens"], t  # drafts kept and drafts rejected
    for key in ("aborted", "preemptions", "swapped_blocks", "async_rounds", "steps_ahead", "forks", "beams",
                "stopped_by_string"):
        assert t[key] > 0, (key, t)


def test_random_traffic_with_drafts_on_the_tiny_model(small_vocab_engine_model, monkeypatch):
    """The same on the tiny random model itself (real kernels and sampler), its prompts made
    periodic (a few ids repeated) so that every step has drafts to check; against its tokens
    alone without drafts, up to float32 ties."""
    make_round = traffic_tests.traffic.make_round

    def periodic(seed, **kw):
        rnd = make_round(seed, **kw)
        rng = np.random.default_rng([seed, 8])
        for a in rnd.arrivals:
            if isinstance(a.prompt, list):
                period = rng.integers(3, 300, int(rng.integers(1, 4))).tolist()
                a.prompt = (period * 64)[:len(a.prompt) + len(period)]
        return rnd

    monkeypatch.setattr(traffic_tests.traffic, "make_round", periodic)
    t = traffic_tests.run_rounds(small_vocab_engine_model, oracle=False, rounds=range(3100, 3103),
                                 num_requests=traffic_tests.MODEL_REQUESTS, options=lambda seed: {
                                     "speculative_config": {"num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                                            "prompt_lookup_max": 2}})
    assert t["compared"] >= 20 and 0 < t["accepted_tokens"] < t["draft_tokens"], t


PROMPTS = ["Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, grape. Again: apple, banana,",
           "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
           "# the same function, renamed:\ndef fibonacci(n):\n",
           "The capital of France is"]


@pytest.fixture(scope="module")
def smollm_engines(smollm):
    plain = LLM(smollm, max_num_seqs=8, enable_prefix_caching=False)
    drafting = LLM(smollm, max_num_seqs=8, enable_prefix_caching=False,
                   speculative_config={"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
    return plain, drafting


# Each kind of request on every prompt, in one batch (suite time); penalties in a batch of their
# own, where fewer drafts hold.
@pytest.mark.parametrize("kinds", [
    [SamplingParams(temperature=0, max_tokens=40, logprobs=2),
     SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=40),
     SamplingParams(temperature=0, max_tokens=40, stop=["fig", "return fib"], min_tokens=3)],
    [SamplingParams(temperature=0.7, seed=5, max_tokens=40, repetition_penalty=1.1, frequency_penalty=0.2)],
], ids=["greedy-logprobs-seeded-stop-string", "penalties"])
def test_the_default_model_gives_the_same_tokens_with_drafts(smollm_engines, kinds):
    plain, drafting = smollm_engines
    prompts = [p for _ in kinds for p in PROMPTS]
    params = [k for k in kinds for _ in PROMPTS]
    before = drafting.stats()
    want = plain.generate(prompts, params, use_tqdm=False)
    got = drafting.generate(prompts, params, use_tqdm=False)
    stopped = 0
    for w, g, sp in zip(want, got, params):
        a, b = w.outputs[0], g.outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, a.finish_reason,
                                                                          a.stop_reason)
        stopped += bool(sp.stop) and b.stop_reason in sp.stop
        if sp.logprobs:
            assert [set(x) for x in b.logprobs] == [set(x) for x in a.logprobs]
            np.testing.assert_allclose([x[t].logprob for x, t in zip(b.logprobs, b.token_ids)],
                                       [x[t].logprob for x, t in zip(a.logprobs, a.token_ids)], atol=1e-4)
    # The list's "fig" and the function's "return fib" end two completions, in their drafts' stretch.
    assert stopped == (2 if any(sp.stop for sp in params) else 0)
    after = drafting.stats()
    assert after["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]
    assert after["num_used_blocks"] == 0
    if not any(sp.has_penalties for sp in params):  # the list and the renamed function repeat their prompts
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        assert 1 + accepted / drafts > 2  # most drafts hold


def test_samples_draft_each_on_their_own_and_beams_do_not(smollm_engines):
    """The samples of n > 1 draft each on their own (their lengths part where drafts are
    accepted); beam search decodes one token at a time, also beside a request that drafts in
    the same steps; each gets its tokens without drafts."""
    plain, drafting = smollm_engines
    kinds = [SamplingParams(n=2, temperature=0.8, seed=1, max_tokens=24),
             SamplingParams(use_beam_search=True, beam_width=2, temperature=0, max_tokens=12)]
    for params, drafts in zip(kinds, (True, False)):
        before = drafting.stats()["spec_num_drafts"]
        want = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0]
        got = drafting.generate(PROMPTS[:1], params, use_tqdm=False)[0]
        assert [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs], params
        assert (drafting.stats()["spec_num_drafts"] > before) == drafts, params
    # Beside a drafting request, in one batch.
    mixed = [SamplingParams(temperature=0, max_tokens=24), kinds[0]]
    want = [[c.token_ids for c in plain.generate(PROMPTS[:1], p, use_tqdm=False)[0].outputs] for p in mixed]
    before = drafting.stats()["spec_num_drafts"]
    got = drafting.generate(PROMPTS[:1] * 2, mixed, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == want
    assert drafting.stats()["spec_num_drafts"] > before


def test_bad_words_are_masked_at_drafted_positions(smollm_engines):
    """The list repeats in the prompt, so its next words come as drafts; a bad word among them
    is masked at its drafted row (its mask sees the drafts before the row), and the tokens are
    those of decoding without drafts. (As in vLLM, "date, elderberry" is also banned after a
    space, whose tokens are as many; "cherry" would not be: " cherry" is one token, "cherry" two.)"""
    plain, drafting = smollm_engines
    params = SamplingParams(temperature=0, max_tokens=24, bad_words=["date, elderberry", "fig."])
    banned = plain.inputs.bad_words_token_ids(params)

    def has(tokens, word):
        return any(tokens[i:i + len(word)] == word for i in range(len(tokens)))

    free = plain.generate(PROMPTS[:1], params.replace(bad_words=None), use_tqdm=False)[0].outputs[0].token_ids
    assert sum(has(free, w) for w in banned) == 2  # (what the words change: each once, after a space)
    before = drafting.stats()["spec_num_accepted_tokens"]
    want = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    got = drafting.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.token_ids != free
    assert not any(has(got.token_ids, w) for w in banned)  # (the text may still spell one otherwise)
    assert drafting.stats()["spec_num_accepted_tokens"] > before


def test_structured_outputs_draft_within_their_grammar(smollm_engines):
    """A structured request drafts too: only drafts its grammar takes, each draft's row masked by
    the grammar after the drafts before it; the outputs are those without drafts and match."""
    import json
    import re

    from jaxpaged import StructuredOutputsParams

    plain, drafting = smollm_engines
    schema = {"type": "object", "required": ["name", "city"],
              "properties": {"name": {"type": "string"}, "city": {"type": "string"}}}
    ask = [{"role": "user", "content": "Give the person as JSON with name and city: 'Alice Smith, who lives "
                                       "in Paris, and Alice Smith's city is Paris.'"}]
    cases = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"(Alice Smith, ){2,6}Paris"),
             StructuredOutputsParams(choice=["Alice Smith lives in Paris", "Alice Smith lives in Rome"])]
    before = drafting.stats()
    for so in cases:
        params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)
        want = plain.chat(ask, params, use_tqdm=False)[0].outputs[0]
        got = drafting.chat(ask, params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text) == (want.token_ids, want.text), so
        if so.json is not None:
            assert set(json.loads(got.text)) == {"name", "city"}
        elif so.regex is not None:
            assert re.fullmatch(so.regex, got.text)
    after = drafting.stats()
    assert after["spec_num_accepted_tokens"] > before["spec_num_accepted_tokens"]
    assert after["num_used_blocks"] == 0


def test_drafts_stop_at_max_tokens_and_max_model_len(smollm):
    """A draft never carries a sequence past ``max_tokens`` or ``max_model_len``."""
    llm = LLM(smollm, max_model_len=48, enable_prefix_caching=False,
              speculative_config={"num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    prompt = llm.tokenizer.encode("one two one two one two one two one two")
    for max_tokens in (1, 2, 3, 7):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    out = llm.generate([prompt], SamplingParams(temperature=0, ignore_eos=True, max_tokens=None), use_tqdm=False)[0]
    assert len(prompt) + len(out.outputs[0].token_ids) == 48
    assert llm.stats()["spec_num_accepted_tokens"] > 0 and llm.stats()["num_used_blocks"] == 0


def test_the_server_streams_drafted_tokens_and_counts_them(smollm, smollm_engines):
    """Served with drafts: completions, streamed or not, equal the offline engine's without
    drafts, and /metrics counts the drafts."""
    import httpx
    import openai
    import test_server as ts

    plain, _ = smollm_engines
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    s = ts.Running(LLM(smollm, max_num_seqs=4, num_blocks=64, speculative_config=config))
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key=ts.KEY, max_retries=0, timeout=120)
        want = [o.outputs[0].text for o in plain.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=32),
                                                          use_tqdm=False)]
        r = c.completions.create(model=ts.MODEL, prompt=PROMPTS[:2], max_tokens=32, temperature=0)
        assert [ch.text for ch in r.choices] == want
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=ts.MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stream=True))
        assert streamed == want[0]
        with httpx.Client(base_url=s.url, headers=ts.AUTH, timeout=60) as http:
            m = ts.wait_idle(http)
        assert 0 < m["jaxpaged:spec_decode_num_accepted_tokens_total"] <= m["jaxpaged:spec_decode_num_draft_tokens_total"]
        assert m["jaxpaged:spec_decode_num_drafts_total"] > 0
    finally:
        s.stop()


def test_the_command_line_takes_a_speculative_config(capsys, tiny_engine_folder):
    import json

    from jaxpaged.cli import main

    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
    assert main(["--model", str(tiny_engine_folder), "--json", "--max-tokens", "12", "--ignore-eos",
                 "--temperature", "0", "--speculative-config", config, "1 2 1 2 1 2 1 2"]) == 0
    plain = capsys.readouterr().out
    summary = json.loads(plain.splitlines()[-1])["summary"]
    assert 0 <= summary["spec_acceptance_rate"] <= 1 and summary["spec_mean_acceptance_length"] >= 0
    assert main(["--model", str(tiny_engine_folder), "--json", "--max-tokens", "12", "--ignore-eos",
                 "--temperature", "0", "1 2 1 2 1 2 1 2"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0]) == json.loads(plain.splitlines()[0])
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_engine_folder), "--speculative-config", "{ngram", "hi"])
    assert "--speculative-config: not JSON" in capsys.readouterr().err
    assert main(["--model", str(tiny_engine_folder), "--speculative-config",
                 '{"method": "medusa", "num_speculative_tokens": 2}', "hi"]) != 0
    assert "speculative_config method='medusa' is not supported" in capsys.readouterr().err


def test_no_drafts_while_the_batch_is_at_disable_by_batch_size(tiny_engine_model):
    """``disable_by_batch_size``: no sequence drafts in a step while that many requests run;
    drafting resumes once fewer do (the paging oracle, whose outputs repeat, stands in for
    the model)."""
    import traffic

    llm = traffic.engine(tiny_engine_model, oracle=True, oracle_markov=1, block_size=16, num_blocks=64,
                         max_model_len=64, async_scheduling=False, speculative_config={
                             "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 2})
    for n in (8, 16, 40):
        llm.add_request({"prompt_token_ids": [300, 301, 302]}, SamplingParams(temperature=0, max_tokens=n))
    drafted_alone = False
    while llm.has_unfinished_requests():
        running = len(llm.scheduler.running)
        llm.step()
        drafts = sum(len(s.draft) for s in llm.core.last.scheduled)
        if running >= 2 and len(llm.scheduler.running) >= 2:
            assert drafts == 0
        drafted_alone |= len(llm.core.last.scheduled) == 1 and drafts > 0
    assert drafted_alone and llm.stats()["num_used_blocks"] == 0
