"""``LLM``: the offline engine (vLLM's ``LLM`` API) and its step loop.

A step is: schedule (host) → build the padded batch (host) → one jitted device step
(model + sampling, pool donated) → postprocess (append tokens, detokenize, stop
checks, fork samples and beams, free finished sequences).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import re
import time
from collections.abc import Iterator, Sequence as Seq
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxpaged.attention import BACKENDS
from jaxpaged.batch import build_batch, bucket
from jaxpaged.beam_search import BeamState
from jaxpaged.block_manager import BlockManager
from jaxpaged.contiguous import ContiguousBlockManager
from jaxpaged.detokenizer import Detokenizer
from jaxpaged.kv_cache import kv_pool_bytes
from jaxpaged.loader import LoadedModel, load_model, shard_model
from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.runner import ModelRunner
from jaxpaged.sampler import SamplingRow, build_sampling_metadata
from jaxpaged.sampling_params import MAX_LOGPROBS, SamplingParams
from jaxpaged.scheduler import Scheduler
from jaxpaged.sequence import Request, Sequence

log = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
DEFAULT_CPU_KV_MEMORY = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2-135M in float32
GPU_KV_FRACTION = 0.5  # of the device memory still free after loading the weights
_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1 << 10, "M": 1e6, "MB": 1e6, "MIB": 1 << 20,
          "G": 1e9, "GB": 1e9, "GIB": 1 << 30, "T": 1e12, "TB": 1e12, "TIB": 1 << 40}


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """``2147483648``, ``"2GiB"``, ``"512 MB"`` → bytes."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(f"{name} must be a number of bytes or a string like '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if not m or m.group(2).upper() not in _UNITS:
            raise ValueError(f"{name}={value!r} is not a size like '2GiB' or '512MB'")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise ValueError(f"{name}={value!r} must be positive")
    return n


