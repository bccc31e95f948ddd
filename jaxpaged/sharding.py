"""Tensor parallelism: a 1-D device mesh ``"tp"``, where each array lives on it, and the
``shard_map`` regions that GSPMD must not partition on its own.

``LLM(..., tensor_parallel_size=N)`` builds a mesh over N devices and shards the model
Megatron-style (vLLM's layout):

============================  =======================  ===================================
param (stacked over layers)   shape                    spec
============================  =======================  ===================================
``wq``, ``wk``, ``wv``        ``[L, D, heads, H]``     ``P(None, None, "tp", None)`` column
``wo``                        ``[L, N, H, D]``         ``P(None, "tp", None, None)`` row
``w_gate``, ``w_up``          ``[L, D, F]``            ``P(None, None, "tp")`` column
``w_down``                    ``[L, F, D]``            ``P(None, "tp", None)`` row
``embed``                     ``[V, D]``               ``P("tp", None)`` vocab (see below)
``lm_head``                   ``[D, V]``               ``P(None, "tp")`` vocab
norms                         ``[L, D]``, ``[D]``      replicated
``bq``, ``bk``, ``bv``        ``[L, heads, H]``        ``P(None, "tp", None)`` (Qwen2)
``q_norm``, ``k_norm``        ``[L, H]``               replicated (Qwen3)
``router``                    ``[L, D, E]``            replicated (Mixtral, Qwen-MoE)
``we_gate``, ``we_up``        ``[L, E, D, F]``         ``P(None, None, None, "tp")`` column
``we_down``                   ``[L, E, F, D]``         ``P(None, None, "tp", None)`` row
``ws_*`` (shared expert)      as ``w_*``; ``[L, D]``   as the MLP's; its gate replicated
KV pool ``k``, ``v``          ``[L, NB, KVH, BS, D]``  ``P(None, None, "tp")``
============================  =======================  ===================================

Device ``d`` holds query heads ``[d N/tp, (d+1) N/tp)`` and KV heads ``[d K/tp, (d+1) K/tp)``:
contiguous slices keep every query head with its GQA KV head. It holds its heads' slice of
*every* block, so block ids stay global and the host block manager does not know about TP.

Collectives of one step (what the compiled HLO shows; ``tests/tp_cases.py`` checks it):

- per layer, two all-reduces of the ``[T, D]`` activations: after the row-parallel
  ``wo`` and after ``w_down``. GSPMD inserts them where the contraction runs over the
  sharded head or MLP axis; a mixture of experts runs under :func:`jax.shard_map` (each
  device every expert's slice of the MLP width) and ends in its own all-reduce
  (:func:`jaxpaged.model.moe_mlp`);
- once per step, one all-reduce of ``[T, D]`` for the vocab-parallel embedding lookup
  (:func:`embed_tokens`) and one all-gather of the ``[S, V]`` logits
  (:func:`vocab_parallel_logits`); sampling runs replicated on the gathered logits;
- nothing touches the pool: ``write_kv`` and the paged attention kernels run per shard
  under :func:`jax.shard_map` (:func:`paged_attention_per_shard`). Left to GSPMD, the
  kernels' view of the pool as ``[L * NB * KVH, BS * D]`` rows merges the sharded head
  axis into the gathered one, and the compiled step all-gathers the whole K and V pools
  in every layer (checked on jax 0.10.2).

Why the embedding and LM head are sharded by vocabulary rather than replicated: they are
the largest single tensors of small and mid-size models (21% of SmolLM2-135M's weights;
13% of Llama-3-8B's with its untied head), so replicating them would keep every device's weight
memory well above 1/N, and the LM head's ``D x V`` matmul per sampled row would run
unsplit on every device. The price is small: one ``[T, D]`` all-reduce for the lookup
and one ``[S, V]`` all-gather of the logits per step (S rows, not T tokens). A vocabulary
not divisible by N falls back to replicated tables (vLLM pads the vocabulary instead;
that would change the param shapes).

With ``tensor_parallel_size=1`` none of this exists: the model's ``mesh`` is None and
it runs exactly the single-device code, with no mesh and no ``shard_map``.

Several hosts
-------------
JAX is multi-controller: every host runs the same Python program. Call
``jax.distributed.initialize()`` first thing (on SLURM, Kubernetes with the JobSet
env vars, or Cloud TPU it finds its peers by itself; elsewhere pass
``coordinator_address="host0:port", num_processes=P, process_id=i``). After it,
``jax.devices()`` lists the devices of every host and
``LLM(model, tensor_parallel_size=jax.device_count())`` builds the mesh over all of them.
Each process reads the checkpoint and fills only the shards of its own devices
(:func:`shard_params` uses ``jax.make_array_from_callback``, which asks only for
addressable shards). Every process must submit the same requests in the same order: the
host scheduler is deterministic, so each one builds the same padded batches, which the
jitted step takes as replicated values, and each gets the (replicated) sampled tokens.
On CPU the collectives go through gloo (``jax_cpu_collectives_implementation``, the
default in jax 0.10.2); ``tests/test_tp.py`` runs two processes on localhost this way.
Not supported across processes: ``preemption_mode="swap"`` (its host pool would need
every head of a block on one host). Across hosts, two all-reduces per layer ride the
network, so in practice keep the ``"tp"`` axis within a node.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Float, Int

from jaxpaged.attention import AttentionMetadata, paged_attention
from jaxpaged.config import LlamaConfig
from jaxpaged.kv_cache import KVPool, write_kv

if TYPE_CHECKING:
    from jaxpaged.model import Llama

TP = "tp"
HEADS = P(None, TP, None)  # [T, heads, H] activations: sharded by head
# [L, NB, KVH, BS, D]: every block, this device's heads. Written without the trailing Nones,
# the form jit hands back for outputs, so the step's output sharding equals its input's.
POOL = P(None, None, TP)
_LAYER_SPECS = {
    "input_norm": P(), "post_attn_norm": P(),
    "wq": P(None, None, TP, None), "wk": P(None, None, TP, None), "wv": P(None, None, TP, None),
    "wo": P(None, TP, None, None),
    "w_gate": P(None, None, TP), "w_up": P(None, None, TP),
    "w_down": P(None, TP, None),
    # Qwen2's q/k/v biases [L, heads, H] go with their heads; Qwen3's q/k norms [L, H] are replicated.
    "bq": P(None, TP, None), "bk": P(None, TP, None), "bv": P(None, TP, None),
    "q_norm": P(), "k_norm": P(),
    # A mixture of experts (jaxpaged.model.moe_mlp): each expert's MLP width sharded as the
    # dense MLP's, the router replicated; Qwen2-MoE's shared expert as a dense MLP.
    "router": P(), "we_gate": P(None, None, None, TP), "we_up": P(None, None, None, TP),
    "we_down": P(None, None, TP, None),
    "ws_gate": P(None, None, TP), "ws_up": P(None, None, TP), "ws_down": P(None, TP, None), "ws_router": P(),
}
_DENSE_MLP = ("w_gate", "w_up", "w_down")
_MOE = ("router", "we_gate", "we_up", "we_down")
_SHARED_EXPERT = ("ws_gate", "ws_up", "ws_down", "ws_router")


def moe_local_spec(name: str) -> P:
    """The spec of one layer's slice of the expert param ``name`` (its stack's, less the layer axis)."""
    return P(*_LAYER_SPECS[name][1:])


def _mlp_widths(cfg: LlamaConfig) -> tuple[int, ...]:
    return (cfg.intermediate_size,) if cfg.moe is None else cfg.moe.widths


def valid_tp_sizes(cfg: LlamaConfig) -> list[int]:
    """Sizes that split the KV heads (hence the query heads) and the MLP width evenly."""
    return [n for n in range(1, cfg.num_kv_heads + 1)
            if cfg.num_kv_heads % n == 0 and all(w % n == 0 for w in _mlp_widths(cfg))]


def request_cpu_devices(n: int) -> None:
    """Have jax's CPU backend make ``n`` devices, if it has not started yet.

    Data and tensor parallelism on CPU need several CPU devices, and jax makes them only when
    its backends start (one by default). Before that, ``jax_num_cpu_devices`` sets how many:
    an engine created before any jax computation in its process needs no ``XLA_FLAGS``.
    Nothing changes once the backends are up, or where the process already chose a count
    (``XLA_FLAGS=--xla_force_host_platform_device_count``, or ``jax_num_cpu_devices`` at least
    ``n``); the device check then says what is missing. On a GPU or TPU the CPU backend gets
    the ``n`` devices too, unused.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n <= 1:
        return
    chosen = getattr(jax.config, "jax_num_cpu_devices", n)  # -1: not set
    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "") or chosen >= n:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # the backends are up already
        pass


