"""Every paged-attention kernel against the reference.

Each case is one batch holding all the awkward lengths at once (1, 3, bs-1, bs, bs+1,
513, 2048 and a zero-length padding row), with blocks scattered through the pool by a
random permutation, tables wider than needed (padded with the null block), and fresh
random inputs. Every slot no sequence owns (the null block, free blocks, the tail of a
last block, the other layer) holds NaN, so a kernel that reads or weighs one fails.

Pallas' interpreter fills every output buffer with NaN before the kernel runs (checked
by ``test_interpreter_poisons_outputs``), so an output element a program forgets to
write fails the comparison too.

Each case's batch and reference output are built once and shared by every kernel tested on
it (compiling the reference dominates the run time otherwise).

Tolerances: float32 ``atol = rtol = 2e-5``; bfloat16 inputs ``atol = rtol = 3e-2``
(outputs are bf16, one ulp is 2**-8 relative, and the kernels feed bf16 probabilities to
the PV product).

``TestPallasKernels`` runs in interpret mode everywhere; ``TestPallasKernelsNative``
repeats it lowered for the GPU and skips when there is none.
"""

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxpaged.compat import abstract_gpu
from jaxpaged.pallas import common
from jaxpaged.pallas import xla as xla_attention
from jaxpaged.pallas.paged_attention import auto_num_splits, paged_decode_attention
from jaxpaged.pallas import ragged_paged_attention as gpu_ragged
from jaxpaged.pallas.ragged_paged_attention import default_block_q, mixed_paged_attention, ragged_paged_attention
from jaxpaged.pallas.reference import ref_paged_decode_attention, ref_ragged_paged_attention
from jaxpaged.pallas.xla import xla_paged_decode_attention, xla_ragged_paged_attention
from paged import dot_precisions

KVH = 2
NUM_LAYERS = 2
LAYER = 1
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
HAS_GPU = jax.default_backend() == "gpu"


def decode_contexts(bs):
    return [1, 3, bs - 1, bs, bs + 1, 513, 2048, 0]


def ragged_chunks(bs):
    """(cached, new) per sequence: every context length of decode_contexts, chunks that
    start mid-block after a cached prefix, decode rows inside a mixed batch, a fresh
    multi-block prefill and a zero-length row in the middle."""
    return [(0, 1), (0, 3), (bs - 3, 2), (bs - 1, 1), (0, 0), (3, bs - 2), (512, 1), (2043, 5), (0, 37)]


def make_pool(rng, *, block_size, head_dim, contexts, dtype, extra_cols=2, free_blocks=5):
    """Pool and block tables for sequences of the given context lengths.

    Returns (k, v, block_tables, context_lens); layer LAYER holds the data.
    """
    bs = block_size
    need = [-(-c // bs) for c in contexts]
    nb = 1 + sum(need) + free_blocks
    width = max(need) + extra_cols
    perm = rng.permutation(np.arange(1, nb))
    tables = np.zeros((len(contexts), width), np.int32)  # padding entries: null block 0
    owned = np.zeros((nb, bs), bool)
    i = 0
    for s, (c, n) in enumerate(zip(contexts, need)):
        tables[s, :n] = perm[i:i + n]
        i += n
        for p in range(c):
            owned[tables[s, p // bs], p % bs] = True
    shape = (NUM_LAYERS, nb, KVH, bs, head_dim)
    k = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(shape).astype(np.float32)
    stale = np.broadcast_to(~owned[:, None, :], (nb, KVH, bs))
    for a in (k, v):
        a[:, stale] = np.nan
        a[1 - LAYER] = np.nan
    return (jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(tables),
            jnp.asarray(contexts, jnp.int32))


def decode_case(seed, *, block_size, ratio, head_dim, dtype, contexts=None):
    rng = np.random.default_rng(seed)
    contexts = decode_contexts(block_size) if contexts is None else contexts
    k, v, tables, lens = make_pool(rng, block_size=block_size, head_dim=head_dim, contexts=contexts,
                                   dtype=dtype)
    q = jnp.asarray(rng.standard_normal((len(contexts), KVH * ratio, head_dim)), dtype)
    return q, k, v, jnp.int32(LAYER), tables, lens


def ragged_case(seed, *, block_size, ratio, head_dim, dtype, pad_tokens=3, chunks=None):
    rng = np.random.default_rng(seed)
    chunks = ragged_chunks(block_size) if chunks is None else chunks
    contexts = [c + n for c, n in chunks]
    k, v, tables, lens = make_pool(rng, block_size=block_size, head_dim=head_dim, contexts=contexts,
                                   dtype=dtype)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in chunks])]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in chunks] + [np.zeros(pad_tokens)])
    T = int(qsl[-1]) + pad_tokens
    q = jnp.asarray(rng.standard_normal((T, KVH * ratio, head_dim)), dtype)
    return (q, k, v, jnp.int32(LAYER), tables, lens, jnp.asarray(qsl)), jnp.asarray(positions, jnp.int32)


