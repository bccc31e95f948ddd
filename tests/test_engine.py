"""The engine on a tiny random model: scheduling, caching and preemption never change tokens."""

import dataclasses

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams, batch

PROMPTS = [
    "The quick brown fox",
    "Paged attention splits the KV cache into blocks so that",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Bonjour, je m'appelle",
    "1, 2, 3, 4, 5,",
    "A long prompt that spans several blocks of the pool: " + "lorem ipsum dolor sit amet " * 6,
    "Q: What is the capital of Japan?\nA:",
    "日本語のテキストも",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)


def make(model, **kw):
    kw.setdefault("debug_checks", True)
    kw.setdefault("block_size", 8)
    kw.setdefault("num_blocks", 256)  # small: debug_checks walks every block after every step
    return LLM(model, **kw)


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_no_leak(llm):
    s = llm.stats()
    assert s["num_used_blocks"] == 0, s
    llm.bm.check_invariants()


@pytest.fixture(scope="module")
def reference(tiny_engine_model):
    llm = make(tiny_engine_model, enable_prefix_caching=False)
    greedy = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    seeded = tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False))
    assert_no_leak(llm)
    assert len({tuple(t[0]) for t in greedy}) > 1  # the model is not degenerate
    return greedy, seeded


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=True),
    dict(max_num_batched_tokens=16),  # chunked prefill: prompts split across steps
    dict(max_num_seqs=3),
    dict(num_blocks=24, preemption_mode="recompute"),
    dict(num_blocks=24, preemption_mode="swap", swap_space="64MiB"),
    dict(block_size=16),
    dict(kv_allocator="contiguous"),  # the pre-vLLM baseline: 3 regions of max_model_len slots
], ids=["prefix-cache", "chunked-prefill", "few-seqs", "preempt-recompute", "preempt-swap", "bs16",
        "contiguous"])
def test_same_tokens_under_any_schedule(tiny_engine_model, reference, options, monkeypatch):
    greedy, seeded = reference
    monkeypatch.setattr(batch, "SPLIT_MIN_ROWS", 1)  # mixed steps split at every count, not only from 8 decodes
    llm = make(tiny_engine_model, **options)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == greedy
    assert tokens(llm.generate(PROMPTS, SEEDED, use_tqdm=False)) == seeded
    if "max_num_batched_tokens" in options:  # decodes beside prompt chunks; on CPU those steps run split
        split = {k[-1] > 0 for k in llm.runner.compiled_shapes if k[0] == "forward" and not k[-2]}
        assert split == ({True, False} if llm.runner.split_decodes else {False}), split
    if "num_blocks" in options:
        assert llm.stats()["num_preemptions"] > 0
    if options.get("preemption_mode") == "swap":
        assert llm.stats()["num_swapped_out_blocks"] > 0
    assert_no_leak(llm)


def test_warm_prefix_cache_same_tokens_and_hits(tiny_engine_model, reference):
    greedy, _ = reference
    llm = make(tiny_engine_model)
    cold = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    hits_before = llm.stats()["prefix_cache_hits"]
    warm = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert cold == greedy and tokens(warm) == greedy
    assert llm.stats()["prefix_cache_hits"] > hits_before
    assert max(o.num_cached_tokens for o in warm) >= 8
    assert_no_leak(llm)


def test_each_prompt_alone_equals_batched(tiny_engine_model, reference):
    greedy, seeded = reference
    llm = make(tiny_engine_model)
    for i in (0, 2, 5):
        assert tokens(llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False))[0] == greedy[i]
        assert tokens(llm.generate([PROMPTS[i]], SEEDED, use_tqdm=False))[0] == seeded[i]
    assert_no_leak(llm)


def test_parallel_samples_share_prompt_blocks_and_differ(tiny_engine_model):
    llm = make(tiny_engine_model)
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = llm.generate([PROMPTS[5]], params, use_tqdm=False)[0]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len(set(samples)) == 4
    again = llm.generate([PROMPTS[5]], params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    assert_no_leak(llm)
    # The contiguous baseline copies the prompt into each sample's region instead of sharing.
    contiguous = make(tiny_engine_model, kv_allocator="contiguous", num_blocks=1 + 64 * 5)
    out = contiguous.generate([PROMPTS[5]], params, use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in out.outputs] == samples
    assert_no_leak(contiguous)


def test_fork_shares_blocks(tiny_engine_model):
    """While n=4 samples decode, the prompt's full blocks are held once, not four times."""
    llm = make(tiny_engine_model, enable_prefix_caching=False)
    rid = llm.add_request(PROMPTS[5], SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True))
    llm.step()  # the whole prompt
    llm.step()  # the fork has happened; every sample appended one token
    req = llm.scheduler.running[0]
    assert len(req.seqs) == 4
    tables = [llm.bm.block_table(s.seq_id) for s in req.seqs]
    n_prompt_full = len(req.prompt_token_ids) // 8
    assert all(t[:n_prompt_full] == tables[0][:n_prompt_full] for t in tables)
    assert len({t[-1] for t in tables}) == 4  # private last blocks after copy-on-write
    while llm.has_unfinished_requests():
        llm.step()
    assert_no_leak(llm)
    assert rid not in llm.core.requests


