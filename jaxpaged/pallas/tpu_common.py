"""What jaxpaged's Mosaic (TPU) kernels share: the page pipeline and its tile rules.

Used by :mod:`.tpu_paged_attention` (decode, split-K) and
:mod:`.tpu_ragged_paged_attention` (prefill, chunked prefill, mixed batches), which keep
the signatures and semantics of the Triton kernels but are written for how a TPU works:
the grid runs sequentially on each TensorCore, memory moves by explicit DMAs, and
vectors are (8 sublanes x 128 lanes) tiles.

**What a program reads.** Scalars, prefetched into SMEM before the grid starts
(``PrefetchScalarGridSpec``): lengths or query-block descriptors, and the block table
flattened to one row-major ``[S * W]`` vector (a 2-D SMEM array pads its rows); the
layer is folded into the ids (``layer * NB + block``) and entries past a sequence's
length point at the layer's null block. Its queries, ``[KVH, rows, D]`` (the query heads
of each KV head as rows), arrive through a BlockSpec in VMEM. The pool, viewed as
``[L * NB, KVH, BS, D]`` (a free reshape), stays in HBM (``memory_space=pl.ANY``): a
program copies exactly the pages its sequence owns, one DMA per page for K and one for
V, each ``[KVH, BS, D]``: a block's heads are contiguous in jaxpaged's block-major pool,
so one descriptor brings every head and a program serves all KV heads.

**DMA schedule** (:func:`attend_pages`). Pages are consumed ``pages_per_block`` at a time
(a compute block of ``N = pages_per_block * BS`` keys) through two VMEM slots per K and V
(``[2, KVH, N, D]``): block ``c + 1``'s copies are started into the other slot before
waiting on block ``c``'s, so HBM streams the next pages while the MXU works on these.
Pages past the sequence's length are neither copied nor waited for (the last block is
usually partial and moves no bytes for its tail); their stale slot contents are masked
with ``where``, never multiplied (a slot may hold NaN). The first block of a program is
exposed latency: JAX's kernels hide it by prefetching the next program's pages across
grid steps, which forces an ``"arbitrary"`` (sequential, one-core) grid; these kernels
keep their grids ``"parallel"`` (a megacore chip may split them) and pay one block's
latency per program, to be measured on a TPU.

**Online softmax** per KV head, in VMEM scratch: accumulator ``[KVH, rows, D]`` float32,
running max and sum ``[KVH, rows, 128]`` (lane-broadcast, as in JAX's kernels: Mosaic
slices vectors on lane-tile boundaries only). Logits and sums in float32; ``p @ v``
takes ``p`` in the pool dtype.

**Tile sizes.** :func:`default_pages_per_block`: ~``KEYS_PER_BLOCK`` (512) keys, so the
logits ``[rows, N]`` are lane-dense (N >= 128) and per-block fixed costs (DMA issue,
semaphore wait, rescale) are amortised over >= 256 KiB of K/V at Llama-3-8B shapes;
halved until the four K/V slots fit ``KV_VMEM_BUDGET`` (8 MiB, half of v5e's default
scoped VMEM, leaving room for queries, accumulators and logits); never more than a table
row holds. ``block_size`` must be a multiple of 8 so that every page starts on a sublane
tile of its slot (bf16 packs 16 rows per tile: 8-row bf16 pages are legal but not
tile-aligned, unmeasured). ``head_dim`` 64 is kept as is: every array keeps the full
head_dim as its last dimension (legal Mosaic block shapes) and Mosaic pads it to 128
lanes in VMEM, so no lane-unaligned slice is ever formed.

**Versus JAX's** ``ops/tpu/ragged_paged_attention``: it takes one layer's pages as
``[pages, page_size, 2 * KVH, D]`` (K and V heads interleaved, one DMA per page for both,
split again by strided loads and, for bf16, bit tricks), tokens as ``[T, Hq, D]`` tiles,
and a sequential grid that carries a sequence cursor and the prefetch across programs.
jaxpaged keeps K and V as separate ``[L, NB, KVH, BS, D]`` arrays (a block's write,
copy-on-write and swap are one slab each), reads the layer out of the stacked pool by
folding it into the page id, and regroups queries outside the kernel as ``[KVH, rows, D]``
tiles, so each head's products are plain 2-D matmuls. Its kernel also needs ``head_dim`` a
multiple of 128 (SmolLM2's 64 is refused) and no zero-length sequence below ``num_seqs``
(its cross-program prefetch then waits on the wrong transfer); jaxpaged takes both. On
the same pool contents, both interpreted, the two agree to ~2e-7 in float32
(``tests/test_tpu_kernels.py``).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxpaged.pallas import common

KEYS_PER_BLOCK = 512
KV_VMEM_BUDGET = 8 << 20
LANES = 128


HLO_INTERPRETER = "hlo"


def interpret_params(interpret) -> pltpu.InterpretParams | bool:
    """The ``interpret`` of the ``pallas_call``: ``None`` -> TPU interpret mode on CPU;
    ``True`` -> default ``InterpretParams()``; ``"hlo"`` (:data:`HLO_INTERPRETER`) ->
    Pallas' generic interpreter.

    TPU interpret mode simulates the memory spaces, DMAs and semaphores through ordered
    host callbacks; the generic interpreter runs each DMA as a plain copy and has no
    effects, which is what a ``lax.platform_dependent`` branch needs in jax 0.10.2 (the
    lowering of a step for TPU drops the CPU branch but not its effect tokens, and fails).
    """
    interpret = common.default_interpret() if interpret is None else interpret
    if interpret == HLO_INTERPRETER:
        return True
    return pltpu.InterpretParams() if interpret is True else interpret


def round_up(n: int, multiple: int) -> int:
    return pl.cdiv(n, multiple) * multiple


def sublane_rows(dtype) -> int:
    """Rows per vreg tile: 8 for 32-bit, 16 for bf16 (two rows packed per sublane), 32 for 8-bit."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def default_pages_per_block(block_size: int, num_kv_heads: int, head_dim: int, dtype, max_pages: int) -> int:
    """Pages per compute block: ~KEYS_PER_BLOCK keys, the 4 K/V slots within KV_VMEM_BUDGET."""
    ppb = max(1, KEYS_PER_BLOCK // block_size)
    slot_bytes = lambda p: p * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize
    while ppb > 1 and 4 * slot_bytes(ppb) > KV_VMEM_BUDGET:
        ppb //= 2
    return max(1, min(ppb, max_pages))


def check_tpu_shapes(block_size: int, dtype, what: str) -> None:
    rows = sublane_rows(dtype) if jnp.dtype(dtype).itemsize == 1 else 8  # a byte's tile: 32 rows
    if block_size % rows:
        raise ValueError(f"{what}: block_size={block_size} must be a multiple of {rows} on TPU for a "
                         f"{jnp.dtype(dtype).name} pool (a page must start on a sublane tile of its VMEM slot)")


def kv_scratch(num_kv_heads, rows, head_dim, keys, dtype):
    """K/V double buffers, their DMA semaphores, and the online-softmax state."""
    return [
        pltpu.VMEM((2, num_kv_heads, keys, head_dim), dtype),  # K slots
        pltpu.VMEM((2, num_kv_heads, keys, head_dim), dtype),  # V slots
        pltpu.SemaphoreType.DMA((2, 2)),  # [K or V, slot]
        pltpu.VMEM((num_kv_heads, rows, head_dim), jnp.float32),  # accumulator
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running max
        pltpu.VMEM((num_kv_heads, rows, LANES), jnp.float32),  # running sum
    ]


def _copy_pages(bt_ref, k_hbm, v_hbm, kbuf, vbuf, sems, *, table_off, page0, n_pages, slot, start: bool):
    """Start (or wait for) the copies of pages ``page0 ..`` of a table row into ``slot``.

    Pages at or past ``n_pages`` are skipped on both sides, so starts and waits pair up.
    """
    ppb, bs = kbuf.shape[2] // k_hbm.shape[2], k_hbm.shape[2]
    for i in range(ppb):
        @pl.when(page0 + i < n_pages)
        def _(i=i):
            pid = bt_ref[table_off + page0 + i]
            for j, (hbm, buf) in enumerate(((k_hbm, kbuf), (v_hbm, vbuf))):
                copy = pltpu.make_async_copy(hbm.at[pid], buf.at[slot, :, pl.ds(i * bs, bs), :],
                                             sems.at[j, slot])
                copy.start() if start else copy.wait()


def _attend_block(q_ref, kbuf, vbuf, acc_ref, m_ref, l_ref, *, slot, key0, row_pos, kv_len, scale):
    """One compute block of keys ``key0 .. key0 + N`` for every KV head, online softmax."""
    num_kv_heads, rows, _ = q_ref.shape
    keys = kbuf.shape[2]
    key_pos = key0 + lax.broadcasted_iota(jnp.int32, (1, keys), 1)
    visible = (key_pos <= row_pos) & (key_pos < kv_len)  # [rows, keys]
    in_ctx = key0 + lax.broadcasted_iota(jnp.int32, (keys, 1), 0) < kv_len  # [keys, 1]
    for h in range(num_kv_heads):
        q = q_ref[h]  # [rows, D]
        k = common.from_kv(kbuf[slot, h], q.dtype)  # [keys, D]
        prec = common.dot_precision(k.dtype)  # float32: fp32 contraction, not bf16 passes
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=prec,
                            preferred_element_type=jnp.float32) * scale  # [rows, keys]
        s = jnp.where(visible, s, common.MASK_VALUE)
        m_prev = m_ref[h]  # [rows, 128], all lanes equal
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, :1])
        l_ref[h] = alpha * l_ref[h] + p.sum(axis=1, keepdims=True)
        m_ref[h] = m_next
        # Stale slots may hold NaN and 0 * NaN = NaN: zero them. The select runs in float32
        # (chips before v6 have no bf16 VPU).
        v = jnp.where(in_ctx, common.from_kv(vbuf[slot, h], jnp.float32), 0.0).astype(k.dtype)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)  # [rows, D]
        acc_ref[h] = alpha[:, :1] * acc_ref[h] + pv


