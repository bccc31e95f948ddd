"""The stop rule, one pure function: which token ends a sequence, and why."""

import pytest

from jaxpaged.detokenizer import Detokenizer
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.stopping import check_stop, is_stop_token

EOS = (2,)


def stop(params, token, *, out=1, total=10, string=None, max_model_len=64):
    return check_stop(params, token, num_output_tokens=out, num_tokens=total, stop_string=string, eos_ids=EOS,
                      max_model_len=max_model_len)


@pytest.mark.parametrize("params, token, kw, want", [
    (SamplingParams(), 5, {}, None),
    (SamplingParams(), 2, {}, ("stop", None)),  # EOS
    (SamplingParams(ignore_eos=True), 2, {}, None),
    (SamplingParams(stop_token_ids=[7]), 7, {}, ("stop", 7)),
    (SamplingParams(stop=["ab"]), 5, dict(string="ab"), ("stop", "ab")),
    (SamplingParams(max_tokens=3), 5, dict(out=3), ("length", None)),
    (SamplingParams(max_tokens=None), 5, dict(total=64), ("length", None)),  # max_model_len
    (SamplingParams(max_tokens=3), 2, dict(out=3), ("stop", None)),  # a stop beats the length at the same token
    # Before min_tokens nothing but the length stops it.
    (SamplingParams(min_tokens=4, max_tokens=8, stop_token_ids=[7], stop=["ab"]), 7, dict(out=3, string="ab"), None),
    (SamplingParams(min_tokens=4, max_tokens=8), 2, dict(out=3), None),
    (SamplingParams(min_tokens=4, max_tokens=8, stop_token_ids=[7]), 7, dict(out=4), ("stop", 7)),
    (SamplingParams(min_tokens=4, max_tokens=4), 5, dict(out=4), ("length", None)),
])
def test_stop_rule(params, token, kw, want):
    assert stop(params, token, **kw) == want


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(ignore_eos=True, stop_token_ids=[7]),
                                    SamplingParams(min_tokens=3, stop_token_ids=[7, 9], stop=["ab"])])
@pytest.mark.parametrize("token", [2, 5, 7, 9])
@pytest.mark.parametrize("out", [1, 3, 4])
def test_a_stop_token_is_what_check_stop_ends_on_without_a_string(params, token, out):
    # The token whose text stays out of the output is exactly the one check_stop stops on by id.
    by_id = stop(params, token, out=out) == ("stop", token if token != 2 else None) and token in (2, 7, 9)
    assert is_stop_token(params, token, num_output_tokens=out, eos_ids=EOS) == by_id


class Letters:  # a tokenizer whose token i is the text WORDS[i]
    WORDS = ["paternal", "ab", "c", "d", " "]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.WORDS[i] for i in ids)


def detokenize(ids, stop, min_tokens=0, include_stop=False):
    d = Detokenizer(Letters(), skip_special_tokens=True, stop=stop, min_tokens=min_tokens, include_stop=include_stop)
    for n, t in enumerate(ids, 1):
        if (s := d.add(t)) is not None:
            return d.text, s, n
    return d.text, None, len(ids)


@pytest.mark.parametrize("ids, stop, min_tokens, want", [
    ([0], ["e", "a"], 0, ("p", "a", 1)),  # the earliest match, whatever the list order
    ([1, 1, 2], ["bc", "ba"], 0, ("a", "ba", 2)),  # a match across tokens
    ([1, 1, 2], ["bc", "ba"], 3, ("aba", "bc", 3)),  # "ba" came before min_tokens: it does not count
    ([1, 1, 1], ["ba"], 2, ("a", "ba", 2)),  # the min_tokens-th token may complete one
    ([2, 3, 4], ["x"], 0, ("cd ", None, 3)),
])
def test_detokenizer_stop_strings(ids, stop, min_tokens, want):
    assert detokenize(ids, stop, min_tokens) == want


@pytest.mark.parametrize("ids, stop, want", [
    ([0], ["e", "a"], ("pa", "a", 1)),  # the earliest match kept, what followed in the token not
    ([1, 1, 2], ["bc", "ba"], ("aba", "ba", 2)),
    ([0, 1], ["rnal"], ("paternal", "rnal", 1)),
])
def test_a_stop_string_kept_in_the_output_ends_it(ids, stop, want):
    assert detokenize(ids, stop, include_stop=True) == want


def test_a_stream_holds_back_only_what_could_still_be_cut():
    assert SamplingParams(stop=["abc", "x"]).output_text_buffer_length == 2
    assert SamplingParams(stop=["abc"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams().output_text_buffer_length == 0
    with pytest.raises(TypeError, match="include_stop_str_in_output must be a bool"):
        SamplingParams(include_stop_str_in_output=1)