def test_seeded_sampling_independent_of_batch(tiny_engine_model, reference):
    _, seeded = reference
    llm = make(tiny_engine_model)
    mixed = [SEEDED if i % 2 == 0 else GREEDY for i in range(len(PROMPTS))]
    got = tokens(llm.generate(PROMPTS, mixed, use_tqdm=False))
    assert [got[i] for i in range(0, len(PROMPTS), 2)] == [seeded[i] for i in range(0, len(PROMPTS), 2)]


def test_stop_conditions(tiny_engine_model, reference):
    greedy, _ = reference
    llm = make(tiny_engine_model)
    full = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0].outputs[0]
    stop_tok = full.token_ids[5]
    o = llm.generate(PROMPTS[1], GREEDY.replace(stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    k = full.token_ids.index(stop_tok)
    assert o.token_ids == full.token_ids[:k + 1] and o.finish_reason == "stop" and o.stop_reason == stop_tok
    assert o.text == llm.tokenizer.decode(full.token_ids[:k]) != llm.tokenizer.decode(o.token_ids)  # vLLM's: its text out
    # A stop string: generation ends and the string is not in the text.
    word = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    if word.strip():
        o = llm.generate(PROMPTS[1], GREEDY.replace(stop=[word]), use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and o.stop_reason == word
        assert word not in o.text and full.text.startswith(o.text)
    o = llm.generate(PROMPTS[1], GREEDY.replace(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert o.token_ids == full.token_ids[:3] and o.finish_reason == "length"
    # EOS ends a sequence only after min_tokens; the logit bias forces EOS.
    eos = SamplingParams(temperature=0, max_tokens=10, min_tokens=4, logit_bias={2: 100.0})
    o = llm.generate(PROMPTS[1], eos, use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 5 and o.token_ids[-1] == 2 and o.finish_reason == "stop"
    # A stop string counts only from min_tokens on, like EOS: a match before that leaves the text whole.
    # The bias forces "ab" (one token) every step: "ab|ab" holds "ba" from the second token on.
    ab = llm.tokenizer.encode("ab", add_special_tokens=False)
    assert len(ab) == 1
    for min_tokens, text, n in ((0, "a", 2), (4, "ababa", 4), (7, "abababababa", 7)):
        p = SamplingParams(temperature=0, max_tokens=10, min_tokens=min_tokens, logit_bias={ab[0]: 100.0}, stop=["ba"])
        o = llm.generate(PROMPTS[1], p, use_tqdm=False)[0].outputs[0]
        assert (o.text, len(o.token_ids), o.finish_reason, o.stop_reason) == (text, n, "stop", "ba"), min_tokens
        assert "".join(llm.stream(PROMPTS[1], p)) == text  # "ab" is not yielded before "ba" cuts it to "a"
    assert_no_leak(llm)


def test_logprobs_returned(tiny_engine_model):
    llm = make(tiny_engine_model)
    o = llm.generate(PROMPTS[0], GREEDY.replace(logprobs=3, max_tokens=4), use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 4
    for tok, pos in zip(o.token_ids, o.logprobs):
        assert tok in pos and pos[tok].rank == 1  # greedy picks the top token
        assert len(pos) == 3
        lps = sorted((lp.logprob for lp in pos.values()), reverse=True)
        assert lps[0] <= 0 and lps == sorted(lps, reverse=True)
    np.testing.assert_allclose(o.cumulative_logprob, sum(p[t].logprob for t, p in zip(o.token_ids, o.logprobs)),
                               rtol=1e-5)


def test_streaming_and_engine_loop(tiny_engine_model, reference):
    greedy, _ = reference
    llm = make(tiny_engine_model)
    text = "".join(llm.stream(PROMPTS[0], GREEDY))
    assert text == llm.tokenizer.decode(greedy[0][0], skip_special_tokens=True)
    a = llm.add_request(PROMPTS[0], GREEDY)
    b = llm.add_request(PROMPTS[1], GREEDY)
    llm.step()
    llm.abort(a)
    finals = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            if o.finished:
                finals[o.request_id] = o
    assert set(finals) == {b} and finals[b].outputs[0].token_ids == greedy[1][0]
    assert_no_leak(llm)


def test_abort_ends_streams_and_generate(tiny_engine_model, reference, monkeypatch):
    greedy, _ = reference
    llm = make(tiny_engine_model)
    g = llm.stream(PROMPTS[0], GREEDY)
    first = next(g)
    (rid,) = llm.core.requests
    llm.abort(rid)
    assert first and "".join(g) == ""  # the stream ends at once (it used to spin forever)
    assert_no_leak(llm)
    with pytest.raises(ValueError, match="outside the vocabulary"):  # raised by the call, not the first next()
        llm.stream([10 ** 6], GREEDY)

    advance = llm._advance
    aborted = []

    def advance_then_abort():  # another caller aborts one of generate's requests between steps
        advance()
        if not aborted:
            aborted.append(max(llm.core.requests, key=int))
            llm.abort(aborted[0])

    monkeypatch.setattr(llm, "_advance", advance_then_abort)
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert outs[1].request_id == aborted[0] and outs[1].finished
    assert outs[1].outputs[0].finish_reason == "abort"
    assert greedy[1][0][:len(outs[1].outputs[0].token_ids)] == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == greedy[0][0]
    assert llm.step() == [] and not llm.has_unfinished_requests()
    assert_no_leak(llm)


def test_chat_and_generate_helpers(tiny_engine_model, tiny_engine_folder):
    import jaxpaged

    llm = make(tiny_engine_model)
    out = llm.chat([{"role": "user", "content": "Hi!"}], GREEDY.replace(max_tokens=5), use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 5
    assert out[0].prompt_token_ids[:1] == llm.tokenizer.convert_tokens_to_ids(["<|im_start|>"])
    assert out[0].prompt.startswith("<|im_start|>") and "Hi!" in out[0].prompt  # the templated text, as vLLM
    assert llm.tokenizer(out[0].prompt, add_special_tokens=False)["input_ids"] == out[0].prompt_token_ids
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "H"}, {"type": "text", "text": "i!"}]}],
                     GREEDY.replace(max_tokens=5), use_tqdm=False)  # OpenAI text parts, joined
    assert parts[0].prompt_token_ids == out[0].prompt_token_ids
    assert parts[0].outputs[0].token_ids == out[0].outputs[0].token_ids
    assert not llm.has_unfinished_requests()  # nothing left for the caller, though a step may be in flight
    one = llm.generate([[42]], SamplingParams(max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert one.prompt_logprobs == [None]  # one entry a prompt position, as vLLM
    text = jaxpaged.generate(PROMPTS[0], model=tiny_engine_folder, temperature=0, max_tokens=24, ignore_eos=True,
                             block_size=8)
    assert isinstance(text, str) and text == llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].text
    with pytest.raises(TypeError, match="unknown options"):
        jaxpaged.generate("x", model=tiny_engine_folder, temprature=0)


def test_chat_template_options(tiny_engine_model):
    """vLLM's ``LLM.chat`` options: a template of one's own, the template's variables, and a
    final message continued instead of a new turn; bad ones refused by name before any work."""
    llm = make(tiny_engine_model)
    conv = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, I am"}]
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if name %} ({{ name }}){% endif %}"
    params = GREEDY.replace(max_tokens=2)
    out = llm.chat(conv, params, use_tqdm=False, chat_template=template, chat_template_kwargs={"name": "Ann"})[0]
    assert out.prompt == "[user]Hi![assistant]Hello, I am (Ann)" and len(out.outputs[0].token_ids) == 2
    cont = llm.chat(conv, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
    assert cont.prompt.endswith("Hello, I am") and cont.prompt.startswith("<|im_start|>")
    new_turn = llm.chat(conv, params, use_tqdm=False)[0].prompt
    assert new_turn.startswith(cont.prompt) and new_turn.endswith("<|im_start|>assistant\n")
    for options, exc, match in [
        (dict(continue_final_message=True), ValueError, "continue_final_message and add_generation_prompt"),
        (dict(chat_template="{% if %}"), ValueError, "chat_template is not a valid Jinja template"),
        (dict(chat_template=3), TypeError, "chat_template must be a non-empty str"),
        (dict(chat_template_kwargs={"add_generation_prompt": False}), ValueError,
         r"chat_template_kwargs\['add_generation_prompt'\]: add_generation_prompt is not the template's"),
        (dict(chat_template_kwargs="x"), TypeError, "chat_template_kwargs must be a dict"),
        (dict(chat_template_kwargs={"self": 1}), ValueError, r"chat_template_kwargs\['self'\]"),
        (dict(chat_template="{% if 1 %}" * 120 + "x" + "{% endif %}" * 120), ValueError,
         "chat_template is not a usable Jinja template"),  # deeper than Python compiles
        (dict(continue_final_message=1, add_generation_prompt=False), TypeError, "continue_final_message must be"),
    ]:
        with pytest.raises(exc, match=match):
            llm.chat(conv, params, use_tqdm=False, **options)
    assert not llm.has_unfinished_requests()
    llm.tokenizer.chat_template, saved = None, llm.tokenizer.chat_template
    try:
        with pytest.raises(ValueError, match="chat_template: this model has none of its own"):
            llm.chat(conv, params, use_tqdm=False)
        assert llm.chat(conv, params, use_tqdm=False, chat_template=template)[0].prompt.startswith("[user]")
    finally:
        llm.tokenizer.chat_template = saved


def test_beam_search_as_vllm_calls_it(tiny_engine_model):
    """``LLM.beam_search(prompts, BeamSearchParams)``: the search ``SamplingParams(use_beam_search)``
    runs, as vLLM's sequences (prompt tokens and text included, best first)."""
    from jaxpaged import BeamSearchParams

    llm = make(tiny_engine_model)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, length_penalty=0.5)
    outs = llm.beam_search([PROMPTS[0], [5, 6, 7]], params)
    plain = llm.generate([PROMPTS[0], [5, 6, 7]], SamplingParams(
        n=3, use_beam_search=True, beam_width=3, max_tokens=6, ignore_eos=True, temperature=0, length_penalty=0.5),
        use_tqdm=False)
    for got, want in zip(outs, plain):
        assert len(got.sequences) == 3
        for seq, c in zip(got.sequences, want.outputs):
            assert seq.tokens == want.prompt_token_ids + c.token_ids and seq.cum_logprob == c.cumulative_logprob
            assert seq.text == llm.tokenizer.decode(seq.tokens) and seq.finish_reason == "length"
            assert len(seq.logprobs) == 6 and all(len(p) >= 6 for p in seq.logprobs)  # top 2 x width a token
        scores = [s.cum_logprob / (len(s.tokens) - len(want.prompt_token_ids)) ** 0.5 for s in got.sequences]
        assert scores == sorted(scores, reverse=True)
    with pytest.raises(ValueError, match="temperature must be 0 for beam search"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    # A beam ended by EOS: its text leaves the EOS out (vLLM's); made likely by taking the greedy
    # first token as the EOS of a copy of the model.
    eos = llm.generate(PROMPTS[0], GREEDY.replace(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids[0]
    copy = dataclasses.replace(tiny_engine_model, config=dataclasses.replace(tiny_engine_model.config,
                                                                          eos_token_ids=(eos,)))
    ended = make(copy).beam_search([PROMPTS[0]], BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=0.0))
    ended = ended[0].sequences  # (length_penalty 0: the short beam, ended by EOS, ranks first)
    assert any(s.tokens[-1] == eos for s in ended)
    for s in ended:
        assert s.text == llm.tokenizer.decode(s.tokens[:-1] if s.tokens[-1] == eos else s.tokens)
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(TypeError, match="params must be BeamSearchParams"):
        llm.beam_search("x", SamplingParams())
    assert_no_leak(llm)


def test_a_preempted_request_does_not_count_its_own_blocks_as_cached(tiny_engine_model):
    """``num_cached_tokens`` (the usage's cached_tokens) is what the prefix cache held at the
    first admission: recomputing after a preemption hits the request's own blocks, which are
    not a cache hit of its prompt (vLLM sets it once)."""
    llm = make(tiny_engine_model, num_blocks=12, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=8)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 1000, 60).tolist() for _ in range(5)]  # preempted mid-prefill, in 8-token chunks
    outs = llm.generate(prompts, GREEDY.replace(max_tokens=20), use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.num_cached_tokens for o in outs] == [0] * 5
    fresh = rng.integers(3, 1000, 30).tolist()
    first, again = (llm.generate([fresh], GREEDY.replace(max_tokens=1), use_tqdm=False)[0] for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 24)  # 3 whole blocks of 8 of 30 tokens
    assert_no_leak(llm)


def test_allowed_token_ids_mask_only_their_own_rows(tiny_engine_model):
    """vLLM's ``allowed_token_ids``: a request samples only those tokens, greedy or not, beside
    unrestricted and structured rows in the same steps, which keep their own tokens."""
    llm = make(tiny_engine_model)
    rng = np.random.default_rng(0)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], [GREEDY, SEEDED], use_tqdm=False)]
    regex = SamplingParams(temperature=0, max_tokens=8, structured_outputs={"regex": "[0-9]{4}"})
    digits = llm.generate(PROMPTS[2], regex, use_tqdm=False)[0].outputs[0].text
    allowed = sorted(set(rng.integers(3, llm.config.vocab_size, 6).tolist()) | {alone[0][0]})
    restricted = [GREEDY.replace(allowed_token_ids=allowed), SEEDED.replace(allowed_token_ids=allowed)]
    outs = llm.generate(PROMPTS[:2] * 2 + [PROMPTS[2]], [*restricted, GREEDY, SEEDED, regex], use_tqdm=False)
    for o in outs[:2]:
        assert set(o.outputs[0].token_ids) <= set(allowed) and len(o.outputs[0].token_ids) == 24
    assert outs[0].outputs[0].token_ids[0] == alone[0][0]  # the greedy pick was allowed: still taken first
    assert [o.outputs[0].token_ids for o in outs[2:4]] == alone and outs[4].outputs[0].text == digits
    digits_only = llm.generate(PROMPTS[2], regex.replace(allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert digits_only.text == digits  # sharing no token with the grammar's: the grammar wins, its output valid
    with pytest.raises(ValueError, match=r"allowed_token_ids \[\d+\] are outside the vocabulary"):
        llm.generate(PROMPTS[0], GREEDY.replace(allowed_token_ids=[1, llm.config.vocab_size]), use_tqdm=False)
    assert_no_leak(llm)


def test_compiled_shapes_bounded_over_mixed_workload(small_vocab_engine_model):
    rng = np.random.default_rng(0)
    llm = make(small_vocab_engine_model, debug_checks=False, max_num_seqs=32, max_num_batched_tokens=128,
               num_blocks=160, enable_prefix_caching=False)
    vocab = llm.config.vocab_size
    prompts = [rng.integers(3, vocab, int(rng.integers(1, 120))).tolist() for _ in range(200)]
    params = [SamplingParams(temperature=float(rng.choice([0.0, 0.7])), seed=i, ignore_eos=True,
                             max_tokens=int(rng.integers(1, 40))) for i in range(200)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [p.max_tokens for p in params]
    n = llm.stats()["num_compiled_shapes"]
    # The model: S in {1..32} (6), T = S for decode or {8..128} (5) for prefill, W in {4..64} (5);
    # on CPU, mixed steps of 8 or more decodes split into a one-token part of D in {8..32}
    # rows and the rest (batch.build_batch's split_decodes), T = D + {8..128}: more prefill
    # shapes (this workload: 24 model shapes against 22 unsplit, 56 in all against 46). The sampler,
    # compiled apart: R = S (6) and two modes (all greedy or not). They add up.
    assert 0 < n <= (6 + 6 * 5) * 5 + 6 * 2, n
    print(f"{n} compiled step shapes for 200 mixed requests")
    executables = llm.runner.programs.forward._cache_size()
    llm.generate(prompts, params, use_tqdm=False)  # the same workload again: nothing new to compile
    assert llm.stats()["num_compiled_shapes"] == n
    # Nor anything XLA would see as new: the first pool was once uncommitted, so the first
    # step's shape compiled again with the committed pool every later step returns.
    assert llm.runner.programs.forward._cache_size() == executables
    assert_no_leak(llm)


def test_steps_with_and_without_pending_tokens_share_one_executable():
    """A step shape compiles once, whether its token ids all come from the host (synchronous
    steps, or async ones with no pending token) or partly from the step before (async
    scheduling fills them in on the device). Host ids were once left uncommitted, so every
    shape seen both ways compiled twice. A model of its own, so no other test's executables
    are in its programs' cache."""
    import jax.numpy as jnp
    from flax import nnx

    from jaxpaged.config import LlamaConfig
    from jaxpaged.loader import LoadedModel
    from jaxpaged.model import Llama

    cfg = LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=3,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=256)
    model = Llama(cfg, dtype=jnp.float32, attention_backend="xla", rngs=nnx.Rngs(0))
    llm = make(LoadedModel(model, None, cfg, "random"), debug_checks=False, max_num_seqs=4,
               max_num_batched_tokens=32, num_blocks=60, enable_prefix_caching=False)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 96, int(rng.integers(1, 30))).tolist() for _ in range(8)]
    params = [SamplingParams(temperature=0, ignore_eos=True, max_tokens=int(rng.integers(1, 8))) for _ in prompts]
    executables = llm.runner.programs.forward._cache_size()
    llm.core.async_scheduling = False
    sync = tokens(llm.generate(prompts, params, use_tqdm=False))
    llm.core.async_scheduling = True
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == sync
    shapes = {k for k in llm.runner.compiled_shapes if k[0] == "forward"}
    assert llm.runner.programs.forward._cache_size() - executables == len(shapes)
    assert_no_leak(llm)


