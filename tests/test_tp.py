"""Tensor parallelism (:mod:`jaxpaged.sharding`).

The multi-device cases need devices that exist before jax starts, so they run in child
processes: ``tests/tp_cases.py`` under pytest with 4 simulated CPU devices, and
``tests/tp_multiprocess.py`` as two ``jax.distributed`` processes on localhost. This
process has one device: it checks the errors and that ``tensor_parallel_size=1`` adds
nothing.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import make_tiny_moe, make_tiny_qwen, make_tiny_tp_hf
from jax.sharding import PartitionSpec as P

from jaxpaged import LLM, sharding
from jaxpaged.cli import build_parser
from jaxpaged.config import LlamaConfig

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory):
    return make_tiny_tp_hf(tmp_path_factory.mktemp("tiny-tp"))


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def tiny_qwens(tmp_path_factory):
    """A Qwen2 and a Qwen3 (biases, q/k norms: params of their own to shard)."""
    folders = [tmp_path_factory.mktemp(arch) for arch in ("qwen2", "qwen3")]
    for folder, arch in zip(folders, ("qwen2", "qwen3")):
        make_tiny_qwen(folder, arch, tie=arch == "qwen2")
    return folders


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A Qwen2-MoE (experts and a shared expert to shard)."""
    folder = tmp_path_factory.mktemp("qwen2_moe")
    make_tiny_moe(folder, "qwen2_moe")
    return folder


@pytest.mark.long
def test_cases_on_four_cpu_devices(tiny_tp, tiny_qwens, tiny_moe):
    """tp = 1, 2, 4 on a tiny model and tp = 1, 3 on the default model: same tokens and
    logits, the step's collectives, 1/N memory, errors (see tests/tp_cases.py)."""
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=4", JAXPAGED_TP_TINY=str(tiny_tp),
                    JAXPAGED_TP_QWEN=os.pathsep.join(map(str, tiny_qwens)), JAXPAGED_TP_MOE=str(tiny_moe))
    proc = subprocess.run([sys.executable, "-m", "pytest", str(TESTS / "tp_cases.py"), "-q", "-p", "no:cacheprovider"],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, \
        proc.stdout[-6000:] + proc.stderr[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_on_localhost(tiny_tp, tmp_path):
    """jax.distributed over two CPU processes (gloo): one mesh, each process holding half the
    KV heads, both receiving the tokens and logprobs of a single-process run."""
    from tp_cases import ENGINE, GREEDY, PROMPTS

    port = _free_port()
    outs = [tmp_path / f"process{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(TESTS / "tp_multiprocess.py"), str(i), "2", str(port),
                               str(tiny_tp), str(outs[i])], env=child_env(), cwd=TESTS.parent,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    ref = LLM(tiny_tp, **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)
    for out in outs:
        got = json.loads(out.read_text())
        assert got["tokens"] == [o.outputs[0].token_ids for o in ref]
        want = [[lp[t].logprob for lp in o.outputs[0].logprobs for t in sorted(lp)] for o in ref]
        for g, w in zip(got["logprobs"], want):
            np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
        assert got["local_pool_shard"][2] * 2 == got["global_pool"][2]


# ---- one device ----------------------------------------------------------------------


def test_tp1_adds_nothing(tiny_tp):
    llm = LLM(tiny_tp, tensor_parallel_size=1, num_blocks=8)
    assert llm.loaded.model.mesh is None
    assert llm.runner.kv.k.sharding == jax.sharding.SingleDeviceSharding(jax.devices()[0])


def test_more_devices_than_exist(tiny_tp):
    n = jax.device_count() + 1
    with pytest.raises(ValueError, match=rf"tensor_parallel_size={n} needs {n} devices, but only {n - 1} "
                                         rf"cpu device\(s\) exist; on CPU, create the engine before any jax "
                                         rf"computation runs in the process \(it then makes its devices\), or set "
                                         rf"XLA_FLAGS=--xla_force_host_platform_device_count={n} before jax starts"):
        LLM(tiny_tp, tensor_parallel_size=n)


@pytest.mark.parametrize("n,exc,match", [(0, ValueError, "must be >= 1"), (-2, ValueError, "must be >= 1"),
                                         ("2", TypeError, "must be an int"), (1.0, TypeError, "must be an int")])
def test_bad_tensor_parallel_size(tiny_tp, n, exc, match):
    with pytest.raises(exc, match=match):
        LLM(tiny_tp, tensor_parallel_size=n)


def cfg(**kw) -> LlamaConfig:
    base = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                num_kv_heads=3, head_dim=64)
    return LlamaConfig(**{**base, **kw})


def test_valid_sizes_divide_kv_heads_and_mlp():
    assert sharding.valid_tp_sizes(cfg()) == [1, 3]  # SmolLM2-135M
    assert sharding.valid_tp_sizes(cfg(num_heads=32, num_kv_heads=8, intermediate_size=14336)) == [1, 2, 4, 8]
    assert sharding.valid_tp_sizes(cfg(num_heads=8, num_kv_heads=4, intermediate_size=6)) == [1, 2]


def test_vocab_not_divisible_replicates_embeddings():
    assert sharding.param_specs(cfg(tie_word_embeddings=True), 3)["embed"] == P(sharding.TP, None)
    specs = sharding.param_specs(cfg(vocab_size=49153), 3)
    assert specs["embed"] == P() and specs["lm_head"] == P()
    assert specs["layers"]["wo"] == P(None, sharding.TP, None, None)


def test_cli_flag():
    assert build_parser().parse_args(["hi", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    assert build_parser().parse_args(["hi"]).tensor_parallel_size == 1
