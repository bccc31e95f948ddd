"""The device side of the engine: the KV pool, the jitted step, and block moves.

This is the only module where host state becomes device arrays. ``execute`` takes what
the scheduler decided, applies its block moves (copy-on-write copies, swaps), builds the
padded batch and the sampling metadata, runs the model over the batch with the pool
donated (so XLA updates it in place), samples from the logits on the device, and
returns only the sampled tokens and the requested logprobs, as numpy.

Under tensor parallelism the params and the pool arrive sharded (:mod:`jaxpaged.sharding`)
and ``_forward`` compiles for those input shardings; its pool output leaves the model's
``shard_map`` with the same sharding, so donation reuses the buffers and no step reshards.
"""

from __future__ import annotations

import functools
import logging
import time

import jax
import numpy as np
from flax import nnx

from jaxpaged import sharding
from jaxpaged.attention import AttentionMetadata
from jaxpaged.batch import Batch, build_batch
from jaxpaged.kv_cache import KVPool, copy_blocks, gather_blocks, init_kv_pool, scatter_blocks
from jaxpaged.model import Llama
from jaxpaged.padding import bucket
from jaxpaged.sampler import SamplingRow, build_sampling_metadata, compute_logprobs, sample
from jaxpaged.sampling_params import MAX_LOGPROBS
from jaxpaged.scheduler import PromptLogprobs, RunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)


# The step is two jitted calls, the model and the sampler, so their compiled shapes add up
# instead of multiplying: the model compiles per (tokens, sequences, block-table width,
# logits rows), the sampler per (rows, sampling options). One fused jit compiled every
# product of the two (133 shapes for 180 requests of random traffic, ~0.7 s each on CPU).
# The logits stay on the device between the two; the pool is donated to the model.
@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2,))
def _forward(graphdef, params, kv: KVPool, tokens, md: AttentionMetadata, logits_indices):
    """The model over one padded batch: logits at ``logits_indices`` ([N, V]) and the new pool."""
    model = nnx.merge(graphdef, params)
    return model(tokens, kv, md, logits_indices=logits_indices)


@functools.partial(jax.jit, static_argnames=("num_logprobs", "num_prompt_logprobs", "use_penalties"))
def _sample(logits, sm, prompt_lp_targets, *, num_logprobs: int, num_prompt_logprobs: int, use_penalties: bool):
    """Sample the first R rows of ``logits`` (R = the metadata's rows); score the rest against
    ``prompt_lp_targets`` (prompt logprobs; None when there are none)."""
    R = sm.temperature.shape[0]
    out = sample(logits[:R], sm, num_logprobs=num_logprobs, use_penalties=use_penalties)
    prompt_lp = None
    if prompt_lp_targets.shape[0]:
        prompt_lp = compute_logprobs(logits[R:], prompt_lp_targets, num_logprobs=num_prompt_logprobs)
    return out, prompt_lp


# Module level, so engines over the same model share compilations.
_jit_gather = jax.jit(gather_blocks)
_jit_scatter = jax.jit(scatter_blocks, donate_argnums=(0,))
_jit_copy = jax.jit(copy_blocks, donate_argnums=(0,))


def row_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request: distinct per index, independent of batching."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