ENGINES_OF_NEW_GEOMETRIES = r"""
import gc, json, os, sys, weakref
import jax.numpy as jnp
from flax import nnx
from jaxpaged import LLM, SamplingParams, runner
from jaxpaged.config import LlamaConfig
from jaxpaged.loader import LoadedModel
from jaxpaged.model import Llama

def maps():
    if not os.path.exists("/proc/self/maps"):  # not Linux
        return 0
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)

params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=2)
models = []  # a vocabulary of its own each (made first: their random init compiles programs of jax's)
for i in range(int(sys.argv[1])):
    cfg = LlamaConfig(vocab_size=96 + 8 * i, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=16, max_position_embeddings=256)
    models.append(LoadedModel(Llama(cfg, dtype=jnp.float32, attention_backend="xla", rngs=nnx.Rngs(i)), None, cfg,
                              "random"))
counts, programs, samplers = [], [], []
for i, lm in enumerate(models):  # and a pool size of its own
    llm = LLM(lm, num_blocks=40 + i, block_size=8, max_num_seqs=2, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
    programs.append(weakref.ref(llm.runner.programs))
    samplers.append(weakref.ref(llm.runner.sampler_programs))
    del llm
    gc.collect()
    counts.append(maps())
print(json.dumps({"maps": counts, "alive": [p() is not None for p in programs],
                  "samplers_alive": [p() is not None for p in samplers],
                  "keep": [runner.PROGRAMS.keep_recent, runner.SAMPLERS.keep_recent]}))
"""


