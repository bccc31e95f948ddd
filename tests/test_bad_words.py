"""``bad_words`` (vLLM's sampling parameter): a word's last token is masked wherever the output
so far ends with its other tokens, so no bad word's tokens ever appear in a completion, and
a completion is the one without bad words up to the first place one would have begun."""

import pytest

from jaxpaged import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Paged attention splits the cache"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_engine_model):
    return LLM(tiny_engine_model, block_size=16, num_blocks=128, async_scheduling=False)


def contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def round_trips(llm, ids: list[int]) -> str | None:
    """The text of ``ids`` if it tokenizes back to them (stripped of leading spaces), else None."""
    text = llm.tokenizer.decode(ids)
    if text.strip() and llm.tokenizer.encode(text.lstrip(), add_special_tokens=False) == ids:
        return text.lstrip()
    return None


def first_word(llm, tokens: list[int], length: int) -> tuple[int, str]:
    """The first position of ``tokens`` where ``length`` of them are a word that round-trips."""
    for k in range(1, len(tokens) - length):
        if (word := round_trips(llm, tokens[k:k + length])) is not None:
            return k, word
    raise AssertionError(f"no {length} tokens of this completion round-trip: pick another prompt")


def test_token_ids_are_the_word_and_the_word_after_a_space(llm):
    tok = llm.tokenizer
    ids = llm.inputs.bad_words_token_ids(SamplingParams(bad_words=["  cache", "paged attention"]))
    for word in ("cache", "paged attention"):
        bare = tok.encode(word, add_special_tokens=False)
        spaced = tok.encode(" " + word, add_special_tokens=False)
        assert bare in ids
        assert (spaced in ids) == (spaced[0] != bare[0] and len(spaced) == len(bare))
    assert len(ids) >= 2


@pytest.mark.parametrize("length", [1, 2, 3])
def test_a_bad_word_never_appears_and_the_rest_is_unchanged(llm, length):
    plain = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    k, word = first_word(llm, plain, length)
    out = llm.generate([PROMPT], GREEDY.replace(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    banned = llm.inputs.bad_words_token_ids(SamplingParams(bad_words=[word]))
    assert plain[k:k + length] in banned
    assert not any(contains(out, w) for w in banned)
    # Up to where the word would have been finished, the same tokens; there, another one.
    first = min(i for i in range(len(plain)) for w in banned if plain[i:i + len(w)] == w) + length - 1
    assert out[:first] == plain[:first] and out[first] != plain[first]
    assert len(out) == GREEDY.max_tokens


def test_async_scheduling_and_samples_keep_them_out(tiny_engine_model, llm):
    """The masks follow the tokens as they come: the overlapped loop (whose sampler waits for
    the token before) gives the synchronous loop's tokens, greedy and seeded samples alike,
    none with a bad word in them (drafts: ``test_spec_decode.py``)."""
    plain = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    words = [first_word(llm, plain, n)[1] for n in (1, 2)]
    banned = llm.inputs.bad_words_token_ids(SamplingParams(bad_words=words))
    params = [GREEDY.replace(bad_words=words),
              SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, bad_words=words)]
    want = llm.generate([PROMPT, PROMPT], params, use_tqdm=False)
    overlapped = LLM(tiny_engine_model, block_size=16, num_blocks=128, async_scheduling=True)
    got = overlapped.generate([PROMPT, PROMPT], params, use_tqdm=False)
    assert overlapped.core.num_steps_ahead > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    for o in want:
        for c in o.outputs:
            assert not any(contains(c.token_ids, w) for w in banned)


def test_bad_words_are_checked_before_any_work(llm):
    with pytest.raises(TypeError, match="bad_words must be a list of str or None"):
        SamplingParams(bad_words="cache")
    with pytest.raises(ValueError, match="bad_words cannot contain an empty or blank word"):
        SamplingParams(bad_words=["ok", " "])
    with pytest.raises(ValueError, match=r"bad_words\[1\] is not valid Unicode"):
        llm.generate(["hi"], SamplingParams(bad_words=["ok", "\ud800"]), use_tqdm=False)
    assert not llm.has_unfinished_requests()
    with pytest.raises(ValueError, match="bad_words cannot be used with use_beam_search"):
        SamplingParams(bad_words=["x"], use_beam_search=True, beam_width=2, temperature=0)