class ModelRunner:
    def __init__(self, model: Llama, *, num_blocks: int, block_size: int, max_model_len: int,
                 eos_ids: tuple[int, ...] = (), num_host_blocks: int = 0, dtype=None):
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.eos_ids = eos_ids
        self.time_batch = self.time_device = 0.0  # seconds spent building batches / in the device step
        self.graphdef, self.params = nnx.split(model)
        self.dtype = dtype or model.dtype
        self.mesh = model.mesh
        pool_device = None if self.mesh is None else sharding.pool_sharding(self.mesh)
        self.kv = init_kv_pool(cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim, self.dtype,
                               device=pool_device)
        if num_host_blocks and self.mesh is not None and not all(
                d.process_index == jax.process_index() for d in self.mesh.devices.flat):
            raise ValueError("preemption_mode='swap' is not supported when the mesh spans several processes "
                             "(a host's swap space would hold only its own heads); use 'recompute'")
        host_shape = (cfg.num_layers, num_host_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        # Host (CPU memory) pool for swapped-out blocks, allocated lazily on first use.
        self._host_shape = host_shape
        self.host_k: np.ndarray | None = None
        self.host_v: np.ndarray | None = None
        self.compiled_shapes: set[tuple] = set()

    # ---- block moves ----------------------------------------------------------------

    def apply_block_ops(self, ops: list[tuple[str, int, int]]) -> None:
        """Apply the scheduler's block moves in order: copy-on-write copies, swap-outs, swap-ins.

        Runs of one kind go to the device in one call. Copies are not fused into the step:
        each padded copy count would be another compilation of the whole model.
        """
        i = 0
        while i < len(ops):
            kind = ops[i][0]
            j = i
            while j < len(ops) and ops[j][0] == kind:
                j += 1
            pairs = np.array([(a, b) for _, a, b in ops[i:j]], np.int32)
            if kind == "copy":
                self.kv = _jit_copy(self.kv, *_padded_pairs(pairs))
            elif kind == "out":
                self._swap_out(pairs[:, 0], pairs[:, 1])
            else:
                self._swap_in(pairs[:, 0], pairs[:, 1])
            i = j

    def _host_pool(self):
        if self.host_k is None:
            self.host_k = np.zeros(self._host_shape, self.kv.k.dtype)
            self.host_v = np.zeros(self._host_shape, self.kv.v.dtype)
        return self.host_k, self.host_v

    def _swap_out(self, device_blocks: np.ndarray, host_blocks: np.ndarray) -> None:
        hk, hv = self._host_pool()
        n = len(device_blocks)
        ids = np.zeros(bucket(n), np.int32)
        ids[:n] = device_blocks
        k, v = jax.device_get(_jit_gather(self.kv, ids))
        hk[:, host_blocks], hv[:, host_blocks] = k[:, :n], v[:, :n]

    def _swap_in(self, host_blocks: np.ndarray, device_blocks: np.ndarray) -> None:
        hk, hv = self._host_pool()
        n = len(device_blocks)
        ids = np.zeros(bucket(n), np.int32)  # padding rewrites the null block with its own data
        ids[:n] = device_blocks
        k = np.zeros((hk.shape[0], len(ids), *hk.shape[2:]), hk.dtype)
        v = np.zeros_like(k)
        k[:, :n], v[:, :n] = hk[:, host_blocks], hv[:, host_blocks]
        self.kv = _jit_scatter(self.kv, ids, (k, v))

    # ---- the step -------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step: block moves, the model, sampling. Returns numpy results."""
        t0 = time.perf_counter()
        self.apply_block_ops(out.block_ops)
        if not out.scheduled:
            return RunnerOutput(None)
        batch = build_batch(out, block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq)
        rows = [SamplingRow(r.seq.request.params, row_seed(r.seq.request.seed, r.index),
                            r.seq.request.prompt_token_ids, r.seq.output_token_ids) for r in batch.rows]
        sm, num_logprobs, use_penalties = build_sampling_metadata(rows, len(batch.logits_indices), self.vocab_size,
                                                                  self.eos_ids)
        # Beam search ranks each beam's top 2 * width continuations.
        beam_k = max((2 * r.seq.request.params.beam_width for r in batch.rows if r.seq.request.is_beam_search),
                     default=0)
        num_logprobs = min(bucket(max(num_logprobs, beam_k)) if max(num_logprobs, beam_k) else 0, self.vocab_size)
        num_prompt_lp = max((r.seq.request.params.prompt_logprobs for r in batch.prompt_lp_rows), default=0)
        num_prompt_lp = min(bucket(num_prompt_lp), MAX_LOGPROBS) if num_prompt_lp else 0
        t1 = time.perf_counter()
        sampled, prompt_lp = self._run(batch, sm, num_logprobs=num_logprobs, num_prompt_logprobs=num_prompt_lp,
                                       use_penalties=use_penalties)
        self.time_batch += t1 - t0
        self.time_device += time.perf_counter() - t1
        chunks, i = [], 0
        for group in batch.prompt_lp_rows:
            lps, ranks, top_ids, top_lps = (x[i:i + group.count] for x in prompt_lp)
            chunks.append(PromptLogprobs(group.seq.request, group.start, lps, ranks, top_ids, top_lps))
            i += group.count
        return RunnerOutput(sampled, chunks)

    def _run(self, batch: Batch, sm, *, num_logprobs: int, num_prompt_logprobs: int, use_penalties: bool):
        """Run one step; returns (SamplerOutput, prompt logprobs or None) as numpy."""
        md = AttentionMetadata(
            positions=batch.positions, slot_mapping=batch.slot_mapping, block_tables=batch.block_tables,
            context_lens=batch.context_lens, query_start_loc=batch.query_start_loc,
            decode_only=batch.decode_only,
        )
        idx = np.concatenate([batch.logits_indices, batch.prompt_lp_indices])
        self.compiled_shapes.add(("forward", *batch.shape_key))
        self.compiled_shapes.add(("sample", len(batch.logits_indices), len(batch.prompt_lp_indices), num_logprobs,
                                  num_prompt_logprobs, use_penalties, tuple(np.shape(x) for x in jax.tree.leaves(sm)),
                                  jax.tree.structure(sm)))
        logits, self.kv = _forward(self.graphdef, self.params, self.kv, batch.tokens, md, idx)
        out, prompt_lp = _sample(logits, sm, batch.prompt_lp_targets, num_logprobs=num_logprobs,
                                 num_prompt_logprobs=num_prompt_logprobs, use_penalties=use_penalties)
        return jax.device_get((out, prompt_lp))


def _padded_pairs(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    padded = np.zeros((bucket(len(pairs)), 2), np.int32)  # null -> null copies are no-ops
    padded[:len(pairs)] = pairs
    return padded[:, 0], padded[:, 1]