def _check_device_count(name: str, n: int, have: int) -> None:
    """Raise unless ``n`` (the setting ``name``) is an int >= 1 and at most ``have`` devices."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name} must be an int, got {n!r}")
    if n < 1:
        raise ValueError(f"{name}={n} must be >= 1")
    if n > have:
        hint = (f"; on CPU, create the engine before any jax computation runs in the process (it then makes "
                f"its devices), or set XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax starts"
                if jax.default_backend() == "cpu" else "")
        raise ValueError(f"{name}={n} needs {n} devices, but only {have} "
                         f"{jax.default_backend()} device(s) exist{hint}")


def check_tp_size(n: int) -> None:
    """Raise unless ``n`` is an int >= 1 and at most the number of devices."""
    _check_device_count("tensor_parallel_size", n, jax.device_count())


def data_parallel_devices(dp: int, tp: int = 1) -> list | None:
    """Each replica's device for ``data_parallel_size=dp`` (:mod:`jaxpaged.data_parallel`):
    the first ``dp`` of this process's devices; None for one replica. Raises before any work
    when they do not exist, and for replicas of several devices (with tensor parallelism),
    not supported yet."""
    _check_device_count("data_parallel_size", dp, jax.local_device_count())
    if dp == 1:
        return None
    if tp > 1:
        raise ValueError(f"data_parallel_size={dp} with tensor_parallel_size={tp}: replicas of several devices "
                         "are not supported yet; use one of the two")
    return jax.local_devices()[:dp]


def model_on_device(model: Llama, device) -> Llama:
    """The model with its parameters on ``device`` (the same arrays where they are there already)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, device))


