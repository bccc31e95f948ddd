"""The PagedAttention (vLLM) paper's headline tables, reproduced on the default model and this machine.

    python scripts/reproduce_seeds.py                     # everything (tens of minutes on 2 cores)
    python scripts/reproduce_seeds.py --quick             # a smoke run of every section (minutes)
    python scripts/reproduce_seeds.py --only utilization,prefix

Paged allocation (``BlockManager``) against the pre-vLLM contiguous baseline
(``ContiguousBlockManager``: every request reserves ``max_model_len`` slots) at the same
KV memory budget. Sections (``--only`` takes their names):

- ``utilization``: KV memory utilization (stored / allocated; the paper: 20-38% for the
  contiguous systems, ~96% paged) and maximum concurrent requests (the paper: 3-4x),
  over a ShareGPT-like workload and several budgets. Host-only: the engine's scheduler
  over each block manager with no model (exact for memory and concurrency); a small case
  is checked against a real engine run.
- ``batch``: engine throughput vs batch size, paged vs contiguous, until the contiguous
  pool stops fitting the batch (the paper: 2-4x at the peak).
- ``block_size``: block size 4 / 8 / 16 / 32 / 64: fragmentation (host-only) and decode
  speed (engine) (the paper: 16 best, 32 for long contexts).
- ``prefix``: a shared ~500-token system prompt with and without prefix caching: KV
  memory, TTFT, throughput (engine).
- ``sharing``: parallel sampling n=4 (host block manager, exact) and beam width 4 (engine
  run; blocks counted with and without sharing at every step).
- ``preemption``: swap vs recompute, the cost of preempting one sequence by its length
  (the runner's swap copies vs re-prefilling), and one end-to-end run under memory pressure.
- ``residency``: decode step time for the same batch at 1k / 4k / 16k pool blocks (must be
  flat: the pool is donated, never copied).

Every table is printed under the machine and the date, and each section writes a PNG to
``bench_out/``; ``bench_out/reproduce_seeds[_quick].json`` holds all numbers. A script, not
a test: timed numbers on a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import (CompileCounter, Workload, greedy_params, machine_header, machine_info,  # noqa: E402
                          make_workload, new_figure, percentile, run_offline, save_figure, save_json, simulate, table,
                          warm_then_run)

SECTIONS = ("utilization", "batch", "block_size", "prefix", "sharing", "preemption", "residency")
MAX_MODEL_LEN = 2048  # the window of the paper's OPT models; ShareGPT-like lengths are clipped to it
GiB = 1 << 30


class Ctx:
    """What the sections share: options, the loaded model (lazily), the report."""

    def __init__(self, args):
        self.args = args
        self.quick = args.quick
        self.progress = not args.no_progress
        self.report: dict = {"machine": machine_info(), "args": vars(args)}
        self._lm = None

    @property
    def lm(self):
        if self._lm is None:
            import jaxpaged

            t = time.perf_counter()
            self._lm = jaxpaged.load_model()
            print(f"loaded {self._lm.source} in {time.perf_counter() - t:.1f} s", flush=True)
        return self._lm

    @property
    def vocab(self) -> int:
        return 49152 if self._lm is None else self._lm.config.vocab_size

    def block_bytes(self, block_size: int) -> int:
        # 30 layers x (K + V) x 3 KV heads x 64 x float32 per token, SmolLM2-135M; no jax needed
        return 30 * 2 * 3 * 64 * 4 * block_size

    def engine(self, **kw):
        from jaxpaged import LLM

        kw.setdefault("max_model_len", MAX_MODEL_LEN)
        return LLM(self.lm, **kw)

    def sharegpt(self, n: int, seed: int = 0, max_model_len: int = MAX_MODEL_LEN) -> Workload:
        return make_workload("sharegpt", n, vocab_size=self.vocab, max_model_len=max_model_len,
                             seed=self.args.seed + seed)


def _free(*objs) -> None:
    del objs
    gc.collect()


# ---- 1. utilization and concurrency (host-only) --------------------------------------------


def section_utilization(ctx: Ctx) -> dict:
    from jaxpaged.block_manager import BlockManager
    from jaxpaged.contiguous import ContiguousBlockManager

    n = 300 if ctx.quick else 1000
    w = ctx.sharegpt(n)
    budget = ctx.args.kv_budget
    bs = 16
    nb = budget // ctx.block_bytes(bs)
    systems = {
        "paged (block 16)": lambda nb: BlockManager(nb, bs, max_model_len=MAX_MODEL_LEN),
        f"contiguous, reserve {MAX_MODEL_LEN}": lambda nb: ContiguousBlockManager(nb, bs,
                                                                                   max_model_len=MAX_MODEL_LEN),
        "contiguous, reserve 8192 (model window)": lambda nb: ContiguousBlockManager(nb, bs, max_model_len=8192),
    }
    rows, out, sims = [], {}, {}
    for name, make in systems.items():
        t = time.perf_counter()
        sim = simulate(make(nb), w)
        s = sims[name] = sim.summary()
        out[name] = s
        rows.append([name, nb - 1, s["utilization_avg"], s["utilization_at_peak"], s["budget_holding_tokens_avg"],
                     s["max_running"], s["mean_running"], s["steps"], s["preemptions"],
                     f"{100 * s['recomputed_fraction']:.1f}%", time.perf_counter() - t])
    paged = out["paged (block 16)"]
    base = out[f"contiguous, reserve {MAX_MODEL_LEN}"]
    table(f"KV memory utilization and concurrency at the same budget ({budget / GiB:.2f} GiB = {nb - 1} blocks of 16)",
          ["allocator", "usable blocks", "utilization avg", "utilization @peak", "budget holding tokens",
           "max concurrent", "mean concurrent", "steps", "preemptions", "recomputed tokens", "sim s"], rows,
          [f"workload: {n} requests, {w.description}; host-only: the engine's scheduler over each block manager",
           "utilization = tokens stored / slots allocated (avg over steps weighted by allocation; @peak: at the step "
           "with the most blocks in use); budget holding tokens = stored tokens / all slots of the pool",
           "recomputed tokens: extra tokens run through the model because preempted requests are recomputed, as a "
           "fraction of the work without preemption",
           f"paged vs contiguous({MAX_MODEL_LEN}): {paged['max_running'] / base['max_running']:.1f}x max concurrent, "
           f"{paged['mean_running'] / base['mean_running']:.1f}x mean concurrent, "
           f"{base['steps'] / paged['steps']:.1f}x fewer steps",
           "the paper (OPT-13B, ShareGPT): Orca keeps 20.4-38.2% of its KV memory for real tokens, vLLM 96.3%"])

    # concurrency vs budget
    budgets = [256 << 20, 512 << 20, GiB, 2 * GiB] if not ctx.quick else [256 << 20, GiB]
    crow, conc = [], []
    for b in budgets:
        nb_b = b // ctx.block_bytes(bs)
        p = simulate(BlockManager(nb_b, bs, max_model_len=MAX_MODEL_LEN), w).summary()
        c = simulate(ContiguousBlockManager(nb_b, bs, max_model_len=MAX_MODEL_LEN), w).summary()
        conc.append((b, p, c))
        crow.append([f"{b / GiB:.2f} GiB", nb_b - 1, p["max_running"], c["max_running"],
                     p["max_running"] / c["max_running"], p["mean_running"] / c["mean_running"],
                     p["utilization_avg"], c["utilization_avg"]])
    table("Maximum concurrent requests vs KV budget", ["budget", "blocks", "paged max", "contiguous max",
                                                       "ratio (max)", "ratio (mean)", "paged util", "contig util"],
          crow, ["the paper: 3-4x more concurrent requests (its baselines also reserve the output length only)"])

    # the simulation against a real engine run: same peak blocks and concurrency
    check = _check_sim_vs_engine(ctx)

    fig, ax = new_figure(1, 3, "KV utilization and concurrency, paged vs contiguous (same budget)")
    names = list(out)
    ax[0][0].bar(range(len(names)), [out[k]["utilization_avg"] * 100 for k in names], color=["C0", "C1", "C3"])
    ax[0][0].set_xticks(range(len(names)), [k.replace(", ", "\n") for k in names], fontsize=7)
    ax[0][0].set_ylabel("% of allocated KV slots holding tokens")
    ax[0][0].axhspan(20.4, 38.2, color="C1", alpha=0.15, label="paper: Orca 20-38%")
    ax[0][0].axhline(96.3, color="C0", ls="--", lw=0.8, label="paper: vLLM 96%")
    ax[0][0].legend(fontsize=7)
    a = ax[0][1]
    a.plot([b / GiB for b, _, _ in conc], [p["max_running"] for _, p, _ in conc], "o-", label="paged")
    a.plot([b / GiB for b, _, _ in conc], [c["max_running"] for _, _, c in conc], "o-", label="contiguous")
    a.set_xlabel("KV budget (GiB)")
    a.set_ylabel("max concurrent requests")
    a.legend()
    a = ax[0][2]
    for name, make in list(systems.items())[:2]:
        sim = simulate(make(nb), w)
        a.plot(sim.running, label=name, lw=0.8)
    a.set_xlabel("step")
    a.set_ylabel("running requests")
    a.legend(fontsize=7)
    save_figure(fig, "seeds_utilization.png")
    return {"budget_bytes": budget, "workload": w.summary(), "allocators": out,
            "concurrency_vs_budget": [{"budget": b, "paged": p, "contiguous": c} for b, p, c in conc],
            "sim_vs_engine": check}


def _check_sim_vs_engine(ctx: Ctx) -> dict:
    """A small run under memory pressure through the engine and through the simulation."""
    from jaxpaged.block_manager import BlockManager
    from jaxpaged.contiguous import ContiguousBlockManager

    w = make_workload("sharegpt", 8 if ctx.quick else 16, vocab_size=ctx.vocab, max_model_len=128,
                      seed=ctx.args.seed + 5, prompt_len=40, output_len=32)
    rows, out = [], {}
    for alloc, blocks in (("paged", 13), ("contiguous", 3 * 8 + 1)):  # 12 blocks of 16: preemption is certain
        llm = ctx.engine(num_blocks=blocks, block_size=16, max_model_len=128, kv_allocator=alloc)
        r = run_offline(llm, w, f"engine {alloc}", progress=False)
        bm = BlockManager(blocks, 16, max_model_len=128) if alloc == "paged" else \
            ContiguousBlockManager(blocks, 16, max_model_len=128)
        s = simulate(bm, w).summary()
        e = r.kv_at_peak()
        steps = sum(1 for st in r.steps if st.chunks)  # the simulation skips steps that only preempted
        same = (e["peak_used_blocks"], e["max_running"], steps, r.engine_stats["num_preemptions"]) == \
            (s["peak_used_blocks"], s["max_running"], s["steps"], s["preemptions"])
        out[alloc] = {"engine": e | {"steps": steps, "preemptions": r.engine_stats["num_preemptions"]},
                      "sim": s, "same": same}
        rows.append([alloc, blocks - 1, e["peak_used_blocks"], s["peak_used_blocks"], e["max_running"],
                     s["max_running"], steps, s["steps"], r.engine_stats["num_preemptions"], s["preemptions"],
                     same])
        _free(llm)
    table("Check: host-only simulation vs the engine (small run under memory pressure)",
          ["allocator", "blocks", "peak blocks (engine)", "(sim)", "max running (engine)", "(sim)", "steps (engine)",
           "(sim)", "preempt (engine)", "(sim)", "identical"], rows,
          [f"{len(w)} requests, {w.description}"])
    return out


# ---- 2. throughput vs batch size (engine) ----------------------------------------------------


def section_batch(ctx: Ctx) -> dict:
    regions = 4 if ctx.quick else 8
    sizes = [1, 4, 16] if ctx.quick else [1, 2, 4, 8, 16, 32, 64]
    prompt, new = (32, 16) if ctx.quick else (100, 128)
    bs = 16
    blocks = regions * (MAX_MODEL_LEN // bs) + 1  # the contiguous pool holds exactly `regions` requests
    rows, res = [], []
    for b in sizes:
        w = make_workload("fixed", b, vocab_size=ctx.vocab, max_model_len=MAX_MODEL_LEN, seed=ctx.args.seed + b,
                          prompt_len=prompt, output_len=new)
        r = {}
        for alloc in ("paged", "contiguous"):
            llm = ctx.engine(num_blocks=blocks, block_size=bs, max_num_seqs=b, kv_allocator=alloc)
            run, _ = warm_then_run(llm, w, vocab_size=ctx.vocab, label=f"{alloc} batch {b}", progress=ctx.progress)
            r[alloc] = run.summary()
            _free(llm)
        res.append((b, r))
        p, c = r["paged"], r["contiguous"]
        rows.append([b, p["max_running"], c["max_running"], p["gen_tok_s"], c["gen_tok_s"],
                     p["gen_tok_s"] / c["gen_tok_s"], p["total_tok_s"], c["total_tok_s"],
                     f"{p['compiles']}/{c['compiles']}"])
    table(f"Throughput vs batch size at the same KV budget ({blocks - 1} blocks: the contiguous pool fits {regions} "
          f"requests of {MAX_MODEL_LEN})",
          ["batch", "paged running", "contig running", "paged gen tok/s", "contig gen tok/s", "paged / contig",
           "paged total tok/s", "contig total tok/s", "compiles in timed runs (p/c)"], rows,
          [f"each row: `batch` requests of {prompt} prompt + {new} new tokens, max_num_seqs = batch, greedy; "
           "each run after a warm-up with the same lengths",
           "the paper: 2-4x at the peak (GPU; on this CPU a bigger batch amortizes the weight reads until "
           "the matmuls are compute-bound)"])
    fig, ax = new_figure(1, 1, "Throughput vs batch size, paged vs contiguous (same KV budget)")
    a = ax[0][0]
    a.plot(sizes, [r["paged"]["gen_tok_s"] for _, r in res], "o-", label="paged")
    a.plot(sizes, [r["contiguous"]["gen_tok_s"] for _, r in res], "o-", label=f"contiguous (fits {regions})")
    a.axvline(regions, color="C1", ls=":", lw=0.8)
    a.set_xscale("log", base=2)
    a.set_xlabel("requested batch size")
    a.set_ylabel("generated tokens / s")
    a.legend()
    save_figure(fig, "seeds_batch.png")
    return {"blocks": blocks, "regions": regions, "prompt": prompt, "new_tokens": new,
            "rows": [{"batch": b, **r} for b, r in res]}


# ---- 3. block size sweep ----------------------------------------------------------------


def section_block_size(ctx: Ctx) -> dict:
    from jaxpaged.block_manager import BlockManager

    sizes = [4, 8, 16, 32, 64]
    timed_sizes = [8, 16, 32] if ctx.quick else sizes
    contexts = [192] if ctx.quick else [512, 1536]
    batch, new = (4, 8) if ctx.quick else (16, 32)
    w = ctx.sharegpt(300 if ctx.quick else 1000)
    budget = ctx.args.kv_budget
    frag, speed = {}, {}
    for bs in sizes:
        frag[bs] = simulate(BlockManager(budget // ctx.block_bytes(bs), bs, max_model_len=MAX_MODEL_LEN), w).summary()
    for ctx_len in contexts:
        for bs in timed_sizes:
            wl = make_workload("fixed", batch, vocab_size=ctx.vocab, max_model_len=MAX_MODEL_LEN,
                               seed=ctx.args.seed + bs, prompt_len=ctx_len, output_len=new)
            llm = ctx.engine(block_size=bs, kv_cache_memory=min(budget, 512 << 20), max_num_seqs=batch)
            run, _ = warm_then_run(llm, wl, vocab_size=ctx.vocab, label=f"block {bs}, context {ctx_len}",
                                   progress=ctx.progress)
            s = run.summary()
            speed[(ctx_len, bs)] = {"decode_step_ms": 1e3 * s["decode_step_median_s"],
                                    "decode_tok_s": batch / s["decode_step_median_s"], "gen_tok_s": s["gen_tok_s"],
                                    "total_tok_s": s["total_tok_s"], "compiles": s["compiles"]}
            _free(llm)
    rows = []
    for bs in sizes:
        f = frag[bs]
        row = [bs, budget // ctx.block_bytes(bs) - 1, f["utilization_avg"], f["utilization_at_peak"],
               f["max_running"], f["mean_running"]]
        for c in contexts:
            sp = speed.get((c, bs))
            row += [sp["decode_step_ms"], sp["decode_tok_s"]] if sp else ["-", "-"]
        rows.append(row)
    heads = ["block size", "blocks", "utilization avg", "utilization @peak", "max concurrent", "mean concurrent"]
    for c in contexts:
        heads += [f"decode step ms @ctx {c}", f"decode tok/s @ctx {c}"]
    table(f"Block size: fragmentation (host-only, {budget / GiB:.2f} GiB budget) vs speed (engine, batch {batch})",
          heads, rows,
          [f"fragmentation: {len(w)} ShareGPT-like requests; speed: {batch} requests of <ctx> prompt tokens + {new} "
           f"new tokens after a warm-up; decode step = median of decode-only steps; decode tok/s = batch / step",
           "the paper: block size 16 best overall, 32 for long contexts (GPU kernel; here the XLA:CPU backend)"])
    fig, ax = new_figure(1, 2, "Block size: fragmentation vs speed")
    ax[0][0].plot(sizes, [100 * frag[b]["utilization_avg"] for b in sizes], "o-")
    ax[0][0].set_xscale("log", base=2)
    ax[0][0].set_xlabel("block size")
    ax[0][0].set_ylabel("% of allocated slots holding tokens")
    for c in contexts:
        ax[0][1].plot(timed_sizes, [speed[(c, b)]["decode_step_ms"] for b in timed_sizes], "o-", label=f"context {c}")
    ax[0][1].set_xscale("log", base=2)
    ax[0][1].set_xlabel("block size")
    ax[0][1].set_ylabel(f"decode step ms (batch {batch})")
    ax[0][1].legend()
    save_figure(fig, "seeds_block_size.png")
    return {"fragmentation": frag, "speed": {f"ctx{c}_bs{b}": v for (c, b), v in speed.items()}}


# ---- 4. prefix caching -----------------------------------------------------------------


def section_prefix(ctx: Ctx) -> dict:
    n, new, sys_len = (8, 8, 500) if ctx.quick else (32, 64, 500)
    rng = np.random.default_rng(ctx.args.seed + 77)
    system = rng.integers(256, ctx.vocab, sys_len).tolist()
    # user turns: lognormal around 60 tokens
    users = np.clip(np.rint(rng.lognormal(np.log(60) - 0.125, 0.5, n)), 8, 300).astype(int)
    prompts = [system + rng.integers(256, ctx.vocab, u).tolist() for u in users]
    w = Workload("prefix", prompts, [new] * n, ctx.args.seed, f"a shared {sys_len}-token system prompt + "
                                                            f"~60-token user turns, {new} new tokens each")
    res, rows = {}, []
    for caching in (False, True):
        llm = ctx.engine(enable_prefix_caching=caching, kv_cache_memory=GiB)  # fits all: no preemption either way
        warm = w.with_fresh_ids(ctx.args.seed + 1234, ctx.vocab, shared_prefix_len=sys_len)
        run_offline(llm, warm, f"warm-up, caching {caching}", progress=ctx.progress)
        r = run_offline(llm, w, f"prefix caching {'on' if caching else 'off'}", progress=ctx.progress)
        s, lat, kv = r.summary(), r.latency(), r.kv_at_peak()
        hits = r.engine_stats["prefix_cache_hits"]
        res[caching] = {**s, **lat, "hits": hits, "computed_prompt_tokens": r.num_prompt_tokens - hits}
        rows.append(["on" if caching else "off", kv["peak_used_blocks"], r.num_prompt_tokens - hits,
                     hits / r.num_prompt_tokens, lat["ttft_p50_s"], lat["ttft_mean_s"], r.gen_tok_s, r.total_tok_s,
                     r.wall_s, r.compiles])
        _free(llm)
    off, on = res[False], res[True]
    table("Prefix caching: a shared system prompt", ["prefix caching", "peak KV blocks", "prompt tokens computed",
                                                    "hit rate", "TTFT p50 s", "TTFT mean s", "gen tok/s",
                                                    "total tok/s", "wall s", "compiles in run"], rows,
          [f"{n} requests submitted at once: {w.description}; TTFT counts from submission (queueing included)",
           f"KV memory saved: {100 * (1 - on['peak_used_blocks'] / off['peak_used_blocks']):.0f}% of peak blocks; "
           f"TTFT p50 {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x lower; throughput "
           f"{on['gen_tok_s'] / off['gen_tok_s']:.2f}x"])
    fig, ax = new_figure(1, 3, "Prefix caching with a shared system prompt")
    for i, (key, lab) in enumerate((("peak_used_blocks", "peak KV blocks"), ("ttft_p50_s", "TTFT p50 (s)"),
                                    ("gen_tok_s", "generated tok/s"))):
        ax[0][i].bar(["off", "on"], [off[key], on[key]], color=["C1", "C0"])
        ax[0][i].set_title(lab)
    save_figure(fig, "seeds_prefix.png")
    return {"workload": w.summary(), "off": off, "on": on}


# ---- 5. block sharing: parallel sampling and beam search -----------------------------------------


def _parallel_sampling_blocks(prompt: int, out: int, n: int, bs: int) -> tuple[int, int]:
    """Peak used blocks of one n-sample request, with sharing (fork) and without (n copies)."""
    from jaxpaged.block_manager import BlockManager

    tokens = list(range(1000, 1000 + prompt))
    peak = {}
    for share in (True, False):
        bm = BlockManager(4 * n * (prompt + out) // bs + 16, bs, enable_prefix_caching=False)
        if share:
            bm.allocate(0, tokens)
            bm.mark_computed(0, prompt, tokens)
            for c in range(1, n):  # the engine forks after the prompt's first sampled token
                bm.fork(0, c)
        else:
            for c in range(n):
                bm.allocate(c, tokens)
                bm.mark_computed(c, prompt, tokens)
        seqs = {c: list(tokens) for c in range(n)}
        for _ in range(out):
            for c in range(n):
                bm.append_slots(c, 1)
                seqs[c].append(7)
                bm.mark_computed(c, len(seqs[c]), seqs[c])
        peak[share] = bm.stats().num_used_blocks  # never falls: nothing is freed but copied-from shared blocks
    return peak[True], peak[False]


def section_sharing(ctx: Ctx) -> dict:
    bs, n = 16, 4
    w = ctx.sharegpt(60 if ctx.quick else 300, seed=3)
    shared = unshared = 0
    per = []
    for p, o in zip(w.prompt_lens, w.max_tokens):
        s, u = _parallel_sampling_blocks(p, o, n, bs)
        shared, unshared = shared + s, unshared + u
        per.append(1 - s / u)
    rows = [["parallel sampling n=4 (host, exact)", f"{len(w)} ShareGPT-like requests", shared, unshared,
             1 - shared / unshared, percentile(per, 50), "-"]]

    # beam search: the engine decides which beams fork; count blocks with and without sharing every step
    nb_req, new = (2, 16) if ctx.quick else (8, 64)
    wb = make_workload("sharegpt", nb_req, vocab_size=ctx.vocab, max_model_len=512, seed=ctx.args.seed + 9,
                       prompt_len=120, output_len=new)
    wb.max_tokens = [new] * nb_req
    llm = ctx.engine(block_size=bs, max_model_len=512, kv_cache_memory=256 << 20)
    from jaxpaged.sampling_params import SamplingParams

    for i, p in enumerate(wb.prompts):
        llm.add_request(p, SamplingParams(use_beam_search=True, beam_width=4, n=1, temperature=0.0, max_tokens=new,
                                          ignore_eos=True))
    trace_s, trace_u = [], []
    t = time.perf_counter()
    while llm.has_unfinished_requests():
        llm.step()
        used = llm.bm.stats().num_used_blocks
        private = sum(len(llm.bm.block_table(s.seq_id)) for req in llm.scheduler.running for s in req.live_seqs()
                      if s.seq_id in llm.bm)
        trace_s.append(used)
        trace_u.append(private)
    beam_s = time.perf_counter() - t
    _free(llm)
    bsh, bun = max(trace_s), max(trace_u)
    rows.append([f"beam search width 4 (engine, {nb_req} requests)",
                 f"prompts p50 {int(np.median(wb.prompt_lens))}, {new} new tokens", bsh, bun, 1 - bsh / bun,
                 1 - sum(trace_s) / max(sum(trace_u), 1), f"{beam_s:.0f} s"])
    table("Block sharing: KV blocks with vs without sharing", ["case", "workload", "peak blocks shared",
                                                               "peak blocks unshared", "saved @peak",
                                                               "saved (p50 per request / time-avg)", "engine time"],
          rows, ["unshared = every sample or beam holds a private copy of all its blocks (the contiguous systems); "
                 "parallel sampling: per-request peaks summed",
                 "the paper: parallel sampling saves 6-10% (Alpaca) / 16-30% (ShareGPT), beam search 38-55% / 44-66%"])
    fig, ax = new_figure(1, 2, "Block sharing")
    ax[0][0].hist([100 * x for x in per], bins=20)
    ax[0][0].set_xlabel("% of blocks saved per request, n=4")
    ax[0][1].plot(trace_s, label="shared (paged)")
    ax[0][1].plot(trace_u, label="unshared")
    ax[0][1].set_xlabel("engine step")
    ax[0][1].set_ylabel("KV blocks in use")
    ax[0][1].set_title("beam search width 4")
    ax[0][1].legend()
    save_figure(fig, "seeds_sharing.png")
    return {"parallel_sampling": {"shared": shared, "unshared": unshared, "saved": 1 - shared / unshared,
                                  "saved_p50": percentile(per, 50)},
            "beam_search": {"peak_shared": bsh, "peak_unshared": bun, "saved_at_peak": 1 - bsh / bun,
                            "saved_time_avg": 1 - sum(trace_s) / max(sum(trace_u), 1), "trace_shared": trace_s,
                            "trace_unshared": trace_u}}


# ---- 6. swap vs recompute -----------------------------------------------------------------


def section_preemption(ctx: Ctx) -> dict:
    bs = 16
    lengths = [128, 512, 1024] if ctx.quick else [64, 256, 512, 1024, 2048, 4096]
    reps = 2 if ctx.quick else 3
    maxlen = max(lengths) + 64
    llm = ctx.engine(block_size=bs, max_model_len=maxlen, kv_cache_memory=1 * GiB, preemption_mode="swap",
                     swap_space=(maxlen // bs + 8) * ctx.block_bytes(bs), enable_prefix_caching=False)
    rng = np.random.default_rng(ctx.args.seed + 11)
    rows, res = [], []
    for L in lengths:
        nb = -(-L // bs)
        out_ops = [("out", d, h) for d, h in zip(range(1, nb + 1), range(nb))]
        in_ops = [("in", h, d) for h, d in zip(range(nb), range(1, nb + 1))]
        t_out, t_in, t_re = [], [], []
        for k in range(reps + 1):
            t = time.perf_counter()
            llm.runner.apply_block_ops(out_ops)
            t1 = time.perf_counter()
            llm.runner.apply_block_ops(in_ops)
            llm.runner.kv.k.block_until_ready()
            t2 = time.perf_counter()
            llm.generate([{"prompt_token_ids": rng.integers(256, ctx.vocab, L).tolist()}], greedy_params(1),
                         use_tqdm=False)
            t3 = time.perf_counter()
            if k:  # the first round compiles
                t_out.append(t1 - t)
                t_in.append(t2 - t1)
                t_re.append(t3 - t2)
        so, si, re_ = map(np.median, (t_out, t_in, t_re))
        mb = nb * ctx.block_bytes(bs) / 1e6
        res.append({"tokens": L, "blocks": nb, "mb": mb, "swap_out_s": so, "swap_in_s": si, "recompute_s": re_})
        rows.append([L, nb, mb, 1e3 * so, 1e3 * si, 1e3 * (so + si), 2 * mb / 1e3 / (so + si), 1e3 * re_,
                     re_ / (so + si)])
    _free(llm)
    table("Preemption cost of one sequence: swap (out + in) vs recompute (re-prefill)",
          ["tokens", "blocks", "KV MB", "swap out ms", "swap in ms", "swap total ms", "swap GB/s", "recompute ms",
           "recompute / swap"], rows,
          ["swap: the runner's block copies device -> host pool -> device (ModelRunner.apply_block_ops); recompute: "
           "a prefill of the same tokens (chunks of 512) plus one sampled token; medians after a compile round",
           "on a CPU 'device' and 'host' share the memory, so swap is a memcpy; on a GPU it crosses PCIe"])

    # end to end under memory pressure
    n, prompt, new = (8, 128, 32) if ctx.quick else (16, 256, 128)
    w = make_workload("fixed", n, vocab_size=ctx.vocab, max_model_len=1024, seed=ctx.args.seed + 12,
                      prompt_len=prompt, output_len=new)
    need = n * -(-(prompt + new) // bs)
    blocks = int(need * 0.5) + 1
    e2e, erows = {}, []
    for mode in ("recompute", "swap"):
        kw = {"swap_space": need * ctx.block_bytes(bs)} if mode == "swap" else {}
        llm = ctx.engine(block_size=bs, max_model_len=1024, num_blocks=blocks, preemption_mode=mode,
                         enable_prefix_caching=False, **kw)
        r, _ = warm_then_run(llm, w, vocab_size=ctx.vocab, label=f"preemption {mode}", progress=ctx.progress)
        s = r.summary()
        e2e[mode] = s
        erows.append([mode, blocks - 1, need, r.engine_stats["num_preemptions"], r.wall_s, r.gen_tok_s,
                      r.total_tok_s, r.compiles])
        _free(llm)
    table("End to end under memory pressure: recompute vs swap", ["mode", "blocks", "blocks needed by all",
                                                                  "preemptions", "wall s", "gen tok/s",
                                                                  "total tok/s", "compiles in run"], erows,
          [f"{n} requests of {prompt} + {new} tokens in a pool of half of what they need at full length"])
    fig, ax = new_figure(1, 1, "Preemption cost by sequence length")
    a = ax[0][0]
    a.plot(lengths, [1e3 * (r["swap_out_s"] + r["swap_in_s"]) for r in res], "o-", label="swap out + in")
    a.plot(lengths, [1e3 * r["recompute_s"] for r in res], "o-", label="recompute (prefill)")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("sequence length (tokens)")
    a.set_ylabel("ms")
    a.legend()
    save_figure(fig, "seeds_preemption.png")
    return {"by_length": res, "end_to_end": e2e}


# ---- 7. pool residency ---------------------------------------------------------------------


def _mem_available() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def section_residency(ctx: Ctx) -> dict:
    pools = [1024, 4096, 16384]
    # 16k blocks of 16 tokens are 12 GB of float32 K/V; on a machine shared with others, halve
    # the block size until the largest pool fits (the block count is the point)
    cap = ctx.args.residency_max_gib * GiB
    bs = 16
    while bs > 1 and (max(pools) * ctx.block_bytes(bs) > cap
                      or max(pools) * ctx.block_bytes(bs) * 1.2 + GiB > _mem_available()):
        bs //= 2
    batch = 8
    rounds = 2 if ctx.quick else 3
    # Short contexts fit one chunk of the decode attention's loop; long ones take several
    # (its loop runs over chunks of the block table), which is where a copy could hide.
    regimes = {"short": (128, 8 if ctx.quick else 24), "long": (512 + 64, 4 if ctx.quick else 16)}
    rows, res = [], {}
    for regime, (prompt, new) in regimes.items():
        w = make_workload("fixed", batch, vocab_size=ctx.vocab, max_model_len=MAX_MODEL_LEN,
                          seed=ctx.args.seed + 21, prompt_len=prompt, output_len=new)
        steps: dict[int, list[float]] = {nb: [] for nb in pools}
        compiles = dict.fromkeys(pools, 0)
        stopped: dict[int, str] = {}
        # Pools timed in turn over several rounds (A B C A B C ...), so drifting load spreads
        # over all sizes; compilations stay cached across rounds (same shapes).
        for rnd in range(rounds):
            for nb in pools:
                if nb in stopped:
                    continue
                pool_bytes = nb * ctx.block_bytes(bs)
                if pool_bytes * 1.2 + GiB > _mem_available():
                    stopped[nb] = f"skipped: not enough free memory for {pool_bytes / GiB:.1f} GiB"
                    continue
                llm = ctx.engine(block_size=bs, num_blocks=nb, max_num_seqs=batch)
                r, _ = warm_then_run(llm, w.with_fresh_ids(ctx.args.seed + 100 * rnd, ctx.vocab), vocab_size=ctx.vocab,
                                     label=f"{regime} context, pool {nb} blocks, round {rnd + 1}",
                                     progress=ctx.progress, warmup=rnd == 0)
                _free(llm)
                steps[nb] += [st.seconds for st in r.steps if st.decode_only]
                compiles[nb] += r.compiles
                base = np.median(steps[pools[0]])
                if nb != pools[0] and np.median(steps[nb]) > 3 * base:
                    # a step time that grows with the pool: larger pools would only take longer
                    for bigger in pools[pools.index(nb) + 1:]:
                        stopped[bigger] = (f"not run: {nb} blocks already {np.median(steps[nb]) / base:.1f}x "
                                           f"slower than {pools[0]}")
        res[regime] = {}
        for nb in pools:
            pool_bytes = nb * ctx.block_bytes(bs)
            dec = steps[nb]
            if not dec:
                rows.append([regime, prompt, nb, pool_bytes / GiB, stopped.get(nb, "-"), "-", "-", "-", "-"])
                continue
            res[regime][nb] = {"pool_gib": pool_bytes / GiB, "decode_step_median_s": float(np.median(dec)),
                               "decode_step_min_s": float(min(dec)), "decode_steps": len(dec),
                               "compiles": compiles[nb]}
            base = res[regime][pools[0]]["decode_step_median_s"]
            rows.append([regime, prompt, nb, pool_bytes / GiB, 1e3 * np.median(dec), 1e3 * min(dec),
                         1e3 * percentile(dec, 90), f"{100 * (np.median(dec) / base - 1):+.1f}%", compiles[nb]])
    notes = [f"{batch} requests, block size {bs}" + ("" if bs == 16 else f" (lowered from 16 so that 16k blocks fit "
                                                                          f"--residency-max-gib="
                                                                          f"{ctx.args.residency_max_gib} and the free "
                                                                          f"memory)")
             + f"; short: {regimes['short'][0]}-token prompts + {regimes['short'][1]} new tokens (one chunk of the "
               f"decode loop), long: {regimes['long'][0]} + {regimes['long'][1]} (several chunks); decode-only step "
               f"times of {rounds} rounds over the pools in turn, after a warm-up",
             "target: within 5% from 1k to 16k blocks; a copy of the pool per layer would add "
             "30 x pool bytes / bandwidth per step"]
    table(f"Pool residency: decode step time vs pool size (same batch, block size {bs})",
          ["context", "prompt", "pool blocks", "pool GiB", "step ms p50", "step ms min", "step ms p90",
           "vs smallest", "compiles in runs"], rows, notes)
    fig, ax = new_figure(1, 1, "Decode step time vs KV pool size")
    for regime, by_pool in res.items():
        xs = sorted(by_pool)
        ax[0][0].plot(xs, [1e3 * by_pool[x]["decode_step_median_s"] for x in xs], "o-",
                      label=f"{regime} context (median)")
    ax[0][0].set_xscale("log", base=2)
    ax[0][0].set_yscale("log")
    ax[0][0].set_xlabel("pool blocks")
    ax[0][0].set_ylabel("decode step ms")
    ax[0][0].legend()
    save_figure(fig, "seeds_residency.png")
    return {"block_size": bs, **{regime: {str(k): v for k, v in by_pool.items()} for regime, by_pool in res.items()}}


# ---- main ----------------------------------------------------------------------------------


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run of every section")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {SECTIONS}")
    p.add_argument("--kv-budget", type=lambda s: int(float(s) * GiB), default=GiB,
                   help="KV budget in GiB for the host-only tables (default 1, the engine's CPU default)")
    p.add_argument("--residency-max-gib", type=float, default=None,
                   help="largest KV pool the residency section may allocate (default 13; --quick: 4); the block "
                        "size is lowered from 16 until 16k blocks fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.residency_max_gib is None:
        args.residency_max_gib = 4.0 if args.quick else 13.0
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = sorted(set(only) - set(SECTIONS))
    if bad:
        p.error(f"unknown sections {bad}; choose from {SECTIONS}")
    print(f"# reproduce_seeds: {machine_header()}", flush=True)
    ctx = Ctx(args)
    CompileCounter.get()
    times = {}
    name = "reproduce_seeds" + ("_quick" if args.quick else "")
    for sec in SECTIONS:
        if sec not in only:
            continue
        t = time.perf_counter()
        print(f"\n## {sec}", flush=True)
        ctx.report[sec] = globals()[f"section_{sec}"](ctx)
        times[sec] = time.perf_counter() - t
        print(f"({sec}: {times[sec]:.0f} s)", flush=True)
        ctx.report["section_seconds"] = times
        save_json(f"{name}.json", ctx.report)
    table("Section run times", ["section", "seconds"], [[k, v] for k, v in times.items()])
    return ctx.report


if __name__ == "__main__":
    main()
