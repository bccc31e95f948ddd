"""The sampler against an independent numpy reference written from vLLM's rules."""

import collections
import functools

import jax
import numpy as np
import pytest

from jaxpaged.sampler import (
    SamplingRow, build_sampling_metadata, compute_logprobs, process_logits, sample,
    truncate_logits,
)
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams as SP

V = 64
EOS = 2

sample_jit = jax.jit(sample, static_argnames=("num_logprobs", "use_penalties"))
process_jit = jax.jit(process_logits, static_argnames="use_penalties")
truncate_jit = jax.jit(truncate_logits)


def random_logits(seed, rows, vocab=V, scale=3.0):
    return (scale * np.random.default_rng(seed).standard_normal((rows, vocab))).astype(np.float32)


# ------------------------------------------------------------------ numpy reference


def ref_process(logits, p, prompt, output, eos_ids=(EOS,)):
    """logit_bias, min_tokens ban, repetition / frequency / presence penalties (float64)."""
    x = logits.astype(np.float64).copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    if len(output) < p.min_tokens:
        x[list(eos_ids) + p.stop_token_ids] = -np.inf
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in collections.Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def ref_probs(processed, p):
    """The distribution vLLM samples from: temperature, min_p, top_k, top_p (in that order)."""
    if p.is_greedy:
        return np.eye(len(processed))[np.argmax(processed)]
    x = processed / p.temperature
    probs = softmax(x)
    keep = probs >= p.min_p * probs.max()
    if 0 < p.top_k < len(x):
        keep[np.argsort(-np.where(keep, x, -np.inf), kind="stable")[p.top_k:]] = False
    if p.top_p < 1:
        q = np.where(keep, probs, 0.0) / probs[keep].sum()
        order = np.argsort(q, kind="stable")  # ascending, as vLLM
        drop = np.cumsum(q[order]) <= 1 - p.top_p
        drop[-1] = False
        keep[order[drop]] = False
    q = np.where(keep, probs, 0.0)
    return q / q.sum()


def run(rows, logits, padded_rows=None, eos_ids=(EOS,)):
    sm, k, pen = build_sampling_metadata(rows, padded_rows or len(logits), logits.shape[1], eos_ids)
    return sample_jit(logits, sm, num_logprobs=k, use_penalties=pen), sm


# ------------------------------------------------------------------ logits processing

MIXED = [  # (params, prompt, output): every option, alone and combined
    (SP(repetition_penalty=1.3), [5, 6, 7, 5], [9, 10]),
    (SP(repetition_penalty=0.7, frequency_penalty=0.5), [1, 3], [3, 3, 8, 8, 8]),
    (SP(presence_penalty=-1.5, frequency_penalty=-0.25), [4], [11, 11, 12]),
    (SP(logit_bias={0: 5.0, 63: -7.5, 20: 0.25}), [0], [63]),
    (SP(min_tokens=4, stop_token_ids=[17, 30]), [2], [1, 2]),  # still banned
    (SP(min_tokens=2, stop_token_ids=[17]), [2], [1, 2]),  # long enough: nothing banned
    (SP(temperature=0.0, repetition_penalty=2.0, presence_penalty=1.0, logit_bias={40: 3.0},
        min_tokens=3), list(range(30, 45)), [40, 41]),
    (SP(), [], []),
]


def test_process_logits_matches_reference():
    logits = random_logits(0, 8)
    rows = [SamplingRow(p, i, pr, out) for i, (p, pr, out) in enumerate(MIXED)]
    sm, _, pen = build_sampling_metadata(rows, 8, V, [EOS])
    assert pen
    got = np.asarray(process_jit(logits, sm, use_penalties=pen))
    for i, (p, prompt, output) in enumerate(MIXED):
        np.testing.assert_allclose(got[i], ref_process(logits[i], p, prompt, output), rtol=1e-6,
                                   err_msg=f"row {i}: {p}")


