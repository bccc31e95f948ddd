"""The device side of the engine: the KV pool, the jitted step, and block moves.

This is the only module where host state becomes device arrays. ``dispatch`` takes what
the scheduler decided, applies its block moves (copy-on-write copies, swaps), builds the
padded batch and the sampling metadata, and launches the model over the batch with the
pool donated (so XLA updates it in place) and the sampler on its logits; JAX dispatch is
asynchronous, so it returns while the device works. ``collect`` waits for the step and
returns only the sampled tokens and the requested logprobs, as numpy. ``execute`` is the
two in a row.

Async scheduling dispatches step N+1 before collecting step N: tokens the host has not
seen yet stay on the device, and the next step reads them from step N's sampled rows.

Under tensor parallelism the params and the pool arrive sharded (:mod:`jaxpaged.sharding`)
and ``_forward`` compiles for those input shardings; its pool output leaves the model's
``shard_map`` with the same sharding, so donation reuses the buffers and no step reshards.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged import hugepages, sharding
from jaxpaged.attention import AttentionMetadata, resolve_backend
from jaxpaged.batch import Batch, build_batch
from jaxpaged.kv_cache import KVPool, copy_blocks, gather_blocks, init_kv_pool, scatter_blocks
from jaxpaged.lora import LoRAConfig, LoRASlots
from jaxpaged.model import Llama
from jaxpaged.padding import bucket
from jaxpaged.sampler import SamplingRow, build_sampling_metadata, compute_logprobs, sample
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpaged.scheduler import PromptLogprobs, RunnerOutput, SchedulerOutput
from jaxpaged.structured_output import allowed_bitmask, token_bitmask

log = logging.getLogger(__name__)


class _HashedOnce:
    """A static jit argument hashed once, not on every call: the graphdef of an unstacked
    model (30 layer nodes) took ~1.2 ms of the host's time a step to hash, on a machine where
    host time is taken from the device's cores. Equal when the values are equal, so engines
    over the same model still share compilations."""

    __slots__ = ("value", "_hash")

    def __init__(self, value):
        self.value, self._hash = value, hash(value)

    def __hash__(self):
        return self._hash

    def __eq__(self, other):
        return isinstance(other, _HashedOnce) and (self.value is other.value or self.value == other.value)


def split_model(model: Llama) -> tuple[_HashedOnce, tuple[jax.Array, ...]]:
    """``model`` as :func:`_forward` takes it: its structure (static, hashed once) and its
    arrays as a flat tuple. A tuple of arrays takes jit's C++ fast path; the nnx state
    (182 variables in the CPU form of the default model) was flattened in Python every
    step: 1.5-1.8 vs 0.9-1.0 ms to dispatch a batch-1 step on a 2-vCPU Xeon."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return _HashedOnce((graphdef, treedef)), tuple(leaves)


# The step is two jitted calls, the model and the sampler, so their compiled shapes add up
# instead of multiplying: the model compiles per (tokens, sequences, block-table width,
# logits rows), the sampler per (rows, sampling options). One fused jit compiled every
# product of the two (133 shapes for 180 requests of random traffic, ~0.7 s each on CPU).
# The logits stay on the device between the two; the pool is donated to the model.
# Jitted per geometry by StepPrograms (static_argnums=(0,), donate_argnums=(2,)).
def _forward(structure: _HashedOnce, params: tuple[jax.Array, ...], kv: KVPool, tokens, md: AttentionMetadata,
             logits_indices, lora_weights=None, lora_slots=None, *, return_hidden: bool = False):
    """The model over one padded batch: logits at ``logits_indices`` ([N, V]) and the new pool;
    with ``return_hidden`` (a step holding embedding requests) their final hidden states [N, D]
    too; ``lora_weights``, ``lora_slots``: the LoRA slots' weights and each token's slot (a step
    holding LoRA requests, jaxpaged.lora). ``structure``, ``params``: from :func:`split_model`."""
    graphdef, treedef = structure.value
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    lora = None if lora_slots is None else (lora_slots, lora_weights)
    return model(tokens, kv, md, logits_indices=logits_indices, return_hidden=return_hidden, lora=lora)


