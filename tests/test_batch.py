"""build_batch: the padded arrays of one step, against a sequence-by-sequence oracle.

Random mixes of prefill chunks (fresh, after a cached prefix, mid-block) and decodes
over a real block manager whose blocks are scattered by earlier frees, so block tables
are not contiguous. No jax.
"""

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged import batch
from jaxpaged.batch import build_batch
from jaxpaged.block_manager import BlockManager
from jaxpaged.padding import NULL_BLOCK, bucket, token_bucket
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.scheduler import ScheduledSeq, SchedulerOutput
from jaxpaged.sequence import Request

BS = 4


def oracle(sched, bm, T, S, W, num_decode_rows=0):
    """What each array must hold, written one sequence and one token at a time: in the
    scheduler's order, or (``num_decode_rows`` > 0) its one-token rows first, then padding
    rows of one token up to ``num_decode_rows``, then the others."""
    tokens, positions, slots = np.zeros(T, np.int32), np.zeros(T, np.int32), np.full(T, NULL_BLOCK, np.int32)
    tables, lens, qsl = np.full((S, W), NULL_BLOCK, np.int32), np.zeros(S, np.int32), np.zeros(S + 1, np.int32)
    order = list(sched)
    if num_decode_rows:
        ones = [s for s in sched if s.num_new_tokens == 1]
        order = ones + [None] * (num_decode_rows - len(ones)) + [s for s in sched if s.num_new_tokens != 1]
    t = 0
    for i, s in enumerate(order):
        if s is None:  # padding of the one-token part: a token in the null block, context 0
            t += 1
            qsl[i + 1] = t
            continue
        table = bm.block_table(s.seq.seq_id)
        tables[i, :len(table)] = table
        for p in range(s.start, s.start + s.num_new_tokens):
            tokens[t], positions[t], slots[t] = s.seq.token_ids[p], p, bm.slot(s.seq.seq_id, p)
            t += 1
        lens[i], qsl[i + 1] = s.start + s.num_new_tokens, t
    qsl[len(order) + 1:] = t
    return tokens, positions, slots, tables, lens, qsl


# Each sequence: (prompt length, tokens already computed, tokens this step).
seq_strategy = st.integers(1, 40).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n - 1)).flatmap(
        lambda nc: st.tuples(st.just(nc[0]), st.just(nc[1]), st.integers(1, nc[0] - nc[1]))))


@settings(max_examples=60, deadline=None)
@given(seqs=st.lists(seq_strategy, min_size=1, max_size=12), holes=st.integers(0, 12), seed=st.integers(0, 99),
       split_min_rows=st.sampled_from([None, 1, 3, batch.SPLIT_MIN_ROWS]))