def test_no_penalties_means_no_penalty_arrays_and_same_logits():
    logits = random_logits(1, 4)
    rows = [SamplingRow(SP(top_k=5), 0, [1, 2, 3], [4, 5]), SamplingRow(SP(min_p=0.1), 1, [1], [])]
    sm, _, pen = build_sampling_metadata(rows, 4, V, [EOS])
    assert not pen and sm.prompt_ids.shape == (4, 0) and sm.output_ids.shape == (4, 0)
    np.testing.assert_array_equal(process_jit(logits, sm, use_penalties=False), logits)


TRUNCATION = [
    SP(temperature=0.5), SP(temperature=1.7), SP(top_k=5), SP(top_p=0.7),
    SP(min_p=0.3), SP(top_k=10, top_p=0.5, min_p=0.05, temperature=0.8),
    SP(top_k=V + 10, top_p=0.9), SP(temperature=0.05, top_p=0.99),
]


@pytest.mark.parametrize("params", [TRUNCATION, [SP(top_k=3), SP(top_k=5, top_p=0.6), SP(),
                                                 SP(min_p=0.2, top_k=2), SP(temperature=0.3)]],
                         ids=["full-sort", "top-k-bound-8"])
def test_truncated_distribution_matches_reference(params):
    logits = random_logits(2, 8)
    rows = [SamplingRow(p, i, [], []) for i, p in enumerate(params)]
    sm, _, _ = build_sampling_metadata(rows, 8, V, [EOS])
    assert sm.top_k_bound == (V if len(params) == len(TRUNCATION) else 8)
    got = np.asarray(jax.nn.softmax(truncate_jit(logits, sm), axis=-1))
    for i, p in enumerate(params):
        want = ref_probs(logits[i].astype(np.float64), p)
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=f"support of row {i}: {p}")
        np.testing.assert_allclose(got[i], want, atol=1e-6, err_msg=f"row {i}: {p}")


# ------------------------------------------------------------------ sampling


def test_greedy_takes_argmax_after_penalties_and_bias():
    logits = random_logits(3, 8)
    greedy = [(p.replace(temperature=0.0, n=1), pr, out) for p, pr, out in MIXED]
    rows = [SamplingRow(p, 100 + i, pr, out) for i, (p, pr, out) in enumerate(greedy)]
    out, sm = run(rows, logits)
    assert sm.all_greedy
    want = [np.argmax(ref_process(logits[i], *g)) for i, g in enumerate(greedy)]
    np.testing.assert_array_equal(out.tokens, want)
    # The same rows in a batch that also samples take the same argmax.
    rows[-1] = SamplingRow(SP(temperature=0.9), 0, [], [])
    out, sm = run(rows, logits)
    assert not sm.all_greedy
    np.testing.assert_array_equal(out.tokens[:-1], want[:-1])


def test_top_k_1_is_greedy_for_every_seed_and_temperature():
    logits = random_logits(4, 8)
    for seed in range(3):
        rows = [SamplingRow(SP(top_k=1, temperature=t), seed * 8 + i, [], [0] * i)
                for i, t in enumerate([0.1, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0])]
        out, _ = run(rows, logits)
        np.testing.assert_array_equal(out.tokens, logits.argmax(-1))


def test_min_tokens_suppresses_eos_and_stop_token_ids():
    logits = random_logits(5, 4)
    logits[:, EOS] = 50.0  # EOS would win every time
    logits[:, 17] = 45.0
    p = SP(min_tokens=3, stop_token_ids=[17], temperature=0.0)
    rows = [SamplingRow(p, 0, [], [5]), SamplingRow(p, 0, [], [5, 6]),
            SamplingRow(p, 0, [], [5, 6, 7]), SamplingRow(p.replace(ignore_eos=True), 0, [], [])]
    out, _ = run(rows, logits)
    assert out.tokens[0] not in (EOS, 17) and out.tokens[1] not in (EOS, 17)
    assert out.tokens[2] == EOS  # the third token is out: EOS allowed again
    assert out.tokens[3] not in (EOS, 17)  # vLLM bans EOS under min_tokens even with ignore_eos


