"""Attention metadata and the one attention entry point the model calls.

The metadata is an explicit pytree passed into the jitted step (no global context).
Tokens of all sequences in a step are flattened along one axis of padded length ``T``;
sequences are padded to ``S`` rows. Padding rows have zero query length and zero
context length; padding tokens sit after ``query_start_loc[S]`` and write their K/V into
the null block.

Backends (``backend=``):

- ``"pallas_tpu"``: the Mosaic kernels (:mod:`jaxpaged.pallas.tpu_paged_attention`,
  :mod:`~jaxpaged.pallas.tpu_ragged_paged_attention`). On CPU, only for testing, they
  run in Pallas' generic interpreter (each DMA a plain copy); under
  ``pltpu.force_tpu_interpret_mode()`` in TPU interpret mode, which simulates the memory
  spaces, DMAs and semaphores. TPU interpret mode is not the default because its ordered
  host callbacks, staged in the CPU branch, make jax 0.10.2 fail to lower the step for TPU.
- ``"pallas_gpu"``: the Triton kernels (:mod:`jaxpaged.pallas.paged_attention`,
  :mod:`~jaxpaged.pallas.ragged_paged_attention`), on CUDA and ROCm; on CPU they run in
  the Pallas interpreter, only for testing.
- ``"pallas"``: the Pallas kernels of the platform: ``"pallas_tpu"`` on TPU,
  ``"pallas_gpu"`` on GPU and (interpreted) on CPU.
- ``"xla"``: the same algorithm in plain XLA ops (:mod:`jaxpaged.pallas.xla`), the fast
  path on CPU; runs anywhere.
- ``"reference"``: the dense pure-jnp oracle (:mod:`jaxpaged.pallas.reference`).
- ``"auto"`` (the default): ``"pallas_tpu"`` on TPU, ``"pallas_gpu"`` on GPU, ``"xla"``
  on CPU and anything else (measurements in ``scripts/bench_kernels.py``,
  ``scripts/bench_gpu.py`` and docs/measurements.md: on an H100 the Pallas decode kernel is 8-20x
  faster than the XLA path; on CPU Pallas only interprets).

**Selection rule.** The platform is the one the step is *lowered* for, not the one this
process runs on: :func:`paged_attention` stages one branch per platform with
:func:`jax.lax.platform_dependent` (table: :func:`resolve_backend`), and lowering keeps
only the branch of the target platform. So a step jitted on a CPU machine and lowered
with ``lowering_platforms=("tpu",)`` (or exported for TPU) holds the Mosaic kernel, and
the compiled CPU step holds the XLA path alone, with no conditional and no kernel in it.
Every branch is traced, so a kernel that cannot take the shapes (Mosaic: ``block_size``
a multiple of 8; Triton: power-of-two ``block_size`` and ``head_dim`` >= 16) does not
join: under ``"auto"`` its platform gets the XLA path instead; under a named Pallas
backend its platform is left out, so lowering for it fails, and on this process's own
platform the kernel's error is raised right away.

Decode-only steps (``md.decode_only``) use the decode kernels (one query per sequence,
split-K for long tables); all other steps use the ragged kernels (on GPU, or their
decode rows the decode kernel: ``ragged_paged_attention.MIXED_DECODE_ROWS``). A mixed
step laid out in two parts (``md.num_decode_rows``, the XLA path's layout on CPU) runs
its leading one-token rows through the decode kernels and the rest through the ragged
ones, on every backend.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.kv_cache import KVPool
from jaxpaged.pallas.common import check_paged_inputs
from jaxpaged.pallas.paged_attention import paged_decode_attention
from jaxpaged.pallas import ragged_paged_attention as gpu_ragged
from jaxpaged.pallas.ragged_paged_attention import mixed_paged_attention, ragged_paged_attention
from jaxpaged.pallas.reference import ref_ragged_paged_attention
from jaxpaged.pallas.tpu_common import HLO_INTERPRETER
from jaxpaged.pallas.tpu_paged_attention import tpu_paged_decode_attention
from jaxpaged.pallas.tpu_ragged_paged_attention import tpu_ragged_paged_attention
from jaxpaged.pallas.xla import xla_paged_decode_attention, xla_ragged_paged_attention

BACKENDS = ("auto", "pallas", "pallas_tpu", "pallas_gpu", "xla", "reference")

# backend -> {lowering platform: implementation}. None: every platform not named; a
# platform missing from a row cannot run that backend. A Pallas kernel on "cpu" runs in
# its interpreter.
_SELECTION: dict[str, dict[str | None, str]] = {
    "auto": {"tpu": "pallas_tpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", None: "xla"},
    "pallas": {"tpu": "pallas_tpu", "cuda": "pallas_gpu", "rocm": "pallas_gpu", "cpu": "pallas_gpu"},
    "pallas_tpu": {"tpu": "pallas_tpu", "cpu": "pallas_tpu"},
    "pallas_gpu": {"cuda": "pallas_gpu", "rocm": "pallas_gpu", "cpu": "pallas_gpu"},
    "xla": {None: "xla"},
    "reference": {None: "reference"},
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions: Int[Array, "T"]  # position of each token in its own sequence (RoPE, causality)
    slot_mapping: Int[Array, "T"]  # block * block_size + offset where the token's K/V is written
    block_tables: Int[Array, "S W"]  # logical -> physical block; padding entries = null block 0
    context_lens: Int[Array, "S"]  # tokens in the cache after this step's writes; 0 = padding row
    query_start_loc: Int[Array, "S+1"]  # sequence s owns tokens [qsl[s], qsl[s+1])
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))  # T == S, one token each
    # A split mixed step: rows [0, D) one token each (tokens [0, D)), attended as a decode
    # batch; the rest as a ragged one. 0: not split (batch.build_batch's ``split_decodes``).
    num_decode_rows: int = dataclasses.field(default=0, metadata=dict(static=True))

    def split(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """The decode part's metadata and the ragged part's, each with its own rows and tokens."""
        D = self.num_decode_rows
        qsl = self.query_start_loc
        return (AttentionMetadata(self.positions[:D], self.slot_mapping[:D], self.block_tables[:D],
                                  self.context_lens[:D], qsl[:D + 1], decode_only=True),
                AttentionMetadata(self.positions[D:], self.slot_mapping[D:], self.block_tables[D:],
                                  self.context_lens[D:], qsl[D:] - qsl[D]))


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")


def resolve_backend(backend: str, platform: str) -> str | None:
    """The implementation ``backend`` runs when lowered for ``platform`` (``"cpu"``, ``"tpu"``,
    ``"cuda"``, ``"rocm"``, ...): ``"pallas_tpu"``, ``"pallas_gpu"``, ``"xla"`` or
    ``"reference"`` (a Pallas kernel on ``"cpu"`` is interpreted); None where it cannot run.

    >>> resolve_backend("auto", "tpu"), resolve_backend("auto", "cpu"), resolve_backend("pallas", "cuda")
    ('pallas_tpu', 'xla', 'pallas_gpu')
    """
    check_backend(backend)
    row = _SELECTION[backend]
    return row.get(platform, row.get(None))


def _attend(impl: str, interpret: bool, q, k_pool, v_pool, layer, block_tables, context_lens, query_start_loc,
            positions, *, decode: bool, scale: float, num_splits: int | None, debug: bool):
    """One implementation over the arguments of :func:`paged_attention`, flattened."""
    args = (q, k_pool, v_pool, layer, block_tables, context_lens)
    if impl == "reference":
        return ref_ragged_paged_attention(*args, query_start_loc, positions, scale=scale)
    if impl == "xla":
        if decode:
            return xla_paged_decode_attention(*args, scale=scale, debug=debug)
        return xla_ragged_paged_attention(*args, query_start_loc, scale=scale, debug=debug)
    decode_fn, ragged_fn = {"pallas_gpu": (paged_decode_attention, ragged_paged_attention),
                            "pallas_tpu": (tpu_paged_decode_attention, tpu_ragged_paged_attention)}[impl]
    if impl == "pallas_tpu" and interpret:
        interpret = HLO_INTERPRETER  # not TPU interpret mode: its callbacks break TPU lowering (see there)
    if decode:
        return decode_fn(*args, scale=scale, num_splits=num_splits, interpret=interpret, debug=debug)
    if gpu_ragged.MIXED_DECODE_ROWS not in ("ragged", "split"):
        raise ValueError(f"ragged_paged_attention.MIXED_DECODE_ROWS={gpu_ragged.MIXED_DECODE_ROWS!r}: "
                         "'ragged' or 'split'")
    if impl == "pallas_gpu" and gpu_ragged.MIXED_DECODE_ROWS == "split":
        return mixed_paged_attention(*args, query_start_loc, scale=scale, num_splits=num_splits,
                                     interpret=interpret, debug=debug)
    return ragged_fn(*args, query_start_loc, scale=scale, interpret=interpret, debug=debug)


def _trace_error(fn: Callable, args) -> Exception | None:
    """What tracing ``fn(*args)`` raises (a kernel rejecting the shapes or dtype), if anything."""
    try:
        jax.eval_shape(fn, *args)  # the kernels' inner jits cache this trace for the real one
    except Exception as e:  # noqa: BLE001  (any kernel refusal; "auto" must still run elsewhere)
        return e
    return None


def _is_this_process_platform(platform: str | None) -> bool:
    here = jax.default_backend()  # "gpu" for both CUDA and ROCm
    return platform == here or (here == "gpu" and platform in ("cuda", "rocm"))


def paged_attention(
    q: Float[Array, "T Hq D"],
    kv: KVPool,
    layer: Int[Array, ""],
    md: AttentionMetadata,
    *,
    scale: float,
    backend: str = "auto",
    num_splits: int | None = None,
    debug: bool = False,
) -> Float[Array, "T Hq D"]:
    """Attention of this step's queries over the paged pool of one layer.

    ``layer`` may be traced (the model's ``lax.scan`` index): every backend reads that
    layer out of the full stacked pool without copying it. Token ``t`` of a decode-only
    step is the query of sequence ``t``. Token positions are implied by the metadata
    (each sequence's queries are the last ``q_len`` tokens of its context);
    ``md.positions`` must agree (the reference backend uses it).

    ``backend`` is chosen per lowering platform (see the module docstring); ``num_splits``
    overrides the split-K choice of the Pallas decode kernels; ``debug`` range-checks the
    block table at run time.
    """
    check_backend(backend)
    if md.num_decode_rows and not md.decode_only:
        D = md.num_decode_rows
        if not 0 < D < min(q.shape[0], md.context_lens.shape[0]):
            raise ValueError(f"num_decode_rows={D}: must leave tokens ({q.shape[0]}) and rows "
                             f"({md.context_lens.shape[0]}) to the ragged part")
        parts = [paged_attention(x, kv, layer, m, scale=scale, backend=backend, num_splits=num_splits, debug=debug)
                 for x, m in zip((q[:D], q[D:]), md.split())]
        return jnp.concatenate(parts)
    check_paged_inputs(q, kv.k, kv.v, md.block_tables, md.context_lens, md.query_start_loc,
                       decode=md.decode_only, what="paged_attention")
    args = (q, kv.k, kv.v, layer, md.block_tables, md.context_lens, md.query_start_loc, md.positions)
    attend = functools.partial(_attend, decode=md.decode_only, scale=scale, num_splits=num_splits, debug=debug)
    row = _SELECTION[backend]
    if set(row) == {None}:  # the same code on every platform: no platform_dependent at all
        return attend(row[None], False, *args)
    fns: dict[tuple[str, bool], Callable] = {}  # one function per implementation: platforms share branches
    branches, refusal = {}, None
    for platform, impl in row.items():
        key = (impl, platform == "cpu" and impl != "xla")
        if key not in fns:
            fns[key] = functools.partial(attend, *key)
            if impl != "xla" and (error := _trace_error(fns[key], args)) is not None:
                if backend == "auto":
                    fns[key] = functools.partial(attend, "xla", False)
                elif _is_this_process_platform(platform):
                    raise error
                else:
                    fns[key], refusal = None, error
        if fns[key] is not None:
            branches["default" if platform is None else platform] = fns[key]
    if not branches:
        raise refusal
    return jax.lax.platform_dependent(*args, **branches)