def test_programs_of_engines_gone_are_freed():
    """One process building engines of new pool geometries and vocabularies one after another:
    each one's compiled programs (the steps and block moves per geometry, the sampler per
    vocabulary) go once its engine is gone and it is no longer among the most recent
    ``keep_recent``. They once stayed for the life of the process, and each XLA:CPU program
    holds memory mappings, ~170 for a step: Linux allows 65,530, past which XLA fails with
    "LLVM compilation error: Cannot allocate memory". A process of its own, so that its
    mappings are its engines' only."""
    import json
    import os
    import subprocess
    import sys

    n = 7
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    r = subprocess.run([sys.executable, "-c", ENGINES_OF_NEW_GEOMETRIES, str(n)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    keep, keep_samplers = out["keep"]
    assert out["alive"] == [False] * (n - keep) + [True] * keep, out
    assert out["samplers_alive"] == [False] * (n - keep_samplers) + [True] * keep_samplers, out
    maps = out["maps"]
    per_geometry = (maps[keep - 1] - maps[0]) / (keep - 1)  # while every geometry is kept
    assert maps[-1] - maps[keep - 1] < per_geometry, out  # then the old ones' programs are unmapped


def test_program_budget_frees_the_least_recently_used_shapes(monkeypatch):
    """``runner.ShapedJit`` keeps each call shape's programs in a jit object of its own,
    entered in the process's ``runner.BUDGET``: past ``max_programs`` the least recently used
    shape's go (freed: nothing else holds them), and a shape called again is compiled again
    and gives the same result. An owner's entries go with it."""
    import gc
    import weakref

    from jaxpaged import runner

    budget = runner.ProgramBudget(max_programs=3)
    monkeypatch.setattr(runner, "BUDGET", budget)
    rng = np.random.default_rng(0)
    f = runner.ShapedJit(lambda x, y, *, scale: x * scale + y.sum(), static_argnames=("scale",))
    inputs = {n: (rng.standard_normal(n).astype(np.float32), rng.standard_normal((2, n)).astype(np.float32))
              for n in (1, 2, 3, 4)}
    refs = {}
    for n in (1, 2, 3, 1, 4):  # 1 used again before 4 comes: 2 is the least recently used
        x, y = inputs[n]
        np.testing.assert_allclose(f(x, y, scale=3.0), x * 3.0 + y.sum(), rtol=1e-6, atol=1e-6)
        refs.setdefault(n, weakref.ref(budget.owned(f._owner)[-1]))
    gc.collect()
    assert [n for n, r in refs.items() if r() is None] == [2] and len(budget) == 3
    assert budget.num_evicted == 1 and f._cache_size() == 3
    f(*inputs[4], scale=2.0)  # a static argument is part of the shape: a new entry, 3 goes
    assert refs[3]() is None and refs[4]() is not None and budget.num_evicted == 2
    np.testing.assert_allclose(f(*inputs[2], scale=3.0), inputs[2][0] * 3.0 + inputs[2][1].sum(), rtol=1e-6,
                               atol=1e-6)
    del f
    gc.collect()
    assert len(budget) == 0


def test_program_budget_near_the_map_limit_frees_a_quarter(monkeypatch):
    """Past ``maps_fraction`` of the kernel's limit on memory mappings (XLA:CPU programs hold
    them; past the limit XLA cannot compile), each new program first frees the least recently
    used quarter of the entries; under it, nothing goes."""
    from jaxpaged import runner

    budget = runner.ProgramBudget(maps_fraction=0.5)
    monkeypatch.setattr(runner, "BUDGET", budget)
    monkeypatch.setattr(runner, "max_memory_maps", lambda: 1000)
    maps = [400]
    monkeypatch.setattr(runner, "process_memory_maps", lambda: maps[0])
    f = runner.ShapedJit(lambda x: x + 1)
    for n in range(1, 9):
        f(np.ones(n, np.float32))
    assert len(budget) == 8 and budget.num_evicted == 0
    maps[0] = 501
    f(np.ones(9, np.float32))
    assert len(budget) == 7 and budget.num_evicted == 2  # 8 // 4 went, then 9 came
    first_leaf_shapes = [key[2][0][0] for _, key in budget._entries]  # key: (static, treedef, leaves)
    assert first_leaf_shapes == [(n,) for n in range(3, 10)]  # the two least recently used went
    maps[0] = None  # no /proc: no mappings to count, nothing freed
    f(np.ones(10, np.float32))
    assert len(budget) == 8


def test_steps_past_256_tokens_pad_to_quarter_octaves_and_keep_tokens(tiny_engine_model):
    """A prefill step of 395 tokens runs at T = 448, and a mixed one (3 decodes and a
    300-token prompt) at 320 (3 decodes are too few to split: ``batch.SPLIT_MIN_ROWS``),
    not at the next power of two; every request gets the tokens it gets alone."""
    rng = np.random.default_rng(1)
    options = dict(max_num_batched_tokens=1024, max_num_seqs=8, block_size=16, num_blocks=160,
                   enable_prefix_caching=False)
    llm = make(tiny_engine_model, **options)
    vocab = llm.config.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in (200, 150, 45, 300)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = [tokens(llm.generate([p], params, use_tqdm=False))[0] for p in prompts]
    llm = make(tiny_engine_model, **options)
    for i, p in enumerate(prompts[:3]):
        llm.add_request(p, params, request_id=str(i))
    got = {}
    for step in range(40):
        if step == 1:
            llm.add_request(prompts[3], params, request_id="3")
        for o in llm.step():
            if o.finished:
                got[int(o.request_id)] = [c.token_ids for c in o.outputs]
        if not llm.has_unfinished_requests():
            break
    assert [got[i] for i in range(4)] == alone
    # (T less the one-token part, that part's rows) of the steps that are not decode-only
    shapes = {(k[1] - k[-1], k[-1]) for k in llm.runner.compiled_shapes if k[0] == "forward" and not k[-2]}
    assert {(448, 0), (320, 0)} <= shapes, shapes
    assert_no_leak(llm)


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt is empty"),
    ([], "prompt is empty"),
    ([1, 2, 49152], r"outside the vocabulary \[0, 49152\)"),
    ([-1], "outside the vocabulary"),
    ([5] * 600, "prompt has 600 tokens; max_model_len is 512"),
    ({"text": "x"}, "takes 'prompt' and/or 'prompt_token_ids'"),
    (3.5, "prompt must be a str"),
])
def test_bad_prompt_rejected_alone(tiny_engine_model, reference, prompt, match):
    greedy, _ = reference
    llm = make(tiny_engine_model)
    good = llm.add_request(PROMPTS[0], GREEDY)
    with pytest.raises((ValueError, TypeError), match=match):
        llm.add_request(prompt, GREEDY)
    with pytest.raises((ValueError, TypeError), match=match.replace("prompt ", "")) as e:  # validated before any work
        llm.generate([PROMPTS[1], prompt], GREEDY, use_tqdm=False)
    assert str(e.value).startswith("prompts[1]"), e.value  # which prompt of the batch
    finals = {}
    while llm.has_unfinished_requests():
        finals.update({o.request_id: o for o in llm.step() if o.finished})
    assert list(finals) == [good] and finals[good].outputs[0].token_ids == greedy[0][0]
    assert_no_leak(llm)