SETTINGS = [SP(temperature=0.7), SP(top_k=3), SP(top_p=0.6), SP(min_p=0.2),
            SP(top_k=5, top_p=0.8, min_p=0.05, temperature=1.3)]


def test_empirical_distribution_matches_reference():
    vocab, draws = 16, 2048
    base = random_logits(6, len(SETTINGS), vocab, scale=1.5)
    logits = np.repeat(base, draws, axis=0)
    rows = [SamplingRow(p, 7919 * i + j, [], [])
            for i, p in enumerate(SETTINGS) for j in range(draws)]
    out, _ = run(rows, logits)
    tokens = np.asarray(out.tokens).reshape(len(SETTINGS), draws)
    for i, p in enumerate(SETTINGS):
        want = ref_probs(base[i].astype(np.float64), p)
        freq = np.bincount(tokens[i], minlength=vocab) / draws
        assert np.all(freq[want == 0] == 0), f"{p} sampled a truncated token"
        sigma = np.sqrt(want * (1 - want) / draws)
        assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-9), (p, freq, want)


def test_same_seed_and_position_give_the_same_token_in_any_batch():
    p = SP(temperature=1.0, top_p=0.95)
    seeds = [11, 12, 13, 14, 2**40 + 11, 7, 8, 9]
    row_logits = random_logits(7, 1, scale=0.5)  # nearly flat: many tokens are likely
    alone = run([SamplingRow(p, s, [1], [3] * 5) for s in seeds], np.repeat(row_logits, 8, 0))[0]
    # Reversed, padded to 16 rows and mixed with rows that need penalties, top-k and logprobs.
    others = [SamplingRow(SP(top_k=2, repetition_penalty=1.5, logprobs=5), 99, [1, 2], [3]),
              SamplingRow(SP(temperature=0.0), 98, [4], [])]
    mixed_rows = others + [SamplingRow(p, s, [1], [3] * 5) for s in reversed(seeds)]
    mixed_logits = np.concatenate([random_logits(8, 2), np.repeat(row_logits, 8, 0),
                                   random_logits(9, 6)])  # padding rows get logits too
    mixed, sm = run(mixed_rows, mixed_logits, padded_rows=16)
    assert sm.top_k_bound == V
    np.testing.assert_array_equal(np.asarray(mixed.tokens)[2:10][::-1], alone.tokens)
    assert len(set(np.asarray(alone.tokens[:4]).tolist())) > 1, "different seeds, same token"


def test_positions_give_independent_streams():
    logits = np.repeat(random_logits(9, 1, scale=0.1), 32, 0)  # nearly uniform
    streams = []
    for seed in (5, 6):
        out, _ = run([SamplingRow(SP(), seed, [], [0] * pos) for pos in range(32)], logits)
        streams.append(np.asarray(out.tokens))
    assert len(set(streams[0].tolist())) >= 16  # positions 0..31 are not one repeated draw
    assert np.mean(streams[0] != streams[1]) > 0.8


def test_rng_key_is_jax_random_key_of_the_seed():
    rows = [SamplingRow(SP(), s, [], []) for s in (0, 1, 12345, 2**32 - 1, 2**32 + 5, -1)]
    sm, _, _ = build_sampling_metadata(rows, 8, V, [EOS])
    for i, s in enumerate((0, 1, 12345, 2**32 - 1)):
        np.testing.assert_array_equal(sm.rng_key[i], jax.random.key_data(jax.random.key(s)))
    np.testing.assert_array_equal(sm.rng_key[4], [1, 5])  # the high word is kept
    np.testing.assert_array_equal(sm.rng_key[5], [2**32 - 1, 2**32 - 1])  # -1 mod 2**64


# ------------------------------------------------------------------ logprobs


