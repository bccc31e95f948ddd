"""Sampling the next token of every sequence in a step, on device.

The pipeline follows vLLM v1's sampler, row by row with each row's own parameters:

1. raw log-probs: ``log_softmax`` of the model's logits, before anything below (vLLM's
   default ``logprobs_mode="raw_logprobs"``); the sampled token's log-prob and rank and
   the ``num_logprobs`` most likely tokens are reported from these;
2. ``process_logits``: -inf for tokens a structured output's grammar does not allow next
   (a bitmask the host computes, :mod:`jaxpaged.structured_output`); add ``logit_bias``; set
   EOS and ``stop_token_ids`` to -inf while the output is shorter than ``min_tokens`` (unless
   that leaves a structured row no token: its grammar allows only those);
   repetition penalty on tokens seen in the prompt or output (positive logits divided,
   others multiplied); frequency and presence penalties on output tokens (OpenAI rule).
   Greedy rows take the argmax here;
3. ``truncate_logits``: divide by the temperature, then drop (-inf) tokens below
   ``min_p`` times the top probability, outside the ``top_k``, and outside the ``top_p``
   nucleus of what is left, in that order;
4. draw: Gumbel-max, ``argmax(logits + g)`` with ``g ~ Gumbel(0, 1)`` for each vocab
   entry, is an exact sample of ``softmax(logits)``.

Why it costs little:

- ``min_p`` needs no softmax: ``p_i >= min_p * p_max`` iff ``l_i >= l_max + log(min_p)``.
- ``top_k`` and ``top_p`` become one logit threshold per row, without sorting the
  vocabulary (on XLA:CPU a full-row ``top_k`` costs 10-25 ms per 49152-entry row, and
  compiling it with a full-row cumsum 1-2 s). The k-th largest logit comes from
  ``lax.top_k`` over the ``C = top_k_bound`` largest (the next power of two above the
  batch's largest ``top_k``), or, for ``C > 1024``, from a bisection on counts. When
  every ``top_p`` row also has a ``top_k``, its nucleus is found in those ``C`` sorted
  logits too. Otherwise (static ``top_p_search``) each row looks for its nucleus in its
  ``TOP_P_WINDOW`` = 256 largest logits, against the mass of the whole row; rows whose
  nucleus fills that window (flat distributions) are gathered and bisected on the logit
  cut-off that measures the probability mass above it: 32 masked sums over the row
  halve an interval of int32 order keys of float32 logits down to one float, so the
  kept set is exactly the one a sorted cumulative sum would give. On SmolLM2's
  next-token distributions at temperature 0.7 and top_p 0.9, 0.75% of rows go past 256
  tokens (16% at temperature 1.0).
- Tokens are kept by comparing the full-vocab logits with the threshold, and the Gumbel
  noise is indexed by token id, so a row's draw never depends on ``C``.
- The noise of a row comes from ``fold_in(key(seed), output_pos)``: a request's tokens
  depend only on its seed and positions, never on batch composition, row order, padding
  or preemption. An all-greedy batch draws no noise at all (static ``all_greedy``).
- The noise is jax.random's own Threefry, bit for bit, with its rounds unrolled so that
  XLA:CPU fuses it (``_threefry2x32``), and every argmax is a max and a bool argmax
  (``first_argmax``): a temperature draw at 64 x 49152 took ~20 ms over greedy's ~7, not
  ~70, and greedy's own argmax 5.0 -> 1.5 ms at 48 rows.
- Why Gumbel noise over the whole vocabulary and not one uniform per row with an
  inverse CDF (~3 ms, tried): a row's logits differ by float rounding between batch
  compositions and schedules, and an inverse CDF's token boundaries lie ~1/V apart on
  a flat distribution, so u crosses one for a few draws in a hundred and seeded outputs
  change with the batch. Gumbel-max flips only when the two largest noisy logits nearly
  tie, which rounding almost never reaches (``tests/test_engine.py`` checks seeded
  tokens under every schedule).
- Penalty counts are built by scatter-add only when the static ``use_penalties`` is set;
  the prompt is shipped only when some row has a repetition penalty. Unused id lists
  have width 0, so they cost nothing.

``build_sampling_metadata`` is the host side: numpy arrays padded to bounded shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Bool, Float, Int, UInt32

from jaxpaged.padding import bucket
from jaxpaged.sampling_params import MAX_LOGPROBS, SAMPLING_EPS, SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingMetadata:
    """Per-row sampling parameters of one step; padding rows are greedy with no options."""

    temperature: Float[Array, "S"]  # < SAMPLING_EPS means greedy
    top_k: Int[Array, "S"]  # keep the k largest logits; 0 = off
    top_p: Float[Array, "S"]  # 1 = off
    min_p: Float[Array, "S"]  # 0 = off
    repetition_penalty: Float[Array, "S"]  # 1 = off
    presence_penalty: Float[Array, "S"]  # 0 = off
    frequency_penalty: Float[Array, "S"]  # 0 = off
    prompt_ids: Int[Array, "S P"]  # prompt tokens for the repetition penalty; -1 pads; P may be 0
    output_ids: Int[Array, "S O"]  # tokens generated so far, for penalties; -1 pads; O may be 0
    bias_ids: Int[Array, "S B"]  # logit_bias token ids; -1 pads; B may be 0
    bias_values: Float[Array, "S B"]  # added to the logits of bias_ids; 0 pads
    banned_ids: Int[Array, "S M"]  # EOS + stop ids while output < min_tokens; -1 pads; M may be 0
    allowed: Int[Array, "S W"]  # structured outputs: bit t % 32 of word t // 32 set = token t allowed; W may be 0
    rng_key: UInt32[Array, "S 2"]  # threefry2x32 key data of jax.random.key(seed)
    output_pos: Int[Array, "S"]  # index in the output of the token sampled now (= tokens so far)
    # The static truncation plan. C >= every row's top_k, a power of two or V (0: no row
    # uses top_k); the k-th largest logits come from lax.top_k(C) if C <= MAX_TOP_K_WINDOW,
    # else from a bisection on counts.
    top_k_bound: int = dataclasses.field(default=0, metadata=dict(static=True))
    # Some top_p row has no top_k window to find its nucleus in (no top_k, or C is past
    # MAX_TOP_K_WINDOW): nuclei come from the TOP_P_WINDOW largest logits, or from a
    # bisection on mass over the whole row where they go past them (_searched_nuclei).
    top_p_search: bool = dataclasses.field(default=False, metadata=dict(static=True))
    all_greedy: bool = dataclasses.field(default=False, metadata=dict(static=True))  # skip the draw


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    tokens: Int[Array, "S"]  # the sampled (or argmax) token of each row
    logprobs: Float[Array, "S"]  # raw log-prob of `tokens` (before temperature, penalties…)
    ranks: Int[Array, "S"]  # tokens whose raw logit is >= that of `tokens` (1 = most likely; vLLM)
    top_ids: Int[Array, "S K"]  # the K most likely tokens under the raw distribution
    top_logprobs: Float[Array, "S K"]  # their raw log-probs, descending


def _scatter_ids(ids: Int[Array, "S N"], vocab: int) -> Int[Array, "S N"]:
    # -1 pads become an out-of-range index that mode="drop" discards (a negative index
    # would wrap around to the last token instead).
    return jnp.where(ids < 0, vocab, ids)


def apply_penalties(logits: Float[Array, "S V"], sm: SamplingMetadata) -> Float[Array, "S V"]:
    """Repetition penalty (prompt and output tokens), then frequency and presence (output)."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    counts = jnp.zeros((num_rows, vocab), jnp.int32)
    counts = counts.at[rows, _scatter_ids(sm.output_ids, vocab)].add(1, mode="drop")
    in_output = counts > 0
    seen = in_output
    if sm.prompt_ids.shape[1]:
        in_prompt = jnp.zeros((num_rows, vocab), bool)
        seen = seen | in_prompt.at[rows, _scatter_ids(sm.prompt_ids, vocab)].set(True, mode="drop")
    penalty = jnp.where(seen, sm.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - sm.frequency_penalty[:, None] * counts
    return logits - sm.presence_penalty[:, None] * in_output


def process_logits(
    logits: Float[Array, "S V"], sm: SamplingMetadata, *, use_penalties: bool
) -> Float[Array, "S V"]:
    """The structured outputs' masks, logit bias, the ``min_tokens`` ban and penalties: what
    greedy rows take the argmax of."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    logits = logits.astype(jnp.float32)
    if sm.allowed.shape[1]:
        token = jnp.arange(vocab, dtype=jnp.int32)
        bits = jnp.right_shift(sm.allowed[:, token // 32], token % 32) & 1  # [S, V]
        logits = jnp.where(bits == 1, logits, -jnp.inf)
    logits = logits.at[rows, _scatter_ids(sm.bias_ids, vocab)].add(sm.bias_values, mode="drop")
    banned = logits.at[rows, _scatter_ids(sm.banned_ids, vocab)].set(-jnp.inf, mode="drop")
    if sm.allowed.shape[1]:  # a grammar that allows only banned stop ids: it wins over min_tokens
        banned = jnp.where(jnp.all(banned == -jnp.inf, axis=-1, keepdims=True), logits, banned)
    return apply_penalties(banned, sm) if use_penalties else banned


MAX_TOP_K_WINDOW = 1024  # past this, lax.top_k on XLA:CPU costs more than counting (V=49152)
# Rows with top_p but no top-k window look for their nucleus among this many largest logits
# first (lax.top_k(256) at 64 x 49152: ~13 ms, a 32-step bisection over the rows: ~58 ms).
TOP_P_WINDOW = 256


def _order_key(x: Float[Array, "*"]) -> Int[Array, "*"]:
    """int32 with the order of float32 ``x`` (NaN aside): bisect on floats as integers."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def _from_order_key(key: Int[Array, "*"]) -> Float[Array, "*"]:
    return lax.bitcast_convert_type(jnp.where(key >= 0, key, key ^ 0x7FFFFFFF), jnp.float32)


def _smallest_logit_where(
    holds: Callable[[Float[Array, "S"]], Bool[Array, "S"]], row_max: Float[Array, "S"]
) -> Float[Array, "S"]:
    """Per row, the smallest float ``t <= row_max`` where ``holds(t)`` is true.

    ``holds`` maps a float per row to a bool per row; it must be monotone in ``t`` (false,
    then true), true at ``row_max`` and false below -inf. Bisection on the int32 order
    keys: 32 steps take any bracket of them down to one float, so the answer is exact.
    """

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        ok = holds(_from_order_key(mid)) & (mid != lo)  # mid == lo once converged: stay
        return jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)

    lo = jnp.full(row_max.shape, _order_key(jnp.float32(-jnp.inf)) - 1)  # below -inf
    return _from_order_key(lax.fori_loop(0, 32, step, (lo, _order_key(row_max)))[1])


