"""The engine's options, checked before anything is loaded, and the KV pool they size.

``LLM`` documents every option; this module validates them (a clear error naming the
option and the limit) and turns memory sizes into a number of KV blocks.
"""

from __future__ import annotations

import dataclasses
import re

from jaxpaged.attention import BACKENDS, resolve_backend
from jaxpaged.kv_cache import check_kv_cache_dtype
from jaxpaged.scheduler import SCHEDULING_POLICIES
from jaxpaged.spec_decode import SpeculativeConfig, as_speculative_config

DEFAULT_CPU_KV_MEMORY = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32
DEVICE_KV_FRACTION = 0.5  # of a GPU's or TPU's memory still free after loading the weights
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1 << 10, "M": 1e6, "MB": 1e6, "MIB": 1 << 20,
          "G": 1e9, "GB": 1e9, "GIB": 1 << 30, "T": 1e12, "TB": 1e12, "TIB": 1 << 40}


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """``2147483648``, ``"2GiB"``, ``"512 MB"`` → bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be a number of bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size like '2GiB' or '512MB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return n


def _check_int(name: str, v, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if v < minimum:
        raise ValueError(f"{name}={v} must be >= {minimum}")


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """``LLM``'s engine options (see its docstring), validated on construction."""

    block_size: int | None = None  # None: default_block_size() of the platform
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: int | str = 0
    attention_backend: str = "auto"
    seed: int = 0
    debug_checks: bool = False
    kv_allocator: str = "paged"
    tensor_parallel_size: int = 1
    async_scheduling: bool = True
    kv_cache_dtype: str = "auto"
    data_parallel_size: int = 1
    speculative_config: SpeculativeConfig | dict | None = None  # a dict becomes a SpeculativeConfig
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", as_speculative_config(self.speculative_config))
        if self.block_size is not None:
            _check_int("block_size", self.block_size, 1)
            if self.block_size & (self.block_size - 1) or self.block_size > 256:
                raise ValueError(f"block_size={self.block_size} must be a power of two in [1, 256]")
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("seed", self.seed, 0)
        for name in ("enable_prefix_caching", "debug_checks", "async_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("data_parallel_size", self.data_parallel_size, 1)
        for name, minimum in (("num_blocks", 2), ("max_model_len", 1), ("max_num_batched_tokens", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum)
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={self.preemption_mode!r}; choose 'recompute' or 'swap'")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy={self.scheduling_policy!r}; choose from {SCHEDULING_POLICIES}")
        if self.preemption_mode == "swap" and not self.swap_bytes:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (host memory for KV blocks)")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        if self.kv_allocator not in ("paged", "contiguous"):
            raise ValueError(f"kv_allocator={self.kv_allocator!r}; choose 'paged' or 'contiguous'")
        if self.kv_allocator == "contiguous" and self.preemption_mode == "swap":
            raise ValueError("kv_allocator='contiguous' has no swap space; use preemption_mode='recompute'")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; choose from {BACKENDS}")

    @property
    def swap_bytes(self) -> int:
        return parse_bytes(self.swap_space, "swap_space") if self.swap_space else 0

    def model_len(self, max_position_embeddings: int) -> int:
        n = self.max_model_len or max_position_embeddings
        if n > max_position_embeddings:
            raise ValueError(f"max_model_len={n} exceeds the model's max_position_embeddings={max_position_embeddings}")
        return n

    def kv_blocks(self, block_bytes: int, max_model_len: int) -> int:
        """Blocks in each device's pool; ``block_bytes`` is one block of every layer's K and V."""
        device_block_bytes = block_bytes // self.tensor_parallel_size  # each device holds its heads
        num_blocks = self.num_blocks
        if num_blocks is None:
            kv_bytes = parse_bytes(self.kv_cache_memory) if self.kv_cache_memory is not None else \
                _default_kv_bytes(device_block_bytes, self.block_size, self.attention_backend, self.max_num_seqs,
                                  max_model_len)
            num_blocks = kv_bytes // device_block_bytes
        if num_blocks < 2:
            raise ValueError(f"a KV pool of {num_blocks} blocks is too small: one is the null block, "
                             f"and a request needs at least one more ({block_bytes} bytes per block)")
        return num_blocks


def default_block_size(platform: str, attention_backend: str = "auto", kv_cache_dtype: str = "auto") -> int:
    """Tokens per KV block where ``block_size`` is not given: 64 on CPU where attention runs
    in XLA ops, 16 elsewhere (the Pallas kernels on GPU and TPU, as in vLLM). ``platform``
    is a device's (``"cpu"``, ``"gpu"``, ``"tpu"``).

    The XLA path gathers each row's blocks, one ``block_size x head_dim`` tile per KV head,
    and on CPU such a gather reads DRAM at a rate set by the tile's size: random tiles of
    4 / 16 / 64 KB (float32, head_dim 64: blocks of 16 / 64 / 256) at 13.5 / 18.9 / 26.8 GB/s,
    where a streaming read runs at ~42-47 GB/s (2-core AMD EPYC, 30 layers' worth of tiles,
    too many to stay in cache). With the default model, 48 requests x 128
    tokens ran at 344-378 generated tok/s with blocks of 16, 392 with 32, 439-453 with 64
    and 442 with 128 (decode steps at context ~100-230: p50 96-102 -> 81 ms); single-stream
    decode is unchanged (59 tok/s). vLLM's CPU platform does the same (128 where its IPEX
    kernels run). The costs: a block of 64 wastes up to 63 slots per sequence (that workload
    peaks at 87% KV utilization), and prefix caching shares whole blocks only, so a shared
    prefix shorter than 64 tokens gets no hit (``LLM(block_size=16)`` where that matters).
    A float8 pool under the TPU kernels takes 32: a page of bytes must fill whole 32-row VMEM
    tiles (``pallas.tpu_common.check_tpu_shapes``).
    """
    backend = resolve_backend(attention_backend, platform)
    if platform == "cpu" and backend == "xla":
        return 64
    return 32 if backend == "pallas_tpu" and kv_cache_dtype.startswith("fp8") else 16


def _default_kv_bytes(block_bytes: int, block_size: int | None, attention_backend: str, max_num_seqs: int,
                      max_model_len: int) -> int:
    import jax

    device = jax.local_devices()[0]
    block_size = block_size or default_block_size(device.platform, attention_backend)
    return default_kv_bytes(device.platform, device.memory_stats(), block_bytes=block_bytes,
                            block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len)


def default_kv_bytes(platform: str, memory_stats: dict | None, *, block_bytes: int, block_size: int,
                     max_num_seqs: int, max_model_len: int) -> int:
    """Bytes of KV pool per device when ``kv_cache_memory`` is not given.

    On CPU: room for ``max_num_seqs`` sequences of ``max_model_len`` tokens, capped at
    ``DEFAULT_CPU_KV_MEMORY`` (host memory is shared with everything else). On an
    accelerator (GPU or TPU, the same rule): ``DEVICE_KV_FRACTION`` of the memory the
    device reports free after the weights are loaded (``memory_stats()``:
    ``bytes_limit - bytes_in_use``), or ``DEFAULT_CPU_KV_MEMORY`` when it reports nothing.
    """
    if platform == "cpu":
        need = max_num_seqs * (-(-max_model_len // block_size) + 1) * block_bytes
        return min(DEFAULT_CPU_KV_MEMORY, need)
    stats = memory_stats or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return int(DEVICE_KV_FRACTION * free) if free > 0 else DEFAULT_CPU_KV_MEMORY