def assert_matches(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


def scale_for(head_dim):
    return head_dim ** -0.5


ref_decode = jax.jit(ref_paged_decode_attention, static_argnames="scale")
ref_ragged = jax.jit(ref_ragged_paged_attention, static_argnames="scale")


# Full sweeps on float32; head_dim 128 and bfloat16 on a representative subset.
SWEEP = [dict(block_size=bs, ratio=r, head_dim=64, dtype=jnp.float32)
         for bs in (8, 16, 32) for r in (1, 3, 4, 8)]
SUBSET = [
    dict(block_size=16, ratio=3, head_dim=128, dtype=jnp.float32),
    dict(block_size=8, ratio=8, head_dim=128, dtype=jnp.float32),
    dict(block_size=32, ratio=1, head_dim=128, dtype=jnp.float32),
    dict(block_size=16, ratio=3, head_dim=64, dtype=jnp.bfloat16),
    dict(block_size=8, ratio=4, head_dim=128, dtype=jnp.bfloat16),
]
CASES = SWEEP + SUBSET
# The XLA path also at the engine's CPU layout: 64-token blocks, SmolLM2's 3 query heads per KV head.
XLA_CASES = CASES + [dict(block_size=64, ratio=3, head_dim=64, dtype=jnp.float32)]


def case_id(c):
    return f"bs{c['block_size']}-r{c['ratio']}-d{c['head_dim']}-{jnp.dtype(c['dtype']).name}"


def seed_of(c):
    return zlib.crc32(case_id(c).encode())


# One batch (and one reference result) per case, shared by every kernel tested on it.
@functools.cache
def decode_inputs(cid):
    case = next(c for c in XLA_CASES if case_id(c) == cid)
    args = decode_case(seed_of(case), **case)
    return args, ref_decode(*args, scale=scale_for(case["head_dim"]))


@functools.cache
def ragged_inputs(cid):
    case = next(c for c in XLA_CASES if case_id(c) == cid)
    args, positions = ragged_case(seed_of(case) + 1, **case)
    return args, ref_ragged(*args, positions, scale=scale_for(case["head_dim"]))


class TestPallasKernels:
    INTERPRET = True

    @pytest.mark.parametrize("num_splits", [1, None], ids=["single-pass", "split-k-auto"])
    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_decode(self, case, num_splits):
        args, ref = decode_inputs(case_id(case))
        if num_splits is None:  # the 2048 row makes the table wide enough for split-K
            assert auto_num_splits(args[4].shape[1] * case["block_size"], args[0].shape[0] * KVH) > 1
        out = paged_decode_attention(*args, scale=scale_for(case["head_dim"]), num_splits=num_splits,
                                     interpret=self.INTERPRET)
        assert_matches(out, ref, case["dtype"])

    @pytest.mark.parametrize("num_splits", [2, 5])
    def test_decode_split_k_override(self, num_splits):
        # 5 partitions: short rows leave most partitions empty (l = 0), one is ragged.
        case = dict(block_size=16, ratio=3, head_dim=64, dtype=jnp.float32)
        args = decode_case(num_splits, **case)
        out = paged_decode_attention(*args, scale=0.1, num_splits=num_splits, interpret=self.INTERPRET)
        assert_matches(out, ref_decode(*args, scale=0.1), jnp.float32)

    @pytest.mark.parametrize("case", CASES, ids=case_id)
    def test_ragged(self, case):
        args, ref = ragged_inputs(case_id(case))
        out = ragged_paged_attention(*args, scale=scale_for(case["head_dim"]), interpret=self.INTERPRET)
        assert_matches(out, ref, case["dtype"])

    @pytest.mark.parametrize("block_q", [4, 32])  # 4 * next_power_of_2(4) = 16 rows: the GPU minimum
    def test_ragged_block_q(self, block_q):
        case = dict(block_size=16, ratio=4, head_dim=64, dtype=jnp.float32)
        args, positions = ragged_case(block_q, **case)
        out = ragged_paged_attention(*args, scale=0.1, block_q=block_q, pages_per_chunk=2,
                                     interpret=self.INTERPRET)
        assert_matches(out, ref_ragged(*args, positions, scale=0.1), jnp.float32)

    @pytest.mark.parametrize("case", SUBSET, ids=case_id)
    def test_mixed_split(self, case):
        # The one-token rows (a fresh one, one at bs - 1, one at 512) go to the decode
        # kernel, the rest to the ragged kernel; the zero-length row and padding tokens to neither.
        args, ref = ragged_inputs(case_id(case))
        out = mixed_paged_attention(*args, scale=scale_for(case["head_dim"]), interpret=self.INTERPRET)
        assert_matches(out, ref, case["dtype"])

    @pytest.mark.parametrize("fn", [ragged_paged_attention, mixed_paged_attention], ids=["ragged", "mixed"])
    @pytest.mark.parametrize("case", SUBSET, ids=case_id)
    def test_packed_query_layout_and_fixed_block_q(self, case, fn, monkeypatch):
        # The former defaults (until an H100 measured the others): queries packed per block of 16
        # tokens, outputs gathered back; the groups of 3 (padded to 4), 1 and 8.
        monkeypatch.setattr(gpu_ragged, "QUERY_LAYOUT", "packed")
        monkeypatch.setattr(gpu_ragged, "BLOCK_Q_RULE", "fixed")
        args, ref = ragged_inputs(case_id(case))
        out = fn(*args, scale=scale_for(case["head_dim"]), interpret=self.INTERPRET)
        assert_matches(out, ref, case["dtype"])

    @pytest.mark.parametrize("fn", [ragged_paged_attention, mixed_paged_attention], ids=["ragged", "mixed"])
    @pytest.mark.parametrize("case", SUBSET[:2], ids=case_id)
    def test_direct_query_layout_in_reversed_block_order(self, case, fn, monkeypatch, fresh_traces):
        # The interpreter runs the programs in grid order, so a store spilling past its block's
        # real tokens into the next row would be overwritten by that row's block and pass; on a
        # GPU the programs race. With the blocks in reverse order such a spill survives.
        monkeypatch.setattr(gpu_ragged, "QUERY_LAYOUT", "direct")
        schedule = common.q_block_schedule

        def reversed_schedule(*args, **kwargs):
            blocks, (tok_block, tok_row, tok_valid) = schedule(*args, **kwargs)
            n = blocks[0].shape[0]
            return tuple(x[::-1] for x in blocks), (n - 1 - tok_block, tok_row, tok_valid)

        monkeypatch.setattr(common, "q_block_schedule", reversed_schedule)
        args, ref = ragged_inputs(case_id(case))
        out = fn(*args, scale=scale_for(case["head_dim"]), interpret=self.INTERPRET)
        assert_matches(out, ref, case["dtype"])

    @pytest.mark.parametrize("layout", ["direct", "packed"])
    @pytest.mark.parametrize("fn", [ragged_paged_attention, mixed_paged_attention], ids=["ragged", "mixed"])
    @pytest.mark.parametrize("case", SUBSET[:2], ids=case_id)
    def test_longest_first_block_order(self, case, fn, layout, monkeypatch):
        # The blocks launched by decreasing keys walked: outputs land in their tokens' places in
        # either layout (the packed one renumbers each token's block to match).
        monkeypatch.setattr(gpu_ragged, "QUERY_LAYOUT", layout)
        monkeypatch.setattr(gpu_ragged, "BLOCK_ORDER", "longest_first")
        args, ref = ragged_inputs(case_id(case))
        out = fn(*args, scale=scale_for(case["head_dim"]), interpret=self.INTERPRET)
        assert_matches(out, ref, case["dtype"])

    def test_mixed_split_with_split_k_and_mean_block_q(self, monkeypatch):
        monkeypatch.setattr(gpu_ragged, "BLOCK_Q_RULE", "mean")
        case = dict(block_size=16, ratio=4, head_dim=64, dtype=jnp.float32)
        args, positions = ragged_case(7, **case)
        assert default_block_q(args[0].shape[0], args[4].shape[0], 4) == 8  # 67 tokens over 9 rows
        out = mixed_paged_attention(*args, scale=0.1, num_splits=3, interpret=self.INTERPRET)
        assert_matches(out, ref_ragged(*args, positions, scale=0.1), jnp.float32)
        out = ragged_paged_attention(*args, scale=0.1, interpret=self.INTERPRET)  # block_q 8 by the rule
        assert_matches(out, ref_ragged(*args, positions, scale=0.1), jnp.float32)


@pytest.mark.skipif(not HAS_GPU, reason="native Pallas kernels need a GPU")
class TestPallasKernelsNative(TestPallasKernels):
    INTERPRET = False


class TestXlaKernels:
    @pytest.mark.parametrize("case", XLA_CASES, ids=case_id)
    def test_decode(self, case):
        args, ref = decode_inputs(case_id(case))
        out = xla_paged_decode_attention(*args, scale=scale_for(case["head_dim"]))
        assert_matches(out, ref, case["dtype"])

    @pytest.mark.parametrize("case", XLA_CASES, ids=case_id)
    def test_ragged(self, case):
        args, ref = ragged_inputs(case_id(case))
        out = xla_ragged_paged_attention(*args, scale=scale_for(case["head_dim"]))
        assert_matches(out, ref, case["dtype"])

    @pytest.mark.parametrize("pages_per_chunk", [1, 3])
    def test_chunk_size_does_not_change_results(self, pages_per_chunk):
        case = dict(block_size=8, ratio=3, head_dim=64, dtype=jnp.float32)
        args = decode_case(11, **case)
        out = xla_paged_decode_attention(*args, scale=0.1, pages_per_chunk=pages_per_chunk)
        assert_matches(out, ref_decode(*args, scale=0.1), jnp.float32)
        args, positions = ragged_case(12, **case)
        out = xla_ragged_paged_attention(*args, scale=0.1, block_q=3, pages_per_chunk=pages_per_chunk)
        assert_matches(out, ref_ragged(*args, positions, scale=0.1), jnp.float32)

    @pytest.mark.parametrize("longest_blocks", [1, 2, 3, 4, 5, 8, 15])
    @pytest.mark.parametrize("pages_per_chunk", [4, 6])
    def test_decode_reads_the_last_chunk_in_a_half_piece(self, longest_blocks, pages_per_chunk):
        # Full chunks, then what is left in half a chunk where it fits (_chunk_plan): every
        # remainder, a chunk wider than the table, exactly as wide, and a table with unused
        # columns. Stale slots hold NaN (make_pool), so a piece read past a context shows.
        bs = 8
        longest = (longest_blocks - 1) * bs + 3
        contexts = [longest, 1, max(1, longest - bs - 5), bs, 0]
        case = dict(block_size=bs, ratio=3, head_dim=64, dtype=jnp.float32)
        args = decode_case(100 + longest_blocks, contexts=contexts, **case)
        out = xla_paged_decode_attention(*args, scale=0.1, pages_per_chunk=pages_per_chunk)
        assert_matches(out, ref_decode(*args, scale=0.1), jnp.float32)

    def test_chunk_plan_covers_the_blocks_within_half_a_chunk(self):
        for chunk in range(1, 11):
            half = common.next_power_of_2(chunk) // 2
            for n_blocks in range(4 * chunk):
                n_full, piece = xla_attention._chunk_plan(jnp.int32(n_blocks), chunk)
                read = [(int(piece[1]), piece[0])] if piece is not None and bool(piece[2]) else []
                starts = [c * chunk for c in range(int(n_full))] + [s for s, _ in read]
                sizes = [chunk] * int(n_full) + [n for _, n in read]
                assert starts == list(np.cumsum([0] + sizes)[:-1]), (chunk, n_blocks)
                covered = sum(sizes)
                assert n_blocks <= covered <= -(-n_blocks // chunk) * chunk, (chunk, n_blocks)
                assert covered - n_blocks < max(half, 1), (chunk, n_blocks)  # exact for chunks of 1, 2


def split_layout(chunks, num_decode_rows: int, pad_rows: int = 2, pad_tokens: int = 3):
    """A mixed step's rows in the two-part layout of ``batch.build_batch(split_decodes=True)``:
    its one-token rows first, padded to ``num_decode_rows`` rows of one token (context 0),
    then the others and ``pad_rows`` padding rows. Returns ``(rows, token_src)``: each new
    row's old row (-1: padding) and each new token's old token index (-1: padding)."""
    new = [n for _, n in chunks]
    qsl = np.concatenate([[0], np.cumsum(new)])
    ones = [i for i, n in enumerate(new) if n == 1]
    rest = [i for i, n in enumerate(new) if n != 1]
    rows = ones + [-1] * (num_decode_rows - len(ones)) + rest + [-1] * pad_rows
    token_src = []
    for k, i in enumerate(rows):
        if i >= 0:
            token_src += range(qsl[i], qsl[i + 1])
        elif k < num_decode_rows:
            token_src.append(-1)  # the one-token part's padding row: a token of its own
    return np.asarray(rows), np.asarray(token_src + [-1] * pad_tokens)


@pytest.mark.parametrize("backend", ["xla", "reference", "pallas_gpu", "pallas_tpu"])
def test_split_mixed_step_matches_the_reference(backend):
    """A mixed step laid out in two parts (``AttentionMetadata.num_decode_rows``): the
    one-token rows (decodes, and a one-token prompt chunk) through the decode path, the rest
    through the ragged one, give every real token what the reference gives it in the
    usual layout."""
    from jaxpaged.attention import AttentionMetadata, paged_attention
    from jaxpaged.kv_cache import KVPool

    bs, head_dim = 16, 64
    chunks = [(0, 5), (40, 1), (bs - 1, 1), (3, bs - 2), (0, 1), (70, 1), (2 * bs, 9)]
    case = dict(block_size=bs, ratio=3, head_dim=head_dim, dtype=jnp.float32)
    (q, k, v, layer, tables, lens, qsl), positions = ragged_case(31, chunks=chunks, **case)
    ref = np.asarray(ref_ragged(q, k, v, layer, tables, lens, qsl, positions, scale=0.1))
    D = 8  # four one-token rows, padded
    rows, token_src = split_layout(chunks, D)
    real_row, real_tok = rows >= 0, token_src >= 0
    rng = np.random.default_rng(32)
    q_split = np.where(real_tok[:, None, None], np.asarray(q)[np.maximum(token_src, 0)],
                       rng.standard_normal((len(token_src), *q.shape[1:])).astype(np.float32))
    row_tokens = np.where(real_row, np.diff(np.asarray(qsl))[np.maximum(rows, 0)], 0)
    row_tokens[:D] = 1
    md = AttentionMetadata(
        positions=jnp.asarray(np.where(real_tok, np.asarray(positions)[np.maximum(token_src, 0)], 0), jnp.int32),
        slot_mapping=jnp.zeros(len(token_src), jnp.int32),  # attention reads the pool only
        block_tables=jnp.asarray(np.where(real_row[:, None], np.asarray(tables)[np.maximum(rows, 0)], 0)),
        context_lens=jnp.asarray(np.where(real_row, np.asarray(lens)[np.maximum(rows, 0)], 0), jnp.int32),
        query_start_loc=jnp.asarray(np.concatenate([[0], np.cumsum(row_tokens)]), jnp.int32),
        num_decode_rows=D)
    attend = jax.jit(functools.partial(paged_attention, scale=0.1, backend=backend))
    out = np.asarray(attend(jnp.asarray(q_split), KVPool(k, v), layer, md))
    assert out.shape == q_split.shape and np.all(np.isfinite(out[real_tok]))
    np.testing.assert_allclose(out[real_tok], ref[token_src[real_tok]], atol=2e-5, rtol=2e-5)
    n = len(rows)
    with pytest.raises(ValueError, match=rf"num_decode_rows={n}: must leave tokens \(\d+\) and rows \({n}\)"):
        paged_attention(jnp.asarray(q_split), KVPool(k, v), layer,
                        dataclasses.replace(md, num_decode_rows=len(rows)), scale=0.1, backend=backend)


def test_block_q_rules(monkeypatch):
    assert gpu_ragged.BLOCK_Q_RULE == "mean"  # the default
    assert default_block_q(720, 256, 4) == 4  # a busy mixed step: ~3 tokens a row
    assert default_block_q(720, 256, 1) == 16  # no group to fill the 16 rows with
    assert default_block_q(1024, 64, 4) == 16  # prompt chunks: capped at BLOCK_Q
    assert default_block_q(300, 256, 8) == 2
    monkeypatch.setattr(gpu_ragged, "BLOCK_Q_RULE", "fixed")
    assert default_block_q(720, 256, 4) == default_block_q(8, 256, 4) == gpu_ragged.BLOCK_Q == 16
    monkeypatch.setattr(gpu_ragged, "BLOCK_Q_RULE", "median")
    with pytest.raises(ValueError, match="BLOCK_Q_RULE"):
        default_block_q(720, 256, 4)


def test_longest_first_orders_blocks_by_keys_walked():
    # Rows: a 5-token prompt chunk at positions 3-7 (blocks of 2: keys 5, 7, 8), a decode row
    # at context 20 (20), one at context 2 (2); 16 token slots, so padding blocks follow.
    qsl, lens = jnp.array([0, 5, 6, 7]), jnp.array([8, 20, 2])
    blocks, (tok_block, _, valid) = common.q_block_schedule(qsl, lens, 16, 2)
    (seq, tok0, nq, pos0), tb = gpu_ragged.order_blocks(blocks, tok_block, "longest_first")
    real = int((nq > 0).sum())
    assert real == 5 and bool(jnp.all(nq[real:] == 0))
    assert (pos0 + nq)[:real].tolist() == [20, 8, 7, 5, 2]
    assert seq[:real].tolist() == [1, 0, 0, 0, 2]
    for t in range(7):  # every real token still finds its own block, at its new place
        b = int(tb[t])
        assert int(tok0[b]) <= t < int(tok0[b] + nq[b])
    same = gpu_ragged.order_blocks(blocks, tok_block, "sequence")
    assert same[0] is blocks and same[1] is tok_block
    with pytest.raises(ValueError, match="BLOCK_ORDER='random'"):
        gpu_ragged.order_blocks(blocks, tok_block, "random")


def test_query_layout_is_checked(monkeypatch):
    monkeypatch.setattr(gpu_ragged, "QUERY_LAYOUT", "strided")
    args, _ = ragged_case(0, block_size=16, ratio=3, head_dim=64, dtype=jnp.float32)
    with pytest.raises(ValueError, match="QUERY_LAYOUT='strided'"):
        ragged_paged_attention(*args, scale=0.1, interpret=True)


def test_split_k_is_chosen_for_long_tables_and_small_grids():
    assert auto_num_splits(8192, 8) == 8  # long table, few programs: one partition per 1024 keys
    assert auto_num_splits(8192, 256) == 4  # capped so the grid reaches ~1024 programs
    assert auto_num_splits(8192, 1024) == 1  # the grid is full without splitting
    assert auto_num_splits(2048, 512) == 1  # short table, a grid that fills the GPU: single pass
    assert auto_num_splits(1024, 32) == 4  # short table, small grid: one partition per 256 keys
    assert auto_num_splits(2048, 64) == 8
    assert auto_num_splits(512, 256) == 2
    assert auto_num_splits(256, 8) == 1  # one partition's worth of keys
    assert auto_num_splits(2048, 200) == 5  # capped by the target grid (1024 programs)


def test_interpreter_poisons_outputs():
    """The assumption behind 'unwritten outputs fail': interpret mode starts from NaN."""
    def kernel(o_ref):
        o_ref[0] = jnp.ones((8,), jnp.float32)  # writes row 0 only

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((2, 8), jnp.float32), interpret=True)()
    assert np.all(np.asarray(out[0]) == 1) and np.all(np.isnan(np.asarray(out[1])))


# ---------------------------------------------------------------- lowering for CUDA


def _lower_for_cuda(f, *args):
    with abstract_gpu():  # jax 0.11 asks the (absent) GPU for its compute capability
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_lowers_to_triton(dtype, num_splits):
    args = decode_case(0, block_size=16, ratio=3, head_dim=64, dtype=dtype)
    f = functools.partial(paged_decode_attention, scale=0.125, num_splits=num_splits, interpret=False)
    assert "__gpu$xla.gpu.triton" in _lower_for_cuda(f, *args)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["packed", "direct"])