def _kth_largest(logits: Float[Array, "S V"], row_max: Float[Array, "S"], k: Int[Array, "S"]
                 ) -> Float[Array, "S"]:
    """The k-th largest logit of each row (1 <= k <= V), by bisection on counts."""
    # Fewer than k logits above t  <=>  t >= the k-th largest.
    return _smallest_logit_where(
        lambda t: jnp.sum(logits > t[:, None], axis=-1, dtype=jnp.int32) < k, row_max)


def _nucleus_cut(
    logits: Float[Array, "S V"], probs: Float[Array, "S V"], row_max: Float[Array, "S"],
    top_p: Float[Array, "S"],
) -> Float[Array, "S"]:
    """Smallest logit each row keeps under ``top_p``, by bisection on probability mass.

    ``probs`` are the unnormalised probabilities of the tokens still kept (0 for the
    others). vLLM keeps a token while the mass strictly above it is < top_p, so token i
    stays iff ``F(l_i) < top_p * sum(probs)`` with ``F(t)`` the mass of logits > t. F falls
    as t rises: the kept tokens are those with ``l_i >= t*``, t* the smallest float where
    ``F(t*) < top_p * sum(probs)``; tokens tied with t* are all kept.
    """
    target = top_p * jnp.sum(probs, axis=-1)
    return _smallest_logit_where(
        lambda t: jnp.sum(jnp.where(logits > t[:, None], probs, 0.0), axis=-1) < target, row_max)


