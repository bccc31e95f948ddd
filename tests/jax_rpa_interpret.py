"""Two test-side patches that let jax 0.10.2's TPU interpreter run JAX's own ragged paged
attention kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) on CPU.

Installed only inside ``rpa_interpreter_patches()`` and restored on exit, so every other
kernel (jaxpaged's included) runs on the stock interpreter.

1. Reads through reshaped or bitcast refs. Every ref read goes through the interpreter's
   ``get`` callback, which turns the ref's transforms into one index range
   (``jax/_src/pallas/mosaic/interpret/utils.py`` ``to_range``) and assumes each is an
   ``NDIndexer``. JAX's RPA kernel reads its K/V double buffer as
   ``kv_bufs.at[buf].reshape(P * page * heads, D)[start::step]`` (and, for packed dtypes,
   through ``.bitcast(jnp.uint32)``): ``'ReshapeTransform' object has no attribute
   'indices'``. The patch reads through the transforms before the first reshape or
   bitcast, then applies the rest (reshape, TPU bitcast along the second-minor
   dimension, strided indexing) in numpy.
2. Masked stores. ``SharedMemory.swap_buffer_content`` builds a masked store's in-bounds
   mask with ``in_bounds_mask[in_bounds_shape[i]:] = False`` for every dimension ``i``,
   which always slices axis 0, so an in-bounds masked store into ``acc.at[:, h:h + G, :]``
   is reported as "Out-of-bounds masked swap". The patch does a masked store as a read
   plus an unmasked store of ``where(mask, val, old)``: the same result.

``tests/test_tpu_kernels.py`` pins that the stock interpreter still fails, so these can go
when JAX fixes it.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
from jax._src.pallas.mosaic.interpret import utils as iutils
from jax._src.state import indexing
from jax._src.state import types as state_types


def _np_tpu_bitcast(x: np.ndarray, dtype) -> np.ndarray:
    """jax._src.state.utils.bitcast in numpy: TPU packing along the second-minor dim."""
    dtype = np.dtype(dtype)
    xb, yb = x.dtype.itemsize, dtype.itemsize
    if xb < yb:
        r = yb // xb
        x = x.reshape(*x.shape[:-2], x.shape[-2] // r, r, x.shape[-1]).swapaxes(-1, -2)
        return np.ascontiguousarray(x).view(dtype)[..., 0]
    if xb > yb:
        r = xb // yb
        y = np.ascontiguousarray(x).view(dtype).reshape(*x.shape, r)
        return y.swapaxes(-1, -2).reshape(*x.shape[:-2], x.shape[-2] * r, x.shape[-1])
    return x.view(dtype)


@contextlib.contextmanager
def rpa_interpreter_patches():
    orig_get, orig_swap = ipc.get, ipc.swap
    raw_get, raw_swap = orig_get.__wrapped__, orig_swap.__wrapped__

    def get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *a, **kw):
        ts = list(transforms)
        cut = next((i for i, t in enumerate(ts) if not isinstance(t, indexing.NDIndexer)), None)
        if cut is None:
            return raw_get(token, device_id, local_core_id, memory_space, buffer_id, transforms, *a, **kw)
        token, x = raw_get(token, device_id, local_core_id, memory_space, buffer_id, tuple(ts[:cut]), *a, **kw)
        x = np.asarray(x)
        for t in ts[cut:]:
            if isinstance(t, state_types.ReshapeTransform):
                x = x.reshape(t.shape)
            elif isinstance(t, state_types.BitcastTransform):
                x = _np_tpu_bitcast(x, t.dtype)
            elif isinstance(t, indexing.NDIndexer):
                t = jax.tree.map(int, t)
                x = x[tuple(iutils._transform_slice_or_index(i) for i in t.indices)]
            else:
                raise NotImplementedError(f"ref transform {t}")
        return token, np.ascontiguousarray(x)

    def swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, mask, **kw):
        if mask is None:
            return raw_swap(token, device_id, local_core_id, memory_space, buffer_id, transforms, val, None, **kw)
        mask, val = np.asarray(mask), np.asarray(val)
        _, old = raw_get(token, device_id, local_core_id, memory_space, buffer_id, transforms, **kw)
        token, _ = raw_swap(token, device_id, local_core_id, memory_space, buffer_id, transforms,
                            np.where(mask, val, old), None, **kw)
        return token, np.where(mask, old, val)

    ipc.get, ipc.swap = ipc.fail_on_exception(get), ipc.fail_on_exception(swap)
    try:
        yield
    finally:
        ipc.get, ipc.swap = orig_get, orig_swap