@pytest.mark.parametrize("fn", [ragged_paged_attention, mixed_paged_attention], ids=["ragged", "mixed"])
def test_ragged_lowers_to_triton(dtype, fn, layout, monkeypatch):
    monkeypatch.setattr(gpu_ragged, "QUERY_LAYOUT", layout)
    args, _ = ragged_case(0, block_size=16, ratio=3, head_dim=64, dtype=dtype)
    f = functools.partial(fn, scale=0.125, interpret=False)
    text = _lower_for_cuda(f, *args)
    assert text.count("__gpu$xla.gpu.triton") == (2 if fn is mixed_paged_attention else 1)
    assert ("ragged_paged_direct_" in text) == (layout == "direct")  # the layout switch reaches the trace


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_float32_dots_ask_for_full_precision(kernel, dtype):
    """On GPU the default lets Triton multiply float32 in TF32 (~1e-3 error; the native
    tests failed at 8.6e-4 on an H100): float32 kernels must ask for HIGHEST."""
    if kernel == "decode":
        args = decode_case(0, block_size=16, ratio=3, head_dim=64, dtype=dtype)
        f = functools.partial(paged_decode_attention, scale=0.125, num_splits=1, interpret=False)
    else:
        args, _ = ragged_case(0, block_size=16, ratio=3, head_dim=64, dtype=dtype)
        f = functools.partial(ragged_paged_attention, scale=0.125, interpret=False)
    precisions = dot_precisions(jax.make_jaxpr(f)(*args).jaxpr)
    assert len(precisions) == 2  # q @ k and p @ v
    if dtype == jnp.float32:
        assert all(p is not None and set(p) == {jax.lax.Precision.HIGHEST} for p in precisions), precisions
    else:  # bf16 follows jax.default_matmul_precision
        assert all(p is None for p in precisions), precisions


