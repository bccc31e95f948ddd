"""Host memory in transparent huge pages, for the CPU form's weights and the KV pool (Linux).

A CPU decode step reads every weight (~540 MB for the default model in float32) and, through
the attention's gathers, scattered 16 KB tiles of the pool. In 4 KB pages that is one TLB
miss per 4 KB, and in a virtual machine each miss walks two page tables (guest and host). In
2 MB pages the misses all but vanish. On a 2-vCPU Intel Xeon VM (Firecracker, THP in
``madvise`` mode, as most distributions ship it), the engine's single-stream decode went from
29.0-30.6 to 27.6-28.9 ms a token with the weights in one huge-page region and the
embedding and the pool in huge pages (alternating processes; the same tokens; in a slower
sitting later 32.4-34.9 -> 29.6-30.3); the 48-request decode batch did not move. Every buffer
of the process in huge pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, which jaxpaged
cannot set for a running process: XLA's temporary buffers too) measured 26.7-27.8; with this
module in place it adds nothing measurable (2026-11-27, the twenty-sixth session).

Two ways in:

- :func:`host_arrays`: host arrays in one anonymous mapping advised ``MADV_HUGEPAGE`` before
  it is first touched (so the kernel backs it with huge pages as it faults it in), filled and
  then handed to jax without a copy (``jax.device_put`` of a host array aliases it on CPU).
  One region for all the weights: per-array buffers lose up to 2 MB at each end to alignment,
  which for the default model's ~1-7 MB projections is half of them.
- :func:`collapse`: huge pages for buffers jax already allocated: the embedding (copied into
  huge pages by ``MADV_COLLAPSE``, Linux 6.1+) and the KV pool, which is donated to every step
  and so must stay jax's own (a step updates it in place, so its address, and its huge pages,
  last); a new pool is all zeros, so its pages are dropped and come back huge when written.

Both fall back to doing nothing where huge pages are unavailable (not Linux, THP ``never``,
an older kernel). ``JAXPAGED_HUGE_PAGES=0`` turns both off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
import os
import sys
from collections.abc import Iterable, Sequence

import numpy as np

HUGE_PAGE = 2 << 20
_MADV_COLLAPSE = 25  # linux/mman.h; not in Python's mmap module
_ALIGN = 64  # bytes between arrays in a region: XLA:CPU's buffer alignment


@functools.cache
def available() -> bool:
    """Whether this process can get transparent huge pages by asking (``madvise``)."""
    if os.environ.get("JAXPAGED_HUGE_PAGES", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


@functools.cache
def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc


def region(nbytes: int) -> np.ndarray:
    """A zeroed ``uint8`` host array of ``nbytes``, starting on a 2 MB boundary, in memory
    advised ``MADV_HUGEPAGE`` before its first touch. It keeps its mapping alive."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: plain pages
        pass
    buf = np.frombuffer(m, np.uint8)
    start = -buf.ctypes.data % HUGE_PAGE
    return buf[start:start + nbytes]


def host_arrays(specs: Sequence[tuple[tuple[int, ...], np.dtype]], device) -> list[np.ndarray]:
    """Writable host arrays of the given ``(shape, dtype)``s, to fill and then hand to
    ``jax.device_put(a, device)``: on a CPU device with huge pages available, views into one
    :func:`region` (which ``device_put`` then aliases rather than copies: jax keeps the view,
    and so the mapping, alive); otherwise plain ``np.empty`` arrays."""
    if not (available() and getattr(device, "platform", None) == "cpu"):
        return [np.empty(shape, dtype) for shape, dtype in specs]
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs]
    offsets = np.cumsum([0] + [-(-n // _ALIGN) * _ALIGN for n in sizes])
    buf = region(int(offsets[-1]))
    return [buf[o:o + n].view(dtype).reshape(shape) for (shape, dtype), o, n in zip(specs, offsets, sizes)]


def collapse(arrays: Iterable, *, zeros: bool = False) -> int:
    """Back the 2 MB-aligned interior of each CPU array's buffers (one per shard) with huge
    pages: ``MADV_HUGEPAGE``, then ``MADV_COLLAPSE``, which copies what is there into huge
    pages (Linux 6.1+; ~0.5 s for 1 GB here, up to 3 s when the kernel first has to compact
    memory). With ``zeros`` (the caller's promise that the arrays hold only zeros, as a new
    pool does) the pages are dropped instead (``MADV_DONTNEED``): they read as zeros again, and
    the kernel backs each with a huge page when a write first touches it, at no cost up front.
    Returns the bytes advised; 0 where huge pages are unavailable or the kernel refuses."""
    if not available():
        return 0
    libc = _libc()
    done = 0
    buffers = [shard.data for a in arrays for shard in a.addressable_shards]  # a pool sharded over CPU devices too
    for b in buffers:
        if b.device.platform != "cpu":
            continue
        b.block_until_ready()  # nothing may still be writing the memory advised
        ptr = b.unsafe_buffer_pointer()
        lo = -(-ptr // HUGE_PAGE) * HUGE_PAGE
        hi = (ptr + b.nbytes) // HUGE_PAGE * HUGE_PAGE
        if hi <= lo:
            continue
        if libc.madvise(lo, hi - lo, mmap.MADV_HUGEPAGE) != 0:
            continue
        if libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED if zeros else _MADV_COLLAPSE) == 0:
            done += hi - lo
    return done

