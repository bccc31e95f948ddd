"""Data parallelism (:mod:`jaxpaged.data_parallel`).

The replicas need devices that exist before jax starts, so their cases run in a child
process with 2 simulated CPU devices (``tests/dp_cases.py``); this process has one device
and checks the errors.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from test_tp import child_env

from jaxpaged import LLM
from jaxpaged.engine_args import EngineArgs

TESTS = Path(__file__).resolve().parent


# The model-tier traffic of enable_dp_attention in a process of its own: XLA:CPU maps each
# compiled program's code into a few hundred memory regions, and the cases together compile
# enough programs to near the kernel's limit of 65,530 a process. That traffic runs the
# 20,480-token vocabulary of the model tier (test_engine_traffic): its sampler's work is most
# of a step.
@pytest.mark.parametrize("which", ["not traffic_on_the_model", "traffic_on_the_model"])
def test_cases_on_two_cpu_devices(tiny_engine_folder, small_vocab_engine_folder, which):
    folder = small_vocab_engine_folder if which == "traffic_on_the_model" else tiny_engine_folder
    env = child_env(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAXPAGED_DP_TINY=str(folder))
    proc = subprocess.run([sys.executable, "-m", "pytest", str(TESTS / "dp_cases.py"), "-q", "-p", "no:cacheprovider",
                           "-k", which], env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, \
        proc.stdout[-6000:] + proc.stderr[-3000:]


def test_more_replicas_than_devices_is_refused_before_loading(tiny_engine_model):
    # This process ran jax computations already (the fixture built a model): too late for the
    # engine to make its devices, so it says how.
    with pytest.raises(ValueError, match=r"data_parallel_size=2 needs 2 devices, but only 1 cpu device\(s\) exist; "
                                         r"on CPU, create the engine before any jax computation runs in the process "
                                         r"\(it then makes its devices\), or set "
                                         r"XLA_FLAGS=--xla_force_host_platform_device_count=2 before jax starts"):
        LLM(tiny_engine_model, data_parallel_size=2)


# A fresh process without XLA_FLAGS: the engine makes its two CPU devices itself (jax's
# backend has not started), and the split runner gives one engine's greedy tokens.
_FRESH_PROCESS = """
import sys
from jaxpaged import LLM, SamplingParams
folder = sys.argv[1]
llm = LLM(folder, data_parallel_size=2, enable_dp_attention=True, max_num_seqs=4)
import jax
assert jax.device_count() == 2, jax.devices()
prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40]} for i in range(4)]
sp = SamplingParams(max_tokens=6, temperature=0)
split = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
assert llm.runner.compiled_shapes, "the program over both devices never ran"
one = [o.outputs[0].token_ids for o in LLM(folder, max_num_seqs=4).generate(prompts, sp, use_tqdm=False)]
assert split == one, (split, one)
print("ok", jax.device_count())
"""


def test_engine_makes_its_cpu_devices_in_a_fresh_process(tiny_engine_folder):
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, str(tiny_engine_folder)], env=child_env(),
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok 2"), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_dp_attention_without_replicas_is_refused_before_loading():
    with pytest.raises(ValueError, match=r"enable_dp_attention needs data_parallel_size > 1"):
        LLM("/nonexistent/model", enable_dp_attention=True)


@pytest.mark.parametrize("bad, err", [(0, ValueError), (True, TypeError), (1.5, TypeError)])
def test_bad_data_parallel_size(bad, err):
    with pytest.raises(err, match="data_parallel_size"):
        EngineArgs(data_parallel_size=bad)
