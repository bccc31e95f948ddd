"""The XLA flags ``import jaxpaged`` sets for itself (``jaxpaged/xla_flags.py``)."""

import os
import subprocess
import sys

from jaxpaged.xla_flags import COMMAND_BUFFERS, set_default_xla_flags


def test_import_asks_xla_for_cuda_graphs_over_the_step_unless_told_otherwise():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    set_default_xla_flags(env)
    want = f"--xla_force_host_platform_device_count=2 --xla_gpu_enable_command_buffer={COMMAND_BUFFERS}"
    assert env["XLA_FLAGS"] == want
    for env in ({"XLA_FLAGS": "--xla_gpu_enable_command_buffer="}, {"JAXPAGED_COMMAND_BUFFERS": "0"}):
        before = dict(env)
        set_default_xla_flags(env)
        assert env == before  # the user's own flag, or the opt-out, wins
    # In a fresh process `import jaxpaged` sets it before jax starts, and jax still runs here (CPU ignores it).
    code = "import os, jaxpaged, jax.numpy as jnp; assert float(jnp.ones(3).sum()) == 3; print(os.environ['XLA_FLAGS'])"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAXPAGED_COMMAND_BUFFERS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "WHILE" in out