def attend_pages(bt_ref, q_ref, k_hbm, v_hbm, kbuf, vbuf, sems, acc_ref, m_ref, l_ref, *,
                 table_off, first_page, n_pages, row_pos, kv_len, scale):
    """Online softmax of the ``q_ref`` rows over ``n_pages`` pages of one table row, from
    page ``first_page``, double-buffered; leaves unnormalised ``(acc, m, l)`` in scratch."""
    block_size = k_hbm.shape[2]
    ppb = kbuf.shape[2] // block_size
    acc_ref[...] = jnp.zeros_like(acc_ref)
    # A finite mask value, not -inf: a row that has seen no visible key yet weighs its
    # masked keys exp(0) = 1 instead of NaN, and the first key it sees wipes that
    # (alpha = exp(MASK - m) = 0). Every real row sees key 0, in its first block.
    m_ref[...] = jnp.full_like(m_ref, common.MASK_VALUE)
    l_ref[...] = jnp.zeros_like(l_ref)
    n_blocks = pl.cdiv(n_pages, ppb)
    copy = functools.partial(_copy_pages, bt_ref, k_hbm, v_hbm, kbuf, vbuf, sems,
                             table_off=table_off + first_page, n_pages=n_pages)

    @pl.when(n_blocks > 0)
    def _():
        copy(page0=0, slot=0, start=True)

    def body(c, carry):
        slot = lax.rem(c, 2)

        @pl.when(c + 1 < n_blocks)
        def _():
            copy(page0=(c + 1) * ppb, slot=1 - slot, start=True)

        copy(page0=c * ppb, slot=slot, start=False)
        _attend_block(q_ref, kbuf, vbuf, acc_ref, m_ref, l_ref, slot=slot,
                      key0=(first_page + c * ppb) * block_size, row_pos=row_pos, kv_len=kv_len,
                      scale=scale)
        return carry

    lax.fori_loop(0, n_blocks, body, 0)


def normalised(acc_ref, l_ref, dtype):
    l = l_ref[...][..., :1]
    return (acc_ref[...] / jnp.where(l > 0, l, 1.0)).astype(dtype)