def _searched_nuclei(
    logits: Float[Array, "S V"], row_max: Float[Array, "S"], threshold: Float[Array, "S"],
    top_p: Float[Array, "S"],
) -> Float[Array, "S"]:
    """Smallest logit each row keeps under ``top_p`` (``threshold`` where top_p is off).

    For plans where some top_p row has no top-k window. Each row first cuts its nucleus
    in its ``TOP_P_WINDOW`` largest logits, of the mass of the whole row (an exact cut
    when a window logit falls out of it); the rows whose nucleus fills the window are
    gathered into the smallest of a few power-of-4 batch sizes that holds them all and
    bisected over the vocabulary (``_nucleus_cut``). Whether a row is bisected depends
    on its own logits only, so its cut never depends on the batch.
    """
    S, V = logits.shape
    W = min(TOP_P_WINDOW, V)
    probs = jnp.where(logits >= threshold[:, None], jnp.exp(logits - row_max[:, None]), 0.0)
    target = top_p * jnp.sum(probs, axis=-1)
    vals = lax.top_k(logits, W)[0]  # [S, W], descending
    valid = vals >= threshold[:, None]
    wprobs = jnp.where(valid, jnp.exp(vals - row_max[:, None]), 0.0)
    keep = valid & (jnp.cumsum(wprobs, axis=-1) - wprobs < target[:, None])  # mass above < target
    num_keep = keep.sum(axis=-1, dtype=jnp.int32)
    cut = jnp.take_along_axis(vals, (jnp.maximum(num_keep, 1) - 1)[:, None], axis=-1)[:, 0]
    past = (top_p < 1.0) & (num_keep == W)  # the nucleus may go on past the window
    # Rows past the window first (a stable partition, by scatter: a sort would cost more).
    num_past = past.sum(dtype=jnp.int32)
    dest = jnp.where(past, jnp.cumsum(past) - 1, num_past + jnp.cumsum(~past) - 1)
    order = jnp.zeros(S, jnp.int32).at[dest].set(jnp.arange(S, dtype=jnp.int32))
    sizes = [4 ** i for i in range(8) if 4 ** i < S] + [S]

    def bisect_first(n: int):
        def branch(cut):
            if n == S:  # every row: no gather
                return jnp.where(past, _nucleus_cut(logits, probs, row_max, top_p), cut)
            rows = order[:n]
            found = _nucleus_cut(logits[rows], probs[rows], row_max[rows], top_p[rows])
            return cut.at[rows].set(jnp.where(past[rows], found, cut[rows]))
        return branch

    which = jnp.where(num_past == 0, 0, 1 + jnp.sum(num_past > jnp.asarray(sizes[:-1], jnp.int32)))
    cut = lax.switch(which, [lambda cut: cut] + [bisect_first(n) for n in sizes], cut)
    return jnp.where(top_p < 1.0, jnp.maximum(threshold, cut), threshold)


