"""The persistent compilation cache (``jaxpaged.compilation_cache``): on by default under
``$JAXPAGED_CACHE_DIR``, so a second process reads the step programs back instead of
compiling them and gives the same tokens; jax's own settings win.

Each case runs in a fresh interpreter: jax decides once per process, at its first
compilation, whether the cache is used.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jaxlib

ENGINE = r"""
import json, sys
import jax
hits = []
jax.monitoring.register_event_listener(
    lambda event, **kw: hits.append(event) if event == "/jax/compilation_cache/cache_hits" else None)
from jaxpaged import LLM, SamplingParams, load_model
llm = LLM(load_model(sys.argv[1], attention_backend="xla"), num_blocks=64, max_num_seqs=4)
out = llm.generate(["Hello there", "Paged attention is"], SamplingParams(max_tokens=8, temperature=0),
                   use_tqdm=False)
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out], "hits": len(hits),
                  "dir": jax.config.jax_compilation_cache_dir}))
"""

ENSURE = r"""
import json
import jax
from jaxpaged.compilation_cache import ensure_compilation_cache
print(json.dumps({"set": str(ensure_compilation_cache()), "dir": jax.config.jax_compilation_cache_dir,
                  "min_s": jax.config.jax_persistent_cache_min_compile_time_secs,
                  "max_bytes": jax.config.jax_compilation_cache_max_size}))
"""


def run(code: str, *args: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_ENABLE_COMP",
                                                                       "JAX_PERSISTENT_CACHE"))}
    r = subprocess.run([sys.executable, "-c", code, *args], env={**clean, **env}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def programs(folder: Path, name: str) -> set[str]:
    return {p.name for p in folder.rglob(f"jit_{name}-*")}


def test_second_process_reads_the_step_programs_back(tiny_engine_folder, tmp_path):
    env = {"JAXPAGED_CACHE_DIR": str(tmp_path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    first = run(ENGINE, str(tiny_engine_folder), **env)
    assert first["dir"].startswith(str(tmp_path / "xla" / f"jaxlib-{jaxlib.__version__}-"))
    written = programs(tmp_path, "_forward")
    assert first["hits"] == 0 and written, first  # the model's step shapes, compiled and kept

    second = run(ENGINE, str(tiny_engine_folder), **env)
    assert second["tokens"] == first["tokens"]
    assert second["hits"] >= len(written), (second, written)
    assert programs(tmp_path, "_forward") == written  # nothing compiled again


def test_defaults_set_only_where_jax_is_not_configured(tmp_path):
    mine = run(ENSURE, JAXPAGED_CACHE_DIR=str(tmp_path))
    assert mine["set"] == mine["dir"] and mine["dir"].startswith(str(tmp_path / "xla"))
    assert (mine["min_s"], mine["max_bytes"]) == (0.2, 2 << 30)

    theirs = run(ENSURE, JAXPAGED_CACHE_DIR=str(tmp_path), JAX_COMPILATION_CACHE_DIR=str(tmp_path / "theirs"),
                 JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="3")
    assert theirs == {"set": "None", "dir": str(tmp_path / "theirs"), "min_s": 3.0, "max_bytes": -1}

    off = run(ENSURE, JAXPAGED_CACHE_DIR=str(tmp_path), JAX_ENABLE_COMPILATION_CACHE="false")
    assert off["set"] == "None" and off["dir"] is None