def make_mesh(n: int, cfg: LlamaConfig) -> Mesh | None:
    """The ``"tp"`` mesh over the first ``n`` devices, or None for ``n == 1`` (no TP at all).

    Raises ``ValueError`` when ``n`` is not a valid size for the model or exceeds the devices.
    """
    check_tp_size(n)
    uneven = [w for w in _mlp_widths(cfg) if w % n]
    if cfg.num_kv_heads % n or uneven:
        what = (f"the model's {cfg.num_kv_heads} KV heads" if cfg.num_kv_heads % n
                else f"the model's {'expert ' if cfg.moe is not None else ''}MLP width {uneven[0]}")
        raise ValueError(f"tensor_parallel_size={n} does not divide {what}; valid sizes for this model: "
                         f"{', '.join(map(str, valid_tp_sizes(cfg)))}")
    if n == 1:
        return None
    return Mesh(np.asarray(jax.devices()[:n]), (TP,))


def vocab_parallel(cfg: LlamaConfig, n: int) -> bool:
    return cfg.vocab_size % n == 0


def param_specs(cfg: LlamaConfig, n: int) -> dict:
    """The ``PartitionSpec`` of every param, as a pure dict shaped like the model's params."""
    vocab = vocab_parallel(cfg, n)
    moe = cfg.moe
    absent = (() if cfg.qkv_bias else ("bq", "bk", "bv")) + (() if cfg.qk_norm else ("q_norm", "k_norm")) + (
        _MOE + _SHARED_EXPERT if moe is None else
        _DENSE_MLP + (() if moe.shared_intermediate_size else _SHARED_EXPERT))
    layers = {name: spec for name, spec in _LAYER_SPECS.items() if name not in absent}
    specs = {"embed": P(TP, None) if vocab else P(), "layers": layers, "final_norm": P()}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = P(None, TP) if vocab else P()
    return specs


