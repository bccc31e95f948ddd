"""Attention metadata and the one attention entry point the model calls.

The metadata is an explicit pytree passed into the jitted step (no global context).
Tokens of all sequences in a step are flattened along one axis of padded length ``T``;
sequences are padded to ``S`` rows. Padding rows have zero query length and zero
context length; padding tokens sit after ``query_start_loc[S]`` and write their K/V into
the null block.

Backends (``backend=``):

- ``"pallas"``: the Pallas kernels of :mod:`jaxpaged.pallas` (Triton on GPU, the Pallas
  interpreter on CPU, which is only for testing).
- ``"xla"``: the same algorithm in plain XLA ops (:mod:`jaxpaged.pallas.xla`), the fast
  path on CPU.
- ``"reference"``: the dense pure-jnp oracle (:mod:`jaxpaged.pallas.reference`).
- ``"auto"``: ``"xla"`` on CPU, ``"pallas"`` on GPU (measurements in
  ``scripts/bench_kernels.py``, ``scripts/bench_gpu.py`` and the README: on an H100 the
  Pallas decode kernel is 8-20x faster than the XLA path).

Decode-only steps (``md.decode_only``) use the decode kernels (one query per sequence,
split-K for long tables); all other steps use the ragged kernels.
"""

from __future__ import annotations

import dataclasses

import jax
from jaxtyping import Array, Float, Int

from jaxpaged.kv_cache import KVPool
from jaxpaged.pallas.common import check_paged_inputs
from jaxpaged.pallas.paged_attention import paged_decode_attention
from jaxpaged.pallas.ragged_paged_attention import ragged_paged_attention
from jaxpaged.pallas.reference import ref_ragged_paged_attention
from jaxpaged.pallas.xla import xla_paged_decode_attention, xla_ragged_paged_attention

BACKENDS = ("auto", "pallas", "xla", "reference")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    positions: Int[Array, "T"]  # position of each token in its own sequence (RoPE, causality)
    slot_mapping: Int[Array, "T"]  # block * block_size + offset where the token's K/V is written
    block_tables: Int[Array, "S W"]  # logical -> physical block; padding entries = null block 0
    context_lens: Int[Array, "S"]  # tokens in the cache after this step's writes; 0 = padding row
    query_start_loc: Int[Array, "S+1"]  # sequence s owns tokens [qsl[s], qsl[s+1])
    decode_only: bool = dataclasses.field(default=False, metadata=dict(static=True))  # T == S, one token each


def resolve_backend(backend: str) -> str:
    """``"auto"`` -> ``"xla"`` on CPU, ``"pallas"`` elsewhere; checks the name."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend == "auto":
        return "xla" if jax.default_backend() == "cpu" else "pallas"
    return backend


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

    ``num_splits`` overrides the split-K choice of the Pallas decode kernel; ``debug``
    range-checks the block table at run time.
    """
    backend = resolve_backend(backend)
    args = (q, kv.k, kv.v, layer, md.block_tables, md.context_lens)
    if backend == "reference":
        check_paged_inputs(*args[:3], *args[4:], md.query_start_loc, decode=False, what="paged_attention")
        return ref_ragged_paged_attention(*args, md.query_start_loc, md.positions, scale=scale)
    if md.decode_only:
        if backend == "pallas":
            return paged_decode_attention(*args, scale=scale, num_splits=num_splits, debug=debug)
        return xla_paged_decode_attention(*args, scale=scale, debug=debug)
    if backend == "pallas":
        return ragged_paged_attention(*args, md.query_start_loc, scale=scale, debug=debug)
    return xla_ragged_paged_attention(*args, md.query_start_loc, scale=scale, debug=debug)