def _bad_word_ends(row) -> list[int]:
    """The last tokens of the row's request's bad words whose other tokens end its output so far
    (its drafts before the row included): masked at this row, as vLLM's ``apply_bad_words``."""
    req = row.seq.request
    if not req.bad_word_prefixes:
        return []
    past = row.seq.output_token_ids + row.drafted
    return [last for prefix, last in req.bad_word_prefixes
            if len(prefix) <= len(past) and tuple(past[len(past) - len(prefix):]) == prefix]


def _sample(logits, sm, prompt_lp_targets, *, num_logprobs: int, num_prompt_logprobs: int, use_penalties: bool):
    """Sample the first R rows of ``logits`` (R = the metadata's rows); score the rest against
    ``prompt_lp_targets`` (prompt logprobs; None when there are none)."""
    R = sm.temperature.shape[0]
    out = sample(logits[:R], sm, num_logprobs=num_logprobs, use_penalties=use_penalties)
    prompt_lp = None
    if prompt_lp_targets.shape[0]:
        prompt_lp = compute_logprobs(logits[R:], prompt_lp_targets, num_logprobs=num_prompt_logprobs)
    return out, prompt_lp


def _fill_pending(tokens, token_src, prev_tokens):
    """``tokens`` with each pending token (``token_src >= 0``) taken from the previous step's samples."""
    return jnp.where(token_src >= 0, prev_tokens[jnp.maximum(token_src, 0)], tokens)


class ProgramCache:
    """Jitted functions that engines with one key share (a pool geometry, a vocabulary), freed
    once no engine needs them.

    jax keeps a function's compiled programs while the Python function lives (its caches hold
    the function weakly), so the programs of module-level functions stayed for the life of
    the process, whatever engine compiled them. On CPU each program holds memory mappings,
    about three per fused kernel (~177 a step program of the default model, ~166 of the tiny
    test model), and Linux allows a process 65,530; past it XLA fails with ``LLVM compilation
    error: Cannot allocate memory``. An engine of the default model compiles some 20-50 step
    shapes, so a process that built engines of a few pool sizes in turn (a notebook trying
    memory settings) kept 4-9k mappings per pool size. So ``get`` makes each key's functions
    anew (``make()`` builds :class:`ShapedJit` objects: jit objects of their own per shape),
    shares them among the live engines with that key, and keeps the ``keep_recent`` most
    recently asked-for keys too, so that engines made one after another with one key (tests,
    a notebook cell run again) still compile once. The rest go with their last engine
    (``tests/test_engine.py``: the mappings stop growing). The shapes one live engine
    compiles are bounded by :class:`ProgramBudget`.
    """

    def __init__(self, keep_recent: int = 4):
        self.keep_recent = keep_recent
        self._live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._recent: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, make: Callable[[], object]):
        with self._lock:
            programs = self._live.get(key)
            if programs is None:
                programs = self._live[key] = make()
            self._recent[key] = programs
            self._recent.move_to_end(key)
            while len(self._recent) > self.keep_recent:
                self._recent.popitem(last=False)
            return programs


PROGRAMS = ProgramCache()  # the steps and block moves, per pool geometry
SAMPLERS = ProgramCache()  # the sampler and the pending-token fill, per vocabulary (any pool)


def process_memory_maps() -> int | None:
    """The process's memory mappings (lines of ``/proc/self/maps``); None where there is no such file."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def max_memory_maps() -> int:
    """The kernel's limit on a process's memory mappings (``vm.max_map_count``, 65,530 by default)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


