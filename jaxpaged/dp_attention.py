"""Data-parallel attention on CPU: replicas' schedulers, one program over their devices.

``LLM(data_parallel_size=N, enable_dp_attention=True)`` keeps the replicas of
:mod:`jaxpaged.data_parallel` (each request on one replica, each replica with its own
scheduler, block manager and KV pool on its own device) but runs their steps as one program
over a ``"dp"`` mesh of their devices, as SGLang's DP attention does: each device runs the
attention of its replica's rows over its replica's pool; the MLP is split between the devices
(each its columns of gate/up and rows of down, for every replica's rows: an all-gather before,
a reduce-scatter after); the LM head is split by vocabulary. On a 2-vCPU CPU this is what pays:
XLA:CPU runs one device's small attention ops on one thread without waiting on the other, and
the matmuls still read each weight once (docs/measurements.md, twenty-seventh and
twenty-eighth sessions).

A step: each replica's :class:`~jaxpaged.runner.ModelRunner` applies its block moves to its
own pool and builds its padded batch; the batches are padded to common shapes (padding rows
and tokens as ``batch.py`` pads them) and laid side by side, the replicas' pools viewed as one
array sharded over the mesh (no copy); the model runs under ``shard_map``; the sampler runs
once over every replica's rows, real rows first; each replica gets its rows back. A step
where only one replica has work (a single stream, the tail of a batch) runs that replica's
own model on its device instead: the split program would pay every layer's collectives for
the other device's padding. So each replica keeps a whole copy of the model (the program's
replicated weights are those copies; the split MLP and LM head are one more copy in all).

Where a program over several CPU devices is launched while another runs, XLA:CPU's client
waits in the launch until the running one is done (it runs each device's part on a worker of
a pool the running program holds); with async scheduling the host's work for the next step
then overlaps the step launched last, which is why the sampler and the pending-token fill
run inside the same program.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpaged.attention import AttentionMetadata
from jaxpaged.batch import Batch
from jaxpaged.data_parallel import DataParallelOutput, DataParallelRunnerOutput
from jaxpaged.kv_cache import KVPool
from jaxpaged.padding import NULL_BLOCK, row_bucket, token_bucket
from jaxpaged.runner import PROGRAMS, ModelRunner, ShapedJit, _fill_pending, _HashedOnce, _sample
from jaxpaged.scheduler import PromptLogprobs, RunnerOutput

AXIS = "dp"




@dataclasses.dataclass
class _Step:
    batches: list[Batch | None]
    sampled: object  # SamplerOutput over the step's rows: each replica's real rows, in order, then padding
    prompt_logprobs: object | None
    row_offsets: list[int]  # first row of each replica in ``sampled``
    rows: list[dict[int, int]]  # each replica's sequence id -> its row in its batch


def _pad(a: np.ndarray, n: int, fill) -> np.ndarray:
    """``a`` at length ``n``: padded with ``fill``, or cut where only padding lies past ``n``."""
    out = np.full((n, *a.shape[1:]), fill, a.dtype)
    out[:min(len(a), n)] = a[:n]
    return out


def _per_device(n: int, largest: int, bucket_fn) -> int:
    """Padded count per device: the bucket of ``n`` devices' worth of the largest part, shared
    out (a replica's own bucket would pad 24 rows to 32 on each of two devices, 64 rows of
    MLP for 48 real; the bucket of 48 is 48)."""
    return max(largest, -(-bucket_fn(n * largest) // n))


def _padded_batch(b: Batch | None, T: int, S: int, W: int, R: int, P_: int) -> dict[str, np.ndarray]:
    """``b``'s arrays at the step's common shapes (an all-padding batch for None)."""
    if b is None:
        return dict(tokens=np.zeros(T, np.int32), positions=np.zeros(T, np.int32),
                    slot_mapping=np.full(T, NULL_BLOCK, np.int32), block_tables=np.full((S, W), NULL_BLOCK, np.int32),
                    context_lens=np.zeros(S, np.int32), query_start_loc=np.zeros(S + 1, np.int32),
                    logits_indices=np.zeros(R, np.int32), prompt_lp_indices=np.zeros(P_, np.int32),
                    prompt_lp_targets=np.zeros(P_, np.int32), token_src=np.full(T, -1, np.int32))
    tables = np.full((S, W), NULL_BLOCK, np.int32)
    rows = min(S, b.block_tables.shape[0])
    tables[:rows, :b.block_tables.shape[1]] = b.block_tables[:rows]
    qsl = _pad(b.query_start_loc, S + 1, b.num_tokens)
    return dict(tokens=_pad(b.tokens, T, 0), positions=_pad(b.positions, T, 0),
                slot_mapping=_pad(b.slot_mapping, T, NULL_BLOCK), block_tables=tables,
                context_lens=_pad(b.context_lens, S, 0), query_start_loc=qsl,
                logits_indices=_pad(b.logits_indices, R, 0), prompt_lp_indices=_pad(b.prompt_lp_indices, P_, 0),
                prompt_lp_targets=_pad(b.prompt_lp_targets, P_, 0),
                token_src=np.full(T, -1, np.int32) if b.token_src is None else _pad(b.token_src, T, -1))


def _md_spec(decode_only: bool) -> AttentionMetadata:
    rows = P(AXIS)
    return AttentionMetadata(positions=rows, slot_mapping=rows, block_tables=P(AXIS, None), context_lens=rows,
                             query_start_loc=rows, decode_only=decode_only)


# The model and the sampler in one program (unlike ModelRunner's two): on CPU, a program over
# several devices launched while the previous one runs waits for it to finish (XLA:CPU's
# client runs each device's part on a worker of a pool the running program holds), so a
# separate sampler program would hold the host until the model is done. Jitted per geometry
# (_DPPrograms, shared through runner.PROGRAMS as ModelRunner's step is).
def _step(layout: _HashedOnce, params, head, kv, tokens, token_src, prev_tokens, md, idx, pick, sm, prompt_lp_targets,
          **static):
    """Fill the pending tokens, run the model under ``shard_map`` over the ``"dp"`` mesh (each
    device its replica's rows and pool), sample the rows ``pick`` of the gathered logits."""
    graphdef, treedef, specs, mesh = layout.value
    rows = P(AXIS)

    def forward(params, head, kv, tokens, md, idx):
        m = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
        return m(tokens, kv, md, logits_indices=idx, dp_axis=AXIS, head_shard=head)

    tokens = _fill_pending(tokens, token_src, prev_tokens)
    kv_spec = KVPool(P(None, AXIS), P(None, AXIS))
    forward_d = jax.shard_map(forward, mesh=mesh,
                              in_specs=(specs, P(AXIS, None), kv_spec, rows, _md_spec(md.decode_only), rows),
                              out_specs=(P(), kv_spec), check_vma=False)
    logits, kv = forward_d(params, head, kv, tokens, md, idx)
    return _sample(logits[pick], sm, prompt_lp_targets, **static), kv


def _on_device(x: jax.Array, device) -> jax.Array:
    """``x`` (whole, or replicated over a mesh) as an array on ``device`` alone, without
    waiting for it: its shard there, or a copy."""
    for shard in x.addressable_shards:
        if shard.device == device and shard.data.shape == x.shape:
            return shard.data
    return jax.device_put(x, device)


class _DPPrograms:
    def __init__(self):
        self.step = ShapedJit(_step, unkeyed_argnums=(1, 2, 3), static_argnums=(0,), donate_argnums=(3,),
                              static_argnames=("num_logprobs", "num_prompt_logprobs", "use_penalties"))


class DPAttentionRunner:
    """The replicas' runners (host work and pools) behind one runner; steps run as one program."""

    def __init__(self, model, parts: list[ModelRunner]):
        if model.is_stacked or model.mesh is not None:
            raise ValueError("enable_dp_attention runs the CPU form of a model on one device per replica")
        n = len(parts)
        for what, size in (("MLP", model.cfg.intermediate_size), ("vocabulary", model.cfg.vocab_size)):
            if size % n:
                raise ValueError(f"enable_dp_attention splits the {what} ({size}) over data_parallel_size={n} "
                                 "devices: it must divide evenly")
        self.parts = parts
        for p in parts:  # the joint step pads the replicas' batches to common shapes: one layout
            p.split_decodes = False
        self.devices = [next(iter(p.kv.k.devices())) for p in parts]
        self.mesh = Mesh(np.asarray(self.devices), (AXIS,))
        graphdef, treedef, specs = self._place_weights(model)
        self._layout = _HashedOnce((graphdef, treedef, tuple(specs), self.mesh))
        kv = parts[0].kv.k
        self.programs: _DPPrograms = PROGRAMS.get(
            ("dp_step", self._layout, kv.shape, kv.dtype, parts[0].max_blocks_per_seq), _DPPrograms)
        self._rows = NamedSharding(self.mesh, P(AXIS))
        self.compiled_shapes: set[tuple] = set()
        self.time_batch = 0.0
        self.time_device = 0.0

    def _place_weights(self, model):
        """The joint step's weights (``self.params``, ``self.head``) from ``model``'s: the MLP
        split over the devices, the rest the replicas' own copies (``parts[i].params``) as one
        array. Returns the model's graphdef, treedef and each leaf's partition spec."""
        n, parts = len(self.parts), self.parts
        graphdef, state = nnx.split(model)
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(state)
        out_in = model.layers[0].out_in
        params, specs = [], []
        for i, (path, leaf) in enumerate(leaves_with_path):
            name = jax.tree_util.keystr(path)
            if "w_gate_up" in name:  # this device's gate columns then its up columns
                axis = 0 if out_in else 1
                gate, up = np.split(np.asarray(leaf), 2, axis=axis)
                a = np.concatenate([x for d in range(n) for x in (np.split(gate, n, axis)[d], np.split(up, n, axis)[d])],
                                   axis=axis)
                spec = P(AXIS, None) if out_in else P(None, AXIS)
                params.append(jax.device_put(a, NamedSharding(self.mesh, spec)))
            elif "w_down" in name:
                spec = P(None, AXIS) if out_in else P(AXIS, None)
                params.append(jax.device_put(np.asarray(leaf), NamedSharding(self.mesh, spec)))
            else:  # replicated: the replicas' own copies of it, one per device, as one array
                spec = P()
                params.append(jax.make_array_from_single_device_arrays(
                    leaf.shape, NamedSharding(self.mesh, spec), [p.params[i] for p in parts]))
            specs.append(spec)
        head = np.asarray(model.embed[...] if model.lm_head is None else model.lm_head[...].T)  # [V, D]
        self.head = jax.device_put(head, NamedSharding(self.mesh, P(AXIS, None)))
        self.params = tuple(params)
        return graphdef, treedef, specs

    # ---- sleep mode (jaxpaged.engine.LLM.sleep) ---------------------------------------

    def discard_weights(self) -> None:
        for p in self.parts:
            p.discard_weights()
        self.params = self.head = None

    def load_weights(self, leaves) -> None:
        for p in self.parts:
            p.load_weights(leaves)
        self._place_weights(nnx.merge(self.parts[0].structure.value[0], self.parts[0].param_state()))

    def discard_kv(self) -> None:
        for p in self.parts:
            p.discard_kv()

    def restore_kv(self) -> None:
        for p in self.parts:
            p.restore_kv()

    def _global_pool(self) -> KVPool:
        """The replicas' pools as one array sharded over the mesh (their buffers, not a copy)."""
        def one(name):
            shards = [getattr(p.kv, name) for p in self.parts]
            shape = (shards[0].shape[0], len(shards) * shards[0].shape[1], *shards[0].shape[2:])
            return jax.make_array_from_single_device_arrays(shape, NamedSharding(self.mesh, P(None, AXIS)), shards)

        return KVPool(one("k"), one("v"))

    def _keep_pool(self, kv: KVPool) -> None:
        """Hand each replica its shard of the step's output pool back."""
        for name in ("k", "v"):
            by_device = {s.device: s.data for s in getattr(kv, name).addressable_shards}
            for p, d in zip(self.parts, self.devices):
                p.kv = p.kv._replace(**{name: by_device[d]})

    def dispatch(self, out: DataParallelOutput, prev: _Step | None = None) -> _Step | None:
        t0 = time.perf_counter()
        batches = [p.prepare(o, prev.rows[i] if prev is not None else None)
                   for i, (p, o) in enumerate(zip(self.parts, out.parts))]
        real = [b for b in batches if b is not None]
        if not real:
            return None
        n = len(self.parts)
        if len(real) == 1:
            step = self._dispatch_solo(next(d for d, b in enumerate(batches) if b is not None), batches, prev)
            self.time_batch += time.perf_counter() - t0
            return step
        decode_only = all(b.decode_only for b in real)
        S = _per_device(n, max(int((b.context_lens > 0).sum()) for b in real), row_bucket)
        T = S if decode_only else _per_device(n, max(b.num_tokens for b in real), lambda t: token_bucket(t, 8))
        W = max(b.block_tables.shape[1] for b in real)
        R = max(S, _per_device(n, max(len(b.rows) for b in real), row_bucket))
        P_ = max(len(b.prompt_lp_indices) for b in real)
        arrays = [_padded_batch(b, T, S, W, R, P_) for b in batches]
        glob = {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]}
        # The sampler's rows: every replica's real rows first, in replica order, then padding;
        # then the prompt-logprob rows likewise. The forward's logits are [replica][R + P] rows.
        num_rows = [0 if b is None else len(b.rows) for b in batches]
        num_lp = [0 if b is None else sum(g.count for g in b.prompt_lp_rows) for b in batches]
        pick = [d * (R + P_) + j for d in range(n) for j in range(num_rows[d])]
        pick += [0] * (n * R - len(pick))
        pick += [d * (R + P_) + R + j for d in range(n) for j in range(num_lp[d])]
        pick += [0] * (n * (R + P_) - len(pick))
        targets = np.concatenate([a["prompt_lp_targets"][:k] for a, k in zip(arrays, num_lp)] +
                                 [np.zeros(n * P_ - sum(num_lp), np.int32)])
        row_offsets = list(np.cumsum([0] + num_rows[:-1]))
        all_rows = [r for b in real for r in b.rows]
        all_lp_rows = [g for b in real for g in b.prompt_lp_rows]
        sm, num_logprobs, use_penalties, num_prompt_lp = self.parts[0].sampling(all_rows, n * R, all_lp_rows)
        # Pending tokens (async scheduling) from the previous step's rows, inside the step's
        # program: on CPU a separate one over the devices would wait for the previous step.
        src = np.concatenate([np.where(a["token_src"] >= 0, a["token_src"] + (prev.row_offsets[d] if prev else 0), -1)
                              for d, a in enumerate(arrays)])
        prev_tokens = (jax.device_put(prev.sampled.tokens, NamedSharding(self.mesh, P()))
                       if prev is not None and (src >= 0).any() else np.zeros(1, np.int32))
        md = AttentionMetadata(
            positions=jax.device_put(glob["positions"], self._rows),
            slot_mapping=jax.device_put(glob["slot_mapping"], self._rows),
            block_tables=jax.device_put(glob["block_tables"], self._rows),
            context_lens=jax.device_put(glob["context_lens"], self._rows),
            query_start_loc=jax.device_put(glob["query_start_loc"], self._rows), decode_only=decode_only)
        idx = np.concatenate([np.concatenate([a["logits_indices"], a["prompt_lp_indices"]]) for a in arrays])
        self.compiled_shapes.add(("forward", T, S, W, R + P_, decode_only))
        (sampled, prompt_lp), kv = self.programs.step(
            self._layout, self.params, self.head, self._global_pool(), glob["tokens"], src, prev_tokens, md, idx,
            np.asarray(pick, np.int32), sm, targets, num_logprobs=num_logprobs, num_prompt_logprobs=num_prompt_lp,
            use_penalties=use_penalties)
        self._keep_pool(kv)
        for x in jax.tree.leaves((sampled, prompt_lp)):
            x.copy_to_host_async()
        self.time_batch += time.perf_counter() - t0
        return _Step(batches, sampled, prompt_lp, row_offsets,
                     [{} if b is None else {r.seq.seq_id: i for i, r in enumerate(b.rows)} for b in batches])

    def _dispatch_solo(self, d: int, batches: list[Batch | None], prev: _Step | None) -> _Step:
        """A step where only replica ``d`` has work: its model alone on its device, as one
        replica of :class:`~jaxpaged.data_parallel.DataParallelRunner` runs it (the split
        program would run every layer's collectives for the other device's padding: a single
        stream took twice its one-device time a token)."""
        p, b = self.parts[d], batches[d]
        src = None
        if b.token_src is not None:  # the pending tokens' rows in the previous step's sampled rows
            src = np.where(b.token_src >= 0, b.token_src + prev.row_offsets[d], -1).astype(np.int32)
        prev_tokens = _on_device(prev.sampled.tokens, self.devices[d]) if src is not None else None
        one = p.launch(b, prev_tokens, src)
        n = len(self.parts)
        return _Step(batches, one.sampled, one.prompt_logprobs, [0] * n, [one.rows if j == d else {} for j in range(n)])

    def collect(self, step: _Step | None) -> RunnerOutput:
        if step is None:
            return RunnerOutput(None)
        t0 = time.perf_counter()
        sampled, prompt_lp = jax.device_get((step.sampled, step.prompt_logprobs))
        self.time_device += time.perf_counter() - t0
        parts, lp_at = [], 0
        for b, off in zip(step.batches, step.row_offsets):
            if b is None:
                parts.append(RunnerOutput(None))
                continue
            mine = jax.tree.map(lambda x, o=off, k=len(b.rows): x[o:o + k], sampled)
            chunks = []
            for group in b.prompt_lp_rows:
                lps, ranks, top_ids, top_lps = (x[lp_at:lp_at + group.count] for x in prompt_lp)
                chunks.append(PromptLogprobs(group.seq.request, group.start, lps, ranks, top_ids, top_lps))
                lp_at += group.count
            parts.append(RunnerOutput(mine if b.rows else None, chunks))
        return DataParallelRunnerOutput(None, parts=parts)