def _row_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of a request: distinct per index, independent of batching."""
    return (seed + index * 0x9E3779B97F4A7C15) % (1 << 64)


@dataclasses.dataclass
class _Timers:
    schedule: float = 0.0
    batch: float = 0.0
    device: float = 0.0
    postprocess: float = 0.0


class LLM:
    """An offline engine over one model, modelled on ``vllm.LLM``.

    Args:
      model: a Hugging Face folder, a ``.gguf`` file, an already loaded
        :class:`~jaxpaged.loader.LoadedModel`, or None for the embedded default
        (SmolLM2-135M-Instruct).
      dtype: parameter, activation and KV dtype; default float32 on CPU, bfloat16 elsewhere.
      block_size: tokens per KV block (a power of two).
      num_blocks: KV pool size in blocks (overrides ``kv_cache_memory``).
      kv_cache_memory: KV pool size per device in bytes or a string like ``"2GiB"``. Default:
        on CPU 1 GiB (capped at what ``max_num_seqs`` full-length sequences need); on GPU
        half of the device memory left free after loading the weights.
      max_num_seqs: most sequences in one step.
      max_model_len: most tokens (prompt + output) per sequence; default the model's.
      max_num_batched_tokens: token budget of one step; longer prompts are prefilled in chunks.
      enable_prefix_caching: share the KV of identical prompt prefixes across requests.
      preemption_mode: ``"recompute"`` or ``"swap"`` (needs ``swap_space``).
      swap_space: bytes (or a size string) of host memory for swapped-out KV blocks.
      attention_backend: ``"auto"``, ``"pallas"``, ``"xla"`` or ``"reference"``.
      seed: seeds the per-request seeds of requests that do not set one.
      debug_checks: check the block manager's invariants after every step.
      kv_allocator: ``"paged"``, or ``"contiguous"``: the pre-vLLM baseline where each
        request reserves ``max_model_len`` slots (for benchmarks).
      tensor_parallel_size: shard the model and the KV pool over this many devices (a
        ``"tp"`` mesh; the KV heads must divide evenly). See :mod:`jaxpaged.sharding`,
        also for several hosts. A loaded model is resharded to this size.
    """

    def __init__(
        self,
        model: str | Path | LoadedModel | None = None,
        *,
        dtype=None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int | str | None = None,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        preemption_mode: str = "recompute",
        swap_space: int | str = 0,
        attention_backend: str = "auto",
        seed: int = 0,
        debug_checks: bool = False,
        kv_allocator: str = "paged",
        tensor_parallel_size: int = 1,
    ):
        _check_int("block_size", block_size, 1)
        if block_size & (block_size - 1) or block_size > 256:
            raise ValueError(f"block_size={block_size} must be a power of two in [1, 256]")
        _check_int("max_num_seqs", max_num_seqs, 1)
        for name, v in (("num_blocks", num_blocks), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
            if v is not None:
                _check_int(name, v, 2 if name == "num_blocks" else 1)
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode={preemption_mode!r}; choose 'recompute' or 'swap'")
        swap_bytes = parse_bytes(swap_space, "swap_space") if swap_space else 0
        if preemption_mode == "swap" and not swap_bytes:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (host memory for KV blocks)")
        kv_bytes = parse_bytes(kv_cache_memory) if kv_cache_memory is not None else None
        if kv_allocator not in ("paged", "contiguous"):
            raise ValueError(f"kv_allocator={kv_allocator!r}; choose 'paged' or 'contiguous'")
        if attention_backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {attention_backend!r}; choose from {BACKENDS}")

        lm = model if isinstance(model, LoadedModel) else load_model(
            model, dtype=dtype, attention_backend=attention_backend, tensor_parallel_size=tensor_parallel_size)
        if isinstance(model, LoadedModel) and attention_backend != lm.model.attention_backend:
            lm = dataclasses.replace(lm, model=lm.model.with_backend(attention_backend))
        if isinstance(model, LoadedModel):
            lm = dataclasses.replace(lm, model=shard_model(lm.model, tensor_parallel_size))
        self.tensor_parallel_size = tensor_parallel_size
        self.loaded = lm
        self.config = cfg = lm.config
        self.tokenizer = lm.tokenizer
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        self.max_num_batched_tokens = max_num_batched_tokens or 512
        kv_dtype = lm.model.dtype
        block_bytes = kv_pool_bytes(cfg.num_layers, 1, cfg.num_kv_heads, block_size, cfg.head_dim, kv_dtype)
        device_block_bytes = block_bytes // tensor_parallel_size  # each device holds its heads of every block
        if num_blocks is None:
            if kv_bytes is None:
                kv_bytes = _default_kv_bytes(device_block_bytes, block_size, max_num_seqs, self.max_model_len)
            num_blocks = kv_bytes // device_block_bytes
        if num_blocks < 2:
            raise ValueError(f"a KV pool of {num_blocks} blocks is too small: one is the null block, "
                             f"and a request needs at least one more ({block_bytes} bytes per block)")
        self.block_size = block_size
        if kv_allocator == "contiguous":
            if preemption_mode == "swap":
                raise ValueError("kv_allocator='contiguous' has no swap space; use preemption_mode='recompute'")
            self.bm = ContiguousBlockManager(num_blocks, block_size, max_model_len=self.max_model_len)
        else:
            self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                   max_model_len=self.max_model_len, swap_space=swap_bytes,
                                   block_bytes=block_bytes, model_id=str(lm.source))
        self.scheduler = Scheduler(self.bm, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=self.max_num_batched_tokens,
                                   preemption_mode=preemption_mode)
        self.runner = ModelRunner(lm.model, num_blocks=num_blocks, block_size=block_size,
                                  num_host_blocks=self.bm.num_host_blocks)
        self.max_blocks_per_seq = -(-self.max_model_len // block_size)
        self.eos_ids = tuple(cfg.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer is not None and self.tokenizer.eos_token_id is not None else ())
        self.debug_checks = debug_checks
        self._rng = np.random.default_rng(seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._beams: dict[str, BeamState] = {}
        self._fork_copies: list[tuple[int, int]] = []  # block copies a fork asked for (contiguous only)
        self.num_steps = 0
        self.peak_kv_utilization = 0.0
        self.timers = _Timers()

    # ---- requests -------------------------------------------------------------------

    def _to_token_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompts as token ids")
            return prompt, self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        if isinstance(prompt, (list, tuple, np.ndarray)):
            ids = [int(t) for t in prompt]
            if not ids:
                raise ValueError("prompt is empty (no token ids)")
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
            return None, ids
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, *,
                    request_id: str | None = None) -> str:
        """Queue a request; returns its id. Raises before any work if it is invalid."""
        return self._enqueue(self._make_request(prompt, params, request_id))

    def _make_request(self, prompt: PromptType, params: SamplingParams | None,
                      request_id: str | None = None) -> Request:
        """A validated request, not queued yet."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._to_token_ids(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(the prompt plus at least one generated token must fit)")
        self.bm.check_fits(len(ids))  # a prompt that could never fit the pool is an error, not a wait
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if request_id is not None and str(request_id) in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 1 << 63))
        req = Request(request_id, text, ids, params, time.monotonic(), seed)
        req.seqs[0].detok = self._detokenizer(params)
        return req

    def _enqueue(self, req: Request) -> str:
        self.scheduler.add(req)
        if req.params.use_beam_search:
            self._beams[req.request_id] = BeamState(req.params.beam_width, req.params.length_penalty)
        self._requests[req.request_id] = req
        return req.request_id

    def _detokenizer(self, params: SamplingParams) -> Detokenizer | None:
        if self.tokenizer is None:
            return None
        return Detokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens, stop=params.stop)

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks are freed and its output is finished with 'abort'."""
        req = self._requests.get(str(request_id))
        if req is None or req.finished:
            return
        for s in req.live_seqs():
            s.finish_reason = "abort"
        req.aborted = True
        self._finish(req)
        self._requests.pop(req.request_id, None)
        self._beams.pop(req.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns the outputs of requests that progressed."""
        return self._step(finished_only=False)

    def _step(self, *, finished_only: bool) -> list[RequestOutput]:
        """One iteration; ``finished_only`` builds outputs for finished requests alone
        (``generate`` waits for those: an output per request per step is ~20 us each)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.timers.schedule += t1 - t0
        touched: dict[str, Request] = {r.request_id: r for r in out.preempted}
        if out.empty:
            if self.scheduler.has_unfinished() and not out.preempted:
                raise RuntimeError("scheduler made no progress: no request fits the KV pool")
            return self._outputs(touched, finished_only)
        ops = [("copy", a, b) for a, b in self._fork_copies] + out.block_ops
        self._fork_copies = []
        copies = self.runner.apply_block_ops(ops)
        batch = build_batch(out, self.bm, copies=copies, max_blocks_per_seq=self.max_blocks_per_seq)
        rows = [SamplingRow(r.seq.request.params, _row_seed(r.seq.request.seed, r.index),
                            r.seq.request.prompt_token_ids, r.seq.output_token_ids) for r in batch.rows]
        sm, num_logprobs, use_penalties = build_sampling_metadata(
            rows, len(batch.logits_indices), self.config.vocab_size, self.eos_ids)
        beam_k = max((2 * r.seq.request.params.beam_width for r in batch.rows if r.seq.request.is_beam_search),
                     default=0)
        num_logprobs = min(bucket(max(num_logprobs, beam_k)) if max(num_logprobs, beam_k) else 0,
                           self.config.vocab_size)
        num_prompt_lp = max((r.seq.request.params.prompt_logprobs for r in batch.prompt_lp_rows), default=0)
        num_prompt_lp = min(bucket(num_prompt_lp), MAX_LOGPROBS) if num_prompt_lp else 0
        t2 = time.perf_counter()
        self.timers.batch += t2 - t1
        sampled, prompt_lp = self.runner.execute(batch, sm, num_logprobs=num_logprobs,
                                                 num_prompt_logprobs=num_prompt_lp, use_penalties=use_penalties)
        t3 = time.perf_counter()
        self.timers.device += t3 - t2
        self.num_steps += 1
        self._postprocess(out, batch, sampled, prompt_lp, touched)
        util = self.bm.stats()
        if util.slots_allocated:
            self.peak_kv_utilization = max(self.peak_kv_utilization, util.utilization)
        if self.debug_checks:
            self.bm.check_invariants()
        self.timers.postprocess += time.perf_counter() - t3
        return self._outputs(touched, finished_only)

    def _outputs(self, touched: dict[str, Request], finished_only: bool = False) -> list[RequestOutput]:
        outs = [self._output(r) for r in touched.values() if r.finished or not finished_only]
        for r in touched.values():  # a finished request's last output is out: forget it
            if r.finished:
                self._requests.pop(r.request_id, None)
                self._beams.pop(r.request_id, None)
        return outs

    def _postprocess(self, out, batch, sampled, prompt_lp, touched: dict[str, Request]) -> None:
        now = time.monotonic()
        for s in out.scheduled:
            s.seq.num_computed_tokens = s.start + s.num_new_tokens
            self.bm.mark_computed(s.seq.seq_id, s.seq.num_computed_tokens, s.seq.token_ids)
            touched[s.seq.request.request_id] = s.seq.request
        if prompt_lp is not None:
            self._record_prompt_logprobs(batch, prompt_lp)
        by_request: dict[str, list[tuple[int, Any]]] = {}
        for i, row in enumerate(batch.rows):
            by_request.setdefault(row.seq.request.request_id, []).append((i, row))
        for rid, rows in by_request.items():
            req = self._requests[rid]
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            if req.is_beam_search:
                self._beam_step(req, [(row.seq, i) for i, row in rows], sampled)
            elif len(rows) > 1 and all(row.seq is rows[0][1].seq for _, row in rows):
                # The prompt's first samples (n > 1): fork the sequence, sharing every block.
                parent = rows[0][1].seq
                children = [parent]
                for i, row in rows[1:]:
                    child = parent.fork(row.index)
                    self._fork_copies += self.bm.fork(parent.seq_id, child.seq_id)
                    children.append(child)
                req.seqs = children
                for (i, _), seq in zip(rows, children):
                    self._append(seq, i, sampled)
            else:
                for i, row in rows:
                    self._append(row.seq, i, sampled)
            if not req.is_beam_search:
                for seq in req.seqs:
                    if seq.finished:
                        self.scheduler.free_seq(seq)
                if not req.live_seqs():
                    self._finish(req)

    def _append(self, seq: Sequence, row: int, sampled) -> None:
        token = int(sampled.tokens[row])
        params = seq.request.params
        seq.token_ids.append(token)
        seq.cumulative_logprob += float(sampled.logprobs[row])
        if params.logprobs is not None:
            entry = {token: Logprob(float(sampled.logprobs[row]), int(sampled.ranks[row]), self._decode1(token))}
            for k in range(params.logprobs):
                t = int(sampled.top_ids[row, k])
                entry.setdefault(t, Logprob(float(sampled.top_logprobs[row, k]), k + 1, self._decode1(t)))
            seq.logprobs.append(entry)
        stop_str = seq.detok.add(token) if seq.detok is not None else None
        n_out = seq.num_output_tokens
        if n_out >= params.min_tokens:
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
            elif token in params.stop_token_ids:
                seq.finish_reason, seq.stop_reason = "stop", token
            elif not params.ignore_eos and token in self.eos_ids:
                seq.finish_reason = "stop"
        if seq.finish_reason is None and (
                (params.max_tokens is not None and n_out >= params.max_tokens)
                or len(seq.token_ids) >= self.max_model_len):
            seq.finish_reason = "length"

    def _stops(self, seq: Sequence, token: int) -> bool:
        p = seq.request.params
        n_out = seq.num_output_tokens + 1
        if n_out >= p.min_tokens and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_ids)):
            return True
        return (p.max_tokens is not None and n_out >= p.max_tokens) or len(seq.token_ids) + 1 >= self.max_model_len

    def _beam_step(self, req: Request, rows: list[tuple[Sequence, int]], sampled) -> None:
        state = self._beams[req.request_id]
        k = 2 * state.width
        beams = [(seq, sampled.top_ids[i, :k].tolist(), sampled.top_logprobs[i, :k].tolist()) for seq, i in rows]
        running, done = state.select(beams, self._stops, req.num_prompt_tokens)
        if done:
            for seq in req.seqs:
                self.scheduler.free_seq(seq)
            req.seqs = []
            self._finish(req)
            return
        # Fork first, from the parents as they are; then append the chosen tokens.
        kept: set[int] = set()
        plan: list[tuple[Sequence, Any]] = []
        for j, c in enumerate(running):
            if c.parent.seq_id in kept:
                child = c.parent.fork(j)
                self._fork_copies += self.bm.fork(c.parent.seq_id, child.seq_id)
                plan.append((child, c))
            else:
                kept.add(c.parent.seq_id)
                plan.append((c.parent, c))
        for seq in req.seqs:
            if seq.seq_id not in kept:
                self.scheduler.free_seq(seq)
        for j, (seq, c) in enumerate(plan):
            seq.index = j
            seq.token_ids.append(c.token)
            seq.cumulative_logprob = c.cumulative_logprob
        req.seqs = [seq for seq, _ in plan]

    def _record_prompt_logprobs(self, batch, prompt_lp) -> None:
        lps, ranks, top_ids, top_lps = prompt_lp
        i = 0
        for group in batch.prompt_lp_rows:
            req = group.seq.request
            k = req.params.prompt_logprobs
            if req.prompt_logprobs is None:
                req.prompt_logprobs = [None] * req.num_prompt_tokens
            for j in range(group.count):
                target = req.prompt_token_ids[group.start + j + 1]
                entry = {target: Logprob(float(lps[i]), int(ranks[i]), self._decode1(target))}
                for r in range(k):
                    t = int(top_ids[i, r])
                    entry.setdefault(t, Logprob(float(top_lps[i, r]), r + 1, self._decode1(t)))
                req.prompt_logprobs[group.start + j + 1] = entry
                i += 1

    def _decode1(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def _finish(self, req: Request) -> None:
        self.scheduler.finish(req)
        req.metrics.finished_time = time.monotonic()

    # ---- outputs --------------------------------------------------------------------

    def _output(self, req: Request) -> RequestOutput:
        p = req.params
        if req.is_beam_search:
            completions = self._beam_outputs(req)
        else:
            completions = [
                CompletionOutput(
                    index=s.index, text=s.detok.text if s.detok is not None else "",
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if s.num_output_tokens else None,
                    logprobs=list(s.logprobs) if p.logprobs is not None else None,
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason)
                for s in sorted(req.seqs, key=lambda s: s.index)
            ]
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=req.prompt_logprobs, outputs=completions, finished=req.finished,
            num_cached_tokens=req.num_cached_tokens, metrics=req.metrics)

    def _beam_outputs(self, req: Request) -> list[CompletionOutput]:
        state = self._beams[req.request_id]
        n = req.params.n
        if req.finished:
            hyps = state.hypotheses if not req.aborted or state.hypotheses else []
            items = [(h.token_ids, h.cumulative_logprob, "length" if len(h.token_ids) - req.num_prompt_tokens
                      >= (req.params.max_tokens or self.max_model_len) else "stop") for h in hyps[:n]]
            if req.aborted and not items:
                items = [(s.token_ids, s.cumulative_logprob, "abort") for s in req.seqs[:n]]
        else:
            items = [(s.token_ids, s.cumulative_logprob, None) for s in req.seqs[:n]]
        outs = []
        for i, (ids, lp, reason) in enumerate(items):
            out_ids = ids[req.num_prompt_tokens:]
            text = self.tokenizer.decode(out_ids, skip_special_tokens=req.params.skip_special_tokens) \
                if self.tokenizer is not None else ""
            outs.append(CompletionOutput(i, text, list(out_ids), lp, None, reason, None))
        return outs

    # ---- convenience APIs -----------------------------------------------------------

    def generate(self, prompts: PromptType | Seq[PromptType], sampling_params: SamplingParams
                 | Seq[SamplingParams] | None = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for one or many prompts; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if isinstance(sampling_params, Seq) and not isinstance(sampling_params, SamplingParams):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
            params = list(sampling_params)
        else:
            params = [sampling_params or SamplingParams()] * len(prompts)
        # Validate everything before any work: a bad prompt raises and nothing is queued.
        reqs = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        ids = [self._enqueue(r) for r in reqs]
        return self._run(ids, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], *, use_tqdm: bool) -> list[RequestOutput]:
        from tqdm.auto import tqdm

        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while wanted - done.keys():
                for o in self._step(finished_only=True):
                    if o.finished and o.request_id in wanted and o.request_id not in done:
                        done[o.request_id] = o
                        generated += sum(len(c.token_ids) for c in o.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")
        finally:
            bar.close()
        return [done[r] for r in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the model's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt)} for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated (deltas of the first completion)."""
        rid = self.add_request(prompt, sampling_params)
        sent = 0
        try:
            while True:
                outs = [o for o in self.step() if o.request_id == rid]
                for o in outs:
                    text = o.outputs[0].text if o.outputs else ""
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
                    if o.finished:
                        return
        finally:
            self.abort(rid)  # a no-op once finished; frees the blocks if the caller stopped early

    def stats(self) -> dict[str, Any]:
        m = self.bm.stats()
        pc = self.bm.prefix_cache_stats
        return {
            "num_blocks": m.num_blocks, "block_size": m.block_size, "num_free_blocks": m.num_free_blocks,
            "num_used_blocks": m.num_used_blocks, "num_cached_blocks": m.num_cached_blocks,
            "kv_usage": m.num_used_blocks / m.num_blocks,
            "peak_kv_utilization": self.peak_kv_utilization,
            "prefix_cache_queries": pc.queries, "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate, "prefix_cache_evictions": pc.evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_out_blocks": self.scheduler.num_swapped_out_blocks,  # total over the run
            "num_host_blocks_used": m.num_host_blocks_used,
            "num_steps": self.num_steps, "num_compiled_shapes": len(self.runner.compiled_shapes),
            "time_schedule_s": self.timers.schedule, "time_batch_s": self.timers.batch,
            "time_device_s": self.timers.device, "time_postprocess_s": self.timers.postprocess,
        }


