"""LoRA adapters, served side by side over one base model (vLLM's multi-LoRA serving).

A request names its adapter with a :class:`LoRARequest` (``LLM.generate(...,
lora_request=...)``; the server's ``model`` field, ``--lora-modules``). The adapter is a PEFT
folder (``adapter_config.json`` and ``adapter_model.safetensors``, as ``save_pretrained``
writes it) with low-rank updates ``W + (alpha / r) B A`` to any of the attention and MLP
projections (a mixture of experts: the attention projections). The engine never merges them
into the base weights:

- :class:`LoRAManager` (host) loads an adapter the first time a request names it, checks it
  against the model (shapes, rank at most ``max_lora_rank``, nothing PEFT stores that this
  engine does not apply), and keeps the ``max_cpu_loras`` most recently used in host memory.
- :class:`LoRASlots` (one per model runner) holds ``max_loras`` adapters on the device: per
  layer and projection, every slot's ``A`` as ``[slots, rank, in]`` and ``B`` as ``[out, slots,
  rank]`` (ranks padded with zeros to ``max_lora_rank``, the scale folded into ``B``); a step's
  adapters take slots, the least recently used others giving theirs up.
- The scheduler runs at most ``max_loras`` adapters at a time: a waiting request whose adapter
  would be one more is passed over (later ones may start) until a running one's ends.
- The forward adds, per token, ``(x A_s) B_s`` of its slot ``s`` (Punica's batched form, in two
  dense products over all slots, a token's one-hot row keeping its own; tokens of the base model
  have none). A step with no adapter runs the program without LoRA.
- The prefix cache keys blocks by adapter too: a prompt's K/V under one adapter is never
  reused under another, or under the base model.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

# The projections an adapter may update, in the order the forward takes them, with PEFT's names.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter for a request (vLLM's ``LoRARequest``): ``lora_name`` names it (the server's
    ``model``), ``lora_int_id`` (>= 1) identifies it (two requests with the same id share its
    loaded weights and its cached prefixes), ``lora_path`` is its PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)) or not str(self.lora_path):
            raise ValueError(f"lora_path must be a path, got {self.lora_path!r}")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """The engine's LoRA limits (vLLM's names): ``max_loras`` adapters on the device at once
    (and in one step), ranks up to ``max_lora_rank``, ``max_cpu_loras`` loaded on the host."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        c = self.max_cpu_loras
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an int >= max_loras ({self.max_loras}), got {c!r}")


def module_shapes(cfg) -> dict[str, tuple[int, int]]:
    """Each projection an adapter may update in a model of config ``cfg``, ``(in, out)`` features,
    in :data:`MODULES`' order: all seven, or for a mixture of experts the four attention
    projections (as vLLM's LoRA did for MoE models before its fused-experts kernels: the
    experts, the router and a shared expert take no adapter)."""
    D, F = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = {"q_proj": (D, q), "k_proj": (D, kv), "v_proj": (D, kv), "o_proj": (q, D)}
    if cfg.moe is not None:
        return attention
    return {**attention, "gate_proj": (D, F), "up_proj": (D, F), "down_proj": (F, D)}


@dataclasses.dataclass
class LoRAAdapter:
    """A loaded adapter, on the host: per module it updates, ``A`` ``[layers, in, rank]`` and
    ``B`` ``[layers, rank, out]`` with the scale folded in (zeros for layers it leaves alone)."""

    request: LoRARequest
    rank: int
    weights: dict[str, tuple[np.ndarray, np.ndarray]]

    @property
    def id(self) -> int:
        return self.request.lora_int_id