def _window_thresholds(
    logits: Float[Array, "S V"], row_max: Float[Array, "S"], threshold: Float[Array, "S"],
    sm: SamplingMetadata,
) -> Float[Array, "S"]:
    """Raise ``threshold`` to each row's top-k cut and, unless ``top_p_search``, top-p cut.

    Both cuts lie among the C largest logits: every top_k is <= C, and without
    ``top_p_search`` every top_p row has a top_k. Logits tied with the top-k cut may go on
    past the C; top-p counts them in the mass it takes its share of, as the whole-row
    search does, so a row's cut never depends on C, that is on the batch.
    """
    bound = sm.top_k_bound
    vals = lax.top_k(logits, bound)[0]  # [S, C], descending
    k = jnp.clip(sm.top_k, 1, bound)
    kth = jnp.take_along_axis(vals, (k - 1)[:, None], axis=-1)[:, 0]
    threshold = jnp.maximum(threshold, jnp.where(sm.top_k > 0, kth, -jnp.inf))
    if sm.top_p_search:
        return threshold
    # Kept tokens are a prefix of `vals`: those with less than top_p of the mass above them.
    valid = vals >= threshold[:, None]
    probs = jnp.where(valid, jnp.exp(vals - row_max[:, None]), 0.0)
    mass_above = jnp.cumsum(probs, axis=-1) - probs  # the first of equal logits sees the true mass
    top_p = sm.top_p
    in_window = valid.sum(axis=-1, dtype=jnp.int32)
    # min, not vals[:, -1]: XLA would merge that slice into top_k's and fall back to a sort.
    ties_past = (top_p < 1.0) & (jnp.min(vals, axis=-1) >= threshold)

    def count_ties_past(_):
        return jnp.sum(logits >= threshold[:, None], axis=-1, dtype=jnp.int32) - in_window

    num_past = lax.cond(jnp.any(ties_past), count_ties_past,
                        lambda _: jnp.zeros_like(in_window), None)
    total = probs.sum(axis=-1) + num_past * jnp.exp(threshold - row_max)
    keep = valid & (mass_above < (top_p * total)[:, None])
    num_keep = jnp.maximum(keep.sum(axis=-1), 1)
    top_p_cut = jnp.take_along_axis(vals, (num_keep - 1)[:, None], axis=-1)[:, 0]
    return jnp.where(top_p < 1.0, jnp.maximum(threshold, top_p_cut), threshold)


