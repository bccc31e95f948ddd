"""Structured outputs (jaxpaged/structured_output.py): the sampler's bitmask against a reference
on random logits, llguidance's masks on SmolLM2's tokenizer, and the engine on the tiny random
model (SmolLM2's tokenizer), whose outputs must match their grammar under every schedule."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxpaged import LLM, SamplingParams
from jaxpaged.sampler import SamplingRow, build_sampling_metadata, sample
from jaxpaged.structured_output import Grammars, StructuredOutputsParams, token_bitmask

EOS = 2
SCHEMA = {"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "enum": [1, 22, 333]},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 4, "maxItems": 4}},
    "required": ["ok", "n", "tags"], "additionalProperties": False}


def unpack(mask: np.ndarray, vocab: int) -> np.ndarray:
    return np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)


@pytest.mark.parametrize("kwargs, error, pattern", [
    (dict(structured_outputs=dict(regex="a", choice=["a"])), ValueError, r"exactly one of .*; got regex, choice"),
    (dict(structured_outputs=dict()), ValueError, r"exactly one of .*; got none"),
    (dict(structured_outputs=dict(regex=5)), TypeError, r"structured_outputs\.regex must be a str, got 5"),
    (dict(structured_outputs=dict(choice=["a", 1])), TypeError, r"structured_outputs\.choice must be a list of str"),
    (dict(structured_outputs=dict(choice=[])), ValueError, r"non-empty list of non-empty strings"),
    (dict(structured_outputs=dict(json_object=False)), ValueError, r"got none"),
    (dict(structured_outputs=dict(regex="a", whitespace=True)), ValueError, r"unknown keys \['whitespace'\]"),
    (dict(structured_outputs="json"), TypeError, r"structured_outputs must be StructuredOutputsParams"),
    (dict(structured_outputs=dict(regex="a"), use_beam_search=True, temperature=0), ValueError,
     r"structured_outputs cannot be used with use_beam_search"),
])
def test_bad_params_are_refused_by_name(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        SamplingParams(**kwargs)


def test_the_sampler_takes_only_allowed_tokens_and_leaves_other_rows_alone():
    """On random logits, every row's token is the one the same row samples from logits already
    set to -inf outside its mask (greedy and seeded rows, top-k / top-p / min-p, bias), and the
    rows whose mask allows everything sample exactly what they sample without any mask."""
    rng = np.random.default_rng(0)
    S, V = 8, 300  # V not a multiple of 32: the last word is partly used
    logits = (3 * rng.standard_normal((S, V))).astype(np.float32)
    mask = rng.integers(-(1 << 31), 1 << 31, size=(S, -(-V // 32)), dtype=np.int64).astype(np.int32)
    mask[:, :4] &= 0x01010101  # sparse allowed sets in the first words ...
    mask[:, 4:] = 0  # ... and nothing past them, so the mask really changes the argmax
    mask[6:] = -1  # rows 6 and 7 are not structured
    allowed = unpack(mask, V)
    assert allowed[:6].sum(axis=1).min() >= 1
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.9, seed=3),
              SamplingParams(temperature=1.2, seed=4, top_k=5), SamplingParams(temperature=0.7, seed=5, top_p=0.8),
              SamplingParams(temperature=1.0, seed=6, min_p=0.2, logit_bias={int(np.argmax(logits[4])): 5.0}),
              SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=0)]
    rows = [SamplingRow(p, 11 * i, [1, 2], []) for i, p in enumerate(params)]

    def run(x, m):
        sm, k, pen = build_sampling_metadata(rows, S, V, [EOS], allowed=m)
        return np.asarray(sample(jax.numpy.asarray(x), jax.tree.map(jax.numpy.asarray, sm), num_logprobs=k,
                                 use_penalties=pen).tokens)

    got = run(logits, mask)
    want = run(np.where(allowed, logits, -np.inf).astype(np.float32), None)
    np.testing.assert_array_equal(got, want)
    assert allowed[np.arange(S), got].all()
    assert got[0] == np.flatnonzero(allowed[0])[np.argmax(logits[0][allowed[0]])]  # greedy: the best allowed
    np.testing.assert_array_equal(got[6:], run(logits, None)[6:])
    assert (got[:6] != run(logits, None)[:6]).any()  # the mask changed something
    with pytest.raises(ValueError, match=r"allowed must be int32 of shape \(8, 10\)"):
        build_sampling_metadata(rows, S, V, [EOS], allowed=mask[:, :9])


def test_a_grammar_that_allows_only_banned_stop_ids_wins_over_min_tokens():
    """min_tokens bans stop ids; where a row's grammar allows nothing else, the grammar wins
    (sampling token 0, outside both, was the other outcome); where it allows more, the ban holds."""
    V = 64
    mask = np.zeros((2, 2), np.int32)
    mask[0, 0] = 1 << 5  # row 0: only token 5, a stop id
    mask[1, 0] = (1 << 5) | (1 << 9)  # row 1: 5 or 9
    logits = np.zeros((2, V), np.float32)
    logits[:, 5] = 3.0
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    sm, k, pen = build_sampling_metadata([SamplingRow(p, 0, [1], []), SamplingRow(p, 0, [1], [])], 2, V, [EOS],
                                         allowed=mask)
    out = sample(jax.numpy.asarray(logits), jax.tree.map(jax.numpy.asarray, sm), num_logprobs=k, use_penalties=pen)
    assert np.asarray(out.tokens).tolist() == [5, 9]


@pytest.fixture(scope="module")
def grammars():
    from jaxpaged.default_model import default_model_path
    from jaxpaged.gguf_loader import tokenizer_from_gguf

    tok = tokenizer_from_gguf(default_model_path())
    return tok, Grammars(tok, vocab_size=49152, eos_ids=[EOS])


def test_masks_follow_the_grammar_on_the_real_tokenizer(grammars):
    tok, g = grammars
    m = g.matcher(g.compile(StructuredOutputsParams(regex="[0-9]{2}x")))
    fork = m.fork()
    V = 49152
    mask = unpack(token_bitmask([(0, m), (2, m), (3, fork)], 4, V), V)
    assert mask[1].all() and (mask[0] == mask[2]).all() and (mask[0] == mask[3]).all()
    texts = [tok.decode([t]) for t in np.flatnonzero(mask[0])]
    assert texts and all(re.fullmatch(r"[0-9]{1,2}|[0-9]{2}x", s) for s in texts), texts[:20]
    for t in tok("12", add_special_tokens=False)["input_ids"]:
        assert m.advance(t)
    after = unpack(token_bitmask([(0, m), (1, fork)], 2, V), V)
    assert [tok.decode([t]) for t in np.flatnonzero(after[0])] == ["x"]
    assert (after[1] == mask[0]).all()  # the fork kept its own place
    assert m.advance(tok("x", add_special_tokens=False)["input_ids"][0]) and m.is_complete
    assert np.flatnonzero(unpack(token_bitmask([(0, m)], 1, V), V)[0]).tolist() == [EOS]
    assert not fork.advance(tok("a", add_special_tokens=False)["input_ids"][0]) and "a" in fork.error
    narrow = token_bitmask([(0, m)], 1, 20480)  # a model with fewer embeddings than the tokenizer
    assert narrow.shape == (1, 640)


def test_a_request_is_compiled_once(grammars, monkeypatch):
    """Checked, then made (``InputProcessor.check`` then ``process``): one compilation."""
    _, g = grammars
    so = StructuredOutputsParams(regex="[a-c]+")
    calls = []
    monkeypatch.setattr(StructuredOutputsParams, "to_grammar",
                        lambda self, f=StructuredOutputsParams.to_grammar: calls.append(1) or f(self))
    assert g.compile(so) == g.compile(so) and len(calls) == 1
    g.compile(StructuredOutputsParams(regex="[a-c]+"))  # equal, but another request's
    assert len(calls) == 2


REQUESTS = [
    ("Free text", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    ("Write a code:", SamplingParams(temperature=0, max_tokens=30,
                                     structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{8}"))),
    ("Pick:", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12,
                             structured_outputs=dict(choice=["alpha", "beta", "gamma delta"]))),
    ("A person:", SamplingParams(temperature=0.8, seed=5, max_tokens=60,
                                 structured_outputs=dict(json=SCHEMA, disable_any_whitespace=True))),
    ("Say yes", SamplingParams(temperature=0.9, seed=9, max_tokens=10, ignore_eos=True,
                               structured_outputs=dict(grammar='start: "y" "e"+ "s"'))),
    ("Count", SamplingParams(temperature=0, max_tokens=10, min_tokens=8,
                             structured_outputs=dict(regex="[0-9]{2}"))),
]


def check(outs):
    free, code, pick, person, yes, count = outs
    assert re.fullmatch(r"[a-z]{3}-[0-9]{8}", code.outputs[0].text), code.outputs[0].text
    assert [c.text in ("alpha", "beta", "gamma delta") for c in pick.outputs] == [True, True]
    obj = json.loads(person.outputs[0].text)
    assert set(obj) == {"ok", "n", "tags"} and isinstance(obj["ok"], bool) and obj["n"] in (1, 22, 333)
    assert len(obj["tags"]) == 4 and set(obj["tags"]) <= {"red", "green"}
    assert re.fullmatch(r"ye+s", yes.outputs[0].text) and EOS not in yes.outputs[0].token_ids  # ignore_eos
    assert re.fullmatch(r"[0-9]{2}", count.outputs[0].text)  # the grammar ends it before min_tokens
    for o in (code, pick, person, yes, count):
        for c in o.outputs:
            assert c.finish_reason == "stop" and c.finish_detail is None, (o.prompt, c)
    assert code.outputs[0].token_ids[-1] == EOS  # a complete grammar lets EOS end it, as in vLLM
    assert len(free.outputs[0].token_ids) == 30


def generate(model, **kw):
    kw = {"block_size": 4, "num_blocks": 256, "max_num_seqs": 8, "max_num_batched_tokens": 32,
          "max_model_len": 128, "debug_checks": True, "async_scheduling": False, **kw}
    llm = LLM(model, **kw)
    outs = llm.generate([p for p, _ in REQUESTS], [s for _, s in REQUESTS], use_tqdm=False)
    while llm.has_unfinished_requests():
        llm.step()
    assert llm.stats()["num_used_blocks"] == 0 and llm.stats()["num_host_blocks_used"] == 0
    return outs, llm


@pytest.fixture(scope="module")
def reference(tiny_engine_model):
    outs, _ = generate(tiny_engine_model)
    check(outs)
    return outs


@pytest.mark.parametrize("kw", [
    dict(async_scheduling=True),
    dict(num_blocks=10, async_scheduling=True),  # recompute preemption
    dict(num_blocks=10, preemption_mode="swap", swap_space=1 << 20),
], ids=["async", "recompute", "swap"])
def test_outputs_match_their_grammar_under_any_schedule(tiny_engine_model, reference, kw):
    outs, llm = generate(tiny_engine_model, **kw)
    check(outs)
    for o, r in zip(outs, reference):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in r.outputs], o.prompt
    if "num_blocks" in kw:  # the JSON request is preempted mid-output and resumes in its grammar
        assert outs[3].metrics.num_preemptions > 0
    if "preemption_mode" in kw:
        assert llm.stats()["num_swapped_out_blocks"] > 0


def test_structured_steps_overlap_with_the_sampler_waiting_for_the_grammar(tiny_engine_model, reference):
    """Under async scheduling a step after one that sampled a structured row still launches
    ahead: its forward runs while the host applies the tokens, its sampler (masks from the
    grammars' new state) once they are applied; the tokens are the synchronous loop's."""
    structured = [1, 3, 4, 5]  # single-sample requests with a grammar
    kw = {"block_size": 4, "num_blocks": 256, "max_num_seqs": 8, "max_model_len": 128, "debug_checks": True}
    llm = LLM(tiny_engine_model, async_scheduling=True, **kw)
    deferred = []
    real = llm.runner.dispatch
    llm.runner.dispatch = lambda out, prev=None, **kw: (deferred.append(kw.get("defer_sampling", False)),
                                                        real(out, prev, **kw))[1]
    outs = llm.generate([REQUESTS[i][0] for i in structured], [REQUESTS[i][1] for i in structured], use_tqdm=False)
    for o, i in zip(outs, structured):
        assert o.outputs[0].token_ids == reference[i].outputs[0].token_ids, o.prompt
        assert o.outputs[0].finish_detail is None
    steps, ahead = llm.core.num_steps, llm.core.num_steps_ahead
    assert ahead >= steps - 3 and sum(deferred) >= steps - 3, (steps, ahead, sum(deferred))
    assert llm.stats()["num_used_blocks"] == 0


def test_a_structured_request_leaves_its_batch_mates_alone(tiny_engine_model, reference):
    llm = LLM(tiny_engine_model, block_size=4, num_blocks=256, max_model_len=128)
    alone = llm.generate(REQUESTS[0][0], REQUESTS[0][1], use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == reference[0].outputs[0].token_ids


def test_edge_constraints_end_cleanly(tiny_engine_model, grammars):
    """A choice whose only token is a stop id banned by min_tokens, and a grammar complete at once."""
    tok, _ = grammars
    one = tok("1", add_special_tokens=False)["input_ids"]
    assert len(one) == 1
    llm = LLM(tiny_engine_model, block_size=4, num_blocks=64, max_model_len=128)
    outs = llm.generate(["a", "b"], [
        SamplingParams(temperature=0, max_tokens=5, min_tokens=2, stop_token_ids=one, structured_outputs=dict(choice=["1"])),
        SamplingParams(temperature=0, max_tokens=5, min_tokens=3, structured_outputs=dict(regex="x"))], use_tqdm=False)
    assert [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].finish_detail) for o in outs] == [
        ("1", "stop", None), ("x", "stop", None)]


def test_a_bad_grammar_is_refused_before_any_work(tiny_engine_model):
    llm = LLM(tiny_engine_model, block_size=4, num_blocks=64, max_model_len=128)
    good = SamplingParams(max_tokens=3)
    for bad, pattern in [(dict(regex="a(b"), r"structured_outputs\.regex is not a valid constraint: .*unclosed group"),
                         (dict(grammar="start: foo"), r"structured_outputs\.grammar .*unknown name"),
                         (dict(json="{"), r"structured_outputs\.json is not valid JSON"),
                         (dict(json={"type": "nonsense"}), r"structured_outputs\.json is not a valid constraint"),
                         (dict(json="true"), r"structured_outputs\.json must be a JSON schema object"),
                         (dict(regex="ab\\"), r"structured_outputs\.regex ends in a lone backslash")]:
        with pytest.raises(ValueError, match=pattern):
            llm.generate(["fine", "bad"], [good, SamplingParams(structured_outputs=bad)], use_tqdm=False)
        assert not llm.has_unfinished_requests() and llm.stats()["num_used_blocks"] == 0


# ---------------------------------------------------------------- random traffic (hypothesis)

ATOMS = ["[a-z]", "[0-9]", "[A-Z]", "(ab|cd)", "x", "-", "( |_)"]


@st.composite
def constraints(draw):
    kind = draw(st.sampled_from(["regex", "regex", "choice", "json", None]))
    if kind == "regex":
        parts = [draw(st.sampled_from(ATOMS)) + "{%d,%d}" % draw(st.tuples(st.integers(1, 2), st.integers(2, 5)))
                 for _ in range(draw(st.integers(1, 3)))]
        return {"regex": "".join(parts)}
    if kind == "choice":
        words = draw(st.lists(st.text("abcdefgh ", min_size=1, max_size=6).filter(str.strip), min_size=1,
                              max_size=4, unique=True))
        return {"choice": words}
    if kind == "json":
        return {"json": {"type": "array", "items": {"enum": draw(st.lists(st.integers(0, 99), min_size=1, max_size=3,
                                                                           unique=True))},
                         "minItems": 1, "maxItems": draw(st.integers(1, 3))}, "disable_any_whitespace": True}
    return None


@st.composite
def requests(draw):
    so = draw(constraints())
    n = draw(st.integers(1, 2))
    return SamplingParams(
        n=n, temperature=0 if n == 1 and draw(st.booleans()) else 0.9, seed=draw(st.integers(0, 1 << 20)),
        max_tokens=draw(st.integers(3, 24)), min_tokens=draw(st.sampled_from([0, 0, 3])),
        ignore_eos=draw(st.booleans()), structured_outputs=so)


def fits(so: dict, text: str, token_ids: list[int], grammars: Grammars, complete: bool) -> bool:
    """Whether ``text`` is a complete match of ``so`` (``complete``), or ``token_ids`` a prefix
    that a fresh matcher of the same grammar takes token by token."""
    if complete:
        if "regex" in so:
            return re.fullmatch(so["regex"], text) is not None
        if "choice" in so:
            return text in so["choice"]
        value = json.loads(text)
        return 1 <= len(value) <= so["json"]["maxItems"] and set(value) <= set(so["json"]["items"]["enum"])
    m = grammars.matcher(grammars.compile(StructuredOutputsParams(**so)))
    return all(m.advance(t) for t in token_ids if t != EOS)


@pytest.fixture(scope="module")
def traffic_engines(tiny_engine_model):
    base = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=32, max_model_len=64, debug_checks=True)
    return [LLM(tiny_engine_model, num_blocks=128, async_scheduling=False, **base),
            LLM(tiny_engine_model, num_blocks=8, **base),  # async, recompute preemption
            LLM(tiny_engine_model, num_blocks=8, preemption_mode="swap", swap_space=1 << 20, **base),
            LLM(tiny_engine_model, num_blocks=16, speculative_config={  # drafts within the grammar
                "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}, **base)]


@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                                   HealthCheck.too_slow])
@given(data=st.data())
def test_random_structured_traffic(traffic_engines, data):
    """Random structured and free requests, some aborted mid-way, on engines that preempt by
    recompute or swap, overlap steps or not, draft (speculative decoding) or not: every output that ends on its own is a complete
    match of its constraint, every output cut by length a prefix the grammar takes, and no
    block is left behind (a request cut for room also ends in a prefix the grammar takes)."""
    llm = data.draw(st.sampled_from(traffic_engines))
    params = data.draw(st.lists(requests(), min_size=2, max_size=6))
    abort_at = data.draw(st.integers(0, 8))
    words = ["Hello", "the list:", "Answer", "x y z", "code 12"]
    ids = [llm.add_request(words[i % len(words)], p) for i, p in enumerate(params)]
    finished, steps, aborted = {}, 0, None
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == abort_at and (live := [i for i in ids if i not in finished]):
            aborted = live[-1]
            llm.abort(aborted)
    assert set(finished) == set(ids) - {aborted}
    for rid, p in zip(ids, params):
        if rid not in finished or p.structured_outputs is None:
            continue
        so = {k: v for k, v in dataclasses.asdict(p.structured_outputs).items() if v not in (None, False)}
        for c in finished[rid].outputs:
            assert c.finish_detail is None or "structured" not in c.finish_detail, c  # a capacity cut may end it
            complete = c.finish_reason == "stop" and c.finish_detail is None
            assert fits(so, c.text, c.token_ids, llm.inputs.grammars, complete), (so, c.text, c.finish_reason)
    s = llm.stats()
    assert s["num_used_blocks"] == 0 and s["num_host_blocks_used"] == 0, s
