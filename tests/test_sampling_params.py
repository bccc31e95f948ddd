import dataclasses
import math

import pytest

from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    expected = dict(
        n=1, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
        presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None, allowed_token_ids=None, bad_words=None, seed=None,
        stop=[],
        stop_token_ids=[], include_stop_str_in_output=False, ignore_eos=False, max_tokens=16, min_tokens=0,
        logprobs=None, prompt_logprobs=None, truncate_prompt_tokens=None, use_beam_search=False, beam_width=None,
        length_penalty=1.0, cache_salt=None, skip_special_tokens=True, structured_outputs=None,
    )
    assert {f.name: getattr(p, f.name) for f in dataclasses.fields(p)} == expected
    assert not p.is_greedy
    assert MAX_LOGPROBS == 20


@pytest.mark.parametrize("kw, field", [
    (dict(n=0), "n"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3], use_beam_search=True, temperature=0), "allowed_token_ids"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.01), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=1e-300), "repetition_penalty"),  # 0 in float32
    (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(temperature=1e300), "temperature"),  # inf in float32
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=2.1), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17), "min_tokens"),  # > max_tokens=16
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
    (dict(logit_bias={3: math.inf}), "logit_bias"),
    (dict(logit_bias={3: math.nan}), "logit_bias"),
    (dict(logit_bias={3: 1e39}), "logit_bias"),  # finite in Python, inf once added to float32 logits
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop_token_ids=[-5]), "stop_token_ids"),
    (dict(cache_salt=""), "cache_salt"),
    (dict(temperature=0.0, n=2), "n"),  # greedy copies would all be identical (vLLM rule)
    (dict(beam_width=2), "beam_width"),  # only with beam search
    (dict(length_penalty=0.5), "length_penalty"),  # only with beam search
    (dict(use_beam_search=True), "temperature"),  # beam search is deterministic
    (dict(use_beam_search=True, temperature=0.0, top_p=0.9), "top_p"),
    (dict(use_beam_search=True, temperature=0.0, top_k=5), "top_k"),
    (dict(use_beam_search=True, temperature=0.0, min_p=0.1), "min_p"),
    (dict(use_beam_search=True, temperature=0.0, beam_width=0), "beam_width"),
    (dict(use_beam_search=True, temperature=0.0, n=4, beam_width=2), "beam_width"),
])
def test_value_errors_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, field", [
    (dict(n=1.0), "n"),
    (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"),
    (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
    (dict(top_k=2.5), "top_k"),
    (dict(max_tokens="16"), "max_tokens"),
    (dict(min_tokens=None), "min_tokens"),
    (dict(seed=1.5), "seed"),
    (dict(seed="7"), "seed"),
    (dict(seed=True), "seed"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=None), "top_p"),
    (dict(logprobs=2.0), "logprobs"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: "big"}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
    (dict(stop=[1, 2]), "stop"),
    (dict(stop_token_ids=["2"]), "stop_token_ids"),
    (dict(stop_token_ids=3), "stop_token_ids"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(cache_salt=7), "cache_salt"),
    (dict(beam_width=2.0), "beam_width"),
])
def test_type_errors_name_the_field(kw, field):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**kw)


def test_error_message_names_value_and_range():
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"min_tokens must be at most max_tokens=4, got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_stop_and_stop_token_ids_are_normalised():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(5, 2, 5)).stop_token_ids == [5, 2]


def test_logit_bias_is_copied_as_int_to_float():
    bias = {3: 1, 7: -2.5}
    p = SamplingParams(logit_bias=bias)
    assert p.logit_bias == {3: 1.0, 7: -2.5} and all(type(v) is float for v in p.logit_bias.values())
    bias[3] = 50.0
    assert p.logit_bias[3] == 1.0


def test_logprobs_true_means_one_and_cap_is_allowed():
    assert SamplingParams(logprobs=True).logprobs == 1
    assert SamplingParams(logprobs=0, prompt_logprobs=MAX_LOGPROBS).max_num_logprobs == MAX_LOGPROBS


def test_greedy_resets_truncation_like_vllm():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.is_greedy and (p.top_p, p.top_k, p.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_beam_search_defaults_beam_width_to_n():
    p = SamplingParams(use_beam_search=True, temperature=0.0, n=3, length_penalty=0.8)
    assert p.beam_width == 3
    assert SamplingParams(use_beam_search=True, temperature=0.0, n=2, beam_width=4).beam_width == 4


def test_max_tokens_none_means_unbounded():
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_seed_accepts_any_int():
    assert SamplingParams(seed=-3).seed == -3
    assert SamplingParams(seed=2**70).seed == 2**70


def test_replace_validates_and_clone_shares_nothing():
    p = SamplingParams(stop=["x"], logit_bias={1: 2.0})
    assert p.replace(top_k=5).top_k == 5
    with pytest.raises(ValueError, match="top_k"):
        p.replace(top_k=-3)
    assert p.replace(top_k=0).top_k == -1  # vLLM's other spelling of "disabled"
    q = p.clone()
    assert q == p and q.stop is not p.stop and q.logit_bias is not p.logit_bias
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.top_k = 3