class ProgramBudget:
    """The compiled programs the process keeps: every call shape of every :class:`ShapedJit` is
    a jit object of its own, entered here, and when a new one is made past the budget the least
    recently used go, their programs with them (made again if their shape comes back, read
    from jax's persistent cache where it is on: :mod:`jaxpaged.compilation_cache`).

    :class:`ProgramCache` frees the programs of engines that are gone; this bounds those of
    one engine that lives long. Its step shapes are bucketed, but traffic keeps meeting new
    ones: one engine over the tiny test model, 5,000 steps of random traffic (lognormal prompt
    and output lengths, ``n`` up to 3, 5,758 requests), compiled 159 step shapes and held
    45.7k memory mappings, still growing. On CPU each program holds mappings (~170-250, about
    three per fused kernel), Linux allows ``vm.max_map_count`` (65,530 by default), and past it
    XLA fails: ``LLVM compilation error: Cannot allocate memory``. So once the process holds
    more than ``maps_fraction`` of that limit, a new program first lets go of the least
    recently used quarter of the entries; and never more than ``max_programs`` entries, on
    any platform. The mappings are counted only when a program is made (~11 ms at 20k).
    """

    def __init__(self, max_programs: int = 1024, maps_fraction: float = 0.5):
        self.max_programs = max_programs
        self.maps_fraction = maps_fraction
        self.num_evicted = 0
        self._entries: collections.OrderedDict = collections.OrderedDict()  # (owner, key) -> jit object
        self._lock = threading.RLock()  # release() may run from a finalizer inside get()
        self._map_limit: int | None = None

    def get(self, owner: int, key: Hashable, make: Callable[[], Callable]) -> Callable:
        with self._lock:
            fn = self._entries.get((owner, key))
            if fn is not None:
                self._entries.move_to_end((owner, key))
                return fn
            self._make_room()
            fn = self._entries[(owner, key)] = make()
            return fn

    def owned(self, owner: int) -> list[Callable]:
        with self._lock:
            return [fn for (o, _), fn in self._entries.items() if o == owner]

    def release(self, owner: int) -> None:
        """Let go of ``owner``'s entries (its :class:`ShapedJit` is gone)."""
        with self._lock:
            for k in [k for k in self._entries if k[0] == owner]:
                del self._entries[k]

    def __len__(self) -> int:
        return len(self._entries)

    def near_map_limit(self) -> bool:
        maps = process_memory_maps()
        if maps is None:
            return False
        if self._map_limit is None:
            self._map_limit = max_memory_maps()
        return maps > self.maps_fraction * self._map_limit

    def _make_room(self) -> None:
        n = len(self._entries)
        if n >= self.max_programs:
            drop = n - self.max_programs + 1
        elif n and self.near_map_limit():
            drop = max(1, n // 4)
        else:
            return
        for _ in range(drop):
            self._entries.popitem(last=False)
        self.num_evicted += drop
        log.info("freed the %d least recently used compiled programs (%d kept)", drop, len(self._entries))


BUDGET = ProgramBudget()
_OWNERS = itertools.count()


def _release(owner: int) -> None:
    BUDGET.release(owner)  # the budget in place when the owner goes (tests swap it)


class ShapedJit:
    """``jax.jit(fn, **options)``, each call shape's programs in a jit object of its own, entered
    in :data:`BUDGET` so that the least recently used can be freed.

    A call's shape key: the static arguments' values, the other arguments' tree structure and
    their leaves' shapes and dtypes, leaving out ``unkeyed_argnums``, arguments whose shapes
    never change for one owner (the params and the pool of one geometry: 180 arrays in the
    CPU form of the default model, too many to look at every step). A key that misses
    something jit tells apart (a sharding) only puts two programs in one entry.
    """

    def __init__(self, fn: Callable, *, unkeyed_argnums: tuple[int, ...] = (), **options):
        self._fn, self._options = fn, options
        self._static = tuple(options.get("static_argnums", ()))
        self._static_names = frozenset(options.get("static_argnames", ()))
        self._skip = frozenset(self._static) | frozenset(unkeyed_argnums)
        self._owner = next(_OWNERS)
        weakref.finalize(self, _release, self._owner)

    def _jit(self):
        return jax.jit(functools.partial(self._fn), **self._options)

    def key(self, args: tuple, kwargs: dict) -> Hashable:
        static = tuple(args[i] for i in self._static)
        static += tuple(sorted((k, v) for k, v in kwargs.items() if k in self._static_names))
        traced = ([a for i, a in enumerate(args) if i not in self._skip],
                  {k: v for k, v in kwargs.items() if k not in self._static_names})
        leaves, treedef = jax.tree.flatten(traced)
        return static, treedef, tuple((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)

    def __call__(self, *args, **kwargs):
        return BUDGET.get(self._owner, self.key(args, kwargs), self._jit)(*args, **kwargs)

    def trace(self, *args, **kwargs):
        """A fresh jit's trace (for lowering; nothing kept)."""
        return self._jit().trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._jit().lower(*args, **kwargs)

    def _cache_size(self) -> int:
        """Programs compiled and kept, over every shape."""
        return sum(fn._cache_size() for fn in BUDGET.owned(self._owner))


class StepPrograms:
    """The jitted step and block moves over one geometry's pool (shared through :data:`PROGRAMS`)."""

    def __init__(self):
        # (The LoRA weights, 420 arrays for the default model, are left out of the key too: their
        # shapes are one engine's; the tokens' slots tell LoRA steps apart.)
        self.forward = ShapedJit(_forward, unkeyed_argnums=(1, 2, 6), static_argnums=(0,), donate_argnums=(2,),
                                 static_argnames=("return_hidden",))
        self.gather = ShapedJit(gather_blocks, unkeyed_argnums=(0,))
        self.scatter = ShapedJit(scatter_blocks, unkeyed_argnums=(0,), donate_argnums=(0,))
        self.copy = ShapedJit(copy_blocks, unkeyed_argnums=(0,), donate_argnums=(0,))


class SamplerPrograms:
    """The jitted sampler and pending-token fill of one vocabulary (shared through :data:`SAMPLERS`):
    their shapes do not depend on the pool, so engines of every pool geometry share them."""

    def __init__(self):
        self.sample = ShapedJit(_sample, static_argnames=("num_logprobs", "num_prompt_logprobs", "use_penalties"))
        self.fill_pending = ShapedJit(_fill_pending)


@dataclasses.dataclass
class InFlight:
    """A dispatched step: its batch and its outputs, still on the device."""

    batch: Batch
    sampled: object  # SamplerOutput of device arrays (None until its sampler is launched)
    prompt_logprobs: object  # (logprobs, ranks, top ids, top logprobs) device arrays, or None
    rows: dict[int, int]  # sequence id -> the row that sampled its pending token
    sampler_args: object = None  # the forward's logits, until the sampler is launched
    hidden: object = None  # [N, D] device array: the rows' hidden states, where embedding requests sample


_DROPPED_ROW = SamplingParams(temperature=0, max_tokens=1)  # the options of a row whose token is dropped


def row_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request: distinct per index, independent of batching."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


class ModelRunner:
    def __init__(self, model: Llama, *, num_blocks: int, block_size: int, max_model_len: int,
                 eos_ids: tuple[int, ...] = (), num_host_blocks: int = 0, dtype=None, device=None,
                 lora_config: LoRAConfig | None = None):
        cfg = model.cfg
        self.vocab_size = cfg.vocab_size
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.eos_ids = eos_ids
        self.time_batch = 0.0  # seconds spent building and launching steps
        self.time_device = 0.0  # seconds spent waiting for the device
        self.structure, self.params = split_model(model)
        self.dtype = dtype or model.dtype
        self.mesh = model.mesh
        # Committed to the params' device, as every step's output pool is: an uncommitted first
        # pool made the first step's shape compile twice (once per commitment).
        # ``device``: the pool's, where the steps run elsewhere (jaxpaged.dp_attention).
        pool_device = device or (next(iter(model.embed[...].devices())) if self.mesh is None
                                 else sharding.pool_sharding(self.mesh))
        self._pool_geometry = (cfg.num_layers, num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim, self.dtype)
        self._pool_device = pool_device
        self.kv = init_kv_pool(*self._pool_geometry, device=pool_device)
        # On CPU, in huge pages: the attention's gathers read scattered 16 KB tiles of it, and a
        # step updates the donated pool in place, so the pages last (jaxpaged.hugepages). The new
        # pool is zeros: its pages are dropped, and come back huge as steps write them.
        hugepages.collapse(self.kv, zeros=True)
        # A step's token ids, committed like the pending ones filled in on the device: host
        # ids left uncommitted made every step shape compile a second time, once for steps
        # with pending tokens (async scheduling) and once for steps without.
        self._token_sharding = (jax.sharding.SingleDeviceSharding(pool_device) if self.mesh is None
                                else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
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
        self.programs: StepPrograms = PROGRAMS.get(
            ("step", self.structure, self.kv.k.shape, self.kv.k.dtype, self.kv.k.sharding, self.max_blocks_per_seq),
            StepPrograms)
        self.sampler_programs: SamplerPrograms = SAMPLERS.get(("sampler", cfg.vocab_size, self._token_sharding),
                                                              SamplerPrograms)
        # A mixed step's one-token rows (from batch.SPLIT_MIN_ROWS of them) as a decode batch
        # of their own (batch.build_batch's ``split_decodes``) where the XLA path attends:
        # there a decode row in the ragged path costs a whole query block, and the ragged
        # path's cost follows its static block count (the default model on CPU, 40 decodes
        # beside 422 prompt tokens: 726-788 -> 555-577 ms a step; docs/measurements.md,
        # "Thirty-first session").
        self.split_decodes = resolve_backend(model.attention_backend, model.platform) == "xla"
        # LoRA adapters on the device (jaxpaged.lora): None where the engine serves none.
        self.lora = None if lora_config is None else LoRASlots(cfg, lora_config, model.dtype, self._token_sharding)

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
                self.kv = self.programs.copy(self.kv, *_padded_pairs(pairs))
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
        k, v = jax.device_get(self.programs.gather(self.kv, ids))
        hk[:, host_blocks], hv[:, host_blocks] = k[:, :n], v[:, :n]

    def _swap_in(self, host_blocks: np.ndarray, device_blocks: np.ndarray) -> None:
        hk, hv = self._host_pool()
        n = len(device_blocks)
        ids = np.zeros(bucket(n), np.int32)  # padding rewrites the null block with its own data
        ids[:n] = device_blocks
        k = np.zeros((hk.shape[0], len(ids), *hk.shape[2:]), hk.dtype)
        v = np.zeros_like(k)
        k[:, :n], v[:, :n] = hk[:, host_blocks], hv[:, host_blocks]
        self.kv = self.programs.scatter(self.kv, ids, (k, v))

    # ---- sleep mode (jaxpaged.engine.LLM.sleep) ---------------------------------------

    def discard_weights(self) -> None:
        """Let go of the weights (the engine keeps a host copy, or reloads them)."""
        self._param_shardings = tuple(a.sharding for a in self.params)
        self._param_specs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.params)
        self.params = None

    @property
    def param_specs(self) -> tuple:
        """The weights' shapes and dtypes, awake or not (:meth:`discard_weights`)."""
        if self.params is None:
            return self._param_specs
        return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.params)

    def load_weights(self, leaves) -> None:
        """Weights from ``leaves`` (host or device arrays in this runner's order), laid out as
        the runner's are (or were, before :meth:`discard_weights`)."""
        shardings = self._param_shardings if self.params is None else tuple(a.sharding for a in self.params)
        self.params = tuple(jax.device_put(x, s) for x, s in zip(leaves, shardings, strict=True))

    def discard_kv(self) -> None:
        """Let go of the KV pool and the swap space (no request holds a block)."""
        self.kv = None
        self.host_k = self.host_v = None

    def restore_kv(self) -> None:
        """A new, zeroed pool as the first one was made."""
        self.kv = init_kv_pool(*self._pool_geometry, device=self._pool_device)
        hugepages.collapse(self.kv, zeros=True)

    def param_state(self) -> nnx.State:
        """The model's parameters as the nnx state (``self.params`` holds its leaves)."""
        return jax.tree.unflatten(self.structure.value[1], self.params)

    # ---- the step -------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """Run one scheduled step: block moves, the model, sampling. Returns numpy results."""
        return self.collect(self.dispatch(out))

    def dispatch(self, out: SchedulerOutput, prev: InFlight | None = None, *,
                 defer_sampling: bool = False) -> InFlight | None:
        """Apply the block moves and launch the step; None when nothing is scheduled.

        ``prev``: the step before, when it has not been collected yet (async scheduling);
        the tokens it sampled are this step's pending inputs. ``defer_sampling``: launch the
        forward alone; :meth:`launch_sampler` launches the sampler once the host has applied
        ``prev``'s tokens (the structured outputs' masks follow them, penalties count them).
        """
        t0 = time.perf_counter()
        batch = self.prepare(out, prev.rows if prev is not None else None)
        if batch is None:
            return None
        step = self.launch(batch, prev.sampled.tokens if prev is not None else None, batch.token_src,
                           defer_sampling=defer_sampling)
        self.time_batch += time.perf_counter() - t0
        return step

    def launch(self, batch: Batch, prev_tokens, token_src: np.ndarray | None, *,
               defer_sampling: bool = False) -> InFlight:
        """Launch a prepared batch: the model and (unless ``defer_sampling``) the sampler. Token
        ``t`` whose ``token_src[t]`` is ``i >= 0`` is pending: it is ``prev_tokens[i]``, sampled
        by the step before (on the device, not yet on the host). ``token_src`` None: no pending
        tokens."""
        tokens = batch.tokens
        if token_src is not None:
            self.compiled_shapes.add(("fill", len(tokens), len(prev_tokens)))
            tokens = self.sampler_programs.fill_pending(tokens, token_src, prev_tokens)
        else:
            tokens = jax.device_put(tokens, self._token_sharding)
        md = AttentionMetadata(
            positions=batch.positions, slot_mapping=batch.slot_mapping, block_tables=batch.block_tables,
            context_lens=batch.context_lens, query_start_loc=batch.query_start_loc,
            decode_only=batch.decode_only, num_decode_rows=batch.num_decode_rows,
        )
        idx = np.concatenate([batch.logits_indices, batch.prompt_lp_indices])
        pooling = any(r.seq.request.pooling is not None for r in batch.rows)  # embeddings: their hidden states too
        lora = batch.lora_slots is not None  # a step holding LoRA requests: their tokens' slots, the slots' weights
        self.compiled_shapes.add(("forward" + "+hidden" * pooling + "+lora" * lora, *batch.shape_key))
        hidden = None
        extra = (self.lora.weights, batch.lora_slots) if lora else ()
        if pooling:
            logits, self.kv, hidden = self.programs.forward(self.structure, self.params, self.kv, tokens, md, idx,
                                                            *extra, return_hidden=True)
            hidden.copy_to_host_async()
        else:
            logits, self.kv = self.programs.forward(self.structure, self.params, self.kv, tokens, md, idx, *extra)
        step = InFlight(batch, None, None, {r.seq.seq_id: i for i, r in enumerate(batch.rows)}, logits, hidden)
        if not defer_sampling:
            self.launch_sampler(step)
        return step

    def launch_sampler(self, step: InFlight) -> None:
        """Launch a dispatched step's sampler, its metadata built now, while the forward runs: the
        structured rows masked by their grammars and the penalties counting the output tokens as
        they stand (a row whose sequence has finished meanwhile samples unmasked: its token is
        dropped)."""
        logits, batch = step.sampler_args, step.batch
        step.sampler_args = None
        sm, num_logprobs, use_penalties, num_prompt_lp = self.sampling(batch.rows, len(batch.logits_indices),
                                                                       batch.prompt_lp_rows)
        self.compiled_shapes.add(("sample", len(batch.logits_indices), len(batch.prompt_lp_indices), num_logprobs,
                                  num_prompt_lp, use_penalties, tuple(np.shape(x) for x in jax.tree.leaves(sm)),
                                  jax.tree.structure(sm)))
        step.sampled, step.prompt_logprobs = self.sampler_programs.sample(
            logits, sm, batch.prompt_lp_targets, num_logprobs=num_logprobs, num_prompt_logprobs=num_prompt_lp,
            use_penalties=use_penalties)
        for x in jax.tree.leaves((step.sampled, step.prompt_logprobs)):
            x.copy_to_host_async()  # the host needs them next; start the transfer now

    def prepare(self, out: SchedulerOutput, pending_rows: dict[int, int] | None = None) -> Batch | None:
        """The host's half of a step: apply the block moves, build the padded batch (None when
        nothing is scheduled). ``pending_rows``: the previous step's rows, as in ``build_batch``."""
        self.apply_block_ops(out.block_ops)
        if not out.scheduled:
            return None
        seq_lora = None
        adapters = {} if self.lora is None else {
            s.seq.request.lora.id: s.seq.request.lora for s in out.scheduled if s.seq.request.lora is not None}
        if adapters:  # the step's adapters into the device's slots; each sequence's slot (-1: none)
            slot = self.lora.slots(adapters)
            seq_lora = np.fromiter((-1 if s.seq.request.lora is None else slot[s.seq.request.lora.id]
                                    for s in out.scheduled), np.int32, len(out.scheduled))
        return build_batch(out, block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
                           pending_rows=pending_rows, split_decodes=self.split_decodes, seq_lora=seq_lora)

    def token_bitmask(self, batch_rows, num_rows: int) -> np.ndarray | None:
        """The token masks of ``num_rows`` padded sampling rows: the structured outputs'
        (llguidance's work, ~0.3 ms a row on CPU), ``allowed_token_ids`` and ``bad_words``, all
        where a row has several (the grammar's alone where the others leave it no token); None if
        no row has one (a finished sequence's row has none)."""
        live = [(i, r) for i, r in enumerate(batch_rows) if not r.seq.finished]
        grammars = [(i, r.matcher) for i, r in live if r.matcher is not None]
        allowed = [(i, r.seq.request.allowed_mask) for i, r in live if r.seq.request.allowed_mask is not None]
        banned = [(i, words) for i, r in live if (words := _bad_word_ends(r))]
        if not grammars and not allowed and not banned:
            return None
        mask = token_bitmask(grammars, num_rows, self.vocab_size) if grammars else \
            np.full((num_rows, -(-self.vocab_size // 32)), -1, np.int32)
        for i, words in allowed:  # a grammar that allows none of them wins (its output stays valid)
            both = mask[i] & words
            if both.any():
                mask[i] = both
        for i, tokens in banned:
            rest = mask[i] & ~allowed_bitmask(tokens, self.vocab_size)
            if rest.any():
                mask[i] = rest
        return mask

    def sampling(self, batch_rows, num_rows: int, prompt_lp_rows) -> tuple:
        """``(metadata, num_logprobs, use_penalties, num_prompt_logprobs)`` of ``num_rows`` padded
        sampling rows, the first ``batch_rows`` real."""
        # A sampling chunk ends at the sequence's last token, pending ones included, or at its
        # last draft, and the scheduler has just advanced num_computed_tokens to that end. A
        # sequence that finished (or was aborted) since the step was scheduled samples a token
        # that is dropped: plainly, without its options (its penalties may lack its last token).
        rows = [SamplingRow(_DROPPED_ROW, 0, (), (), 0) if r.seq.finished else
                SamplingRow(r.seq.request.params, row_seed(r.seq.request.seed, r.index),
                            r.seq.request.prompt_token_ids,
                            r.seq.output_token_ids + r.drafted if r.seq.request.params.has_penalties else (),
                            r.seq.num_computed_tokens - r.seq.num_prompt_tokens - r.ahead) for r in batch_rows]
        allowed = self.token_bitmask(batch_rows, num_rows)
        sm, num_logprobs, use_penalties = build_sampling_metadata(rows, num_rows, self.vocab_size, self.eos_ids,
                                                                  allowed)
        # Beam search ranks each beam's top 2 * width continuations.
        beam_k = max((2 * r.seq.request.params.beam_width for r in batch_rows if r.seq.request.is_beam_search),
                     default=0)
        num_logprobs = min(bucket(max(num_logprobs, beam_k)) if max(num_logprobs, beam_k) else 0, self.vocab_size)
        num_prompt_lp = max((r.seq.request.params.prompt_logprobs for r in prompt_lp_rows), default=0)
        num_prompt_lp = min(bucket(num_prompt_lp), MAX_LOGPROBS) if num_prompt_lp else 0
        return sm, num_logprobs, use_penalties, num_prompt_lp

    def collect(self, step: InFlight | None) -> RunnerOutput:
        """Wait for a dispatched step; its sampled rows and prompt logprobs as numpy."""
        if step is None:
            return RunnerOutput(None)
        t0 = time.perf_counter()
        sampled, prompt_lp, hidden = jax.device_get((step.sampled, step.prompt_logprobs, step.hidden))
        self.time_device += time.perf_counter() - t0
        chunks, i = [], 0
        for group in step.batch.prompt_lp_rows:
            lps, ranks, top_ids, top_lps = (x[i:i + group.count] for x in prompt_lp)
            chunks.append(PromptLogprobs(group.seq.request, group.start, lps, ranks, top_ids, top_lps))
            i += group.count
        return RunnerOutput(sampled, chunks, hidden)


def _padded_pairs(pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    padded = np.zeros((bucket(len(pairs)), 2), np.int32)  # null -> null copies are no-ops
    padded[:len(pairs)] = pairs
    return padded[:, 0], padded[:, 1]