def test_logprobs_are_raw_log_softmax_with_top_k_and_rank():
    logits = random_logits(10, 8)
    params = [SP(logprobs=3, temperature=0.5, repetition_penalty=1.4, logit_bias={1: 4.0}),
              SP(logprobs=0, top_k=4), SP(temperature=0.0, presence_penalty=2.0), SP(logprobs=1)]
    rows = [SamplingRow(p, i, [1, 2], [3, 4]) for i, p in enumerate(params)]
    out, _ = run(rows, logits)
    assert out.top_ids.shape == out.top_logprobs.shape == (8, 4)  # 3 rounds up to 4
    raw = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), axis=-1))
    tokens = np.asarray(out.tokens)
    np.testing.assert_allclose(out.logprobs, raw[np.arange(8), tokens], atol=1e-5)
    np.testing.assert_array_equal(out.ranks, (raw >= raw[np.arange(8), tokens][:, None]).sum(-1))
    order = np.argsort(-raw, axis=-1)[:, :4]
    np.testing.assert_array_equal(out.top_ids, order)
    np.testing.assert_allclose(out.top_logprobs, np.take_along_axis(raw, order, -1), atol=1e-5)


def test_compute_logprobs_serves_prompt_logprobs():
    logits = random_logits(11, 5)
    targets = np.array([0, 63, 5, 9, 9], np.int32)
    lp, ranks, top_ids, top_lp = jax.jit(functools.partial(compute_logprobs, num_logprobs=2))(
        logits, targets)
    raw = np.asarray(jax.nn.log_softmax(logits.astype(np.float64), axis=-1))
    np.testing.assert_allclose(lp, raw[np.arange(5), targets], atol=1e-5)
    np.testing.assert_array_equal(ranks, 1 + (raw > raw[np.arange(5), targets][:, None]).sum(-1))
    np.testing.assert_array_equal(top_ids, np.argsort(-raw, -1)[:, :2])


# ------------------------------------------------------------------ host builder


def test_builder_pads_to_powers_of_two_and_buckets_statics():
    rows = [SamplingRow(SP(logprobs=5, repetition_penalty=1.1, logit_bias={1: 1.0, 2: 2.0, 3: 3.0}),
                        0, list(range(9)), [1, 2, 3]),
            SamplingRow(SP(top_k=20, min_tokens=2, stop_token_ids=[7, 8]), 1, [1], [])]
    sm, k, pen = build_sampling_metadata(rows, 4, V, [EOS, 5])
    assert (k, pen) == (8, True)
    assert sm.prompt_ids.shape == (4, 16) and sm.output_ids.shape == (4, 4)
    assert sm.bias_ids.shape == sm.bias_values.shape == (4, 4)
    np.testing.assert_array_equal(sm.banned_ids[1], [EOS, 5, 7, 8])
    assert (sm.banned_ids[[0, 2, 3]] == -1).all()
    assert sm.top_k_bound == 32
    np.testing.assert_array_equal(sm.output_pos, [3, 0, 0, 0])
    np.testing.assert_array_equal(sm.temperature[2:], 0.0)  # padding rows are greedy
    assert build_sampling_metadata([(SP(logprobs=MAX_LOGPROBS), 0, [], [])], 1, V, [])[1] == MAX_LOGPROBS
    assert build_sampling_metadata([(SP(temperature=0), 0, [], [])], 1, V, [])[0].top_k_bound == 0


def test_builder_rejects_bad_input():
    with pytest.raises(ValueError, match="padded_rows=1"):
        build_sampling_metadata([(SP(), 0, [], [])] * 2, 1, V, [])
    with pytest.raises(ValueError, match=r"logit_bias token ids \[64\].*size 64"):
        build_sampling_metadata([(SP(logit_bias={64: 1.0}), 0, [], [])], 1, V, [])


def test_sample_checks_logits_shape():
    sm, _, _ = build_sampling_metadata([(SP(), 0, [], [])], 2, V, [])
    with pytest.raises(ValueError, match=r"logits have shape \(3, 64\)"):
        sample(random_logits(12, 3), sm, num_logprobs=0, use_penalties=False)
