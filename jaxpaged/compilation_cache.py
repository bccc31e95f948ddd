"""jax's persistent compilation cache, on by default: a step shape compiles once per machine.

Every padded step shape is an XLA program: ~1 s to compile for the default model on CPU,
longer for big models on a GPU. Without a cache each process pays it again, so the CLI's
first answer, every notebook and every restarted server compile the same programs, and a
server stalls on each shape its traffic meets for the first time. With jax's persistent
cache a program compiled once on this machine is read back from disk by later processes.

:func:`ensure_compilation_cache` turns it on at jaxpaged's entry points (``load_model``,
``LLM``) unless jax's cache is configured already: under ``$JAXPAGED_CACHE_DIR/xla``
(default ``~/.cache/jaxpaged/xla``), in a folder per jaxlib version and host CPU. XLA:CPU
compiles for the host's instruction set, and jax's cache key names the platform ("cpu",
jax 0.10.2) but not the instruction set: a home directory shared by machines with other
CPUs must not hand them each other's code.
Programs that compile in under ``MIN_COMPILE_SECONDS`` are not kept; the cache is capped
at ``MAX_BYTES`` (least recently used first out).

To opt out, use jax's own settings: ``JAX_ENABLE_COMPILATION_CACHE=false``, or
``JAX_COMPILATION_CACHE_DIR`` for another folder. jax decides once per process, at its
first compilation, whether the cache is used: a process that compiled something before
calling into jaxpaged keeps running without it.
"""

from __future__ import annotations

import hashlib
import os
import platform
from pathlib import Path

import jax
import jaxlib

MIN_COMPILE_SECONDS = 0.2  # jax's default, 1 s, leaves out most of the default model's step shapes (0.8-1.6 s)
MAX_BYTES = 2 << 30


def host_key() -> str:
    """jaxlib's version and a hash of the host CPU's model and instruction-set flags."""
    cpu = f"{platform.machine()}|{platform.processor()}"
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu += "|" + "|".join(next((ln for ln in lines if ln.startswith(k)), "") for k in ("model name", "flags"))
    except OSError:  # not Linux: the machine and processor names are what there is
        pass
    return f"jaxlib-{jaxlib.__version__}-{hashlib.sha256(cpu.encode()).hexdigest()[:12]}"


def default_dir() -> Path:
    root = Path(os.environ.get("JAXPAGED_CACHE_DIR", Path.home() / ".cache" / "jaxpaged"))
    return root / "xla" / host_key()


def ensure_compilation_cache() -> Path | None:
    """Point jax's persistent cache at :func:`default_dir` unless jax's cache is configured
    (or turned off) already. Returns the folder it set, or None when it left jax's settings
    alone. Idempotent."""
    if not jax.config.jax_enable_compilation_cache or jax.config.jax_compilation_cache_dir:
        return None
    path = default_dir()
    jax.config.update("jax_compilation_cache_dir", str(path))
    if jax.config.jax_persistent_cache_min_compile_time_secs == 1.0:  # jax's default: not the user's choice
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    if jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path