def _check_int(name: str, v, minimum: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {v!r}")
    if v < minimum:
        raise ValueError(f"{name}={v} must be >= {minimum}")


def _default_kv_bytes(block_bytes: int, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    if jax.default_backend() == "cpu":
        need = max_num_seqs * (-(-max_model_len // block_size) + 1) * block_bytes
        return min(DEFAULT_CPU_KV_MEMORY, need)
    dev = jax.local_devices()[0]
    stats = dev.memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    return int(GPU_KV_FRACTION * free) if free > 0 else DEFAULT_CPU_KV_MEMORY


def generate(prompts: PromptType | Seq[PromptType], model: str | Path | LoadedModel | None = None,
             **kwargs) -> str | list[str]:
    """One call from prompt(s) to text: ``kwargs`` go to ``LLM`` or ``SamplingParams`` by name.

    Returns a str for a single str prompt, else a list of str (the first completion of each).
    """
    import inspect

    engine_names = set(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
    sp_names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(kwargs) - engine_names - sp_names - {"use_tqdm"}
    if unknown:
        raise TypeError(f"generate() got unknown options {sorted(unknown)}")
    llm = LLM(model, **{k: v for k, v in kwargs.items() if k in engine_names})
    params = SamplingParams(**{k: v for k, v in kwargs.items() if k in sp_names})
    outs = llm.generate(prompts, params, use_tqdm=kwargs.get("use_tqdm", False))
    texts = [o.outputs[0].text for o in outs]
    return texts[0] if isinstance(prompts, str) else texts
