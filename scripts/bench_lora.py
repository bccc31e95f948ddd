"""What serving LoRA adapters costs, side by side, on the default model (float32 on CPU).

The same workload (random prompt ids, greedy, ``ignore_eos``, all requests at once) on the base
model and through adapters (random PEFT folders of rank ``--rank`` on all seven projections):
every request on one adapter (``max_loras=1``), and the requests spread over four adapters
(``max_loras=4``: each step computes all four slots' updates). Then one request alone with and
without an adapter. Engines alternate, ``--reps`` times each; the table gives the median
generated tok/s and its ratio to the base model's in the same run.

    python scripts/bench_lora.py
    python scripts/bench_lora.py --num-requests 48 --output-len 128 --rank 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_common import alternating_runs, table
from safetensors.numpy import save_file

from jaxpaged import LLM, LoRARequest, SamplingParams
from jaxpaged.loader import load_model
from jaxpaged.lora import MODULES, module_shapes


def random_adapter(folder: Path, cfg, rank: int, seed: int) -> Path:
    """A PEFT LoRA folder with random A and B on every projection of every layer."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    tensors = {}
    for layer in range(cfg.num_layers):
        for m, (n_in, n_out) in module_shapes(cfg).items():
            block = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{key}.lora_A.weight"] = (0.02 * rng.standard_normal((rank, n_in))).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal((n_out, rank))).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": list(MODULES)}))
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    lm = load_model(dtype=np.float32)
    cfg = lm.config
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, args.prompt_len).tolist()}
               for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    tmp = Path(tempfile.mkdtemp(prefix="jaxpaged-lora-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(random_adapter(tmp / f"a{i}", cfg, args.rank, i))) for i in range(4)]
    common = dict(enable_prefix_caching=False, max_lora_rank=args.rank)
    engines = {"base model": LLM(lm, **common),
               "one adapter (max_loras=1)": LLM(lm, enable_lora=True, max_loras=1, **common),
               "four adapters (max_loras=4)": LLM(lm, enable_lora=True, max_loras=4, **common)}
    cases = {  # name: (engine, prompts, one lora request per prompt)
        "base model": ("base model", prompts, None),
        "one adapter": ("one adapter (max_loras=1)", prompts, adapters[0]),
        "four adapters, a quarter each": ("four adapters (max_loras=4)", prompts,
                                          [adapters[i % 4] for i in range(len(prompts))]),
        "single stream, base model": ("base model", prompts[:1], None),
        "single stream, one adapter": ("one adapter (max_loras=1)", prompts[:1], adapters[0]),
    }

    def run(case: str) -> float:
        engine, ps, lora = cases[case]
        t = time.perf_counter()
        outs = engines[engine].generate(ps, params, lora_request=lora, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)

    rates = alternating_runs(run, cases, args.reps)
    med = {case: statistics.median(r) for case, r in rates.items()}
    rows = []
    for case in cases:
        ref = "single stream, base model" if case.startswith("single") else "base model"
        rows.append([case, len(cases[case][1]), med[case], med[case] / med[ref],
                     " / ".join(f"{r:.1f}" for r in rates[case])])
    table(f"LoRA cost: {args.num_requests} x ({args.prompt_len} + {args.output_len}) tokens, rank {args.rank}, "
          f"median of {args.reps}", ["workload", "requests", "generated tok/s", "vs base", "runs"], rows)


if __name__ == "__main__":
    main()
