"""Tensor parallelism on simulated CPU devices: per-device memory and throughput per tp size.

For each model and ``tensor_parallel_size``: the bytes of weights and of the KV pool that
one device holds (the largest over the mesh) against the unsharded totals, and the
generation throughput of one fixed batch (greedy, prefix caching off, timed after a
warm-up run that compiles every shape).

- a random Llama with 8 query / 4 KV heads (loaded straight into its shards): tp = 1, 2, 4;
- the default model, SmolLM2-135M-Instruct (3 KV heads): tp = 1, 3.

The simulated devices share this machine's cores, so tp > 1 cannot be faster here: the
throughput column measures what the partitioning costs (collectives, per-shard kernels),
the memory columns prove the partitioning.

    python scripts/bench_tp.py            # sets XLA_FLAGS for 4 CPU devices itself
    python scripts/bench_tp.py --quick    # the random model only
"""

from __future__ import annotations

import os
import sys

if "jax" in sys.modules:
    raise RuntimeError("import bench_tp before jax: the device count is fixed when jax starts")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_common import random_params, table  # noqa: E402

from jaxpaged import LLM, SamplingParams, load_model  # noqa: E402
from jaxpaged.config import LlamaConfig  # noqa: E402
from jaxpaged.loader import LoadedModel, build_model  # noqa: E402
from jaxpaged.sharding import make_mesh  # noqa: E402

MiB = 1 << 20
RANDOM_CFG = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
                         num_kv_heads=4, head_dim=64, tie_word_embeddings=False, max_position_embeddings=1024)


def on_one_device(arrays) -> int:
    """Bytes of ``arrays`` held by the fullest device."""
    per_device: dict = {}
    for a in jax.tree.leaves(arrays):
        for s in a.addressable_shards:
            per_device[s.device] = per_device.get(s.device, 0) + s.data.nbytes
    return max(per_device.values())


def measure(name: str, lm: LoadedModel, tp: int, *, num_requests: int, prompt_len: int, max_tokens: int) -> list:
    llm = LLM(lm, tensor_parallel_size=tp, block_size=16, num_blocks=num_requests * 8 + 1,
              max_num_seqs=num_requests, max_num_batched_tokens=num_requests * prompt_len,
              enable_prefix_caching=False)
    params, kv = llm.runner.params, llm.runner.kv
    w_total, kv_total = sum(a.nbytes for a in jax.tree.leaves(params)), 2 * kv.k.nbytes
    w_dev, kv_dev = on_one_device(params), on_one_device(kv)
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def batch():
        return [rng.integers(0, lm.config.vocab_size, prompt_len).tolist() for _ in range(num_requests)]

    llm.generate(batch(), sp, use_tqdm=False)  # compiles the prefill and decode shapes
    steps0 = llm.stats()["num_steps"]
    t = time.perf_counter()
    outs = llm.generate(batch(), sp, use_tqdm=False)
    dt = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = llm.stats()["num_steps"] - steps0
    return [name, tp, w_total / MiB, w_dev / MiB, w_dev / w_total, kv_total / MiB, kv_dev / MiB,
            kv_dev / kv_total, n / dt, 1e3 * dt / steps]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the random model only")
    args = ap.parse_args()
    work = dict(num_requests=8, prompt_len=64, max_tokens=32)
    rows = []
    params = random_params(RANDOM_CFG)
    for tp in (1, 2, 4):
        # Straight from host numpy into each device's slices: no device holds the full model.
        model = build_model(RANDOM_CFG, params, mesh=make_mesh(tp, RANDOM_CFG), attention_backend="auto")
        lm = LoadedModel(model, None, RANDOM_CFG, "random")
        rows.append(measure("random 8L 512d 8/4 heads", lm, tp, **work))
    if not args.quick:
        for tp in (1, 3):
            rows.append(measure("SmolLM2-135M 9/3 heads", load_model(tensor_parallel_size=tp), tp, **work))
    table(f"Tensor parallelism over {jax.device_count()} simulated CPU devices (float32)",
          ["model", "tp", "weights MiB", "per device", "fraction", "KV pool MiB", "per device", "fraction",
           "tok/s", "ms/step"], rows,
          notes=[f"workload: {work['num_requests']} requests x {work['prompt_len']} prompt tokens, "
                 f"{work['max_tokens']} greedy tokens each; timed after a warm-up run; prefix caching off",
                 "per device = the fullest device; fraction = per device / unsharded (ideal 1/tp; "
                 "replicated norms are the excess)",
                 "simulated devices share the same cores: tp > 1 shows the partitioning's cost, not a speed-up"])


if __name__ == "__main__":
    main()