def truncate_logits(logits: Float[Array, "S V"], sm: SamplingMetadata) -> Float[Array, "S V"]:
    """Temperature, then min-p, top-k and top-p as -inf: the rows' sampling distributions.

    ``softmax`` of the result is the distribution a non-greedy row samples from. Ties at
    a row's top-k or top-p cut-off are all kept, and top-p takes its fraction of the mass
    that min-p and top-k kept, ties included.
    """
    greedy = sm.temperature < SAMPLING_EPS
    logits = logits / jnp.where(greedy, 1.0, sm.temperature)[:, None]
    row_max = jnp.max(logits, axis=-1)
    threshold = row_max + jnp.log(sm.min_p)  # -inf where min_p == 0
    if 0 < sm.top_k_bound <= MAX_TOP_K_WINDOW:
        threshold = _window_thresholds(logits, row_max, threshold, sm)
    elif sm.top_k_bound:
        kth = _kth_largest(logits, row_max, jnp.clip(sm.top_k, 1, logits.shape[1]))
        threshold = jnp.maximum(threshold, jnp.where(sm.top_k > 0, kth, -jnp.inf))
    if sm.top_p_search:
        threshold = _searched_nuclei(logits, row_max, threshold, sm.top_p)
    return jnp.where(logits >= threshold[:, None], logits, -jnp.inf)


# Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as easy as 1, 2,
# 3", SC'11), the generator behind jax.random's default keys: rotation constants of the
# eight rounds of each cycle, and the key-schedule parity constant.
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_THREEFRY_PARITY = 0x1BD11BDA


