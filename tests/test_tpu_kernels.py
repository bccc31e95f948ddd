"""jaxpaged's Mosaic TPU kernels, run on CPU in TPU interpret mode and lowered for TPU.

The discipline of ``test_kernels.py`` (its pool builder is reused): one batch per case
holding awkward lengths (1, 3, bs-1, bs, bs+1, a multi-block row and a zero-length
padding row), blocks scattered by a random permutation, tables padded with the null
block, NaN in every slot no sequence owns, fresh random inputs. TPU interpret mode
simulates HBM, VMEM, SMEM, the DMAs and their semaphores, and fills every scratch buffer
and output with NaN before the kernel runs, so a page read before its DMA completes, a
forgotten accumulator init or an unwritten output fails the comparison.

The interpreter is slow (it runs every grid step and DMA in Python): contexts stop at a
few blocks, and ``pages_per_block=2`` makes every long row span several compute blocks so
that both double-buffer slots and the cross-slot prefetch are used.

Tolerances: float32 ``1e-5``; bfloat16 ``2e-2`` (bf16 outputs, bf16 probabilities into
``p @ v``).

Peers: JAX's own TPU kernels, interpreted on the same pool contents in their layouts: the
decode kernel (``ops/tpu/paged_attention``) and the ragged paged attention kernel
(``ops/tpu/ragged_paged_attention``; jax 0.10.2's interpreter needs two test-side patches
for it, ``jax_rpa_interpret.py``, and a test pins that the stock one still fails). Lowering: both kernels lowered for
TPU from this CPU machine at Llama-3-8B and SmolLM2 shapes hold one ``tpu_custom_call``
(Mosaic's layout passes run only in libtpu, on a TPU: not checked here).
"""

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_paged_attention
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention as jax_rpa
from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention as jax_rpa_ref

from jax_rpa_interpret import rpa_interpreter_patches
from jaxpaged.pallas.tpu_common import default_pages_per_block
from jaxpaged.pallas.tpu_paged_attention import auto_num_splits, tpu_paged_decode_attention
from jaxpaged.pallas.tpu_ragged_paged_attention import default_block_q, tpu_ragged_paged_attention
import test_kernels
from test_kernels import KVH, LAYER, ref_decode, ref_ragged

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
PPB = 2  # pages per compute block in the numeric tests: several blocks per long row


def decode_contexts(bs):
    return [1, 3, bs - 1, bs, bs + 1, 2 * bs + 5, 5 * bs + 3, 0]


def ragged_chunks(bs):
    """(cached, new) per sequence: single tokens, chunks starting mid-block after a cached
    prefix, a decode row in the mixed batch, a zero-length row, a fresh multi-block prefill."""
    return [(0, 1), (0, 3), (bs - 3, 2), (bs - 1, 1), (0, 0), (3, bs - 2), (2 * bs + 1, 1), (bs + 3, 5),
            (0, 2 * bs + 3)]


def decode_case(seed, *, block_size, **kw):
    """test_kernels' scattered pool and queries, at the shorter contexts interpret mode affords."""
    return test_kernels.decode_case(seed, block_size=block_size, contexts=decode_contexts(block_size), **kw)


def ragged_case(seed, *, block_size, **kw):
    return test_kernels.ragged_case(seed, block_size=block_size, chunks=ragged_chunks(block_size), **kw)


