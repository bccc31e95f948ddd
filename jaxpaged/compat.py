"""What differs between the jax versions jaxpaged supports, in one place.

Supported: jax 0.10.2 with flax 0.12.8 (Python 3.11, where it is the newest jax) and
jax 0.11.x with flax 0.12.10+ (Python 3.12+; the GPU machine runs jax 0.11.2, CUDA 13,
flax 0.12.10). The package's own code runs unchanged on both; what differs is below.

The whole CPU test suite passes on jax 0.10.2 (Python 3.11, CI), 0.11.2 and 0.12.0.1 (Python
3.12, flax 0.12.12; 916 passed on each, 2026-11-28). jax 0.12 is not admitted yet: its GPU path
has not run on a GPU, and it deprecates the Pallas Triton backend the GPU attention kernels use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H100") -> Iterator[None]:
    """Lower Pallas GPU kernels (``lowering_platforms=("cuda",)``) on a machine with no GPU.

    jax 0.11 asks the GPU it lowers a Triton kernel for for its compute capability and
    raises "No supported GPU devices found" when there is none; jax 0.10 assumed one. An
    abstract mesh naming the GPU answers it, and jax 0.10.2 accepts the same call. Where a
    GPU is present it answers itself, and the abstract mesh would clash with the real devices
    (seen on an H100 with jax 0.11.2: "lowering_platforms ... is required when only
    AbstractMesh exists", and sharding type errors when lowering for CPU): nothing to do.
    """
    if jax.default_backend() == "gpu":
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="cuda")
    # Auto, said outright: jax 0.12 made Explicit the default, and an Explicit axis reaches
    # into every op's sharding (a dynamic_update_slice of the interpreted kernels' fails to type).
    mesh = jax.sharding.AbstractMesh((1,), ("_",), axis_types=(jax.sharding.AxisType.Auto,), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
        yield
