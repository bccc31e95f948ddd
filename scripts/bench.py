"""Throughput and latency of jaxpaged on a synthetic workload, next to its peers and its roofline.

    python scripts/bench.py                                  # decode-heavy: 64 x ~100-token prompts, 256 new tokens
    python scripts/bench.py --workload sharegpt --num-requests 128 --mode both --rate 1.0
    python scripts/bench.py --peers --peer-requests 16       # + transformers generate / generate_batch
    python scripts/bench.py --peers llama.cpp --num-requests 48 --output-len 128 --no-prefix-caching
    python scripts/bench.py --peers transformers,llama.cpp   # both kinds of peers
    python scripts/bench.py --quick --peers                  # ~5 minute smoke run of everything
    python scripts/bench.py --mode server --rate 1 --num-requests 32   # against a running jaxpaged-serve

What it does, in one process:

1. Ceilings, measured before and after the engine runs: memory bandwidth (256 MiB copy;
   a 256 MiB sum for the read alone) and float32 matmul FLOP/s (numpy and jax); the
   roofline uses the best figures seen.
2. A seeded workload of token-id prompts (random ids from the vocabulary, the same ids for
   every system), ``ignore_eos`` and a fixed ``max_tokens`` per request, greedy (or, for
   jaxpaged alone, ``--temperature`` / ``--top-p`` with a seed per request).
   ``decode-heavy``: prompts of 90-110 tokens and 256 new tokens (the issue's target);
   ``sharegpt``: lognormal prompt and output lengths with the vLLM paper's ShareGPT means
   (161 / 338 tokens), clipped to ``--max-model-len``.
3. Offline mode: every request submitted at once. A warm-up run with the same lengths and
   other token ids compiles every step shape first; the timed run must compile nothing.
   Online mode: Poisson arrivals at ``--rate`` requests/s on the wall clock (``add_request``
   / ``step``); TTFT counts from each request's scheduled arrival, inter-token latency is
   the gap between consecutive tokens of a request as the client sees them.
4. Reported: generated and total tokens/s, requests/s, KV utilization at peak usage,
   preemptions, compiled shapes and XLA compilations, per-phase host/device seconds, and
   the roofline: per step, bytes = all weights + the K/V of every scheduled context (+ the
   new tokens' K/V), FLOPs = 2 x body params per token + 2 x LM-head params per sampled
   token + attention 4 x layers x heads x head_dim x context per token; the step's floor is
   the larger of bytes / bandwidth and FLOPs / FLOP rate, the run's floor their sum.
5. ``--peers``: the same GGUF in transformers (float32): ``generate`` with left padding
   (static batches of ``--hf-batch-size``, each runs to its longest request; only requested
   tokens count) and ``generate_batch`` (transformers' continuous batching, paged cache).
   They are slow, so ``--peer-requests`` runs them on the first K requests; jaxpaged then
   also runs those same K requests, and the ratios are taken on equal work.
   (A bare ``--peers`` means ``--peers transformers``.)
6. ``--peers llama.cpp``: the CPU engine people pick, on every request of the offline run.
   Built from the ``llama-cpp-python`` sdist's vendored llama.cpp on first use (~10 minutes
   on 2 cores; cached in ``~/.cache/jaxpaged``, or ``--llama-cpp-dir``), the default GGUF
   requantized to F32 (``scripts/llama_cpp_peer.py``; BF16 with ``--dtype bfloat16``, which
   runs jaxpaged's bfloat16 weights, float32 activations on CPU). ``llama-server`` with one continuous-
   batching slot per request gets the same token ids and lengths, greedy, ``ignore_eos``, no
   prompt cache, all at once: generated tok/s from the first submit to the last response,
   and each request's token count checked. Also single-stream decode on both sides: one
   request, ``--single-stream-tokens`` new tokens, prefill excluded (llama.cpp's
   ``predicted_per_second``; jaxpaged's decode steps over their step times), the two sides
   back to back on each prompt (each first in turn) and the ratio taken per pair, each beside
   the read floor (every weight and the context's K/V read once a token at the read bandwidth
   measured in the run: a batch-1 decode's bound). llama.cpp keeps
   its KV cache in f16 unless told otherwise, so it runs in each of ``--llama-configs``: K/V
   in float32 without and with flash attention (the ratios take the faster), and its f16
   default for reference.

Writes ``bench_out/bench_<workload>.json`` and ``.png``. A script, not a test: on a shared
machine the numbers are noisy; the table headers print the machine and its load.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (CompileCounter, ModelCost, RunResult, Workload, ceilings_table, machine_header,  # noqa: E402
                          machine_info, make_workload, measure_ceilings, new_figure, run_offline,
                          run_online, save_figure, save_json, table, warm_then_run)


PEERS = {"transformers", "llama.cpp"}


def parse_args(argv=None):
    from llama_cpp_peer import WEIGHTS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["decode-heavy", "sharegpt"], default="decode-heavy")
    p.add_argument("--num-requests", type=int, default=None, help="default 64 (decode-heavy) or 128 (sharegpt)")
    p.add_argument("--prompt-len", type=int, default=None, help="decode-heavy: mean prompt (100); sharegpt: mean")
    p.add_argument("--output-len", type=int, default=None, help="decode-heavy: new tokens (256); sharegpt: mean")
    p.add_argument("--max-model-len", type=int, default=2048, help="the window lengths are clipped to")
    p.add_argument("--mode", choices=["offline", "online", "both", "server"], default="offline",
                   help="server: Poisson arrivals over HTTP against a running jaxpaged-serve at --url")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server mode: the server's base URL")
    p.add_argument("--api-key", default=None, help="server mode: the server's --api-key")
    p.add_argument("--max-duration", type=float, default=120.0, help="server mode: seconds of arrivals at most")
    p.add_argument("--rate", type=float, default=None,
                   help="online arrivals per second (default: 0.7 x the offline req/s, or 0.5)")
    p.add_argument("--peers", nargs="?", const="transformers", default="",
                   help="comma-separated peers: transformers (generate and generate_batch), llama.cpp; "
                        "bare --peers means transformers")
    p.add_argument("--llama-cpp-dir", default=None,
                   help="an existing llama.cpp build (holding llama-server and llama-quantize, or bin/ or build/bin/); "
                        "default: build the llama-cpp-python sdist's llama.cpp into ~/.cache/jaxpaged once")
    p.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="llama-server -t (default: all cores)")
    p.add_argument("--llama-configs", default="kv-f32,kv-f32-fa,kv-f16-fa",
                   help="comma-separated llama-server settings (scripts/llama_cpp_peer.py's CONFIGS): kv-f32 and "
                        "kv-f32-fa keep K/V in float32 (without / with flash attention), kv-f16-fa is llama.cpp's "
                        "default f16 cache; the ratios take the fastest float32 one")
    p.add_argument("--single-stream-tokens", type=int, default=128,
                   help="--peers llama.cpp: new tokens of the single-request decode comparison")
    p.add_argument("--peer-requests", type=int, default=None,
                   help="run the peers on the first K requests (default: 16, or all if fewer)")
    p.add_argument("--peer-systems", choices=["both", "generate", "generate_batch"], default="both",
                   help="which transformers peers to run (padded generate is ~3x slower than generate_batch: "
                        "run it on fewer requests in a second invocation)")
    p.add_argument("--hf-batch-size", type=int, default=None, help="static batch of padded generate (default: K)")
    p.add_argument("--block-size", type=int, default=None, help="default: the engine's (64 on CPU, 16 on GPU/TPU)")
    p.add_argument("--kv-cache-memory", default=None, help="e.g. 1GiB (default: the engine's)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas, one per device (on CPU the script makes N devices); the roofline still "
                        "counts one reading of the weights per step")
    p.add_argument("--enable-dp-attention", action="store_true",
                   help="with --data-parallel-size > 1 on CPU: the replicas' steps as one program (LLM's "
                        "enable_dp_attention)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--dtype", choices=list(WEIGHTS), default="float32",
                   help="jaxpaged's weights (activations stay float32 on CPU); llama.cpp gets the GGUF requantized "
                        "to the same (F32 or BF16)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="jaxpaged's K/V (auto: float32 on CPU for float32 weights); bfloat16 or fp8 round them, so "
                        "the float32 peers' ratios then compare other precisions")
    p.add_argument("--no-warmup", action="store_true", help="time the first run, compilations included")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample instead of greedy (jaxpaged only: the peers' check compares greedy tokens)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="16 requests: 64 new tokens each (decode-heavy) or lognormal means 100 / 96 clipped to "
                        "256 (sharegpt); peers on 4; both modes")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default=None, help="output name in bench_out/ (default bench_<workload>[_quick])")
    a = p.parse_args(argv)
    a.peers = list(dict.fromkeys(x.strip() for x in a.peers.split(",") if x.strip()))
    if set(a.peers) - PEERS:
        p.error(f"--peers {','.join(a.peers)}: unknown peer; choose from {', '.join(sorted(PEERS))}")
    if a.peers and a.temperature > 0:
        p.error("--peers compares greedy outputs with the peers': leave --temperature at 0")
    if a.quick:
        if a.num_requests is None:
            a.num_requests = 16
        if a.workload == "decode-heavy" and a.output_len is None:
            a.output_len = 64
        if a.workload == "sharegpt":  # a scaled-down ShareGPT: the long tail makes the full one slow on 2 cores
            a.max_model_len = min(a.max_model_len, 256)
            a.prompt_len = a.prompt_len or 100
            a.output_len = a.output_len or 96
        if a.peer_requests is None:
            a.peer_requests = 4
        if a.mode == "offline":
            a.mode = "both"
    if "llama.cpp" in a.peers and a.mode not in ("offline", "both"):
        p.error("--peers llama.cpp compares with the offline run: use --mode offline or both")
    from llama_cpp_peer import CONFIGS

    a.llama_configs = list(dict.fromkeys(x.strip() for x in a.llama_configs.split(",") if x.strip()))
    if not a.llama_configs or set(a.llama_configs) - set(CONFIGS):
        p.error(f"--llama-configs {','.join(a.llama_configs)}: choose from {', '.join(CONFIGS)}")
    a.num_requests = a.num_requests or (64 if a.workload == "decode-heavy" else 128)
    a.peer_requests = min(a.peer_requests or 16, a.num_requests)
    a.out = a.out or f"bench_{a.workload}" + ("_quick" if a.quick else "")
    return a


# ---- peers ---------------------------------------------------------------------------


def load_hf_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    return model, time.perf_counter() - t


def run_hf_generate(model, w: Workload, batch_size: int, progress: bool) -> dict:
    """Static batching with left padding: every batch decodes until its longest request is done."""
    import torch
    from tqdm.auto import tqdm

    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in tqdm(range(0, len(w), batch_size), desc="transformers generate", disable=not progress,
                          leave=False):
            prompts = w.prompts[start:start + batch_size]
            new = max(w.max_tokens[start:start + batch_size])
            width = max(map(len, prompts))
            ids = torch.zeros((len(prompts), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=0)
            outputs += [row[width:].tolist() for row in out]
    wall = time.perf_counter() - t0
    gen = sum(w.max_tokens)  # the useful tokens; the padding work of a static batch counts for nothing
    done = sum(len(o) >= m for o, m in zip(outputs, w.max_tokens))
    return {"system": f"transformers generate (padded, batch {batch_size})", "wall_s": wall,
            "num_generated": gen, "num_computed": sum(len(o) for o in outputs), "complete": done,
            "outputs": [o[:m] for o, m in zip(outputs, w.max_tokens)]}


def run_hf_generate_batch(model, w: Workload, progress: bool, max_batch_tokens: int) -> dict:
    """transformers' continuous batching (paged cache); per-request lengths via its manager when they differ.

    Its cache is sized explicitly (every request fits, pages of 256 tokens) and its token
    budget per step is jaxpaged's: by default it sizes the cache on CPU to 90% of the
    machine's RAM minus its own, which ignores every other process (OOM on a shared machine).
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    cfg = GenerationConfig(max_new_tokens=max(w.max_tokens), eos_token_id=-1, do_sample=False, pad_token_id=0)
    pages = sum(-(-(len(p) + m) // 256) for p, m in zip(w.prompts, w.max_tokens)) + len(w) + 4
    cb = ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=max_batch_tokens)
    t0 = time.perf_counter()
    # No torch.inference_mode here: the manager's thread updates tensors built under it and fails.
    if len(set(w.max_tokens)) == 1:
        res = model.generate_batch(inputs=w.prompts, generation_config=cfg, continuous_batching_config=cb,
                                   progress_bar=progress)
        outs = [r.generated_tokens for r in res.values()]
        how = "generate_batch"
    else:
        outs_by_id = {}
        with model.continuous_batching_context_manager(generation_config=cfg, continuous_batching_config=cb,
                                                       block=True, timeout=5) as mgr:
            ids = [mgr.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
                   for i, (p, m) in enumerate(zip(w.prompts, w.max_tokens))]
            while len(outs_by_id) < len(ids):
                r = mgr.get_result(timeout=1)
                if r is not None and r.is_finished():
                    outs_by_id[r.request_id] = r.generated_tokens
                elif r is None and not mgr.is_running():
                    break
        outs = [outs_by_id.get(i, []) for i in ids]
        how = "continuous_batching_context_manager (per-request max_new_tokens)"
    wall = time.perf_counter() - t0
    if sum(len(o) for o in outs) < sum(w.max_tokens):
        raise RuntimeError(f"generate_batch returned {sum(len(o) for o in outs)} of {sum(w.max_tokens)} tokens "
                           f"(see its log above)")
    return {"system": "transformers generate_batch (continuous batching)", "how": how, "wall_s": wall,
            "num_generated": sum(len(o) for o in outs), "complete": sum(len(o) == m for o, m in zip(outs, w.max_tokens)),
            "outputs": [list(o) for o in outs]}


def agreement(a: list[list[int]], b: list[list[int]], k: int = 16) -> float:
    """Fraction of requests whose first ``k`` greedy tokens agree (float32 vs float32)."""
    pairs = [(x[:k], y[:k]) for x, y in zip(a, b) if len(x) >= k and len(y) >= k]
    return sum(x == y for x, y in pairs) / len(pairs) if pairs else float("nan")


def jaxpaged_decode_rate(llm, prompt: list[int], new_tokens: int) -> dict:
    """Decode tok/s of one request alone, prefill excluded: its ``new_tokens - 1`` decode
    steps over their summed step times (the engine's step timings)."""
    r = run_offline(llm, Workload("single", [prompt], [new_tokens], 0, "one request"), "jaxpaged single stream",
                    progress=False)
    ph = r.phase_split()
    return {"decode_tok_s": ph["decode_steps"] / ph["decode_s"], "compiles": r.compiles,
            "prefill_tok_s": len(prompt) / ph["prefill_or_mixed_s"], "as_asked": r.wrong_lengths == 0}


def jaxpaged_summary(runs: list[dict]) -> dict:
    """Medians of :func:`jaxpaged_decode_rate` runs."""
    rates = [r["decode_tok_s"] for r in runs]
    return {"decode_tok_s": float(np.median(rates)), "decode_tok_s_runs": rates,
            "prefill_tok_s": float(np.median([r["prefill_tok_s"] for r in runs])),
            "compiles": sum(r["compiles"] for r in runs), "as_asked": all(r["as_asked"] for r in runs)}


def paired_single_stream(llm, server, prompts: list[list[int]], new_tokens: int) -> tuple[list[dict], dict]:
    """Single-stream decode on both sides, prompt by prompt: jaxpaged and llama.cpp back to
    back on the same ids, each first in turn. Batch-1 decode reads every weight per token,
    and this machine's memory bandwidth swings between ~40 and ~80 GB/s within minutes, so
    only rates taken in the same minute compare. Returns jaxpaged's runs and llama.cpp's
    summary, whose ratio is the median of the per-prompt ratios."""
    from llama_cpp_peer import single_stream

    jp, lc = [], []
    for k, p in enumerate(prompts):  # who goes first alternates, so a drift favours neither side
        if k % 2:
            lc.append(single_stream(server, [p], new_tokens))
        jp.append(jaxpaged_decode_rate(llm, p, new_tokens))
        if not k % 2:
            lc.append(single_stream(server, [p], new_tokens))
    lc_runs = [r["decode_tok_s"] for r in lc]
    ratios = [b / a["decode_tok_s"] for a, b in zip(jp, lc_runs)]
    return jp, {"decode_tok_s": float(np.median(lc_runs)), "decode_tok_s_runs": lc_runs,
                "prefill_tok_s": float(np.median([r["prefill_tok_s"] for r in lc])),
                "as_asked": all(r["as_asked"] for r in lc), "paired_ratio": float(np.median(ratios)),
                "paired_ratios": ratios}


def run_llama_cpp(args, llm, w: Workload, main_run: RunResult, llama: tuple[Path, Path], vocab: int,
                  cost: ModelCost, read_bandwidth: float) -> dict:
    """llama.cpp's server on every request of the offline run, then the single stream, in each
    of ``args.llama_configs`` (its KV cache type and attention path, ``llama_cpp_peer.CONFIGS``);
    the single stream on jaxpaged too, beside its read floor: a token reads every weight and its
    context's K/V once, at ``read_bandwidth`` (bytes/s, measured in this run).

    One slot per request, so llama.cpp batches all of them as jaxpaged does; each slot's
    context fits the longest request. A server is up only while its setting is measured.
    The ratios take llama.cpp's fastest setting with float32 K/V (its weights are the GGUF's,
    jaxpaged's precision), per measure.
    """
    from llama_cpp_peer import CONFIGS, LlamaServer, run_batch

    bin_dir, gguf = llama
    n = args.single_stream_tokens
    prompts1 = [w.subset(1).with_fresh_ids(args.seed + 50_000 + k, vocab).prompts[0] for k in range(5)]
    jaxpaged_decode_rate(llm, prompts1[0], n)  # compiles the batch-1 shapes
    jp_runs = []
    ctx = max(max(len(p) + m for p, m in zip(w.prompts, w.max_tokens)), len(prompts1[0]) + n) + 16
    jp_out = [main_run.outputs.get(i, []) for i in range(len(w))]
    configs = {}
    for name in args.llama_configs:
        cfg = CONFIGS[name]
        with LlamaServer(bin_dir, gguf, slots=len(w), ctx_per_slot=ctx, threads=args.llama_threads,
                         flags=cfg.flags) as server:
            server.complete(w.prompts[0][:8], 4)  # first-call costs out of the timing
            batch = run_batch(server, w.prompts, w.max_tokens)
            jp_one, single = paired_single_stream(llm, server, prompts1[1:], n)
        jp_runs += jp_one
        batch["agreement_first16"] = agreement(jp_out, batch.pop("outputs"))
        batch["gen_tok_s"] = batch["num_generated"] / batch["wall_s"]
        batch["total_tok_s"] = (batch["num_generated"] + sum(w.prompt_lens)) / batch["wall_s"]
        configs[name] = {"server": server.cmd, "log": str(server.log), "float32": cfg.float32, "note": cfg.note,
                         "batch": batch, "single_stream": single}
        print(f"llama.cpp {name} ({cfg.note}): {batch['gen_tok_s']:.0f} generated tok/s, single stream "
              f"{single['decode_tok_s']:.1f} tok/s (jaxpaged beside it "
              f"{jaxpaged_summary(jp_one)['decode_tok_s']:.1f})", flush=True)
    jp1 = jaxpaged_summary(jp_runs)
    f32 = {k: c for k, c in configs.items() if c["float32"]}
    best = {}
    if f32:
        gen = max(f32, key=lambda k: f32[k]["batch"]["gen_tok_s"])
        one = max(f32, key=lambda k: f32[k]["single_stream"]["decode_tok_s"])
        best = {"gen_tok_s": f32[gen]["batch"]["gen_tok_s"], "gen_config": gen,
                "decode_tok_s": f32[one]["single_stream"]["decode_tok_s"], "decode_config": one,
                "decode_ratio": f32[one]["single_stream"]["paired_ratio"]}
    token_bytes = cost.weight_bytes + cost.kv_bytes_per_token * (len(prompts1[0]) + n // 2)
    out = {"configs": configs, "best_float32": best, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
           "single_stream": {"jaxpaged": jp1, "prompt_len": len(prompts1[0]), "new_tokens": n,
                             "read_floor_tok_s": read_bandwidth / token_bytes, "token_bytes": token_bytes,
                             "read_bandwidth": read_bandwidth}}
    llama_tables(w, main_run, out)
    return out


def llama_tables(w: Workload, jp: RunResult, out: dict) -> None:
    from llama_cpp_peer import WEIGHTS, cpu_flags

    configs, ss, best = out["configs"], out["single_stream"], out["best_float32"]
    jp1 = ss["jaxpaged"]
    kv = out["kv_cache_dtype"]
    precision = out["dtype"] if kv == "auto" else f"{out['dtype']}, K/V {kv}"
    ok = len(w) - jp.wrong_lengths
    rows = [[jp.label, precision, jp.num_requests, jp.num_generated, jp.wall_s, jp.gen_tok_s, jp.total_tok_s,
             f"{ok}/{len(w)}", "-", "-"]]
    notes = []
    for name, c in configs.items():
        lc = c["batch"]
        rows.append([f"llama.cpp {name}", c["note"], lc["num_requests"], lc["num_generated"], lc["wall_s"],
                     lc["gen_tok_s"], lc["total_tok_s"], f"{lc['as_asked']}/{len(w)}", lc["gen_tok_s"] / jp.gen_tok_s,
                     lc["agreement_first16"]])
        notes.append(f"llama.cpp {name}: {' '.join(Path(a).name if a.startswith('/') else a for a in c['server'])}; "
                     f"log {c['log']}")
    first = next(iter(configs.values()))
    table(f"Peer llama.cpp: the same {len(w)} requests, same GGUF in {WEIGHTS[out['dtype']]}, greedy, ignore_eos, "
          "all at once",
          ["system", "precision", "reqs", "gen tok", "wall s", "gen tok/s", "total tok/s", "tokens as asked",
           "llama.cpp / jaxpaged", "same first 16 tokens"], rows,
          notes + [f"llama.cpp build {Path(first['server'][0]).parent}, CPU flags {cpu_flags()}; continuous "
                   "batching, cache_prompt false",
                   "tokens as asked: requests that generated exactly max_tokens (llama.cpp's tokens_predicted)",
                   "same first 16 tokens: fraction of requests whose first 16 greedy tokens equal jaxpaged's "
                   "(llama.cpp's ignore_eos bans EOS; jaxpaged's only does not stop on it)",
                   "llama.cpp spins its threads: another process on a core slows it far more than jaxpaged"])
    floor = ss["read_floor_tok_s"]
    rows = [["jaxpaged", precision, jp1["decode_tok_s"], 1e3 / jp1["decode_tok_s"],
             jp1["decode_tok_s"] / floor, " ".join(f"{r:.1f}" for r in jp1["decode_tok_s_runs"]), jp1["as_asked"],
             "-", "-", jp1["prefill_tok_s"]]]
    for name, c in configs.items():
        lc1 = c["single_stream"]
        rows.append([f"llama.cpp {name}", c["note"], lc1["decode_tok_s"], 1e3 / lc1["decode_tok_s"],
                     lc1["decode_tok_s"] / floor, " ".join(f"{r:.1f}" for r in lc1["decode_tok_s_runs"]),
                     lc1["as_asked"],
                     " ".join(f"{r:.2f}" for r in lc1["paired_ratios"]), lc1["paired_ratio"],
                     lc1["prefill_tok_s"]])
    table(f"Single-stream decode: one request, {ss['prompt_len']}-token prompt, {ss['new_tokens']} new tokens, "
          "medians",
          ["system", "precision", "decode tok/s", "ms / token", "of the read floor", "runs (tok/s)",
           "tokens as asked", "paired llama.cpp / jaxpaged", "median ratio", "prefill tok/s"], rows,
          ["prefill excluded on both sides: jaxpaged's decode steps over their step times (after a warm-up; "
           f"{jp1['compiles']} XLA compiles while timed), llama.cpp's timings.predicted_per_second",
           "each prompt fresh random ids, the same ids on both sides, run by both back to back, each first "
           "in turn (the memory bandwidth this decode reads at swings within minutes): the ratios are per "
           "pair; jaxpaged's row holds all its runs",
           "prefill tok/s: the prompt over its one prefill step (jaxpaged; its first token sampled in it) or "
           "llama.cpp's timings.prompt_per_second, medians",
           f"read floor: {floor:.1f} tok/s ({1e3 / floor:.1f} ms a token), a token's bytes (every weight and the "
           f"K/V of the mean context, {ss['token_bytes'] / 1e6:.0f} MB) at the read bandwidth measured in this "
           f"run ({ss['read_bandwidth'] / 1e9:.1f} GB/s, a jax sum); no decode of one request reads less"])
    if best:
        print(f"against llama.cpp's fastest setting with float32 K/V, jaxpaged's {precision}: generated tok/s "
              "llama.cpp / jaxpaged "
              f"{best['gen_tok_s'] / jp.gen_tok_s:.2f} ({best['gen_config']}), single stream "
              f"{best['decode_ratio']:.2f} ({best['decode_config']}, paired)", flush=True)


# ---- reports ---------------------------------------------------------------------------


def engine_table(results: list[RunResult], title: str) -> None:
    rows = []
    for r in results:
        s, e = r.summary(), r.engine_stats
        host = e["time_schedule_s"] + e["time_batch_s"] + e["time_postprocess_s"]
        rows.append([r.label, s["num_requests"], s["num_generated"], s["wall_s"], s["gen_tok_s"], s["total_tok_s"],
                     s["req_s"], s["num_steps"], s["utilization_at_peak"], s["peak_used_blocks"], s["max_running"],
                     e["num_preemptions"], f"{s['new_shapes']} / {s['compiles']} ({s['compile_s']:.0f} s)",
                     e["time_schedule_s"], e["time_batch_s"], e["time_device_s"], e["time_postprocess_s"],
                     f"{100 * host / max(s['wall_s'], 1e-9):.1f}%", 1e3 * s["decode_step_median_s"],
                     "{:.0f} ms: {} seqs, {} tok, ctx {}".format(1e3 * s["slowest_steps"][0]["seconds"],
                                                                 s["slowest_steps"][0]["seqs"],
                                                                 s["slowest_steps"][0]["tokens"],
                                                                 s["slowest_steps"][0]["max_context"])
                     if s["slowest_steps"] else "-"])
    table(title, ["run", "reqs", "gen tok", "wall s", "gen tok/s", "total tok/s", "req/s", "steps",
                  "KV util @peak", "peak blocks", "max running", "preempt", "new shapes / XLA compiles",
                  "sched s", "batch s", "device s", "post s", "host %", "decode step ms p50", "slowest step"], rows,
          ["KV util @peak: tokens stored / slots allocated at the step that used the most blocks",
           "new shapes / XLA compiles: step shapes first seen / backend compilations during the run "
           "(the timed run must show 0 / 0)",
           "sched/batch/device/post: the engine's per-phase timers; host % = (sched + batch + post) / wall",
           "slowest step: its time and shape (sequences, tokens, longest context); the JSON lists the 3 slowest"])


def roofline_table(results: list[RunResult], cost: ModelCost, ceil: dict) -> list[dict]:
    bw, fl = ceil["bandwidth"], ceil["flops"]
    rows, out = [], []
    for r in results:
        rf = r.roofline(cost, bw, fl)
        dec = [s for s in r.steps if s.decode_only]
        mix = [s for s in r.steps if not s.decode_only]
        dec_floor = sum(cost.floor_s(s.chunks, bw, fl) for s in dec)
        mix_floor = sum(cost.floor_s(s.chunks, bw, fl) for s in mix)
        dec_t, mix_t = sum(s.seconds for s in dec), sum(s.seconds for s in mix)
        rf |= {"decode_floor_s": dec_floor, "decode_s": dec_t, "mixed_floor_s": mix_floor, "mixed_s": mix_t,
               "fraction_median_ceilings": r.roofline(cost, ceil["bandwidth_median"], ceil["flops_median"])[
                   "fraction_of_roofline"], "cores_busy": r.cores_busy}
        out.append(rf)
        rows.append([r.label, rf["flops"] / 1e12, rf["bytes"] / 1e9, rf["roofline_s"], r.wall_s,
                     rf["roofline_gen_tok_s"], r.gen_tok_s, rf["fraction_of_roofline"],
                     rf["fraction_median_ceilings"], rf["achieved_gflop_s"], rf["achieved_gb_s"],
                     f"{dec_floor / dec_t:.2f}" if dec_t else "-", f"{mix_floor / mix_t:.2f}" if mix_t else "-",
                     f"{r.cores_busy:.2f} of {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()}"])
    table("Roofline (same run)", ["run", "TFLOP", "GB moved", "floor s", "wall s", "floor gen tok/s", "gen tok/s",
                                  "fraction of roofline", "fraction (median ceilings)", "GFLOP/s", "GB/s",
                                  "decode steps: floor/time", "prefill+mixed steps: floor/time", "cores busy"], rows,
          [f"ceilings: {bw / 1e9:.1f} GB/s, {fl / 1e9:.0f} GFLOP/s (best seen); median "
           f"{ceil['bandwidth_median'] / 1e9:.1f} GB/s, {ceil['flops_median'] / 1e9:.0f} GFLOP/s",
           f"model: {cost.num_params / 1e6:.1f}M params ({cost.weight_bytes / 1e6:.0f} MB read per step), "
           f"{cost.body_params / 1e6:.1f}M outside the LM head; {2 * cost.body_params / 1e6:.0f} MFLOP per "
           f"prompt token, {2 * cost.num_params / 1e6:.0f} MFLOP per sampled token, + "
           f"{cost.attn_flops_per_ctx} FLOP x context; KV {cost.kv_bytes_per_token / 1e3:.1f} KB per token",
           "fraction of roofline = floor s / wall s (1.0 = at the roofline); the target is >= 0.7",
           "cores busy: the process's CPU seconds (every thread) per wall second of the run, of the cores it may "
           "use (the 48 x 128 run on 2 vCPUs: ~1.6-1.7, its threads waiting on each other between ops)"])
    return out


def latency_table(r: RunResult, rate: float) -> dict:
    lat = r.latency()
    table(f"Online: Poisson arrivals at {rate:.2f} req/s",
          ["run", "reqs", "gen tok/s", "req/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms",
           "e2e p50 s", "e2e p99 s", "preempt", "XLA compiles in run"],
          [[r.label, r.num_requests, r.gen_tok_s, r.req_s, lat["ttft_p50_s"], lat["ttft_p99_s"],
            1e3 * lat["itl_p50_s"], 1e3 * lat["itl_p99_s"], lat["e2e_p50_s"], lat["e2e_p99_s"],
            r.engine_stats["num_preemptions"], f"{r.compiles} ({r.compile_s:.0f} s)"]],
          ["TTFT from the scheduled arrival to the step that returned the first token; ITL between consecutive "
           "tokens of one request", "compilations during the online run (batch shapes the offline warm-up did not "
           "see) inflate p99s"])
    return lat


def plot(name: str, args, results: dict[str, RunResult], cost: ModelCost, ceil: dict, peers: list[dict],
         subset: RunResult | None, online: RunResult | None):
    fig, ax = new_figure(2, 2, f"jaxpaged bench: {args.workload}, {args.num_requests} requests")
    main = results.get("offline")
    # (a) throughput
    labels, vals = [], []
    if main:
        labels += ["jaxpaged", "roofline"]
        vals += [main.gen_tok_s, main.roofline(cost, ceil["bandwidth"], ceil["flops"])["roofline_gen_tok_s"]]
    if subset:
        labels.append(f"jaxpaged ({subset.num_requests} req)")
        vals.append(subset.gen_tok_s)
    for p in peers:
        labels.append(p["system"].replace("transformers ", "hf ").split(" (")[0] + f" ({p['num_requests']} req)")
        vals.append(p["gen_tok_s"])
    a = ax[0][0]
    peer_colors = [f"C{i + 1}" for i, _ in enumerate(peers)]
    a.barh(labels, vals, color=["C0", "C7"] + ["C0"] * (1 if subset else 0) + peer_colors)
    a.set_xlabel("generated tokens / s")
    a.set_title("throughput")
    # (b) step times against their floors
    a = ax[0][1]
    if main:
        t = np.array([s.seconds for s in main.steps])
        floor = np.array([cost.floor_s(s.chunks, ceil["bandwidth"], ceil["flops"]) for s in main.steps])
        a.plot(1e3 * t, label="measured", lw=1)
        a.plot(1e3 * floor, label="roofline floor", lw=1)
        a.set_xlabel("step")
        a.set_ylabel("ms")
        a.set_yscale("log")
        a.legend()
        a.set_title("step time (offline)")
    # (c) KV usage over time
    a = ax[1][0]
    r = main or online
    if r:
        t = np.array([s.t_start for s in r.steps]) - r.steps[0].t_start
        a.plot(t, [s.used_blocks for s in r.steps], label="used blocks")
        a.set_xlabel("s")
        a.set_ylabel("blocks")
        b = a.twinx()
        b.plot(t, [s.tokens_stored / s.slots_allocated if s.slots_allocated else np.nan for s in r.steps],
               color="C3", lw=0.8, label="utilization")
        b.set_ylim(0, 1.05)
        b.set_ylabel("stored / allocated")
        a.set_title(f"KV usage ({r.label})")
    # (d) latency CDFs
    a = ax[1][1]
    if online:
        ttft = sorted(ts[0] - online.arrivals[q] for q, ts in online.token_times.items() if ts)
        itl = sorted(y - x for ts in online.token_times.values() for x, y in zip(ts, ts[1:]))
        a.plot(ttft, np.linspace(0, 1, len(ttft)), label="TTFT")
        a.plot(itl, np.linspace(0, 1, len(itl)), label="inter-token")
        a.set_xscale("log")
        a.set_xlabel("s")
        a.set_ylabel("CDF")
        a.legend()
        a.set_title(f"online latency at {args.rate:.2f} req/s")
    else:
        a.axis("off")
    save_figure(fig, f"{name}.png")


# ---- main ------------------------------------------------------------------------------


def server_mode(args) -> dict:
    """``--mode server``: ``bench_serve`` against a running server; prints one table row."""
    import argparse
    import asyncio

    import bench_serve

    ns = argparse.Namespace(url=args.url, api_key=args.api_key, num_requests=args.num_requests or 64,
                            max_duration=args.max_duration, rate=args.rate or 1.0, prompt_len=args.prompt_len or 100,
                            output_len=args.output_len or 128, vocab_size=49152, seed=args.seed)
    r = asyncio.run(bench_serve.run(ns))
    table(f"Server at {args.url}: {ns.num_requests} requests, Poisson {ns.rate}/s, {ns.prompt_len}-token "
          f"prompts, {ns.output_len} new tokens, streamed",
          ["requests", "failed", "req/s", "gen tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms"],
          [[r["requests"], r["failed"], r["requests_per_s"], r["generated_tok_per_s"], r["ttft_p50_s"],
            r["ttft_p99_s"], 1e3 * r["itl_p50_s"], 1e3 * r["itl_p99_s"]]])
    save_json(f"{args.out or 'bench_server'}.json", {"machine": machine_info(), "args": vars(args), "result": r})
    return r


def main(argv=None) -> dict:
    args = parse_args(argv)
    from jaxpaged.sharding import request_cpu_devices

    request_cpu_devices(args.data_parallel_size)  # before anything starts jax's backends
    if args.mode == "server":
        print(f"# jaxpaged bench: {machine_header()}", flush=True)
        return server_mode(args)
    progress = not args.no_progress
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    print(f"# jaxpaged bench: {machine_header()}", flush=True)
    CompileCounter.get()
    import jaxpaged
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.default_model import default_model_path

    llama = None
    if "llama.cpp" in args.peers:  # first: a build takes minutes, and a failed one should not wait for the rest
        from llama_cpp_peer import WEIGHTS, find_or_build, requantized_gguf

        bin_dir = find_or_build(args.llama_cpp_dir)
        llama = bin_dir, requantized_gguf(bin_dir, default_model_path(), WEIGHTS[args.dtype])
        print(f"llama.cpp: {bin_dir}; {WEIGHTS[args.dtype]} GGUF {llama[1]}", flush=True)
    ceil0 = measure_ceilings(quick=args.quick)
    t = time.perf_counter()
    lm = jaxpaged.load_model(attention_backend=args.attention_backend, dtype=args.dtype)
    print(f"loaded {lm.source} in {time.perf_counter() - t:.1f} s", flush=True)
    vocab = lm.config.vocab_size
    w = make_workload(args.workload, args.num_requests, vocab_size=vocab, max_model_len=args.max_model_len,
                      seed=args.seed, prompt_len=args.prompt_len, output_len=args.output_len)
    ws = w.summary()
    print(f"workload {w.name}: {w.description}; {ws['num_requests']} requests, {ws['prompt_tokens']} prompt + "
          f"{ws['output_tokens']} output tokens (prompt p50 {ws['prompt_len_p50']:.0f} max {ws['prompt_len_max']}, "
          f"output p50 {ws['output_len_p50']:.0f} max {ws['output_len_max']})", flush=True)

    def engine():
        kw = {"kv_cache_memory": args.kv_cache_memory} if args.kv_cache_memory else {}
        return LLM(lm, block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
                   enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                   data_parallel_size=args.data_parallel_size, enable_dp_attention=args.enable_dp_attention,
                   kv_cache_dtype=args.kv_cache_dtype, **kw)

    llm = engine()
    form = llm.loaded.model
    layout = "" if form.is_stacked else f", CPU weights {'[out, in]' if form.layers[0].out_in else '[in, out]'}"
    print(f"engine: {llm.bm.stats().num_blocks} KV blocks of {llm.block_size} in {args.kv_cache_dtype} "
          f"({llm.kv_cache_dtype} arrays), max_num_seqs {args.max_num_seqs}, "
          f"max_num_batched_tokens {llm.max_num_batched_tokens}, backend {lm.model.attention_backend}{layout}",
          flush=True)
    cost = ModelCost.from_loaded(lm, kv_dtype=llm.kv_cache_dtype)  # a 16-bit model's pool is float32 on CPU
    report: dict = {"machine": machine_info(), "args": vars(args), "workload": ws, "model": vars(cost)}

    def params_for(i: int) -> SamplingParams:  # seeded per request: a rerun draws the same tokens
        return SamplingParams(max_tokens=w.max_tokens[i], ignore_eos=True, temperature=args.temperature,
                              top_p=args.top_p, seed=args.seed + i)

    results: dict[str, RunResult] = {}
    warm = None
    if args.mode in ("offline", "both"):
        results["offline"], warm = warm_then_run(llm, w, vocab_size=vocab, label="jaxpaged offline",
                                                 progress=progress, warmup=not args.no_warmup,
                                                 params_for=params_for)
    ceil1 = measure_ceilings(quick=args.quick)
    ceil = {k: max(ceil0[k], ceil1[k]) for k in ceil0}
    ceilings_table(ceil0, "Ceilings measured before the engine runs")
    ceilings_table(ceil1, "Ceilings measured after the offline run")
    report["ceilings"] = {"before": ceil0, "after": ceil1, "used": ceil}

    online = online_warm = None
    if args.mode in ("online", "both"):
        rate = args.rate or (0.7 * results["offline"].req_s if "offline" in results else 0.5)
        args.rate = rate
        if "offline" not in results and not args.no_warmup:
            warm_then_run(llm, w.with_fresh_ids(args.seed + 20_000, vocab), vocab_size=vocab,
                          label="warm-up for online", progress=progress, warmup=False, params_for=params_for)
        if not args.no_warmup:  # online batches take other shapes than offline ones: compile them first
            online_warm = run_online(llm, w.with_fresh_ids(args.seed + 30_000, vocab), rate,
                                     label="jaxpaged online (warm-up)", seed=args.seed + 1, progress=progress,
                                     params_for=params_for)
        online = results["online"] = run_online(llm, w.with_fresh_ids(args.seed + 40_000, vocab), rate,
                                                label="jaxpaged online", seed=args.seed, progress=progress,
                                                params_for=params_for)

    shown = [r for r in (warm, results.get("offline"), online_warm, online) if r is not None]
    engine_table(shown, f"jaxpaged: {w.name}, {len(w)} requests ({w.description})")
    report["runs"] = {r.label: r.summary() for r in shown}
    timed = [r for r in shown if r is not warm and r is not online_warm]
    report["roofline"] = dict(zip([r.label for r in timed], roofline_table(timed, cost, ceil)))
    if args.dtype != "float32":
        print(f"- {args.dtype} weights: the roofline counts their bytes, but its FLOP/s ceilings are float32 "
              "matmul rates; the fraction does not compare with a float32 run's", flush=True)
    if online:
        report["latency"] = latency_table(online, args.rate)

    shown_peers = []
    if llama:
        report["llama_cpp"] = run_llama_cpp(args, llm, w, results["offline"], llama, vocab, cost,
                                            ceil["read_bandwidth"])
        for name, c in report["llama_cpp"]["configs"].items():
            shown_peers.append({"system": f"llama.cpp {name}", "num_requests": len(w),
                                "gen_tok_s": c["batch"]["gen_tok_s"]})

    peers, subset = [], None
    if "transformers" in args.peers:
        k = args.peer_requests
        sub = w.subset(k)
        main_run = results.get("offline")
        if k < len(w) or main_run is None:
            subset, _ = warm_then_run(llm, sub, vocab_size=vocab, label=f"jaxpaged offline, first {k}",
                                      progress=progress, warmup=not args.no_warmup)
        ref = subset or main_run
        del llm
        gc.collect()
        model, load_s = load_hf_model(default_model_path())
        print(f"transformers loaded the GGUF in {load_s:.1f} s", flush=True)
        hf_bs = args.hf_batch_size or k
        budget = args.max_num_batched_tokens or 512  # the engine's default token budget per step
        jp_out = [ref.outputs.get(i, []) for i in range(k)]  # to check the systems do the same work
        tiny = dataclasses.replace(sub.subset(2), max_tokens=[2, 2])
        systems = {"generate": lambda w_: run_hf_generate(model, w_, hf_bs, progress),
                   "generate_batch": lambda w_: run_hf_generate_batch(model, w_, progress, budget)}
        for name, fn in systems.items():
            if args.peer_systems not in ("both", name):
                continue
            try:
                fn(tiny)  # warm-up: first-call costs out of the timing, as jaxpaged's compilation is
                p = fn(sub)
            except Exception as e:  # noqa: BLE001 (report and go on: a peer failing is a result)
                import traceback

                traceback.print_exc()
                p = {"system": "peer failed", "error": repr(e), "wall_s": float("nan"), "num_generated": 0}
            p["num_requests"] = k
            p["gen_tok_s"] = p["num_generated"] / p["wall_s"] if p["wall_s"] else float("nan")
            p["total_tok_s"] = (p["num_generated"] + sum(sub.prompt_lens)) / p["wall_s"] if p["wall_s"] else \
                float("nan")
            p["agreement_first16"] = agreement(jp_out, p.get("outputs", [])) if jp_out else float("nan")
            peers.append(p)
        rows = []
        if main_run is not None:
            rows.append([f"jaxpaged (all {len(w)} requests)", len(w), main_run.wall_s, main_run.gen_tok_s,
                         main_run.total_tok_s, "-", "-", "-"])
        rows.append([f"jaxpaged (first {k})", k, ref.wall_s, ref.gen_tok_s, ref.total_tok_s, 1.0, "-", "-"])
        for p in peers:
            rows.append([p["system"], k, p["wall_s"], p["gen_tok_s"], p["total_tok_s"],
                         ref.gen_tok_s / p["gen_tok_s"] if p["gen_tok_s"] else float("nan"),
                         main_run.gen_tok_s / p["gen_tok_s"] if main_run and p["gen_tok_s"] else float("nan"),
                         p.get("agreement_first16", float("nan"))])
        table(f"Peers: the same {k} requests, same GGUF in float32, greedy, fixed lengths",
              ["system", "reqs", "wall s", "gen tok/s", "total tok/s", "jaxpaged x (same requests)",
               f"jaxpaged all-{len(w)} x", "same first 16 tokens"], rows,
              [f"peers ran the first {k} of {len(w)} requests; 'same requests' compares equal work and batch; the "
               f"'all-{len(w)}' ratio compares jaxpaged at its full batch with the peer at {k} (not equal work)",
               "padded generate counts only requested tokens (a static batch runs to its longest request)",
               f"generate_batch: cache sized to fit every request, max_batch_tokens={budget} (jaxpaged's budget)",
               "same first 16 tokens: fraction of requests whose first 16 greedy tokens equal jaxpaged's"])
        for p in peers:
            p.pop("outputs", None)
        report["peers"] = peers
        if subset:
            report["runs"][subset.label] = subset.summary()

    save_json(f"{args.out}.json", report)
    plot(args.out, args, results, cost, ceil, peers + shown_peers, subset, online)
    return report


if __name__ == "__main__":
    main()