def _threefry2x32(k0, k1, x0, x1):
    """Threefry-2x32-20 of counters ``(x0, x1)`` under key ``(k0, k1)`` (uint32, broadcast).

    The same function as ``jax.random``'s, written out with its 20 rounds unrolled.
    XLA:CPU then fuses it into one elementwise loop: jax lowers it on CPU as a 5-step
    ``fori_loop`` whose every step writes its ``[S, V]`` state to memory, ~6x slower at
    64 x 49152 (tests/test_sampler.py checks the bits against ``jax.random.bits``).
    """
    ks = (k0, k1, k0 ^ k1 ^ jnp.uint32(_THREEFRY_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _THREEFRY_ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << jnp.uint32(r)) | (x1 >> jnp.uint32(32 - r))) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + jnp.uint32(i + 1)
    return x0, x1


def gumbel_noise(sm: SamplingMetadata, vocab: int) -> Float[Array, "S V"]:
    """Each row's Gumbel(0, 1) noise, from ``fold_in(key(seed), output_pos)`` only.

    Bit for bit ``jax.random.gumbel(key, (vocab,))`` of each row's key: entry ``i`` hashes
    the counter ``(0, i)``, its two words xor-ed into 32 random bits, whose top 23 become
    the mantissa of a uniform in ``[tiny, 1)``; then ``-log(-log(u))``.
    """
    keys = jax.random.wrap_key_data(sm.rng_key, impl="threefry2x32")
    keys = jax.random.key_data(jax.vmap(jax.random.fold_in)(keys, sm.output_pos))  # [S, 2]
    token = jnp.arange(vocab, dtype=jnp.uint32)[None, :]
    x0, x1 = _threefry2x32(keys[:, :1], keys[:, 1:], jnp.zeros_like(token), token)
    mantissa = (x0 ^ x1) >> jnp.uint32(32 - 23)
    u = lax.bitcast_convert_type(mantissa | jnp.uint32(0x3F800000), jnp.float32) - 1.0  # [0, 1)
    tiny = jnp.finfo(jnp.float32).tiny
    u = jnp.maximum(tiny, u * (1.0 - tiny) + tiny)
    return -jnp.log(-jnp.log(u))


