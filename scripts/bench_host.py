"""Host time per engine step: 256 decoding sequences through a tiny model on CPU.

The model is small enough that the device step costs little, so what is left of a step is
the engine's own Python: scheduling, building the padded batch and the sampling metadata,
dispatching, and applying the results. With ``async_scheduling`` that work runs while the
device computes the previous step, so a step should cost about max(host, device).

    python scripts/bench_host.py                 # sync and overlapped loops, side by side
    python scripts/bench_host.py --modes sync    # also runs on engines without async scheduling

Columns: ms per decode step (wall clock over steps where all 256 sequences decode), the
host phases per step from the engine's timers (schedule, batch = batch + sampling metadata
+ dispatch, post = applying results), ``wait`` =
time blocked on the device, and ``device`` = the jitted model + sampler alone on the same
shapes (no host work), measured in the same run.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import random_params  # noqa: E402

from jaxpaged import LLM, SamplingParams  # noqa: E402
from jaxpaged.config import LlamaConfig  # noqa: E402
from jaxpaged.loader import LoadedModel, build_model  # noqa: E402

CFG = LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=1024)


def run(mode: str, lm: LoadedModel, prompts, sp, repeats: int) -> dict:
    kwargs = {"async_scheduling": mode == "async"}
    if "async_scheduling" not in inspect.signature(LLM.__init__).parameters:
        if mode != "sync":
            raise SystemExit("this engine has no async_scheduling option: use --modes sync")
        kwargs = {}
    llm = LLM(lm, max_num_seqs=256, max_model_len=1024, max_num_batched_tokens=8192, enable_prefix_caching=False,
              kv_cache_memory="256MiB", **kwargs)
    llm.generate(prompts, sp, use_tqdm=False)  # compile every shape the timed runs meet
    best = None
    for _ in range(repeats):
        s0 = llm.stats()
        # Time only the decode steps where every sequence runs: step by hand.
        for i, p in enumerate(prompts):
            llm.add_request(p, sp, request_id=f"r{i}")
        core = llm.core  # the engine loop itself: no RequestOutput per sequence per step
        while core.num_steps - s0["num_steps"] < 4:  # prefill and first tokens
            core.step()
        s1, t0 = llm.stats(), time.perf_counter()
        while core.num_steps - s1["num_steps"] < sp.max_tokens - 12:
            core.step()
        dt = time.perf_counter() - t0
        s2 = llm.stats()
        steps = s2["num_steps"] - s1["num_steps"]
        while core.has_unfinished():
            core.step()
        llm.step()  # collect the finished requests' outputs
        row = {"ms/step": dt / steps * 1e3}
        for key, name in (("time_schedule_s", "schedule"), ("time_batch_s", "batch"),
                          ("time_postprocess_s", "post"), ("time_device_s", "wait")):
            row[name] = (s2.get(key, 0.0) - s1.get(key, 0.0)) / steps * 1e3
        if best is None or row["ms/step"] < best["ms/step"]:
            best = row
    return best


def device_only(lm: LoadedModel, batch_size: int, context: int, repeats: int = 50) -> float:
    """ms per step of the jitted model + greedy sampler alone, on a decode batch of this shape."""
    from jaxpaged.attention import AttentionMetadata
    from jaxpaged.kv_cache import init_kv_pool
    from jaxpaged.model import runtime_form
    from jaxpaged.runner import StepPrograms, split_model
    from jaxpaged.sampler import build_sampling_metadata, sample

    bs = 16
    width = -(-(context + 1) // bs)
    kv = init_kv_pool(CFG.num_layers, batch_size * width + 1, CFG.num_kv_heads, bs, CFG.head_dim, jax.numpy.float32)
    tables = 1 + np.arange(batch_size * width, dtype=np.int32).reshape(batch_size, width)
    pos = np.full(batch_size, context, np.int32)
    md = AttentionMetadata(positions=pos, slot_mapping=tables[:, -1] * bs + context % bs, block_tables=tables,
                           context_lens=pos + 1, query_start_loc=np.arange(batch_size + 1, dtype=np.int32),
                           decode_only=True)
    structure, params = split_model(runtime_form(lm.model))  # the form an engine runs
    sm, _, _ = build_sampling_metadata([], batch_size, CFG.vocab_size, ())
    tokens = np.arange(batch_size, dtype=np.int32)
    sample_fn = jax.jit(lambda logits, sm: sample(logits, sm, num_logprobs=0, use_penalties=False).tokens)
    forward = StepPrograms().forward
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        logits, kv = forward(structure, params, kv, tokens, md, np.arange(batch_size, dtype=np.int32))
        sample_fn(logits, sm).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times[5:])) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="sync,async", help="comma-separated: sync, async")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per mode (the fastest is shown)")
    a = ap.parse_args()
    lm = LoadedModel(build_model(CFG, random_params(CFG), attention_backend="xla"), None, CFG, "random")
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, CFG.vocab_size, a.prompt_len).tolist()}
               for _ in range(a.num_seqs)]
    sp = SamplingParams(max_tokens=a.output_len, ignore_eos=True, temperature=0.0)
    rows = {m: run(m, lm, prompts, sp, a.repeats) for m in a.modes.split(",")}
    dev = device_only(lm, a.num_seqs, a.prompt_len + a.output_len // 2)
    print(f"\n## Host time per decode step: {a.num_seqs} sequences, tiny model ({CFG.num_layers} layers, hidden "
          f"{CFG.hidden_size}, vocab {CFG.vocab_size}), float32, {platform.processor() or platform.machine()}, "
          f"jax {jax.__version__}")
    cols = ["ms/step", "schedule", "batch", "post", "wait"]
    print(f"{'loop':<8}" + "".join(f"{c:>10}" for c in cols) + f"{'device':>10}")
    for m, r in rows.items():
        print(f"{m:<8}" + "".join(f"{r[c]:>10.2f}" for c in cols) + f"{dev:>10.2f}")
    print("ms per step; device = the jitted model + sampler alone on the same shapes (median of 45)")


if __name__ == "__main__":
    main()
