"""XLA flags jaxpaged sets for itself, before jax starts its backend (``import jaxpaged`` runs this).

**CUDA graphs over the whole step.** A step runs its layers under ``lax.scan``; on a GPU,
XLA enqueues every layer's kernels from the calling thread, each launch costing host time
(Llama-3-8B on an H100: ~7.7 ms of host time a step on average to launch what the device
runs in ~10-15 ms, on the same thread as scheduling). With command buffers extended to
``WHILE`` and ``CONDITIONAL`` (XLA's default list stops at fusions, cuBLAS, cuDNN and custom
calls), the loop is recorded once per step shape as one CUDA graph and replayed. On an
H200, the Llama-3-8B-shaped run of ``scripts/bench_gpu.py --only llama8b``: 7.5 -> 2.5 ms
of launch a step, and small-batch steps 14-22% shorter (with split-K, measured together).
jax on CPU runs unchanged with it (``tests/test_xla_flags.py``); it names GPU command
buffers only, and has not been tried on a TPU here.

Set ``JAXPAGED_COMMAND_BUFFERS=0`` to leave XLA's default; a flag the user already gives
in ``XLA_FLAGS`` wins. Flags are read when jax creates its first backend, so a program that
ran jax computations before importing jaxpaged keeps what it had.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def set_default_xla_flags(environ: MutableMapping[str, str] = os.environ) -> None:
    """Add jaxpaged's flags to ``environ["XLA_FLAGS"]`` (see the module docstring)."""
    if environ.get("JAXPAGED_COMMAND_BUFFERS", "1") == "0":
        return
    flags = environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_command_buffer={COMMAND_BUFFERS}".strip()