def assert_matches(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    np.testing.assert_allclose(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


# Every block size, GQA ratio, head_dim and dtype appears; not the whole cross-product
# (the interpreter is slow).
CASES = [
    dict(block_size=8, ratio=1, head_dim=64, dtype=jnp.float32),
    dict(block_size=16, ratio=3, head_dim=64, dtype=jnp.float32),
    dict(block_size=32, ratio=4, head_dim=128, dtype=jnp.float32),
    dict(block_size=64, ratio=8, head_dim=128, dtype=jnp.float32),
    dict(block_size=16, ratio=3, head_dim=64, dtype=jnp.bfloat16),
    dict(block_size=8, ratio=4, head_dim=128, dtype=jnp.bfloat16),
    dict(block_size=32, ratio=8, head_dim=64, dtype=jnp.bfloat16),
]


def case_id(c):
    return f"bs{c['block_size']}-r{c['ratio']}-d{c['head_dim']}-{jnp.dtype(c['dtype']).name}"


def scale_for(c):
    return c["head_dim"] ** -0.5


@functools.cache
def decode_inputs(cid):
    case = next(c for c in CASES if case_id(c) == cid)
    args = decode_case(zlib.crc32(cid.encode()), **case)
    return args, ref_decode(*args, scale=scale_for(case))


@functools.cache
def ragged_inputs(cid):
    case = next(c for c in CASES if case_id(c) == cid)
    args, positions = ragged_case(zlib.crc32(cid.encode()) + 1, **case)
    return args, ref_ragged(*args, positions, scale=scale_for(case))


@pytest.mark.parametrize("num_splits", [1, 3], ids=["single-pass", "split-k-3"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_decode_matches_reference(case, num_splits):
    # 3 partitions of a padded 8-page table: short rows leave partitions empty (l = 0).
    args, ref = decode_inputs(case_id(case))
    out = tpu_paged_decode_attention(*args, scale=scale_for(case), num_splits=num_splits,
                                     pages_per_block=PPB)
    assert_matches(out, ref, case["dtype"])


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_ragged_matches_reference(case):
    # The smallest legal query block: several blocks per prefill chunk, chunks cut mid-block.
    args, ref = ragged_inputs(case_id(case))
    block_q = 8 // math.gcd(case["ratio"], 8)
    out = tpu_ragged_paged_attention(*args, scale=scale_for(case), block_q=block_q, pages_per_block=PPB)
    assert_matches(out, ref, case["dtype"])


@pytest.mark.parametrize("kernel", ["decode", "ragged"])
def test_default_tiles_match_reference(kernel):
    """Default pages_per_block (the whole table in one block here) and default block_q."""
    case = CASES[1]
    if kernel == "decode":
        args, ref = decode_inputs(case_id(case))
        out = tpu_paged_decode_attention(*args, scale=scale_for(case))
    else:
        args, ref = ragged_inputs(case_id(case))
        out = tpu_ragged_paged_attention(*args, scale=scale_for(case))
    assert_matches(out, ref, case["dtype"])


def test_no_races_under_race_detection_on_two_cores():
    """Both kernels under the interpreter's happens-before race detector, the parallel
    grid split over two simulated cores (megacore), DMAs executed eagerly at start."""
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, dma_execution_mode="eager")
    case = CASES[1]
    args, ref = decode_inputs(case_id(case))
    out = tpu_paged_decode_attention(*args, scale=scale_for(case), num_splits=2, pages_per_block=PPB,
                                     interpret=params)
    assert_matches(out, ref, case["dtype"])
    assert not mosaic_interpret.races.races_found
    args, ref = ragged_inputs(case_id(case))
    out = tpu_ragged_paged_attention(*args, scale=scale_for(case), block_q=8, pages_per_block=PPB,
                                     interpret=params)
    assert_matches(out, ref, case["dtype"])
    assert not mosaic_interpret.races.races_found


def test_race_detector_catches_a_read_before_the_dma_wait():
    """The control for the test above: reading a DMA's destination before waiting is a race."""
    def kernel(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem)
        copy.start()
        o_ref[...] = buf[...]
        copy.wait()

    call = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
                          in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
                          scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(())],
                          interpret=pltpu.InterpretParams(detect_races=True))
    try:
        call(jnp.ones((8, 128))).block_until_ready()
    except jax.errors.JaxRuntimeError as e:  # jax 0.12 raises at the race; 0.10 and 0.11 record it
        assert "RACE DETECTED" in str(e)
    else:
        assert mosaic_interpret.races.races_found


def to_jax_rpa_layout(k, v):
    """One layer of jaxpaged's pool as JAX's RPA pages: [NB, BS, 2 * KVH, D], K and V
    heads interleaved (combined head 2h is K head h, 2h + 1 its V)."""
    nb, _, bs, d = k.shape[1:]
    kv = jnp.stack([k[LAYER].transpose(0, 2, 1, 3), v[LAYER].transpose(0, 2, 1, 3)], axis=3)
    return kv.reshape(nb, bs, 2 * KVH, d)


RPA_CASES = [dict(block_size=16, ratio=3, dtype=jnp.float32), dict(block_size=64, ratio=8, dtype=jnp.float32),
             dict(block_size=16, ratio=3, dtype=jnp.bfloat16), dict(block_size=8, ratio=4, dtype=jnp.bfloat16)]


@pytest.mark.parametrize("case", RPA_CASES, ids=lambda c: f"bs{c['block_size']}-r{c['ratio']}-"
                                                          f"{jnp.dtype(c['dtype']).name}")
def test_ragged_agrees_with_jax_ragged_paged_attention_kernel(case):
    """JAX's RPA kernel and ours, both in TPU interpret mode (NaN-filled scratch), on the same
    pool contents converted to its layout; both against JAX's RPA oracle too.

    Its kernel needs head_dim a multiple of 128 and ``kv_len >= 1`` for every sequence below
    ``num_seqs`` (a zero-length row in the middle leaves its prefetch chain one transfer
    behind and the next sequence reads the null page): it gets the batch without the
    zero-length padding row, which computes the same tokens."""
    (q, k, v, layer, tables, lens, qsl), _ = ragged_case(7, head_dim=128, **case)
    keep = np.asarray(lens) > 0
    their_meta = (jnp.asarray(np.asarray(lens)[keep]), jnp.asarray(np.asarray(tables)[keep]),
                  jnp.asarray(np.concatenate([[0], np.cumsum(np.diff(np.asarray(qsl))[keep])]), jnp.int32),
                  jnp.array([int(keep.sum())], jnp.int32))
    kv = to_jax_rpa_layout(k, v)
    with rpa_interpreter_patches(), pltpu.force_tpu_interpret_mode(pltpu.InterpretParams(uninitialized_memory="nan")):
        theirs = jax_rpa(q, kv, *their_meta, sm_scale=0.1, num_kv_pages_per_block=PPB,
                         num_queries_per_block=8).block_until_ready()
    ours = tpu_ragged_paged_attention(q, k, v, layer, tables, lens, qsl, scale=0.1, block_q=8, pages_per_block=PPB)
    # Its oracle loops over sequences in Python: with the metadata as numpy constants it
    # traces into one jitted computation (op-by-op it compiles every op, ~10 s).
    meta = [np.asarray(x) for x in their_meta]
    oracle = jax.jit(lambda q, kv: jax_rpa_ref(q, kv, *meta, sm_scale=0.1))(q, kv)
    n = int(qsl[-1])
    assert_matches(ours[:n], theirs[:n], case["dtype"])
    assert_matches(theirs[:n], oracle, case["dtype"])
    assert_matches(ours[:n], oracle, case["dtype"])


def test_jax_ragged_paged_attention_kernel_needs_the_patched_interpreter():
    """The stock TPU interpreter of jax 0.10.2 (and of 0.11.2, tried on Python 3.12) cannot
    read through a reshaped ref, which JAX's RPA kernel does for its interleaved K/V
    buffer. When this starts failing, drop ``jax_rpa_interpret``'s patches."""
    (q, k, v, layer, tables, lens, qsl), _ = ragged_case(7, block_size=16, ratio=3, head_dim=128,
                                                         dtype=jnp.float32)
    with pytest.raises(Exception, match="ReshapeTransform"), pltpu.force_tpu_interpret_mode():
        jax_rpa(q, to_jax_rpa_layout(k, v), lens, tables, qsl, jnp.array([tables.shape[0]], jnp.int32),
                sm_scale=0.1, num_kv_pages_per_block=2, num_queries_per_block=8).block_until_ready()
    mosaic_interpret.reset_tpu_interpret_mode_state()  # the failed run leaves its state behind


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_agrees_with_jax_tpu_paged_attention_kernel(dtype):
    """JAX's TPU decode kernel (``ops/tpu/paged_attention``), interpreted, on the same
    pool contents in its layout ``[KVH, NB, BS, D]`` (one layer).

    Two adjustments: JAX's kernel multiplies masked probabilities (0) by V, so NaN in
    stale slots would leak: the unowned slots hold finite junk here instead. And it casts
    K and V to bf16 whatever their dtype: the float32 pool holds bf16-representable
    values, so that cast is exact and float32 tolerance still applies."""
    q, k, v, layer, tables, lens = decode_case(3, block_size=16, ratio=4, head_dim=128, dtype=dtype)
    bf16_exact = lambda x, junk: jnp.where(jnp.isnan(x), junk, x).astype(jnp.bfloat16).astype(dtype)
    q, k, v = bf16_exact(q, 0.0), bf16_exact(k, 3.0), bf16_exact(v, -5.0)
    width = pl.cdiv(tables.shape[1], PPB) * PPB  # its table width must be whole compute blocks
    with pltpu.force_tpu_interpret_mode():
        theirs = jax_paged_attention(q * 0.1, k[LAYER].transpose(1, 0, 2, 3), v[LAYER].transpose(1, 0, 2, 3),
                                     lens, jnp.pad(tables, ((0, 0), (0, width - tables.shape[1]))),
                                     pages_per_compute_block=PPB)
    ours = tpu_paged_decode_attention(q, k, v, layer, tables, lens, scale=0.1, pages_per_block=PPB)
    assert_matches(ours, theirs, dtype)


# ---------------------------------------------------------------- lowering for TPU

SHAPES = {"llama3-8b": (32, 8, 128), "smollm2": (9, 3, 64)}  # (q heads, KV heads, head_dim)


def _lower_for_tpu(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("kernel", ["decode", "decode-split", "ragged"])
def test_lowers_to_mosaic(kernel, model, dtype):
    Hq, kvh, d = SHAPES[model]
    S, W, T = 8, 256, 512
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    pool = sds((32, 1024, kvh, 16, d), dtype)
    common = (pool, pool, sds((), i32), sds((S, W), i32), sds((S,), i32))
    if kernel == "ragged":
        f = functools.partial(tpu_ragged_paged_attention, scale=0.1, interpret=False)
        text = _lower_for_tpu(f, sds((T, Hq, d), dtype), *common, sds((S + 1,), i32))
    else:
        f = functools.partial(tpu_paged_decode_attention, scale=0.1, interpret=False,
                              num_splits=2 if kernel == "decode-split" else 1)
        text = _lower_for_tpu(f, sds((S, Hq, d), dtype), *common)
    assert text.count("tpu_custom_call") == 1
    assert "triton" not in text


# ---------------------------------------------------------------- tile rules and input checks


def test_tile_rules():
    # ~512 keys per block, capped by the table and by the VMEM budget for the K/V slots.
    assert default_pages_per_block(16, 8, 128, jnp.bfloat16, 1024) == 32
    assert default_pages_per_block(16, 8, 128, jnp.bfloat16, 5) == 5
    assert default_pages_per_block(16, 32, 256, jnp.float32, 1024) == 4
    # ~128 query rows, whole bf16 sublane tiles, no more than the batch holds.
    assert [default_block_q(g, 4096) * g for g in (1, 3, 4, 8)] == [128, 144, 128, 128]
    assert default_block_q(3, 5) == 16
    # Split only long tables, and only while sequences are fewer than the cores.
    assert auto_num_splits(8192, 1) == 2
    assert auto_num_splits(8192, 2) == 1
    assert auto_num_splits(1024, 1) == 1


@pytest.fixture(scope="module")
def small_decode():
    return decode_case(5, block_size=8, ratio=3, head_dim=64, dtype=jnp.float32)


def test_rejects_block_size_not_multiple_of_8(small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="block_size=4 must be a multiple of 8 on TPU"):
        tpu_paged_decode_attention(q, k[..., :4, :], v[..., :4, :], layer, bt, lens, scale=0.1)


def test_rejects_query_block_of_partial_sublane_tiles(small_decode):
    q, k, v, layer, bt, lens = small_decode
    qsl = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)
    with pytest.raises(ValueError, match="block_q=2 times the group of 3 query heads"):
        tpu_ragged_paged_attention(q, k, v, layer, bt, lens, qsl, scale=0.1, block_q=2)


@pytest.mark.parametrize("knob", ["num_splits", "pages_per_block"])
def test_rejects_non_positive_knobs(small_decode, knob):
    with pytest.raises(ValueError, match=f"{knob}=0 must be >= 1"):
        tpu_paged_decode_attention(*small_decode, scale=0.1, **{knob: 0})


def test_shares_the_common_input_checks(small_decode):
    q, k, v, layer, bt, lens = small_decode
    with pytest.raises(ValueError, match="num_heads=5 is not a multiple of num_kv_heads=2"):
        tpu_paged_decode_attention(q[:, :5], k, v, layer, bt, lens, scale=0.1)
    with pytest.raises(ValueError, match=f"block table entry {k.shape[1]} is outside the pool"):
        tpu_paged_decode_attention(q, k, v, layer, bt.at[1, 0].set(k.shape[1]), lens, scale=0.1)
