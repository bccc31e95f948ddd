"""float8 KV caches (``kv_cache_dtype="fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``), and 16-bit ones
held as bits on CPU.

The pool holds each value's float8 bytes (``pallas.common.FP8_STORAGE``). The oracle here is
independent of jaxpaged's conversions: ``ml_dtypes`` rounds the float32 values to float8 in
numpy and decodes them back, and the float32 reference attention runs on those decoded
values. Every kernel, reading the byte pool with float32 (or bfloat16) queries, must match
it at the float32 (bfloat16) tolerance: the only error a float8 cache may add is the
rounding of K and V, never one of its own.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.kv_cache import KVPool, copy_blocks, resolve_kv_cache_dtype, write_kv
from jaxpaged.pallas.paged_attention import paged_decode_attention
from jaxpaged.pallas.ragged_paged_attention import mixed_paged_attention, ragged_paged_attention
from jaxpaged.pallas.tpu_paged_attention import tpu_paged_decode_attention
from jaxpaged.pallas.tpu_ragged_paged_attention import tpu_ragged_paged_attention
from jaxpaged.pallas.xla import xla_paged_decode_attention, xla_ragged_paged_attention
import test_kernels
import test_tpu_kernels
from test_kernels import KVH, _lower_for_cuda, ref_decode, ref_ragged

FORMATS = {"fp8_e4m3": (ml_dtypes.float8_e4m3fn, np.uint8), "fp8_e5m2": (ml_dtypes.float8_e5m2, np.int8)}
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def encode(x: np.ndarray, fmt: str) -> np.ndarray:
    """float32 -> the pool's bytes, in numpy: clipped to the format's finite range, rounded."""
    fp8, storage = FORMATS[fmt]
    big = float(ml_dtypes.finfo(fp8).max)
    return np.clip(x, -big, big).astype(fp8).view(storage)


def decode(b: np.ndarray, fmt: str) -> np.ndarray:
    return b.view(FORMATS[fmt][0]).astype(np.float32)


def as_fp8_case(args, fmt: str, q_dtype):
    """A test_kernels batch with its pool in float8 bytes and, for the reference, the same
    pool decoded to float32 (NaN in the unowned slots survives both ways)."""
    q, k, v, *rest = args
    kb, vb = (encode(2.0 * np.asarray(x, np.float32), fmt) for x in (k, v))
    q32 = jnp.asarray(q, jnp.float32)
    fp8_args = (q32.astype(q_dtype), jnp.asarray(kb), jnp.asarray(vb), *rest)
    ref_args = (q32.astype(q_dtype).astype(jnp.float32), jnp.asarray(decode(kb, fmt)), jnp.asarray(decode(vb, fmt)),
                *rest)
    return fp8_args, ref_args


def check(out, ref, dtype):
    out = np.asarray(out, np.float32)
    assert np.all(np.isfinite(out)), "kernel output has NaN/inf"
    np.testing.assert_allclose(out, np.asarray(ref, np.float32), atol=TOL[dtype], rtol=TOL[dtype])


CASES = [("fp8_e4m3", jnp.float32), ("fp8_e5m2", jnp.float32), ("fp8_e4m3", jnp.bfloat16)]
GPU_DECODE = {"xla": xla_paged_decode_attention,
              "pallas_gpu": functools.partial(paged_decode_attention, interpret=True)}
GPU_RAGGED = {"xla": xla_ragged_paged_attention,
              "pallas_gpu": functools.partial(ragged_paged_attention, interpret=True),
              "pallas_gpu_mixed": functools.partial(mixed_paged_attention, interpret=True)}


@functools.cache
def decode_inputs(fmt, q_dtype, tpu: bool):
    shape = dict(block_size=32, ratio=3, head_dim=64, dtype=jnp.float32)
    args = (test_tpu_kernels if tpu else test_kernels).decode_case(11, **shape)
    fp8_args, ref_args = as_fp8_case(args, fmt, q_dtype)
    return fp8_args, ref_decode(*ref_args, scale=0.125)


@functools.cache
def ragged_inputs(fmt, q_dtype, tpu: bool):
    shape = dict(block_size=32, ratio=3, head_dim=64, dtype=jnp.float32)
    args, positions = (test_tpu_kernels if tpu else test_kernels).ragged_case(12, **shape)
    fp8_args, ref_args = as_fp8_case(args, fmt, q_dtype)
    return fp8_args, ref_ragged(*ref_args, positions, scale=0.125)


@pytest.mark.parametrize("impl", GPU_DECODE)
@pytest.mark.parametrize("fmt, q_dtype", CASES, ids=lambda x: getattr(x, "__name__", x))
def test_decode_kernels_read_float8_pools(impl, fmt, q_dtype):
    (q, *rest), ref = decode_inputs(fmt, q_dtype, False)
    check(GPU_DECODE[impl](q, *rest, scale=0.125), ref.astype(q_dtype), q_dtype)


@pytest.mark.parametrize("impl", GPU_RAGGED)
@pytest.mark.parametrize("fmt, q_dtype", CASES, ids=lambda x: getattr(x, "__name__", x))
def test_ragged_kernels_read_float8_pools(impl, fmt, q_dtype):
    (q, *rest), ref = ragged_inputs(fmt, q_dtype, False)
    check(GPU_RAGGED[impl](q, *rest, scale=0.125), ref.astype(q_dtype), q_dtype)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="native Pallas kernels need a GPU")
@pytest.mark.parametrize("fmt, q_dtype", CASES, ids=lambda x: getattr(x, "__name__", x))
def test_native_gpu_kernels_read_float8_pools(fmt, q_dtype):
    """The Triton kernels compiled for the GPU (scripts/gpu_checks.sh runs these where one is lent)."""
    (q, *rest), ref = decode_inputs(fmt, q_dtype, False)
    check(paged_decode_attention(q, *rest, scale=0.125, interpret=False), ref.astype(q_dtype), q_dtype)
    (q, *rest), ref = ragged_inputs(fmt, q_dtype, False)
    for fn in (ragged_paged_attention, mixed_paged_attention):
        check(fn(q, *rest, scale=0.125, interpret=False), ref.astype(q_dtype), q_dtype)


@pytest.mark.parametrize("fmt, q_dtype", CASES[:2], ids=lambda x: getattr(x, "__name__", x))
def test_tpu_kernels_read_float8_pools(fmt, q_dtype):
    """TPU interpret mode (simulated DMAs into byte VMEM slots), several compute blocks a row."""
    (q, *rest), ref = decode_inputs(fmt, q_dtype, True)
    check(tpu_paged_decode_attention(q, *rest, scale=0.125, num_splits=2, pages_per_block=2), ref, q_dtype)
    (q, *rest), ref = ragged_inputs(fmt, q_dtype, True)
    check(tpu_ragged_paged_attention(q, *rest, scale=0.125, block_q=8, pages_per_block=2), ref, q_dtype)


def test_kernels_lower_for_cuda_and_tpu_with_a_float8_pool():
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    S, W, T = 8, 64, 128
    for storage in (jnp.uint8, jnp.int8):
        pool = sds((4, 256, 3, 32, 64), storage)
        tail = (pool, pool, sds((), i32), sds((S, W), i32), sds((S,), i32))
        for q_dtype in (jnp.bfloat16, jnp.float32):
            dec = functools.partial(paged_decode_attention, scale=0.1, interpret=False)
            assert "__gpu$xla.gpu.triton" in _lower_for_cuda(dec, sds((S, 9, 64), q_dtype), *tail)
            rag = functools.partial(ragged_paged_attention, scale=0.1, interpret=False)
            assert "__gpu$xla.gpu.triton" in _lower_for_cuda(rag, sds((T, 9, 64), q_dtype), *tail, sds((S + 1,), i32))
            for f, q in ((functools.partial(tpu_paged_decode_attention, scale=0.1, interpret=False), (S, 9, 64)),
                         (functools.partial(tpu_ragged_paged_attention, scale=0.1, interpret=False), (T, 9, 64))):
                args = (sds(q, q_dtype), *tail) + ((sds((S + 1,), i32),) if len(q) and q[0] == T else ())
                text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
                assert text.count("tpu_custom_call") == 1


def test_tpu_kernels_refuse_float8_pages_of_partial_tiles():
    (q, k, v, *rest), _ = decode_inputs("fp8_e4m3", jnp.float32, True)
    with pytest.raises(ValueError, match="block_size=16 must be a multiple of 32 on TPU for a uint8 pool"):
        tpu_paged_decode_attention(q, k[..., :16, :], v[..., :16, :], *rest, scale=0.1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_write_kv_rounds_and_saturates_as_ml_dtypes(fmt):
    storage = resolve_kv_cache_dtype(fmt, jnp.float32, "cpu")
    assert storage == FORMATS[fmt][1]
    rng = np.random.default_rng(3)
    kv = KVPool(jnp.zeros((2, 6, 3, 4, 8), storage), jnp.zeros((2, 6, 3, 4, 8), storage))
    k = rng.standard_normal((5, 3, 8)).astype(np.float32) * 50
    k[0, 0, :4] = [1e6, -1e6, 3e-9, np.nan]  # past the range, below the smallest subnormal, NaN
    v = rng.standard_normal((5, 3, 8)).astype(np.float32)
    slots = np.array([4, 5, 9, 22, 23], np.int32)
    kv = jax.jit(write_kv)(kv, jnp.int32(1), jnp.asarray(k), jnp.asarray(v), jnp.asarray(slots))
    for got, want in ((kv.k, k), (kv.v, v)):
        got = np.asarray(got)[1].transpose(0, 2, 1, 3).reshape(-1, 3, 8)[slots]
        np.testing.assert_array_equal(got, encode(want, fmt))
    big = float(ml_dtypes.finfo(FORMATS[fmt][0]).max)
    assert decode(np.asarray(kv.k)[1, 1, 0, 0, :2], fmt).tolist() == [big, -big]
    # Copy-on-write moves the bytes unchanged.
    copied = copy_blocks(kv, jnp.asarray([1, 5]), jnp.asarray([3, 2]))
    np.testing.assert_array_equal(np.asarray(copied.k)[:, 3], np.asarray(kv.k)[:, 1])


def test_a_bad_query_dtype_is_named():
    (q, *rest), _ = decode_inputs("fp8_e4m3", jnp.float32, False)
    with pytest.raises(ValueError, match="q dtype int32: a float8 pool"):
        xla_paged_decode_attention(q.astype(jnp.int32), *rest, scale=0.1)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_pool_on_cpu_holds_bits_and_reads_as_the_native_one(dtype):
    """On CPU a 16-bit pool holds its values' bits (XLA:CPU rewrites a whole 16-bit float array
    for each scatter into it): its writes and the XLA path's outputs are bit for bit the
    native pool's."""
    storage = resolve_kv_cache_dtype(dtype, jnp.float32, "cpu")
    assert storage == {"bfloat16": jnp.uint16, "float16": jnp.int16}[dtype]
    assert resolve_kv_cache_dtype(dtype, jnp.float32, "gpu") == jnp.dtype(dtype)
    (q, k, v, *rest), _ = decode_inputs("fp8_e4m3", jnp.float32, False)
    native = [jnp.asarray(decode(np.asarray(x), "fp8_e4m3"), dtype) for x in (k, v)]
    bits = [jax.lax.bitcast_convert_type(x, storage) for x in native]
    q = q.astype(dtype)
    np.testing.assert_array_equal(np.asarray(xla_paged_decode_attention(q, *bits, *rest, scale=0.125)),
                                  np.asarray(xla_paged_decode_attention(q, *native, *rest, scale=0.125)))
    rng = np.random.default_rng(4)
    new = jnp.asarray(rng.standard_normal((3, KVH, 64)), jnp.float32)
    slots = jnp.asarray([5, 40, 77], jnp.int32)
    a = write_kv(KVPool(*bits), jnp.int32(1), new, new, slots)
    b = write_kv(KVPool(*native), jnp.int32(1), new, new, slots)
    np.testing.assert_array_equal(np.asarray(a.k), np.asarray(jax.lax.bitcast_convert_type(b.k, storage)))


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def fp8_reference(tiny_engine_model, prompts):
    """A float8 engine with room for everything: each prompt's tokens."""
    llm = LLM(tiny_engine_model, kv_cache_dtype="fp8", kv_cache_memory="4MiB", enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [rng.integers(3, 250, n).tolist() for n in (5, 17, 40, 3, 29, 12)]


def test_a_float8_pool_holds_four_times_a_float32_ones_tokens(tiny_engine_model):
    f32 = LLM(tiny_engine_model, kv_cache_memory="4MiB", enable_prefix_caching=False)
    fp8 = LLM(tiny_engine_model, kv_cache_dtype="fp8", kv_cache_memory="4MiB", enable_prefix_caching=False)
    assert (f32.runner.kv.k.dtype, fp8.runner.kv.k.dtype) == (jnp.float32, jnp.uint8)
    assert fp8.bm.num_usable_blocks + 1 == 4 * (f32.bm.num_usable_blocks + 1)


@pytest.mark.parametrize("options, expect", [
    (dict(num_blocks=14, preemption_mode="recompute"), "num_preemptions"),
    (dict(num_blocks=14, preemption_mode="swap", swap_space=1 << 20), "num_swapped_out_blocks"),
    (dict(num_blocks=40, enable_prefix_caching=True), "prefix_cache_hits"),
], ids=["recompute", "swap", "prefix-cache"])
def test_float8_pool_under_pressure_gives_the_roomy_engines_tokens(tiny_engine_model, prompts, fp8_reference,
                                                                   options, expect):
    """Preemption (recomputed, or swapped out and in through host bytes) and prefix-cache
    hits keep each request's float8 K/V, so its tokens are those it gets with room to spare."""
    llm = LLM(tiny_engine_model, kv_cache_dtype="fp8", block_size=8, max_num_batched_tokens=32,
              **(dict(enable_prefix_caching=False) | options))
    twice = prompts + prompts[:2]  # with prefix caching the repeats hit the cache
    outs = llm.generate(twice, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == fp8_reference + fp8_reference[:2]
    s = llm.stats()
    assert s[expect] > 0, s
    assert s["num_used_blocks"] == 0 and s["num_host_blocks_used"] == 0, s
    llm.bm.check_invariants()


def test_the_command_lines_offer_every_kv_cache_dtype():
    from jaxpaged.cli import build_parser, engine_kwargs
    from jaxpaged.kv_cache import KV_CACHE_DTYPES
    from jaxpaged.serve import build_parser as serve_parser

    for parser in (build_parser(), serve_parser()):
        action = next(a for a in parser._actions if a.dest == "kv_cache_dtype")
        assert tuple(action.choices) == KV_CACHE_DTYPES
    assert engine_kwargs(build_parser().parse_args(["hi", "--kv-cache-dtype", "fp8"]))["kv_cache_dtype"] == "fp8"


def test_a_float8_pool_under_the_tpu_kernels_gets_blocks_of_32_by_default():
    from jaxpaged.engine_args import default_block_size

    assert default_block_size("tpu", "auto", "fp8") == default_block_size("cpu", "pallas_tpu", "fp8_e5m2") == 32
    assert default_block_size("tpu", "auto", "bfloat16") == default_block_size("gpu", "auto", "fp8") == 16
    assert default_block_size("cpu", "auto", "fp8") == 64
