"""What a finished output says about why it ended, for random sampling parameters (hypothesis).

Every output is checked against the stop rules alone (``jaxpaged/stopping.py``), from its own
tokens: the tiny random model with SmolLM2's tokenizer, a logit bias that makes a few tokens
likely so that stop token ids, EOS and stop strings do fire, and ``min_tokens`` that often
holds them off. Before these checks the server fuzz found text cut by a stop string seen
before ``min_tokens``, and a stop token's text left in the output.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "1, 2, 3,", "Bonjour"]
WORDS = ["ab", " the", "in", "e", "1", " a"]  # one token each, biased up so that the stop strings fire
STOPS = ["ba", "he", "ni", "e1", "11", " a", "a"]


@pytest.fixture(scope="module")
def llm(tiny_engine_model):
    return LLM(tiny_engine_model, block_size=8, num_blocks=256, max_model_len=64, debug_checks=True)


@pytest.fixture(scope="module")
def likely(llm):
    ids = [llm.tokenizer.encode(w, add_special_tokens=False) for w in WORDS]
    assert all(len(i) == 1 for i in ids), ids
    return [i[0] for i in ids] + sorted(llm.eos_ids)


def draw_params(data, likely) -> SamplingParams:
    max_tokens = data.draw(st.integers(1, 14), "max_tokens")
    biased = data.draw(st.lists(st.sampled_from(likely), min_size=1, max_size=4, unique=True), "biased")
    words = [w for t, w in zip(likely, WORDS) if t in biased]  # their substrings make stop strings that fire
    stops = STOPS + [w[i:j] for w in words for i in range(len(w)) for j in range(i + 1, len(w) + 1)]
    p = SamplingParams(  # a bias of 8 or more makes a token the greedy pick here
        temperature=0.0, max_tokens=max_tokens, min_tokens=data.draw(st.integers(0, max_tokens), "min_tokens"),
        logit_bias={t: data.draw(st.floats(8.0, 14.0), f"bias {t}") for t in biased},
        ignore_eos=data.draw(st.booleans(), "ignore_eos"),
        stop=data.draw(st.lists(st.sampled_from(stops), min_size=1, max_size=3, unique=True), "stop"),
        stop_token_ids=data.draw(st.lists(st.sampled_from(biased), max_size=2, unique=True), "stop_token_ids"),
        include_stop_str_in_output=data.draw(st.booleans(), "include_stop_str_in_output"))
    if data.draw(st.booleans(), "sampled"):
        p = p.replace(temperature=data.draw(st.sampled_from([0.5, 1.0])), seed=data.draw(st.integers(0, 2**31)),
                      n=data.draw(st.integers(1, 2)))
    return p


def check_output(llm, p: SamplingParams, c, num_prompt_tokens: int) -> None:
    decode = lambda ids: llm.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    ids, n = c.token_ids, len(c.token_ids)
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(llm.eos_ids))
    assert 1 <= n <= p.max_tokens
    # No stop fired before the last token: ids count from min_tokens on (the last one may be one).
    assert not [t for k, t in enumerate(ids[:-1]) if k + 1 >= p.min_tokens and t in stop_ids]
    if c.finish_reason == "length":
        assert c.stop_reason is None and (n == p.max_tokens or num_prompt_tokens + n == llm.max_model_len)
        assert c.text == decode(ids)
    elif isinstance(c.stop_reason, int) or c.stop_reason is None:  # a stop token id or EOS: its text left out
        assert c.finish_reason == "stop" and n >= p.min_tokens and ids[-1] in stop_ids
        assert c.stop_reason == (ids[-1] if ids[-1] in p.stop_token_ids else None)
        assert c.text == decode(ids[:-1])
    else:  # a stop string: the text stops right before it (right after it, kept)
        assert c.finish_reason == "stop" and c.stop_reason in p.stop and n >= p.min_tokens
        kept = c.stop_reason if p.include_stop_str_in_output else ""
        assert c.text.endswith(kept) and decode(ids).startswith(c.text + c.stop_reason[len(kept):])
    # Stop strings count from min_tokens on: none may end past the text of the first
    # min_tokens - 1 tokens (the min_tokens-th token's text is the first that can end one),
    # but the one kept at the end.
    early = len(decode(ids[:max(p.min_tokens - 1, 0)]))
    text = c.text[:len(c.text) - len(c.stop_reason)] if p.include_stop_str_in_output and isinstance(
        c.stop_reason, str) else c.text
    for s in p.stop:
        i = text.find(s)
        while i != -1:
            assert i + len(s) <= early, (s, c.text, early)
            i = text.find(s, i + 1)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(data=st.data())
def test_every_output_ends_for_the_reason_it_reports(llm, likely, data):
    prompt = data.draw(st.sampled_from(PROMPTS), "prompt")
    p = draw_params(data, likely)
    out = llm.generate(prompt, p, use_tqdm=False)[0]
    assert len(out.outputs) == p.n
    for c in out.outputs:
        check_output(llm, p, c, len(out.prompt_token_ids))
    if p.n == 1 and p.seed is not None or p.temperature == 0:  # the same tokens again, streamed
        assert "".join(llm.stream(prompt, p)) == out.outputs[0].text  # nothing yielded that a stop string cut
    assert llm.stats()["num_used_blocks"] == 0