# ---------------------------------------------------------------- input validation

DECODE_IMPLS = {"pallas": paged_decode_attention, "xla": xla_paged_decode_attention}
RAGGED_IMPLS = {"pallas": ragged_paged_attention, "xla": xla_ragged_paged_attention}


@pytest.fixture(scope="module")
def small_decode():
    return decode_case(5, block_size=8, ratio=3, head_dim=64, dtype=jnp.float32)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_rejects_heads_not_divisible(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="num_heads=5 is not a multiple of num_kv_heads=2"):
        DECODE_IMPLS[impl](q[:, :5], k, v, layer, bt, lens, scale=0.1)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_rejects_dtype_mismatch(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="q dtype bfloat16 != pool dtype float32"):
        DECODE_IMPLS[impl](q.astype(jnp.bfloat16), k, v, layer, bt, lens, scale=0.1)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_rejects_block_size_mismatch(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="block_size 8 vs 4"):
        DECODE_IMPLS[impl](q, k, v[:, :, :, :4], layer, bt, lens, scale=0.1)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_rejects_head_dim_mismatch(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="q head_dim 32 != pool head_dim 64"):
        DECODE_IMPLS[impl](q[..., :32], k, v, layer, bt, lens, scale=0.1)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_rejects_block_ids_outside_the_pool(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    nb = k.shape[1]
    with pytest.raises(ValueError, match=f"block table entry {nb + 3} is outside the pool of {nb} blocks"):
        DECODE_IMPLS[impl](q, k, v, layer, bt.at[2, 0].set(nb + 3), lens, scale=0.1)


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_debug_checks_traced_block_tables(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    nb = k.shape[1]
    f = jax.jit(functools.partial(DECODE_IMPLS[impl], scale=0.1, debug=True))
    f(q, k, v, layer, bt, lens).block_until_ready()  # a valid table passes
    with pytest.raises(Exception, match=f"outside the pool of {nb} blocks"):
        f(q, k, v, layer, bt.at[2, 0].set(nb), lens).block_until_ready()


@pytest.mark.parametrize("impl", DECODE_IMPLS)
def test_decode_rejects_more_tokens_than_sequences(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="one query per sequence"):
        DECODE_IMPLS[impl](jnp.concatenate([q, q]), k, v, layer, bt, lens, scale=0.1)


@pytest.mark.parametrize("impl", RAGGED_IMPLS)
def test_ragged_rejects_bad_query_start_loc(impl, small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="query_start_loc must be int32"):
        RAGGED_IMPLS[impl](q, k, v, layer, bt, lens, jnp.arange(3, dtype=jnp.int32), scale=0.1)


def test_native_pallas_rejects_non_power_of_two_tiles(small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="head_dim=48 must be a power of two"):
        paged_decode_attention(q[..., :48], k[..., :48], v[..., :48], layer, bt, lens, scale=0.1,
                               interpret=False)
