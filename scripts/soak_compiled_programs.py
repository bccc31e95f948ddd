"""One long-lived engine under random traffic: how many programs it compiles, how many it
keeps, and the process's memory mappings (Linux allows ``vm.max_map_count``, 65,530 by
default; past it XLA:CPU cannot compile). ``runner.BUDGET`` bounds what is kept.

A tiny random Llama (2 layers, hidden 96, the default model's 49,152-token vocabulary),
blocks of 16, the engine's defaults otherwise; each step ~0.6 new requests (3 in every
fourth hundred steps), lognormal prompts of 1-400 token ids and outputs of 1-511 tokens,
``n`` 1-3 (seeded sampling where ``n`` > 1). Prints a row every ``--every`` steps.

    python scripts/soak_compiled_programs.py --seconds 720
"""

import argparse
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged import LLM, SamplingParams, runner
from jaxpaged.config import LlamaConfig
from jaxpaged.loader import LoadedModel
from jaxpaged.model import Llama


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--every", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=96, intermediate_size=128, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    model = Llama(cfg, dtype=jnp.float32, attention_backend="xla", rngs=nnx.Rngs(0))
    llm = LLM(LoadedModel(model, None, cfg, "random"), block_size=16, enable_prefix_caching=False)
    rng = np.random.default_rng(args.seed)
    print("| s | steps | requests | model programs kept | shapes met | programs kept | freed | mappings |")
    print("|---|---|---|---|---|---|---|---|")
    t0, steps, requests = time.time(), 0, 0
    while time.time() - t0 < args.seconds:
        for _ in range(rng.poisson(0.6 if steps % 400 < 300 else 3)):
            prompt = int(np.clip(rng.lognormal(4.0, 1.0), 1, 400))
            n = int(rng.choice([1, 1, 1, 2, 3]))
            params = SamplingParams(max_tokens=int(np.clip(rng.lognormal(3.0, 1.0), 1, 511 - prompt)), n=n,
                                    ignore_eos=True, temperature=0.8 if n > 1 else 0.0, seed=requests)
            llm.add_request({"prompt_token_ids": rng.integers(3, cfg.vocab_size, prompt).tolist()}, params)
            requests += 1
        llm.step()
        steps += 1
        if steps % args.every == 0:
            print(f"| {time.time() - t0:.0f} | {steps} | {requests} | {llm.runner.programs.forward._cache_size()} "
                  f"| {len(llm.runner.compiled_shapes)} | {len(runner.BUDGET)} | {runner.BUDGET.num_evicted} "
                  f"| {runner.process_memory_maps()} |", flush=True)


if __name__ == "__main__":
    main()
