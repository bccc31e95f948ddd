"""Paged-attention implementations over the stacked KV pool (see ``kv_cache.py``).

- ``reference``: dense pure-jnp oracle, written for clarity.
- ``paged_attention``: Pallas decode kernel (one query per sequence) with split-K.
- ``ragged_paged_attention``: Pallas kernel for prefill, chunked prefill and mixed batches.
- ``xla``: the same algorithms in plain XLA ops, the fast path on CPU.
- ``tpu_paged_attention``, ``tpu_ragged_paged_attention``: Mosaic TPU kernels with the
  same signatures (decode with split-K; ragged), sharing the page pipeline of ``tpu_common``.
- ``common``: input checks, layer folding, the ragged query-block schedule.

``jaxpaged.attention.paged_attention`` picks among them (``backend=``).
"""
