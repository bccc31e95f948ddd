"""Input processing: every malformed prompt or request is refused with an error naming it."""

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.input_processor import InputProcessor, pair_prompts

VOCAB = 100


def checked(num_tokens, params, priority=0):
    if num_tokens > 50:
        raise ValueError("too long for the pool")


@pytest.fixture
def inputs():
    return InputProcessor(None, vocab_size=VOCAB, max_model_len=64, check_request=checked)


@pytest.mark.parametrize("prompts, expected", [
    ([1, 2, 3], [[1, 2, 3]]),
    ((1, 2, 3), [(1, 2, 3)]),  # a tuple of ids is one prompt, not three
    ("ab", ["ab"]),
    (["ab", "c"], ["ab", "c"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    ({"prompt_token_ids": [1]}, [{"prompt_token_ids": [1]}]),
    ([np.int64(4), 5], [[4, 5]]),
])
def test_pair_prompts(prompts, expected):
    pairs = pair_prompts(prompts, None)
    assert [p for p, _ in pairs] == expected
    assert all(sp is None for _, sp in pairs)  # the engine's default, which the InputProcessor holds


def test_a_request_without_params_gets_the_default_params():
    assert InputProcessor(None, vocab_size=VOCAB, max_model_len=64, check_request=checked).check(
        [1, 2], None)[2] == SamplingParams()
    default = SamplingParams(temperature=0.0, max_tokens=3)  # e.g. the model's generation config's
    inputs = InputProcessor(None, vocab_size=VOCAB, max_model_len=64, check_request=checked, default_params=default)
    assert inputs.check([1, 2], None)[2] is default and inputs.check([1, 2], SamplingParams())[2] == SamplingParams()


def test_a_prompt_truncated_keeps_its_last_tokens(inputs):
    ids = list(range(1, 11))
    assert inputs.check(ids, SamplingParams(truncate_prompt_tokens=4))[1] == ids[-4:]
    assert inputs.check(ids, SamplingParams(truncate_prompt_tokens=40))[1] == ids  # shorter: as it is
    roomy = InputProcessor(None, vocab_size=VOCAB, max_model_len=64, check_request=lambda n, p, prio: None)
    long = list(range(0, 99))  # more than max_model_len: -1 keeps what leaves room for one token
    assert roomy.check(long, SamplingParams(truncate_prompt_tokens=-1))[1] == long[-63:]
    assert inputs.check(ids, SamplingParams(truncate_prompt_tokens=64))[1] == ids  # (vLLM refuses only above)
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be at most max_model_len=64"):
        inputs.check(ids, SamplingParams(truncate_prompt_tokens=65))


def test_pair_prompts_arrays():
    one = pair_prompts(np.array([1, 2, 3]), None)  # a 1-D array is one prompt
    assert len(one) == 1 and one[0][0].tolist() == [1, 2, 3]
    rows = pair_prompts(np.array([[1, 2], [3, 4]]), None)  # a 2-D array is a batch of rows
    assert [p.tolist() for p, _ in rows] == [[1, 2], [3, 4]]
    with pytest.raises(TypeError, match="prompts must be a prompt or a list of prompts, got int"):
        pair_prompts(5, None)
    with pytest.raises(TypeError, match="got bytes"):  # not walked as a list of ints
        pair_prompts(b"hi", None)
    with pytest.raises(ValueError, match="2 sampling params for 3 prompts"):
        pair_prompts(["a", "b", "c"], [SamplingParams()] * 2)


@pytest.mark.parametrize("prompt, ids", [
    ([1, 2, 3], [1, 2, 3]),
    ((4, 5), [4, 5]),
    (np.array([6, 7], dtype=np.int32), [6, 7]),
    ([np.int64(8)], [8]),
    ({"prompt_token_ids": [9]}, [9]),
    ({"prompt_token_ids": (9, 1), "prompt": "text"}, [9, 1]),
])
def test_token_id_prompts(inputs, prompt, ids):
    req = inputs.process(prompt, None, None, ())
    assert req.prompt_token_ids == ids and all(type(t) is int for t in req.prompt_token_ids)
    if isinstance(prompt, dict) and "prompt" in prompt:
        assert req.prompt == prompt["prompt"]  # the text goes to the output, as vLLM's TokensPrompt


@pytest.mark.parametrize("prompt, error, match", [
    ([1, "5"], TypeError, r"prompt must hold int token ids, got '5' \(str\)"),
    ([True, 2], TypeError, r"got True \(bool\)"),
    ([1, 2.0], TypeError, r"got 2.0 \(float\)"),
    ([[1, [2]]], TypeError, r"got \[1, \[2\]\] \(list\)"),
    (np.array([1.5]), TypeError, "prompt must be a 1-D integer array, got 1-D float64"),
    (np.array([[1, 2]]), TypeError, "prompt must be a 1-D integer array, got 2-D int64"),
    (None, TypeError, "prompt must be a str, a list of token ids or a dict, got NoneType"),
    (5, TypeError, "prompt must be a str, a list of token ids or a dict, got int"),
    ([], ValueError, r"prompt is empty \(no token ids\)"),
    ([1, VOCAB], ValueError, r"prompt token ids \[100\] are outside the vocabulary \[0, 100\)"),
    ([-1], ValueError, r"prompt token ids \[-1\] are outside"),
    ({"prompt_token_ids": None}, TypeError, "'prompt_token_ids' must be a list of token ids, got NoneType"),
    ({"prompt_token_ids": [], "prompt": "a"}, ValueError, r"'prompt_token_ids' is empty"),
    ({"prompt_token_ids": ["x"]}, TypeError, r"'prompt_token_ids' must hold int token ids, got 'x'"),
    ({"prompt": 5}, TypeError, "prompt dict's 'prompt' must be a str, got int"),
    ({"prompt": "a"}, ValueError, "this model has no tokenizer"),
    ({"text": "x"}, ValueError, r"takes 'prompt' and/or 'prompt_token_ids', got keys \['text'\]"),
    ({"prompt_token_ids": [1], "multi_modal_data": {}}, ValueError, r"got keys \['multi_modal_data'\]"),
    ({}, ValueError, "takes 'prompt' and/or 'prompt_token_ids'"),
    ("", ValueError, "prompt is empty"),
    ([1] * 64, ValueError, "prompt has 64 tokens; max_model_len is 64"),
    ([1] * 51, ValueError, "too long for the pool"),
])
def test_bad_prompts(inputs, prompt, error, match):
    with pytest.raises(error, match=match):
        inputs.process(prompt, None, None, ())


@pytest.mark.parametrize("params, request_id, match", [
    (SamplingParams(stop_token_ids=[3, VOCAB]), None, r"stop_token_ids \[100\] are outside the vocabulary"),
    (SamplingParams(logit_bias={VOCAB: 1.0}), None, r"logit_bias token ids \[100\] are outside the vocabulary"),
    (None, "", "request id is empty"),
    (None, "live", "request id 'live' is already in use"),
])
def test_bad_requests(inputs, params, request_id, match):
    with pytest.raises(ValueError, match=match):
        inputs.process([1, 2], params, request_id, {"live"})


def test_automatic_ids_skip_live_ones(inputs):
    assert inputs.process([1], None, None, {"0", "1"}).request_id == "2"
    assert inputs.process([1], None, 7, ()).request_id == "7"