def test_chat_names_the_conversation_that_is_too_long(tiny_engine_model):
    llm = make(tiny_engine_model)
    long = [{"role": "user", "content": "hello " * 600}]
    with pytest.raises(ValueError, match=r"^messages has \d+ tokens; max_model_len is 512"):
        llm.chat(long, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^conversation 1 has \d+ tokens"):
        llm.chat([[{"role": "user", "content": "hi"}], long], GREEDY, use_tqdm=False)
    assert_no_leak(llm)


def test_prompt_that_can_never_fit_the_pool(tiny_engine_model):
    llm = make(tiny_engine_model, num_blocks=5)  # 4 usable blocks of 8 slots
    with pytest.raises(ValueError, match="needs 5 blocks of 8 slots, but the pool has 4"):
        llm.add_request([7] * 32, GREEDY)
    assert len(llm.generate([[7] * 20], GREEDY.replace(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("params, match", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=2), "min_p"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(use_beam_search=True, beam_width=2, temperature=0.7), "beam"),
])
def test_invalid_sampling_params(params, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**params)


def test_logit_bias_outside_vocab_rejected(tiny_engine_model):
    llm = make(tiny_engine_model)
    with pytest.raises(ValueError, match="logit_bias token ids \\[60000\\]"):
        llm.add_request(PROMPTS[0], SamplingParams(logit_bias={60000: 1.0}))


@pytest.mark.parametrize("options, exc, match", [
    (dict(block_size=12), ValueError, "block_size=12 must be a power of two"),
    (dict(num_blocks=1), ValueError, "num_blocks=1 must be >= 2"),
    (dict(kv_cache_memory="lots"), ValueError, "kv_cache_memory='lots' is not a size"),
    (dict(kv_cache_memory="10KiB"), ValueError, "too small"),
    (dict(preemption_mode="swap"), ValueError, "needs swap_space"),
    (dict(preemption_mode="drop"), ValueError, "preemption_mode='drop'"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs=0"),
    (dict(max_model_len=4096), ValueError, "exceeds the model's max_position_embeddings=512"),
    (dict(attention_backend="cuda"), ValueError, "unknown attention backend 'cuda'"),
    (dict(kv_cache_dtype="fp4"), ValueError, "kv_cache_dtype='fp4'"),
    (dict(seed=-1), ValueError, "seed=-1 must be >= 0"),
    (dict(seed="x"), TypeError, "seed must be an int, got 'x'"),
    (dict(enable_prefix_caching="no"), TypeError, "enable_prefix_caching must be a bool, got 'no'"),
])
def test_invalid_engine_options(tiny_engine_model, options, exc, match):
    with pytest.raises(exc, match=match):
        LLM(tiny_engine_model, **options)


def test_a_pool_smaller_than_max_model_len_is_logged(tiny_engine_model, caplog):
    with caplog.at_level("WARNING", logger="jaxpaged.engine"):
        make(tiny_engine_model, num_blocks=4)
    assert "max_model_len=512 is more than the KV pool holds (3 blocks of 8 slots: 24 tokens)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxpaged.engine"):
        make(tiny_engine_model, num_blocks=65)
    assert "max_model_len" not in caplog.text


@pytest.mark.parametrize("model, options, exc, match", [
    ("folder", dict(dtype="bogus"), ValueError, r"dtype='bogus': choose one of \('float32', 'bfloat16', 'float16'"),
    ("folder", dict(dtype="int8"), ValueError, "dtype='int8'"),
    (5, {}, TypeError, "model must be a path"),
])
def test_invalid_model_options(tiny_engine_folder, model, options, exc, match):
    with pytest.raises(exc, match=match):
        LLM(tiny_engine_folder if model == "folder" else model, **options)


@pytest.mark.parametrize("messages, exc, match", [
    ({"role": "user", "content": "hi"}, TypeError, "messages must be a non-empty list"),
    ([], TypeError, "messages must be a non-empty list"),
    ([{"content": "hi"}], ValueError, r"messages\[0\] needs a str 'role', got None"),
    ([{"role": "user", "content": "\ud800"}], ValueError, r"messages\[0\].content is not valid Unicode"),
    ([{"role": "user", "content": 5}], TypeError, r"messages\[0\].content must be a str or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], ValueError, r"messages\[0\].content\[0\]: only text"),
    (["hi"], TypeError, r"messages\[0\] must be a dict"),
    ([[{"role": "user", "content": "a"}], [{"role": 1}]], ValueError, r"conversation 1\[0\] needs a str 'role'"),
])
def test_bad_chat_messages(tiny_engine_model, messages, exc, match):
    llm = make(tiny_engine_model)
    with pytest.raises(exc, match=match):
        llm.chat(messages, GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()


def test_a_bfloat16_model_on_cpu_keeps_float32_kv_and_activations(tiny_engine_folder):
    """``kv_cache_dtype="auto"``: a 16-bit model on CPU gets a float32 pool, sized in float32
    bytes. Its activations stay float32 (only the matmuls' inputs are rounded, see
    ``model._cpu_dot_16bit``), so the pool holds K/V that a bfloat16 pool would round; asked
    for, a bfloat16 pool (its values' bits in uint16: ``kv_cache.resolve_kv_cache_dtype``)
    decodes too."""
    import jax.numpy as jnp

    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    auto = LLM(tiny_engine_folder, dtype="bfloat16", kv_cache_memory="4MiB", enable_prefix_caching=False)
    bf16 = LLM(auto.loaded, kv_cache_memory="4MiB", kv_cache_dtype="bfloat16", enable_prefix_caching=False)
    assert auto.loaded.model.dtype == jnp.bfloat16
    assert (auto.runner.kv.k.dtype, bf16.runner.kv.k.dtype) == (jnp.float32, jnp.uint16)  # bfloat16's bits
    assert auto.bm.num_usable_blocks + 1 == (bf16.bm.num_usable_blocks + 1) // 2  # the null block aside
    for llm in (auto, bf16):
        assert [len(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)] == [12] * 3
    k = np.asarray(auto.runner.kv.k)
    written = k[k != 0]
    rounded = np.asarray(jnp.asarray(written).astype(jnp.bfloat16), np.float32)
    assert written.size and not np.array_equal(written, rounded)


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing-model"):
        LLM(tmp_path / "missing-model")


def test_swap_in_then_preempted_again_does_not_loop(tiny_engine_model):
    """A tight pool where a swapped-in request is preempted again in the same step: the
    scheduler waits for memory instead of swapping it in and out forever."""
    llm = make(tiny_engine_model, block_size=4, num_blocks=14, max_num_batched_tokens=16,
               preemption_mode="swap", swap_space="4MiB")
    prompts = [list(range(100, 111)), list(range(200, 208)), list(range(300, 310)), list(range(400, 406))]
    outs = llm.generate(prompts, GREEDY.replace(max_tokens=12), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12] * 4
    assert llm.stats()["num_preemptions"] > 0
    assert_no_leak(llm)