def test_arrays_match_the_oracle(seqs, holes, seed, split_min_rows):
    rng = np.random.default_rng(seed)
    bm = BlockManager(200, BS, enable_prefix_caching=False)
    for h in range(holes):  # scatter the free queue: later allocations are not contiguous
        bm.allocate(("hole", h), [1] * int(rng.integers(1, 3 * BS)))
    for h in rng.permutation(holes):
        bm.free(("hole", int(h)))
    sched = []
    for n, computed, new in seqs:
        req = Request(f"r{len(sched)}", None, rng.integers(0, 1000, n).tolist(), SamplingParams(), 0.0, 0)
        seq = req.seqs[0]
        bm.allocate(seq.seq_id, seq.token_ids, num_new_tokens=computed + new)
        seq.num_computed_tokens = computed
        samples = int(computed + new == n)
        sched.append(ScheduledSeq(seq, computed, new, samples, bm.block_table(seq.seq_id), bm.num_tokens(seq.seq_id)))
    split = split_min_rows is not None
    with mock.patch.object(batch, "SPLIT_MIN_ROWS", split_min_rows or 1):
        b = build_batch(SchedulerOutput(sched, [], [], []), block_size=BS, max_blocks_per_seq=64, split_decodes=split)

    num_tokens = sum(new for *_, new in seqs)
    num_ones = sum(new == 1 for *_, new in seqs)
    decode_only = num_ones == len(seqs)
    assert b.decode_only == decode_only and b.num_tokens == num_tokens
    D = bucket(num_ones) if split and num_ones >= split_min_rows and not decode_only else 0  # row_bucket < 33
    assert b.num_decode_rows == D and b.shape_key[-1] == D
    S = bucket(len(seqs) - num_ones + D) if D else bucket(len(seqs))
    assert b.tokens.shape == (S if decode_only else D + token_bucket(num_tokens - (num_ones if D else 0), 8),)
    assert b.block_tables.shape[0] == S and b.block_tables.shape[1] >= max(-(-(c + n) // BS) for _, c, n in seqs)
    want = oracle(sched, bm, b.tokens.shape[0], S, b.block_tables.shape[1], D)
    for name, got, exp in zip(("tokens", "positions", "slot_mapping", "block_tables", "context_lens",
                               "query_start_loc"),
                              (b.tokens, b.positions, b.slot_mapping, b.block_tables, b.context_lens,
                               b.query_start_loc), want):
        assert got.dtype == np.int32, name
        np.testing.assert_array_equal(got, exp, err_msg=name)
    # Rows sample at the last token of each chunk that reaches the end of its prompt, in the
    # scheduler's order whatever the layout (its update_from_output reads them so).
    samplers = [s for s in sched if s.samples]
    assert [r.seq for r in b.rows] == [s.seq for s in samplers]
    for row, s in zip(b.logits_indices, samplers):
        end = s.start + s.num_new_tokens - 1
        assert (b.tokens[row], b.positions[row]) == (s.seq.token_ids[end], end)
        assert b.slot_mapping[row] == bm.slot(s.seq.seq_id, end)


@pytest.mark.parametrize("reserved", [3, 4])  # past the reserved slots, inside / past the last block
def test_positions_past_the_reserved_slots_are_an_error(reserved):
    bm = BlockManager(20, BS, enable_prefix_caching=False)
    req = Request("r", None, list(range(10)), SamplingParams(), 0.0, 0)
    seq = req.seqs[0]
    bm.allocate(seq.seq_id, seq.token_ids, num_new_tokens=reserved)
    n = reserved + 1
    with pytest.raises(IndexError, match=rf"positions \[0, {n}\) of sequence {seq.seq_id!r}; it has {reserved} slots"):
        s = ScheduledSeq(seq, 0, n, 0, bm.block_table(seq.seq_id), bm.num_tokens(seq.seq_id))
        build_batch(SchedulerOutput([s], [], [], []), block_size=BS, max_blocks_per_seq=8)


def test_row_bucket_pads_by_at_most_a_quarter_past_32():
    from jaxpaged.padding import row_bucket

    sizes = [row_bucket(n) for n in range(1, 1025)]
    assert sizes[:32] == [bucket(n) for n in range(1, 33)]
    assert all(n <= b <= 1.25 * n for n, b in zip(range(33, 1025), sizes[32:]))
    assert sizes == sorted(sizes) and len(set(sizes[32:])) == 4 * 5  # four per octave, 32..1024
    assert row_bucket(48) == 48 and row_bucket(49) == 56 and row_bucket(256) == 256


def test_token_bucket_pads_by_at_most_a_quarter_past_256():
    sizes = [token_bucket(n) for n in range(1, 8193)]
    assert sizes[:256] == [bucket(n) for n in range(1, 257)]
    assert all(n <= b <= 1.25 * n for n, b in zip(range(257, 8193), sizes[256:]))
    assert sizes == sorted(sizes) and len(set(sizes[256:])) == 4 * 5  # four per octave, 256..8192
    assert token_bucket(656) == 768 and token_bucket(488) == 512 and token_bucket(3, 8) == 8