def compute_logprobs(
    logits: Float[Array, "T V"], token_ids: Int[Array, "T"], *, num_logprobs: int
) -> tuple[Float[Array, "T"], Int[Array, "T"], Int[Array, "T K"], Float[Array, "T K"]]:
    """Raw log-prob and rank of ``token_ids`` and the ``num_logprobs`` most likely tokens.

    Also serves ``prompt_logprobs``: pass the prefill logits and the next prompt tokens.
    Returns ``(logprobs, ranks, top_ids, top_logprobs)``; ``K == num_logprobs``.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    chosen = jnp.take_along_axis(logits, token_ids[:, None].astype(jnp.int32), axis=-1)
    ranks = (logits >= chosen).sum(axis=-1, dtype=jnp.int32)
    top_vals, top_ids = lax.top_k(logits, num_logprobs)
    return chosen[:, 0] - lse, ranks, top_ids.astype(jnp.int32), top_vals - lse[:, None]


def first_argmax(x: Float[Array, "S V"]) -> Int[Array, "S"]:
    """``jnp.argmax(x, axis=-1)`` (the first index of each row's maximum), as a max and a bool
    argmax: XLA:CPU runs argmax's (value, index) reduction element by element, and fuses
    whatever feeds it (the draw's noise) into that loop; a max and a bool argmax are vector
    code. 48 x 49152 float32: 5.0 -> 1.5 ms (AMD EPYC, 2 cores)."""
    return jnp.argmax(x == x.max(axis=-1, keepdims=True), axis=-1).astype(jnp.int32)


def sample(
    logits: Float[Array, "S V"],
    sm: SamplingMetadata,
    *,
    num_logprobs: int,
    use_penalties: bool,
) -> SamplerOutput:
    """Sample one token per row. ``num_logprobs`` and ``use_penalties`` must be static."""
    if logits.ndim != 2 or logits.shape[0] != sm.temperature.shape[0]:
        raise ValueError(f"logits have shape {logits.shape}; expected "
                         f"[{sm.temperature.shape[0]}, vocab] to match the sampling metadata")
    processed = process_logits(logits, sm, use_penalties=use_penalties)
    tokens = first_argmax(processed)
    if not sm.all_greedy:
        drawn = first_argmax(truncate_logits(processed, sm) + gumbel_noise(sm, logits.shape[1]))
        tokens = jnp.where(sm.temperature < SAMPLING_EPS, tokens, drawn)
    logprobs, ranks, top_ids, top_logprobs = compute_logprobs(
        logits, tokens, num_logprobs=num_logprobs)
    return SamplerOutput(tokens, logprobs, ranks, top_ids, top_logprobs)


# ---------------------------------------------------------------------------- host side


class SamplingRow(NamedTuple):
    """One sequence to sample for, as the engine hands it to ``build_sampling_metadata``."""

    params: SamplingParams
    seed: int  # params.seed, or for unseeded requests one the engine drew once from its
    #            own generator at admission (so the stream survives preemption); the n
    #            children of one request need distinct seeds. Used modulo 2**64.
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Tokens generated before the one this row draws; None: len(output_token_ids). More when
    # some are still on the device (async scheduling): they count for the noise position
    # and min_tokens, and such a row cannot have penalties.
    num_output_tokens: int | None = None


# Id lists (banned, bias, penalty ids) are 0 wide when no row has any, else a power of two
# >= this: a width is a compilation of the sampler, and 1-, 2- and 4-wide lists cost the same.
MIN_ID_WIDTH = 8


def _padded_ids(lists: Sequence[Sequence[int]], num_rows: int) -> np.ndarray:
    width = max(map(len, lists), default=0)
    out = np.full((num_rows, bucket(width, MIN_ID_WIDTH) if width else 0), -1, np.int32)
    for i, ids in enumerate(lists):
        if len(ids):
            out[i, : len(ids)] = ids
    return out


def build_sampling_metadata(
    rows: Sequence[SamplingRow | tuple],
    padded_rows: int,
    vocab_size: int,
    eos_ids: Sequence[int],
    allowed: np.ndarray | None = None,
) -> tuple[SamplingMetadata, int, bool]:
    """Padded numpy metadata for ``sample``, plus its static ``num_logprobs`` and ``use_penalties``.

    ``allowed``: the structured outputs' token bitmask, ``[padded_rows, ceil(vocab_size / 32)]``
    int32 (``structured_output.token_bitmask``), or None when no row has one.
    Rows past ``len(rows)`` are padding (greedy, no options). Id-list widths (0 or at least
    ``MIN_ID_WIDTH``) and ``num_logprobs`` are rounded up to powers of two (``num_logprobs``
    capped at ``MAX_LOGPROBS``): slice each row's own ``params.logprobs`` columns from the output.
    """
    if rows and not isinstance(rows[0], SamplingRow):
        rows = [SamplingRow(*r) for r in rows]
    if len(rows) > padded_rows:
        raise ValueError(f"{len(rows)} rows do not fit in padded_rows={padded_rows}")
    if allowed is not None and (allowed.shape != (padded_rows, -(-vocab_size // 32)) or allowed.dtype != np.int32):
        raise ValueError(f"allowed must be int32 of shape {(padded_rows, -(-vocab_size // 32))}, "
                         f"got {allowed.dtype} {allowed.shape}")
    num_rows, n = padded_rows, len(rows)
    # Per distinct SamplingParams (a batch usually shares a few), then spread to the rows
    # by index: per-row numpy scalar writes took 1.6 ms at 256 rows, this 0.5 ms.
    distinct: dict[int, int] = {}
    uniq: list[SamplingParams] = []
    for r in rows:
        if id(r.params) not in distinct:
            distinct[id(r.params)] = len(uniq)
            uniq.append(r.params)
    which = np.fromiter((distinct[id(r.params)] for r in rows), np.int64, n)

    def per_row(values, dtype, pad):
        out = np.full(num_rows, pad, dtype)
        out[:n] = np.asarray(values, dtype)[which]
        return out

    temperature = per_row([p.temperature for p in uniq], np.float32, 0)
    top_k = per_row([p.top_k if 0 < p.top_k < vocab_size else 0 for p in uniq], np.int32, 0)
    top_p = per_row([p.top_p for p in uniq], np.float32, 1)
    min_p = per_row([p.min_p for p in uniq], np.float32, 0)
    repetition = per_row([p.repetition_penalty for p in uniq], np.float32, 1)
    presence = per_row([p.presence_penalty for p in uniq], np.float32, 0)
    frequency = per_row([p.frequency_penalty for p in uniq], np.float32, 0)
    seeds = np.fromiter((r.seed % (1 << 64) for r in rows), np.uint64, n)
    rng_key = np.zeros((num_rows, 2), np.uint32)
    # What jax.random.key(seed) holds (x64): the high and low 32 bits.
    rng_key[:n, 0], rng_key[:n, 1] = seeds >> np.uint64(32), seeds & np.uint64(0xFFFFFFFF)
    output_pos = np.zeros(num_rows, np.int32)
    num_outputs = [len(r.output_token_ids) if r.num_output_tokens is None else r.num_output_tokens for r in rows]
    output_pos[:n] = num_outputs
    for p in uniq:
        if bad := [t for t in (p.logit_bias or {}) if t >= vocab_size]:
            raise ValueError(f"logit_bias token ids {bad} are outside the vocabulary (size {vocab_size})")
    penalised = [p.has_penalties for p in uniq]
    use_penalties = any(penalised)
    prompts, outputs, biases, banned = [], [], [], []
    # Rows need id lists only for penalties, logit bias or min_tokens; usually none does.
    lists = any(penalised) or any(p.logit_bias or p.min_tokens for p in uniq)
    for r, u, num_outputs in zip(rows, which.tolist(), num_outputs) if lists else ():
        p = r.params
        if penalised[u] and num_outputs != len(r.output_token_ids):
            raise ValueError(f"penalties need every output token on the host; the row has {len(r.output_token_ids)} "
                             f"of {num_outputs}")
        prompts.append(r.prompt_token_ids if p.repetition_penalty != 1 else ())
        outputs.append(r.output_token_ids if penalised[u] else ())
        biases.append(p.logit_bias or {})
        stops = dict.fromkeys([*eos_ids, *p.stop_token_ids]) if num_outputs < p.min_tokens else {}
        banned.append([t for t in stops if 0 <= t < vocab_size])
    bias_ids = _padded_ids([list(b) for b in biases], num_rows)
    bias_values = np.zeros(bias_ids.shape, np.float32)
    for i, b in enumerate(biases):
        bias_values[i, : len(b)] = list(b.values())

    max_top_k = int(top_k.max(initial=0))
    top_k_bound = min(vocab_size, bucket(max_top_k)) if max_top_k else 0
    windowed = 0 < top_k_bound <= MAX_TOP_K_WINDOW  # a top_k row's nucleus lies in the window
    top_p_search = bool(np.any((top_p < 1) & ((top_k == 0) | (not windowed))))
    num_logprobs = max((p.logprobs or 0 for p in uniq), default=0)
    num_logprobs = min(bucket(num_logprobs), MAX_LOGPROBS, vocab_size) if num_logprobs else 0
    sm = SamplingMetadata(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
        repetition_penalty=repetition, presence_penalty=presence, frequency_penalty=frequency,
        prompt_ids=_padded_ids(prompts, num_rows),
        output_ids=_padded_ids(outputs, num_rows),
        bias_ids=bias_ids, bias_values=bias_values,
        banned_ids=_padded_ids(banned, num_rows),
        allowed=np.zeros((num_rows, 0), np.int32) if allowed is None else allowed,
        rng_key=rng_key, output_pos=output_pos,
        top_k_bound=top_k_bound, top_p_search=top_p_search,
        all_greedy=all(p.is_greedy for p in uniq),
    )
    return sm, num_logprobs, use_penalties