def load_adapter(req: LoRARequest, cfg, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder for a model of config ``cfg``.

    Raises:
      ValueError: naming the file, key or setting this engine cannot apply.
    """
    folder = Path(req.lora_path)
    where = f"LoRA adapter {req.lora_name!r} ({folder})"
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{where}: no adapter_config.json (a PEFT LoRA folder is expected)")
    conf = json.loads(config_file.read_text())
    if conf.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {conf.get('peft_type')!r}; only LORA adapters are supported")
    for key, ok, what in (("use_dora", lambda v: not v, "DoRA"), ("bias", lambda v: v in (None, "none"), "bias"),
                          ("modules_to_save", lambda v: not v, "modules_to_save"),
                          ("fan_in_fan_out", lambda v: not v, "fan_in_fan_out")):
        if not ok(conf.get(key)):
            raise ValueError(f"{where}: {key}={conf[key]!r} ({what}) is not supported")
    r, alpha = conf.get("r"), conf.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: adapter_config.json needs an int r >= 1 and a lora_alpha, got r={r!r}, "
                         f"lora_alpha={alpha!r}")
    if r > max_rank:
        raise ValueError(f"{where}: rank {r} is more than max_lora_rank={max_rank}")
    scale = alpha / math.sqrt(r) if conf.get("use_rslora") else alpha / r
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        hint = " (adapter_model.bin: save it with safe_serialization=True)" if (
            folder / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{where}: no adapter_model.safetensors{hint}")
    from safetensors.numpy import load_file

    tensors = load_file(weights_file)
    shapes, L = module_shapes(cfg), cfg.num_layers
    found: dict[tuple[int, str], dict[str, np.ndarray]] = collections.defaultdict(dict)
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None or m.group(2) not in shapes or int(m.group(1)) >= L:
            moe = cfg.moe is not None and (m is None or m.group(2) not in shapes)
            raise ValueError(f"{where}: tensor {key!r} is not a LoRA update this engine applies (the {L} layers' "
                             f"{', '.join(shapes)}{' (a mixture of experts: its attention only)' if moe else ''})")
        found[int(m.group(1)), m.group(2)][m.group(3)] = t
    # After the tensors' names: PEFT's "all-linear" on a mixture of experts writes a rank_pattern for
    # the experts, whose tensors are the reason to name.
    for key, what in (("rank_pattern", "per-module ranks"), ("alpha_pattern", "per-module alphas")):
        if conf.get(key):
            raise ValueError(f"{where}: {key}={conf[key]!r} ({what}) is not supported")
    if not found:
        raise ValueError(f"{where}: adapter_model.safetensors holds no LoRA weights")
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for (layer, module), ab in sorted(found.items()):
        n_in, n_out = shapes[module]
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.shape != (r, n_in) or b.shape != (n_out, r):
            raise ValueError(f"{where}: layer {layer} {module}: lora_A {a.shape}, lora_B {b.shape}; this model "
                             f"needs ({r}, {n_in}) and ({n_out}, {r})")
        if module not in weights:
            weights[module] = (np.zeros((L, n_in, r), np.float32), np.zeros((L, r, n_out), np.float32))
        weights[module][0][layer] = a.astype(np.float32).T
        weights[module][1][layer] = b.astype(np.float32).T * scale
    return LoRAAdapter(req, r, weights)


class LoRAManager:
    """The adapters requests name, loaded on first use and checked; the ``max_cpu_loras`` most
    recently used stay loaded (a request holds its own adapter while it runs)."""

    def __init__(self, cfg, config: LoRAConfig):
        self.cfg, self.config = cfg, config
        self._loaded: collections.OrderedDict[int, LoRAAdapter] = collections.OrderedDict()
        # Every id ever loaded and its adapter's request: an id names one adapter for the engine's
        # life (device slots and requests still running hold adapters by id).
        self._ids: dict[int, LoRARequest] = {}

    def get(self, req: LoRARequest) -> LoRAAdapter:
        if not isinstance(req, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(req).__name__}")
        known = self._ids.get(req.lora_int_id)
        if known is not None and str(known.lora_path) != str(req.lora_path):
            raise ValueError(f"lora_int_id {req.lora_int_id} is adapter {known.lora_name!r} ({known.lora_path}); "
                             f"{req.lora_name!r} names {req.lora_path}")
        adapter = self._loaded.get(req.lora_int_id)
        if adapter is None:
            adapter = load_adapter(req, self.cfg, self.config.max_lora_rank)
            self._loaded[req.lora_int_id] = adapter
            self._ids.setdefault(req.lora_int_id, req)
            while len(self._loaded) > (self.config.max_cpu_loras or self.config.max_loras):
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(req.lora_int_id)
        return adapter


def _set_slot(weights, slot, new):
    """``weights`` (per layer, per module ``(A [S, R, in], B [out, S, R])``) with slot ``slot`` set to
    ``new`` (per layer, per module ``(A [R, in], B [out, R])``)."""
    return tuple(tuple((a.at[slot].set(na), b.at[:, slot].set(nb)) for (a, b), (na, nb) in zip(layer, layer_new))
                 for layer, layer_new in zip(weights, new))


class LoRASlots:
    """``max_loras`` adapters on the device, for one model runner (see the module docstring).

    ``weights``: per layer, per module of :func:`module_shapes`, ``(A [S, R, in], B [out, S, R])`` in
    ``dtype``, placed with ``sharding`` (replicated over a tensor-parallel mesh): arrays of their
    own per layer, which the CPU form's layer branches read in place (a slice of stacked arrays
    would be copied every layer of every step), each contracted over its minor axes, the layout
    XLA:CPU's products read without a copy (``A`` as ``[in, S * R]`` and ``B`` as ``[S * R,
    out]`` were transposed every layer of every step). Slots are replaced functionally (new
    arrays), so a step already launched keeps the ones it read."""

    def __init__(self, cfg, config: LoRAConfig, dtype, sharding):
        import jax
        import jax.numpy as jnp

        S, R = config.max_loras, config.max_lora_rank
        self.num_slots, self.rank, self.dtype = S, R, dtype
        shapes = module_shapes(cfg)
        self.modules = tuple(shapes)  # each layer's tuple of (A, B), in this order
        self.weights = tuple(tuple((jax.device_put(jnp.zeros((S, R, i), dtype), sharding),
                                    jax.device_put(jnp.zeros((o, S, R), dtype), sharding)) for i, o in shapes.values())
                             for _ in range(cfg.num_layers))
        self._slot_of: collections.OrderedDict[int, int] = collections.OrderedDict()  # adapter id -> slot, LRU first
        self._set = jax.jit(_set_slot)

    def slots(self, adapters: dict[int, LoRAAdapter]) -> dict[int, int]:
        """The slot of each of a step's adapters (at most ``num_slots``), loading those not on the
        device into the slots of the least recently used others."""
        if len(adapters) > self.num_slots:
            raise RuntimeError(f"a step with {len(adapters)} adapters; max_loras is {self.num_slots}")
        free = [s for s in range(self.num_slots) if s not in self._slot_of.values()]
        for lid, adapter in adapters.items():
            if lid not in self._slot_of:
                if free:
                    slot = free.pop()
                else:
                    victim = next(v for v in self._slot_of if v not in adapters)
                    slot = self._slot_of.pop(victim)
                self._load(slot, adapter)
                self._slot_of[lid] = slot
            self._slot_of.move_to_end(lid)
        return {lid: self._slot_of[lid] for lid in adapters}

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every layer's arrays (zeros where it leaves a module alone)."""
        new = [[(np.zeros(a.shape[1:], self.dtype), np.zeros((b.shape[0], b.shape[2]), self.dtype))
                for a, b in layer] for layer in self.weights]
        for name, (wa, wb) in adapter.weights.items():
            for layer, arrays in enumerate(new):
                a, b = arrays[self.modules.index(name)]
                a[:adapter.rank], b[:, :adapter.rank] = wa[layer].T, wb[layer].T
        self.weights = self._set(self.weights, slot, tuple(map(tuple, new)))