def shard_params(params: dict, cfg: LlamaConfig, mesh: Mesh, dtype) -> dict:
    """Place a pure param dict on the mesh, each device receiving only its own slices.

    Host (numpy) arrays go through ``jax.make_array_from_callback``: each shard is sliced
    and cast on the host and copied to its device, so no device ever holds a full copy
    (and under ``jax.distributed`` each process fills only its own devices). Device
    arrays (an already loaded model) are resharded with ``jax.device_put``.
    """
    def put(a, spec):
        sharding = NamedSharding(mesh, spec)
        if isinstance(a, jax.Array):
            return jax.device_put(a.astype(dtype), sharding)
        a = np.asarray(a)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: np.asarray(a[idx]).astype(dtype))

    return jax.tree.map(put, params, param_specs(cfg, mesh.size))


def pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, POOL)


def embed_tokens(mesh: Mesh, table: Float[Array, "V D"], tokens: Int[Array, "T"]) -> Float[Array, "T D"]:
    """Vocab-parallel embedding lookup: each device looks up the tokens of its vocabulary
    slice, zeros elsewhere, and one all-reduce sums the rows (exact: one term is nonzero).

    Written as a ``shard_map`` so the collective is this one all-reduce by construction.
    """
    if table.shape[0] % mesh.size:  # replicated table
        return table[tokens]

    def local(table, tokens):  # table [V/tp, D]
        rows = table.shape[0]
        idx = tokens - lax.axis_index(TP) * rows
        hit = (idx >= 0) & (idx < rows)
        x = jnp.where(hit[:, None], table[jnp.clip(idx, 0, rows - 1)], 0)
        return lax.psum(x, TP)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(TP, None), P()), out_specs=P())(table, tokens)


def vocab_parallel_logits(mesh: Mesh, x: Float[Array, "S D"], table: jax.Array, *,
                          tied: bool, precision=None) -> Float[Array, "S V"]:
    """Logits of ``x`` against the embedding ``[V, D]`` (``tied``) or the LM head ``[D, V]``:
    each device computes its vocabulary slice, one all-gather assembles whole rows.

    A ``shard_map``, because GSPMD left to itself prefers to all-gather the *table* (the
    replicated output pulls replication back into the dot), i.e. the biggest weight,
    every step.
    """
    eq = "SD,VD->SV" if tied else "SD,DV->SV"
    spec = P(TP, None) if tied else P(None, TP)
    if table.shape[0 if tied else 1] % mesh.size:  # replicated table
        return jnp.einsum(eq, x, table, precision=precision)

    def local(x, table):
        return lax.all_gather(jnp.einsum(eq, x, table, precision=precision), TP, axis=1, tiled=True)

    # check_vma=False: all_gather's result is the same on every device, but typed as varying.
    return jax.shard_map(local, mesh=mesh, in_specs=(P(), spec), out_specs=P(), check_vma=False)(x, table)


def paged_attention_per_shard(
    mesh: Mesh,
    q: Float[Array, "T N H"],
    k: Float[Array, "T K H"],
    v: Float[Array, "T K H"],
    kv: KVPool,
    layer: Int[Array, ""],
    md: AttentionMetadata,
    *,
    scale: float,
    backend: str,
) -> tuple[Float[Array, "T N H"], KVPool]:
    """``write_kv`` then ``paged_attention`` on each device's heads and pool slice.

    ``q``, ``k``, ``v`` are sharded by head, the pool by KV head (:data:`POOL`); the
    metadata (slots, block tables, lengths) is replicated, as block ids are global. Returns
    the attention output sharded by head and the updated pool, sharded as it came in, so
    the scan carry and the donated step output keep one layout.
    """
    def local(q, k, v, kv, layer, md):
        kv = write_kv(kv, layer, k, v, md.slot_mapping)
        return paged_attention(q, kv, layer, md, scale=scale, backend=backend), kv

    pool = KVPool(POOL, POOL)
    # check_vma=False: the kernels are written for plain arrays (a pallas_call's outputs and
    # a fori_loop's carry would need varying-axes annotations); every value here is per shard.
    return jax.shard_map(local, mesh=mesh, in_specs=(HEADS, HEADS, HEADS, pool, P(), P()),
                         out_specs=(HEADS, pool), check_vma=False)(q, k, v, kv, layer, md)
