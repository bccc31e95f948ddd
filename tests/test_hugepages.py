"""Huge-page host memory for the CPU form (jaxpaged.hugepages): arrays laid out in one region and
aliased by jax, the fallback without huge pages, and the pool keeping its (collapsed) buffer."""

import gc

import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams, hugepages

CPU = jax.devices("cpu")[0]
SPECS = [((3, 5), np.float32), ((1000, 7), np.float32), ((4,), np.int32), ((257, 129), np.float32)]


@pytest.fixture
def huge_pages(monkeypatch, request):
    """``hugepages.available()`` forced to the test's parameter."""
    monkeypatch.setattr(hugepages, "available", lambda: request.param)
    return request.param


@pytest.mark.parametrize("huge_pages", [True, False], indirect=True)
def test_host_arrays_are_filled_then_handed_to_jax(huge_pages):
    """With huge pages: consecutive views of one region starting on a 2 MB boundary, 64-byte
    aligned, which ``device_put`` aliases and keeps alive after every host reference is gone.
    Without: plain host arrays. The values arrive either way."""
    rng = np.random.default_rng(0)
    host = hugepages.host_arrays(SPECS, CPU)
    assert [(a.shape, a.dtype) for a in host] == [(s, np.dtype(d)) for s, d in SPECS]
    ptrs = [a.ctypes.data for a in host]
    if huge_pages:
        assert ptrs[0] % hugepages.HUGE_PAGE == 0
        assert all(p % 64 == 0 for p in ptrs) and ptrs == sorted(ptrs)
        assert all(b - a >= h.nbytes for a, b, h in zip(ptrs, ptrs[1:], host))
        assert len({id(a.base.base) for a in host}) == 1  # views of the same region
    want = []
    for a in host:
        a[...] = rng.integers(-100, 100, a.shape).astype(a.dtype)
        want.append(a.copy())
    arrays = [jax.device_put(a, CPU) for a in host]
    if huge_pages:  # (jax may alias an aligned plain host array as well)
        assert [x.unsafe_buffer_pointer() for x in arrays] == ptrs
    del host, a
    gc.collect()
    _ = [np.ones(1 << 20, np.float32) for _ in range(8)]  # reuse memory a freed region would have left
    for x, w in zip(arrays, want):
        np.testing.assert_array_equal(np.asarray(x), w)


def test_huge_pages_can_be_turned_off(monkeypatch):
    hugepages.available.cache_clear()
    monkeypatch.setenv("JAXPAGED_HUGE_PAGES", "0")
    try:
        assert not hugepages.available()
        assert hugepages.collapse([jax.device_put(np.ones(1 << 20, np.float32), CPU)]) == 0
        assert all(a.base is None for a in hugepages.host_arrays(SPECS, CPU))  # np.empty: owns its memory
    finally:
        hugepages.available.cache_clear()


def test_collapse_keeps_the_values():
    """``MADV_COLLAPSE`` of an 8 MB buffer's aligned interior: whole huge pages, the contents
    unchanged. (How many it collapses is the kernel's call: it may find no free huge page.)"""
    x = jax.jit(lambda a: a + 1.0)(np.random.default_rng(1).standard_normal((2048, 1024), np.float32))
    want = np.asarray(x).copy()
    done = hugepages.collapse([x])
    assert done % hugepages.HUGE_PAGE == 0 and done <= x.nbytes
    np.testing.assert_array_equal(np.asarray(x), want)


def test_dropped_zero_pages_read_as_zeros_and_take_writes():
    """``collapse(zeros=True)``: the pages of an all-zero buffer are dropped; it still reads as
    zeros, and a donated in-place update writes into it."""
    x = jax.device_put(np.zeros((2048, 1024), np.float32), CPU)
    x = jax.jit(lambda a: a * 0.0)(x)  # a buffer of jax's own
    done = hugepages.collapse([x], zeros=True)
    assert done % hugepages.HUGE_PAGE == 0 and (done > 0) == hugepages.available()
    assert not np.asarray(x).any()
    ptr = x.unsafe_buffer_pointer()
    y = jax.jit(lambda a: a.at[1000:1010].set(7.0), donate_argnums=0)(x)
    assert y.unsafe_buffer_pointer() == ptr
    want = np.zeros((2048, 1024), np.float32)
    want[1000:1010] = 7.0
    np.testing.assert_array_equal(np.asarray(y), want)


def test_the_pool_keeps_its_buffer_across_steps(tiny_engine_model):
    """The pool's pages are dropped once, when the runner makes it (zeros); steps update the
    donated pool in place, so its buffer (and the huge pages it faults in) stay for the
    engine's life."""
    llm = LLM(tiny_engine_model, block_size=8, num_blocks=64)
    ptrs = (llm.runner.kv.k.unsafe_buffer_pointer(), llm.runner.kv.v.unsafe_buffer_pointer())
    llm.generate([[5, 6, 7] * 5, [9, 10]], SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert (llm.runner.kv.k.unsafe_buffer_pointer(), llm.runner.kv.v.unsafe_buffer_pointer()) == ptrs
