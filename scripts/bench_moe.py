"""What a mixture of experts costs on CPU, against the dense model of the same work per token.

A random model with the default model's attention (SmolLM2-135M: 30 layers, 576 wide, float32)
and a mixture of experts in place of its MLP (``--experts`` experts ``--expert-width`` wide,
``--top-k`` a token; the defaults keep the MLP's work per token, 2 x 768 = SmolLM2's 1,536, with
4x its MLP weights), against the dense default-shaped model (random weights too):

1. the CPU form's decode forward (64-token blocks, contexts ~170) at 1 to 48 rows, both models
   alternating, medians;
2. the engine on both: ``--num-requests`` x (``--prompt-len`` + ``--output-len``) greedy tokens,
   and one request alone, alternating, generated tok/s.

    python scripts/bench_moe.py
    python scripts/bench_moe.py --experts 32 --top-k 4 --expert-width 384
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_common import alternating_runs, decode_metadata, random_params, table
from flax import nnx

import jaxpaged.model as model_mod
from jaxpaged import LLM, SamplingParams
from jaxpaged.config import LlamaConfig, MoeConfig
from jaxpaged.kv_cache import KVPool
from jaxpaged.loader import LoadedModel, build_model

BS = 64


def forward_times(models: dict, rows: list[int], reps: int, ctx: int = 170, spread: int = 60) -> dict:
    """``{(rows, name): [seconds]}`` of each model's decode forward in the CPU form, alternating."""
    rng = np.random.default_rng(0)
    out = {}
    for S in rows:
        lens = np.full(S, ctx) if S == 1 else rng.integers(ctx - spread, ctx + spread + 1, S)
        W = -(-int(lens.max()) // BS)
        tables = 1 + rng.permutation(S * W).reshape(S, W).astype(np.int32)
        md = decode_metadata(lens, tables, BS)
        steps = {}
        for name, model in models.items():
            cfg = model.cfg
            graphdef, params = nnx.split(model)
            shape = (cfg.num_layers, S * W + 1, cfg.num_kv_heads, BS, cfg.head_dim)
            tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, S), jnp.int32)
            kv = KVPool(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
            fn = jax.jit(lambda p, kv, t, md, graphdef=graphdef: nnx.merge(graphdef, p)(t, kv, md), donate_argnums=(1,))
            compiled = fn.lower(params, kv, tokens, md).compile()
            box = [kv]

            def step(compiled=compiled, box=box, params=params, tokens=tokens):
                logits, box[0] = compiled(params, box[0], tokens, md)
                return logits

            steps[name] = step

        def run(name: str) -> float:
            t = time.perf_counter()
            jax.block_until_ready(steps[name]())
            return time.perf_counter() - t

        for name, times in alternating_runs(run, steps, reps).items():
            out[S, name] = times
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-width", type=int, default=768)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 48])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--forward-reps", type=int, default=10)
    args = ap.parse_args()

    dense_cfg = LlamaConfig.smollm2_135m()
    moe = MoeConfig(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.expert_width,
                    norm_topk_prob=True)
    moe_cfg = dataclasses.replace(dense_cfg, moe=moe)
    models = {}
    for name, cfg in (("dense", dense_cfg), ("moe", moe_cfg)):
        model = build_model(cfg, random_params(cfg), dtype=jnp.float32)
        models[name] = LoadedModel(model, None, cfg, f"random {name}")
    forms = {name: model_mod.runtime_form(lm.model) for name, lm in models.items()}
    times = forward_times(forms, args.rows, args.forward_reps)
    rows = []
    for S in args.rows:
        dense, moe_ms = (statistics.median(times[S, name]) * 1e3 for name in ("dense", "moe"))
        rows.append([S, dense, moe_ms, moe_ms / dense])
    table(f"Decode forward, CPU form: ms, median of {args.forward_reps} (moe: {moe.num_experts} experts x "
          f"{moe.intermediate_size} wide, top {moe.top_k})", ["rows", "dense", "moe", "moe / dense"], rows)

    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, dense_cfg.vocab_size, args.prompt_len).tolist()}
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    engines = {name: LLM(lm, enable_prefix_caching=False) for name, lm in models.items()}
    cases = {f"{name}, {n} requests": (name, prompts[:n]) for n in (args.num_requests, 1) for name in engines}

    def run(case: str) -> float:
        name, ps = cases[case]
        t = time.perf_counter()
        outs = engines[name].generate(ps, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    rates = alternating_runs(run, cases, args.reps)
    rows = []
    for case, (name, ps) in cases.items():
        dense = statistics.median(rates[f"dense, {len(ps)} requests"])
        med = statistics.median(rates[case])
        rows.append([case, med, med / dense, " / ".join(f"{r:.1f}" for r in rates[case])])
    weights = {name: sum(x.nbytes for x in jax.tree.leaves(nnx.state(lm.model))) / 2**20 for name, lm in models.items()}
    table(f"Engine: {args.num_requests} x ({args.prompt_len} + {args.output_len}) tokens and one request, "
          f"median of {args.reps}", ["workload", "generated tok/s", "vs dense", "runs"], rows,
          [f"weights: dense {weights['dense']:.0f} MiB, moe {weights['moe']:.0f} MiB"])


if __name__ == "__main__":
    main()
