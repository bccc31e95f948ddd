"""The sampler against an independent numpy reference written from vLLM's rules."""

import collections
import functools

import jax
import numpy as np
import pytest

from jaxpaged.sampler import (
    TOP_P_WINDOW, SamplingRow, build_sampling_metadata, compute_logprobs, first_argmax, gumbel_noise, process_logits,
    sample, truncate_logits,
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


def ref_keep_before_top_p(x, p):
    """min_p then top_k on logits ``x``: a token tied with the k-th largest stays too."""
    probs = softmax(x)
    keep = probs >= p.min_p * probs.max()
    if 0 < p.top_k < len(x):
        kept = np.sort(x[keep])[::-1]
        keep &= x >= (kept[p.top_k - 1] if len(kept) >= p.top_k else -np.inf)
    return keep


def ref_mass_above(x, keep):
    """Each token's share of the kept mass held by tokens with strictly larger logits."""
    q = np.where(keep, softmax(x), 0.0)
    q /= q.sum()
    order = np.argsort(-x, kind="stable")
    sorted_x = x[order]
    before = np.concatenate([[0.0], np.cumsum(q[order])])
    above = np.empty_like(q)
    above[order] = before[np.searchsorted(-sorted_x, -sorted_x, side="left")]  # first of ties
    return above


def ref_probs(processed, p):
    """The distribution vLLM samples from: temperature, min_p, top_k, top_p (in that order).

    vLLM's top_p drops a token when it and all smaller ones hold <= 1 - top_p of the mass,
    i.e. keeps it while the mass strictly above it is < top_p. Here ties at the top_k and
    top_p cut-offs are all kept, and top_p takes its share of all that top_k kept.
    """
    if p.is_greedy:
        return np.eye(len(processed))[np.argmax(processed)]
    # Divide in the input's precision, as the sampler does, then work in float64.
    x = (processed / processed.dtype.type(p.temperature)).astype(np.float64)
    keep = ref_keep_before_top_p(x, p)
    if p.top_p < 1:
        keep &= ref_mass_above(x, keep) < p.top_p
    q = np.where(keep, softmax(x), 0.0)
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


def assert_matches_reference(logits, params, got_logits):
    got = np.asarray(jax.nn.softmax(got_logits, axis=-1))
    for i, p in enumerate(params):
        want = ref_probs(logits[i], p)
        np.testing.assert_array_equal(got[i] > 0, want > 0, err_msg=f"support of row {i}: {p}")
        np.testing.assert_allclose(got[i], want, atol=1e-6, err_msg=f"row {i}: {p}")


@pytest.mark.parametrize("params, plan", [
    (TRUNCATION, (16, True)),  # top_p rows without top_k: bisection over the vocab
    ([SP(top_k=3), SP(top_k=5, top_p=0.6), SP(), SP(min_p=0.2, top_k=2), SP(temperature=0.3)],
     (8, False)),  # every top_p row has a top_k: top-k and top-p among the 8 largest
], ids=["vocab-search", "top-k-window-8"])
def test_truncated_distribution_matches_reference(params, plan):
    logits = random_logits(2, 8)
    rows = [SamplingRow(p, i, [], []) for i, p in enumerate(params)]
    sm, _, _ = build_sampling_metadata(rows, 8, V, [EOS])
    assert (sm.top_k_bound, sm.top_p_search) == plan
    assert_matches_reference(logits, params, truncate_jit(logits, sm))


def truncate_rows(logits, params):
    rows = [SamplingRow(p, i, [], []) for i, p in enumerate(params)]
    sm, _, _ = build_sampling_metadata(rows, len(logits), logits.shape[1], [EOS])
    return np.asarray(truncate_jit(logits, sm)), sm


def test_ties_at_a_cut_are_all_kept():
    logits = np.linspace(-3.0, -1.0, V, dtype=np.float32)  # distinct, below the ones set next
    logits[[7, 8, 9, 10]] = [4.0, 2.5, 2.5, 2.5]
    logits[[20, 21]] = 2.0
    p_top = np.exp(4.0) / np.exp(logits.astype(np.float64)).sum()
    cases = [  # (params, the kept token ids)
        (SP(top_k=2), [7, 8, 9, 10]),  # the 2nd largest is tied three times
        (SP(top_k=6), [7, 8, 9, 10, 20, 21]),
        (SP(top_p=0.5 * p_top), [7]),
        (SP(top_p=p_top + 1e-3), [7, 8, 9, 10]),  # the cut falls inside the tie
        (SP(top_k=5, min_p=np.exp(-2.5)), [7, 8, 9, 10, 20, 21]),
        (SP(top_k=5, min_p=np.exp(-2.5), top_p=0.8), [7, 8, 9, 10]),  # 2.0 has 0.86 above it
    ]
    windowed = [(p, kept) for p, kept in cases if p.top_k > 0]  # top-p found among the 8 largest
    for batch, search in ((cases, True), (windowed, False)):
        got, sm = truncate_rows(np.tile(logits, (len(batch), 1)), [p for p, _ in batch])
        assert sm.top_p_search == search
        for row, (p, kept) in zip(got, batch):
            np.testing.assert_array_equal(np.flatnonzero(row > -np.inf), kept, err_msg=str(p))


# ------------------------------------------------------------------ full-size vocabulary

BIG_V = 49152  # SmolLM2's


def big_rows(seed):
    """Logits of the shapes that stress a nucleus cut, fresh for each seed."""
    rng = np.random.default_rng(seed)
    normal = lambda scale: scale * rng.standard_normal(BIG_V)
    peaked = normal(1.0) - 10.0
    peaked[rng.choice(BIG_V, 20, replace=False)] = rng.normal(10.0, 2.0, 20)
    tied = rng.normal(-3.0, 1.0, BIG_V)  # 10 leaders, then ~3000 tokens tied at 1.25
    tied[rng.choice(BIG_V, 3000, replace=False)] = 1.25
    tied[rng.choice(BIG_V, 10, replace=False)] = rng.normal(5.0, 1.0, 10)
    levels = rng.integers(-6, 7, BIG_V) / 2.0  # 13 levels: every cut is among ties
    banned = normal(3.0)
    banned[rng.choice(BIG_V, 50, replace=False)] = -np.inf  # as min_tokens / logit_bias do
    return dict(normal=normal(3.0), flat=normal(0.01), wide=normal(1.0), peaked=peaked,
                tied=tied, levels=levels, banned=banned)


def mid_gap_top_p(logits, p, near):
    """A top_p near ``near`` halfway between two possible cuts: float32 sums decide it
    the same way as float64 ones (a flat row's gaps are only ~1/V of the mass)."""
    x = (logits / np.float32(p.temperature)).astype(np.float64)
    keep = ref_keep_before_top_p(x, p)
    cuts = np.append(np.unique(ref_mass_above(x, keep)[keep]), 1.0)
    j = np.searchsorted(cuts, near).clip(1, len(cuts) - 1)
    assert cuts[j] - cuts[j - 1] > 1e-5, "no robust cut near this top_p"
    return float(np.float32((cuts[j - 1] + cuts[j]) / 2))


def test_full_vocab_rows_match_reference_under_every_plan():
    rows = big_rows(13)
    cases = [  # (logits, params, top_p near): top_p=None keeps params.top_p
        ("normal", SP(temperature=0.8), 0.9),
        ("flat", SP(), 0.9),  # keeps ~44000 tokens
        ("wide", SP(), 3e-3),  # top_p close to 0: a few tokens
        ("peaked", SP(temperature=0.7), 0.999),  # top_p close to 1
        ("normal", SP(top_p=1e-6), None),  # only the top token
        ("levels", SP(temperature=1.3), 0.6),  # cut inside a group of ~3800 ties
        ("banned", SP(min_p=0.02), 0.95),
        # top_k keeps all ~3000 ties and top_p takes its share of them all (normalising
        # over the first 50 only would keep 1 token here, not 2)
        ("tied", SP(top_k=50, min_p=1e-3), 0.1),
        ("normal", SP(top_k=50, min_p=0.01, temperature=1.3), 0.7),
        ("levels", SP(top_k=40), None),  # top_k inside a tie group
        ("flat", SP(top_k=2000, temperature=0.5), 0.5),  # past the lax.top_k window: counting
        ("banned", SP(top_k=1500), None),
    ]
    logits = np.stack([rows[name] for name, _, _ in cases]).astype(np.float32)
    params = [p if near is None else p.replace(top_p=mid_gap_top_p(row, p, near))
              for row, (_, p, near) in zip(logits, cases)]
    plans = {  # rows -> (top_k_bound, top_p_search)
        tuple(range(12)): (2048, True),  # k up to 2000: every cut by bisection over the vocab
        tuple(range(10)): (64, True),  # k-th largest from lax.top_k(64), nuclei by bisection
        (7, 8, 9): (64, False),  # every top_p row has a top_k: all among the 64 largest
    }
    results = {}
    for idx, plan in plans.items():
        batch = [SamplingRow(params[i], 0, [], []) for i in idx]
        sm, _, _ = build_sampling_metadata(batch, len(idx), BIG_V, [EOS])
        assert (sm.top_k_bound, sm.top_p_search) == plan
        truncate = truncate_jit.lower(logits[list(idx)], sm).compile()
        # XLA:CPU takes ~25 ms to sort a row; top_k becomes a sort if its output is sliced.
        assert " sort(" not in truncate.as_text()
        got = np.asarray(truncate(logits[list(idx)], sm))
        assert_matches_reference(logits[list(idx)], [params[i] for i in idx], got)
        for i, row in zip(idx, got):
            results.setdefault(i, []).append(row)
    for i, same_row in results.items():  # a row's cut never depends on the batch's plan
        for other in same_row[1:]:
            np.testing.assert_array_equal(other, same_row[0], err_msg=f"row {i}: {params[i]}")



def test_nuclei_past_the_window_get_the_same_cut_in_any_batch():
    # Rows whose nucleus fills the TOP_P_WINDOW largest logits are gathered into the
    # smallest of a few batch sizes that holds them and bisected: 0, 1, 2 and 17 such
    # rows take different branches, and a row's cut must not notice which.
    rows = big_rows(17)
    named = {  # name -> (logits, params); the first two go past the window, the last not
        "flat": (rows["flat"], SP(top_p=mid_gap_top_p(rows["flat"], SP(), 0.5))),
        "wide": (rows["wide"], SP(top_p=mid_gap_top_p(rows["wide"], SP(), 0.3))),
        "peaked": (rows["peaked"], SP(temperature=0.7, top_p=mid_gap_top_p(rows["peaked"], SP(temperature=0.7),
                                                                          0.999))),
    }
    batches = [["peaked"], ["flat"], ["peaked", "flat", "peaked", "peaked", "peaked"],
               ["wide", "peaked", "flat", "peaked"], ["flat", "wide"] * 8 + ["peaked"] * 3 + ["flat"]]
    cuts: dict[str, list[np.ndarray]] = {}
    for names in batches:
        logits = np.stack([named[n][0] for n in names]).astype(np.float32)
        params = [named[n][1] for n in names]
        got, sm = truncate_rows(logits, params)
        assert sm.top_p_search
        assert_matches_reference(logits, params, got)
        for n, row in zip(names, got):
            cuts.setdefault(n, []).append(row)
    for n, same in cuts.items():
        kept = int(np.sum(same[0] > -np.inf))
        assert (kept > TOP_P_WINDOW) == (n != "peaked"), (n, kept)
        for other in same[1:]:
            np.testing.assert_array_equal(other, same[0], err_msg=n)

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
    assert (sm.top_k_bound, sm.top_p_search) == (2, True)
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



def test_noise_is_jax_random_gumbel_of_the_row_key_bit_for_bit():
    # The unrolled Threefry is checked against jax.random itself, on keys with both words
    # set and on positions past 2**16, with a vocabulary that is not a power of two.
    vocab = 3001
    seeds, positions = (0, 7, 2**33 + 5, 2**64 - 1), (0, 1, 4097, 70000)
    rows = [SamplingRow(SP(), s, [], [0] * pos) for s, pos in zip(seeds, positions)]
    sm, _, _ = build_sampling_metadata(rows, 4, vocab, [EOS])
    noise = np.asarray(jax.jit(gumbel_noise, static_argnums=1)(sm, vocab))
    for i, pos in enumerate(positions):
        key = jax.random.fold_in(jax.random.wrap_key_data(sm.rng_key[i], impl="threefry2x32"), pos)
        np.testing.assert_array_equal(noise[i], jax.random.gumbel(key, (vocab,), np.float32))
    assert np.all(np.isfinite(noise))

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
    # Id lists: a power of two, at least MIN_ID_WIDTH (8) wide where some row has any.
    assert sm.prompt_ids.shape == (4, 16) and sm.output_ids.shape == (4, 8)
    assert sm.bias_ids.shape == sm.bias_values.shape == (4, 8)
    np.testing.assert_array_equal(sm.banned_ids[1], [EOS, 5, 7, 8, -1, -1, -1, -1])
    assert (sm.banned_ids[[0, 2, 3]] == -1).all()
    assert sm.top_k_bound == 32
    np.testing.assert_array_equal(sm.output_pos, [3, 0, 0, 0])
    np.testing.assert_array_equal(sm.temperature[2:], 0.0)  # padding rows are greedy
    assert build_sampling_metadata([(SP(logprobs=MAX_LOGPROBS), 0, [], [])], 1, V, [])[1] == MAX_LOGPROBS
    unused = build_sampling_metadata([(SP(), 0, [1, 2], [3])], 1, V, [EOS])[0]  # no lists: 0 wide, no cost
    assert unused.prompt_ids.shape == unused.output_ids.shape == unused.bias_ids.shape == unused.banned_ids.shape \
        == (1, 0)
    assert build_sampling_metadata([(SP(temperature=0), 0, [], [])], 1, V, [])[0].top_k_bound == 0


@pytest.mark.parametrize("params, plan", [
    ([SP(), SP(temperature=0)], (0, False)),
    ([SP(top_k=20), SP(min_p=0.1)], (32, False)),
    ([SP(top_k=20, top_p=0.9), SP(top_k=3)], (32, False)),  # nucleus within the 32 largest
    ([SP(top_k=20), SP(top_p=0.9)], (32, True)),  # top_p without top_k: search the row
    ([SP(top_p=0.9)], (0, True)),
    ([SP(top_k=1024, top_p=0.5)], (1024, False)),  # the largest lax.top_k window
    ([SP(top_k=1025, top_p=0.5)], (2048, True)),  # past it: count, and search the nucleus
    ([SP(top_k=BIG_V, top_p=0.5), SP(top_k=BIG_V + 1)], (0, True)),  # top_k >= V is off
], ids=["none", "top-k", "top-k-and-p", "mixed", "top-p", "window-1024", "count-2048",
        "top-k-off"])
def test_builder_picks_the_truncation_plan(params, plan):
    sm, _, _ = build_sampling_metadata([(p, 0, [], []) for p in params], 4, BIG_V, [])
    assert (sm.top_k_bound, sm.top_p_search) == plan


def test_builder_rejects_bad_input():
    with pytest.raises(ValueError, match="padded_rows=1"):
        build_sampling_metadata([(SP(), 0, [], [])] * 2, 1, V, [])
    with pytest.raises(ValueError, match=r"logit_bias token ids \[64\].*size 64"):
        build_sampling_metadata([(SP(logit_bias={64: 1.0}), 0, [], [])], 1, V, [])


def test_sample_checks_logits_shape():
    sm, _, _ = build_sampling_metadata([(SP(), 0, [], [])], 2, V, [])
    with pytest.raises(ValueError, match=r"logits have shape \(3, 64\)"):
        sample(random_logits(12, 3), sm, num_logprobs=0, use_penalties=False)


def test_first_argmax_is_numpys_argmax():
    """Ties resolve to the first index, as np.argmax; rows of -inf (all banned) give 0."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((9, 1000)).astype(np.float32)
    x[1, [3, 500, 999]] = 10.0  # a three-way tie
    x[2, [998, 999]] = 10.0  # a tie at the end
    x[3] = -np.inf
    x[4, :] = 1.0
    np.testing.assert_array_equal(np.asarray(first_argmax(x)), np.argmax(x, axis=-1))
