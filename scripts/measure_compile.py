"""Compile time of the jitted step for the default model (30 layers under lax.scan).

Times the first step of each shape (trace + compile + run) against a second run of the
same shape, for a prefill step and a decode step. The persistent compilation cache is off
here (it would time reading the programs back instead); ``--cached`` times that instead, the
second time the script runs.
"""

import sys
import time

import jax

from jaxpaged import LLM, SamplingParams, load_model


def main():
    if "--cached" not in sys.argv:  # before anything compiles: jax decides once per process
        jax.config.update("jax_enable_compilation_cache", False)
    lm = load_model()
    llm = LLM(lm, num_blocks=256)
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 164))}
    t = time.perf_counter()
    llm.generate(prompt, p, use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate({"prompt_token_ids": list(range(200, 264))}, p, use_tqdm=False)
    second = time.perf_counter() - t
    print(f"jax {jax.__version__} on {jax.default_backend()}: {cfg_str(lm)}")
    print(f"first run (compiles one prefill and one decode shape): {first:.2f} s")
    print(f"second run (same shapes, compiled):                     {second:.2f} s")
    print(f"compile time for the two shapes: ~{first - second:.1f} s "
          f"({llm.stats()['num_compiled_shapes']} shapes)")


def cfg_str(lm):
    c = lm.config
    return f"{c.num_layers} layers, hidden {c.hidden_size}, {c.num_heads}/{c.num_kv_heads} heads"


if __name__ == "__main__":
    main()
