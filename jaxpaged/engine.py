"""``LLM``: the offline engine (vLLM's ``LLM`` API), a thin facade over the engine core.

prompt → :class:`~jaxpaged.input_processor.InputProcessor` (validated ``Request``) →
:class:`~jaxpaged.engine_core.EngineCore` (scheduler → model runner → scheduler) → the
changed requests → :class:`~jaxpaged.output_processor.OutputProcessor` (``RequestOutput``).

Every caller gets all its outputs: requests queued by ``generate`` and ``stream`` deliver
to those calls, the others to ``step()``, whichever of them happens to run the engine.
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import logging
import time
from collections import ChainMap
from collections.abc import Iterable, Iterator, Mapping, Sequence as Seq
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxpaged import hugepages
from jaxpaged.block_manager import BlockManager
from jaxpaged.chat_template import template_kwargs
from jaxpaged.compilation_cache import ensure_compilation_cache
from jaxpaged.config import LlamaConfig
from jaxpaged.contiguous import ContiguousBlockManager
from jaxpaged.data_parallel import DataParallelRunner, DataParallelScheduler
from jaxpaged.detokenizer import stream_end
from jaxpaged.dp_attention import DPAttentionRunner
from jaxpaged.engine_args import EngineArgs, default_block_size
from jaxpaged.engine_core import EngineCore
from jaxpaged.generation_config import default_sampling_overrides, for_request
from jaxpaged.input_processor import (RUNNERS, InputProcessor, PromptType, chat_messages, pair_prompts, per_prompt_lora,
                                      prompt_names)
from jaxpaged.kv_cache import kv_pool_bytes, resolve_kv_cache_dtype
from jaxpaged.loader import LoadedModel, assemble_model, load_model, shard_model, stream_params
from jaxpaged.lora import LoRAConfig, LoRAManager, LoRARequest
from jaxpaged.model import runtime_form
from jaxpaged.output_processor import OutputProcessor
from jaxpaged.outputs import (BeamSearchOutput, BeamSearchSequence, EmbeddingRequestOutput, RequestOutput,
                              ScoringOutput, ScoringRequestOutput)
from jaxpaged.pooling import PoolingParams, cosine, score_pairs
from jaxpaged.reasoning import ReasoningParser, check_reasoning_parser
from jaxpaged.runner import ModelRunner, split_model
from jaxpaged.sampling_params import BeamSearchParams, SamplingParams
from jaxpaged.scheduler import Scheduler
from jaxpaged.sequence import Request
from jaxpaged.sharding import data_parallel_devices, model_on_device, request_cpu_devices
from jaxpaged.spec_decode import SpeculativeConfig
from jaxpaged.tool_calling import check_tools

log = logging.getLogger(__name__)


class LLM:
    """An offline engine over one model, modelled on ``vllm.LLM``.

    Args:
      model: a Hugging Face folder, a ``.gguf`` file, an already loaded
        :class:`~jaxpaged.loader.LoadedModel`, or None for the embedded default
        (SmolLM2-135M-Instruct).
      dtype: parameter and activation dtype; default float32 on CPU, bfloat16 elsewhere. On CPU a
        16-bit model keeps float32 activations and multiplies in 16 bits with float32 sums
        (bfloat16: fast on CPUs with AMX or AVX512-BF16 for batches, slower for one sequence).
      block_size: tokens per KV block (a power of two); default 64 where attention runs in XLA
        ops (CPU), 16 for the Pallas kernels (see :func:`~jaxpaged.engine_args.default_block_size`).
      num_blocks: KV pool size in blocks (overrides ``kv_cache_memory``).
      kv_cache_memory: KV pool size per device in bytes or a string like ``"2GiB"``. Default:
        on CPU 1 GiB (capped at what ``max_num_seqs`` full-length sequences need); on GPU
        half of the device memory left free after loading the weights.
      max_num_seqs: most sequences in one step (the forks of ``n > 1`` and beams count).
      max_model_len: most tokens (prompt + output) per sequence; default the model's.
      max_num_batched_tokens: token budget of one step; longer prompts are prefilled in chunks.
      enable_prefix_caching: share the KV of identical prompt prefixes across requests.
      preemption_mode: ``"recompute"`` or ``"swap"`` (needs ``swap_space``).
      scheduling_policy: ``"fcfs"`` (first come, first served) or ``"priority"`` (vLLM's):
        requests run in order of their ``priority`` (lower first), then of arrival; a request
        may preempt running ones of a later priority to make room for itself, as an older one
        does a newer under FCFS (:mod:`jaxpaged.scheduler`). Under FCFS a priority other than 0
        is refused.
      swap_space: bytes (or a size string) of host memory for swapped-out KV blocks.
      attention_backend: ``"auto"`` (Pallas on TPU and GPU, XLA on CPU), ``"pallas"``,
        ``"pallas_tpu"``, ``"pallas_gpu"``, ``"xla"`` or ``"reference"`` (:mod:`jaxpaged.attention`).
      seed: seeds the per-request seeds of requests that do not set one.
      debug_checks: check the block manager's invariants after every step.
      kv_allocator: ``"paged"``, or ``"contiguous"``: the pre-vLLM baseline where each
        request reserves ``max_model_len`` slots (for benchmarks).
      tensor_parallel_size: shard the model and the KV pool over this many devices (a
        ``"tp"`` mesh; the KV heads must divide evenly). See :mod:`jaxpaged.sharding`,
        also for several hosts. A loaded model is resharded to this size. On CPU, devices
        are made as for ``data_parallel_size``.
      data_parallel_size: run this many replicas of the engine, one per device (the model
        copied to each, each with its own KV pool and scheduler), and spread the requests
        over them (:mod:`jaxpaged.data_parallel`). The limits and the pool size are per
        replica. On CPU the engine makes its N devices when it is created before any jax
        computation in the process; otherwise set ``XLA_FLAGS=--xla_force_host_platform_device_count=N``
        before jax starts. Replicas pay only where attention dominates (long contexts): each
        runs its matmuls on its own core.
      enable_dp_attention: with ``data_parallel_size`` > 1 on CPU, run the replicas' steps as
        one program over their devices: attention per replica, the MLP and the LM head split
        between the devices (SGLang's DP attention; :mod:`jaxpaged.dp_attention`); a step
        with work on one replica only runs on its device alone. Each device holds a copy of
        the model, and the split weights one more copy in all.
      async_scheduling: schedule and launch each step while the device runs the previous
        one (vLLM's ``async_scheduling``): the host's work hides behind the device's, and
        the tokens are the synchronous loop's (:mod:`jaxpaged.engine_core`). False runs
        one step at a time.
      kv_cache_dtype: the KV pool's dtype, ``"auto"``, ``"float32"``, ``"bfloat16"``,
        ``"float16"``, or float8 (vLLM's ``"fp8"`` = ``"fp8_e4m3"``, ``"fp8_e5m2"``).
        ``"auto"``: the model's dtype, but float32 for a 16-bit model on CPU (its activations
        are float32 there, so its K/V stay exact). float8 holds 4x a float32 pool's tokens in
        the same memory (2x bfloat16's); K and V are rounded to it (scale 1) and the tokens
        may differ (see :func:`~jaxpaged.kv_cache.resolve_kv_cache_dtype`).
      speculative_config: speculative decoding, vLLM's form: ``{"method": "ngram",
        "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}``
        (or a :class:`~jaxpaged.spec_decode.SpeculativeConfig`). A decoding sequence proposes
        the tokens that followed the latest earlier occurrence of its last few tokens, and
        one step checks them all; outputs stay the ones decoding without it gives. Pays
        where outputs repeat their input or themselves (edits, extraction, code). None: off.
      generation_config: ``"auto"``: the sampling defaults the model folder's
        ``generation_config.json`` sets (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens) are those of requests that give no parameters,
        as in vLLM (:mod:`jaxpaged.generation_config`); ``"vllm"``: jaxpaged's own; or a
        folder whose ``generation_config.json`` to take.
      runner: vLLM's: ``"generate"`` (completions only), ``"pooling"`` (embeddings only,
        :meth:`embed`), or ``"auto"``, both, side by side in the same steps.
      reasoning_parser: a reasoning model's think tags (``"deepseek_r1"``, ``"qwen3"``: vLLM's names; see
        :mod:`jaxpaged.reasoning`): a structured output's grammar then starts after the
        reasoning, so the model thinks freely first; the server splits replies into
        ``reasoning`` and ``content``. The tokenizer must hold the tags as tokens.
      enable_lora: serve LoRA adapters (vLLM's multi-LoRA): a request's ``lora_request``
        (a :class:`~jaxpaged.lora.LoRARequest` naming a PEFT folder) runs the base model with
        that adapter's low-rank updates, beside requests of other adapters and of none
        (:mod:`jaxpaged.lora`).
      max_loras: most adapters on the device at once (and among the running requests).
      max_lora_rank: most rank of an adapter (device memory per slot follows it).
      max_cpu_loras: most adapters kept loaded on the host (default ``max_loras``).
      enable_sleep_mode: allow :meth:`sleep` (vLLM's sleep mode): free the engine's device
        memory between workloads, and :meth:`wake_up` to run again.
    """

    def __init__(self, model: str | Path | LoadedModel | None = None, *, dtype=None, block_size: int | None = None,
                 num_blocks: int | None = None, kv_cache_memory: int | str | None = None, max_num_seqs: int = 256,
                 max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, preemption_mode: str = "recompute", swap_space: int | str = 0,
                 attention_backend: str = "auto", seed: int = 0, debug_checks: bool = False,
                 kv_allocator: str = "paged", tensor_parallel_size: int = 1, async_scheduling: bool = True,
                 kv_cache_dtype: str = "auto", data_parallel_size: int = 1, enable_dp_attention: bool = False,
                 speculative_config: SpeculativeConfig | dict | None = None, generation_config: str | Path = "auto",
                 scheduling_policy: str = "fcfs", reasoning_parser: str | None = None, runner: str = "auto",
                 enable_lora: bool = False, max_loras: int = 1, max_lora_rank: int = 16,
                 max_cpu_loras: int | None = None, enable_sleep_mode: bool = False):
        check_reasoning_parser(reasoning_parser)  # a bad name fails before loading
        lora_config = LoRAConfig(max_loras, max_lora_rank, max_cpu_loras) if enable_lora else None
        if lora_config is not None and enable_dp_attention:
            raise ValueError("enable_lora is not supported with enable_dp_attention; use data_parallel_size "
                             "without it")
        if runner not in RUNNERS:
            raise ValueError(f"runner={runner!r}; choose from {RUNNERS}")
        if (cfg := _model_config(model)) is not None and cfg.moe is not None:  # before devices or weights
            if enable_dp_attention:
                raise ValueError(f"enable_dp_attention is not supported for a mixture-of-experts model "
                                 f"({_source(model)})")
        ensure_compilation_cache()  # also where the model comes built: before the engine compiles
        args = EngineArgs(block_size, num_blocks, kv_cache_memory, max_num_seqs, max_model_len,
                          max_num_batched_tokens, enable_prefix_caching, preemption_mode, swap_space,
                          attention_backend, seed, debug_checks, kv_allocator, tensor_parallel_size, async_scheduling,
                          kv_cache_dtype, data_parallel_size, speculative_config, scheduling_policy)
        request_cpu_devices(data_parallel_size * tensor_parallel_size)  # CPU: made here if jax has not started
        replica_devices = data_parallel_devices(data_parallel_size, tensor_parallel_size)
        if enable_dp_attention and replica_devices is None:
            raise ValueError("enable_dp_attention needs data_parallel_size > 1 (the replicas it runs as one program)")
        if enable_dp_attention and replica_devices[0].platform != "cpu":
            raise ValueError(f"enable_dp_attention runs on CPU devices only, not {replica_devices[0].platform}")
        overrides = default_sampling_overrides(generation_config, _source(model))  # a bad one fails before loading
        if isinstance(model, LoadedModel) and model.model is None:
            raise ValueError("this LoadedModel's weights were let go by its engine's sleep(): wake that engine up "
                             "first")
        if isinstance(model, LoadedModel):
            # Sharded, then in the form it runs in (shared by engines over the same model).
            lm = dataclasses.replace(model, model=runtime_form(shard_model(model.model, tensor_parallel_size)))
            if attention_backend != lm.model.attention_backend:
                lm = dataclasses.replace(lm, model=lm.model.with_backend(attention_backend))
        else:
            lm = load_model(model, dtype=dtype, attention_backend=attention_backend,
                            tensor_parallel_size=tensor_parallel_size)
            lm = dataclasses.replace(lm, model=runtime_form(lm.model))  # the loaded stack is let go
        if block_size is None:
            block_size = default_block_size(lm.model.platform, attention_backend, args.kv_cache_dtype)
            args = dataclasses.replace(args, block_size=block_size)
        self.args, self.loaded, self.config, self.tokenizer = args, lm, lm.config, lm.tokenizer
        self.default_sampling_overrides = overrides
        self.reasoning = ReasoningParser(reasoning_parser, lm.tokenizer) if reasoning_parser is not None else None
        self.tensor_parallel_size, self.block_size = tensor_parallel_size, block_size
        cfg = lm.config
        self.max_model_len = args.model_len(cfg.max_position_embeddings)
        self.max_num_batched_tokens = max_num_batched_tokens or 512
        self.kv_cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, lm.model.dtype, lm.model.platform)
        block_bytes = kv_pool_bytes(cfg.num_layers, 1, cfg.num_kv_heads, block_size, cfg.head_dim, self.kv_cache_dtype)
        num_blocks = args.kv_blocks(block_bytes, self.max_model_len)
        self.eos_ids = tuple(cfg.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer is not None and self.tokenizer.eos_token_id is not None
            else ())

        def replica(model, device=None):
            if kv_allocator == "contiguous":
                bm = ContiguousBlockManager(num_blocks, block_size, max_model_len=self.max_model_len)
            else:
                bm = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                  max_model_len=self.max_model_len, swap_space=args.swap_bytes,
                                  block_bytes=block_bytes, model_id=str(lm.source))
            scheduler = Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                  max_model_len=self.max_model_len, eos_ids=self.eos_ids,
                                  preemption_mode=preemption_mode, speculative_config=args.speculative_config,
                                  scheduling_policy=scheduling_policy,
                                  max_loras=None if lora_config is None else lora_config.max_loras)
            runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size,
                                 max_model_len=self.max_model_len, eos_ids=self.eos_ids,
                                 num_host_blocks=bm.num_host_blocks, dtype=self.kv_cache_dtype, device=device,
                                 lora_config=lora_config)
            return bm, scheduler, runner

        if replica_devices is None:
            self.bm, self.scheduler, self.runner = replica(lm.model)
        elif enable_dp_attention:  # the replicas' pools and host work; one program runs their steps
            if lm.model.is_stacked:
                raise ValueError("enable_dp_attention runs the CPU form of a model (one CPU device per replica)")
            # Each replica keeps a copy of the model on its device: steps where only one
            # replica has work run there alone (DPAttentionRunner._dispatch_solo), and the
            # program over both devices takes its replicated weights from these copies.
            _, schedulers, runners = zip(*(replica(model_on_device(lm.model, d), d) for d in replica_devices))
            self.scheduler, self.runner = DataParallelScheduler(schedulers), DPAttentionRunner(lm.model, list(runners))
            self.bm = self.scheduler.kv
        else:  # one replica per device; the composites stand in for one (jaxpaged.data_parallel)
            _, schedulers, runners = zip(*(replica(model_on_device(lm.model, d)) for d in replica_devices))
            self.scheduler, self.runner = DataParallelScheduler(schedulers), DataParallelRunner(runners)
            self.bm = self.scheduler.kv
        self.data_parallel_size = data_parallel_size
        usable = self.bm.num_usable_blocks // data_parallel_size  # a sequence lives in one replica's pool
        if usable * block_size < self.max_model_len:
            # vLLM refuses this; here a sequence that outgrows the pool alone is finished early
            # (finish_reason "length", with a finish_detail saying why), the others run.
            log.warning("max_model_len=%d is more than the KV pool holds (%d blocks of %d slots: %d tokens); a "
                        "sequence that outgrows the pool alone is finished early", self.max_model_len,
                        usable, block_size, usable * block_size)
        self.core = EngineCore(self.scheduler, self.runner, debug_checks=debug_checks,
                               async_scheduling=async_scheduling)
        self.inputs = InputProcessor(self.tokenizer, vocab_size=cfg.vocab_size, max_model_len=self.max_model_len,
                                     check_request=self.scheduler.check_request, seed=seed, eos_ids=self.eos_ids,
                                     default_params=self.get_default_sampling_params(), reasoning=self.reasoning,
                                     hidden_size=cfg.hidden_size)
        self.inputs.runner = runner
        self.inputs.lora = None if lora_config is None else LoRAManager(cfg, lora_config)
        if isinstance(self.runner, DPAttentionRunner):
            self.inputs.no_pooling = ("embedding requests are not supported with enable_dp_attention (its joint step "
                                      "returns no hidden states); use data_parallel_size without it")
        self.outputs = OutputProcessor(self.tokenizer)
        self._unclaimed: dict[str, Request] = {}  # changed since step() last returned them
        self._claimed: dict[str, dict[str, Request]] = {}  # generate/stream requests -> their inbox
        # Sleep mode: what is let go ("weights", "kv_cache"), the weights' host copy (level 1),
        # and how to load them again (level 2) where the engine loaded them itself.
        self.enable_sleep_mode = enable_sleep_mode
        self._asleep: set[str] = set()
        self._host_weights: list[np.ndarray] | None = None
        self._weights_source = None if isinstance(model, LoadedModel) else (
            None if model is None else Path(model).expanduser().resolve(), dtype)  # (the cwd may change)
        self._weights_dtype = lm.model.dtype

    # ---- requests and the step ------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's; e.g. after the weights changed in place), so no
        later request reuses K/V computed before. False, and nothing forgotten, while requests
        hold blocks: call it between ``generate`` calls (:class:`~jaxpaged.AsyncLLM` has its own)."""
        return self.bm.reset_prefix_cache()

    # ---- sleep mode ------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the engine's device memory until :meth:`wake_up` (vLLM's sleep mode; needs
        ``enable_sleep_mode=True``), e.g. for a trainer between rollouts. Level 1 copies the
        weights to host memory and discards the KV cache; level 2 discards both, and
        :meth:`wake_up` loads the weights from the model's checkpoint again (new weights,
        where a trainer rewrote it). Cached prefixes are forgotten either way.

        Weights given as a :class:`~jaxpaged.loader.LoadedModel` are the caller's (other
        engines may run on them): they stay where they are, and only the KV cache goes.

        Raises:
          ValueError: sleep mode is off, or ``level`` is not 1 or 2.
          RuntimeError: requests are unfinished (let them finish, or abort them, first).
        """
        self.check_can_sleep(level)
        while self.core.has_unfinished():
            self._advance()  # a step launched past the last request's end (async scheduling)
        let_go = "weights" not in self._asleep and self._weights_source is not None
        if let_go and level == 1:  # first: where it fails (arrays on other hosts), nothing is let go yet
            self._host_weights = self._host_copy(self._runners()[0].params)
        if not self.bm.reset_prefix_cache():
            raise RuntimeError("sleep: blocks are still held though no request is unfinished")
        if "kv_cache" not in self._asleep:
            self.runner.discard_kv()
            self._asleep.add("kv_cache")
        if let_go:
            self.runner.discard_weights()
            self.loaded = dataclasses.replace(self.loaded, model=None)
            self._asleep.add("weights")
        if level == 2:  # (after a level-1 sleep too: the weights come from the checkpoint)
            self._host_weights = None
        gc.collect()  # a model's modules refer to each other: without it, their arrays wait for the next collection

    @staticmethod
    def _host_copy(params) -> list[np.ndarray]:
        """The weights in host memory; on CPU in one huge-page region, which ``device_put`` then
        aliases (:func:`jaxpaged.hugepages.host_arrays`): the woken weights read as fast as the
        first ones, and are not copied again."""
        device = next(iter(params[0].devices()))
        host = hugepages.host_arrays([(a.shape, a.dtype) for a in params], device)
        for dst, a in zip(host, params):
            dst[...] = np.asarray(a)
        return host

    def check_can_sleep(self, level: int) -> None:
        """Raise as :meth:`sleep` would before letting anything go."""
        if not self.enable_sleep_mode:
            raise ValueError("sleep mode is off: create the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        if level not in (1, 2) or isinstance(level, bool):
            raise ValueError(f"sleep level must be 1 (weights to host memory) or 2 (weights discarded), got {level!r}")
        if self.core.scheduler.has_unfinished():
            n = len(self.core.requests)
            raise RuntimeError(f"sleep: {n} request(s) are unfinished; let them finish or abort them first")

    def wake_up(self, tags: Seq[str] | None = None) -> None:
        """Undo :meth:`sleep`: ``tags`` ``"weights"``, ``"kv_cache"``, or both (None). Waking
        the weights first lets a caller free more memory before the pool comes back. Requests
        run again once both are back.

        Raises:
          ValueError: an unknown tag.
          RuntimeError: level 2's checkpoint no longer matches the engine's model.
        """
        tags = ("weights", "kv_cache") if tags is None else tuple([tags] if isinstance(tags, str) else tags)
        bad = [t for t in tags if t not in ("weights", "kv_cache")]
        if bad:
            raise ValueError(f"wake_up tags must be 'weights' and/or 'kv_cache', got {bad}")
        if "weights" in tags and "weights" in self._asleep:
            self._load_weights(self._host_weights if self._host_weights is not None else self._reload_weights())
        if "kv_cache" in tags and "kv_cache" in self._asleep:
            self.runner.restore_kv()
            self._asleep.discard("kv_cache")

    def is_sleeping(self) -> bool:
        """Whether :meth:`sleep` let something go that :meth:`wake_up` has not brought back."""
        return bool(self._asleep)

    def _runners(self) -> list[ModelRunner]:
        return list(getattr(self.runner, "parts", [self.runner]))

    def update_weights(self, weights: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Replace the model's weights in memory, e.g. with a trainer's after a step (vLLM's
        ``load_weights`` through ``collective_rpc``): every tensor of the model's checkpoint, by
        its Hugging Face name (``model.layers.0.self_attn.q_proj.weight``, ...), as numpy or jax
        arrays, a mapping or ``(name, array)`` pairs. Cached prefixes are forgotten (their K/V
        came from the old weights). While the engine sleeps (:meth:`sleep`) the weights come
        back with the new values, and :meth:`wake_up` then brings the KV cache back.

        Engines over the same :class:`~jaxpaged.loader.LoadedModel` keep the weights they had:
        this engine's are new arrays. Peak memory: about twice the model's while it converts.

        Raises:
          CheckpointError: a tensor is missing, unknown or of the wrong shape (named; the
            engine keeps its weights).
          RuntimeError: requests are unfinished.
        """
        if self.core.scheduler.has_unfinished():
            n = len(self.core.requests)
            raise RuntimeError(f"update_weights: {n} request(s) are unfinished; let them finish or abort them first")
        pairs = [(str(k), np.asarray(v)) for k, v in (weights.items() if isinstance(weights, Mapping) else weights)]
        first = self._runners()[0]
        params = stream_params(self.config, {k: v.shape for k, v in pairs}, pairs, "update_weights",
                               dtype=self._weights_dtype, mesh=first.mesh)
        model = assemble_model(self.config, params, dtype=self._weights_dtype,
                               attention_backend=self.args.attention_backend, mesh=first.mesh)
        leaves = self._leaves_for(model, "update_weights: the weights given")
        while self.core.has_unfinished():
            self._advance()  # a step launched past the last request's end (async scheduling)
        self.bm.reset_prefix_cache()
        self._load_weights(leaves)

    def _load_weights(self, leaves: list) -> None:
        """Every runner's weights from ``leaves`` (the first runner's order); the engine awake
        as far as its weights go."""
        self.runner.load_weights(leaves)
        first = self._runners()[0]
        self.loaded = dataclasses.replace(self.loaded, model=nnx.merge(first.structure.value[0], first.param_state()))
        self._host_weights = None
        self._asleep.discard("weights")

    def _leaves_for(self, model, what: str) -> list:
        """``model``'s arrays in the engine's layout, checked against the ones it compiled for."""
        first = self._runners()[0]
        structure, leaves = split_model(runtime_form(model))
        want = [(tuple(s.shape), s.dtype) for s in first.param_specs]
        got = [(tuple(x.shape), x.dtype) for x in leaves]
        if structure.value[1] != first.structure.value[1] or got != want:
            raise RuntimeError(f"{what} are not the engine's model's parameters (their names, shapes or dtypes "
                               f"differ)")
        return list(leaves)

    def _reload_weights(self) -> list:
        """The weights of a level-2 sleep, loaded from the model's source again."""
        source, dtype = self._weights_source
        lm = load_model(source, dtype=dtype, attention_backend=self.args.attention_backend,
                        tensor_parallel_size=self.tensor_parallel_size)
        return self._leaves_for(lm.model, f"wake_up: the checkpoint at {lm.source}")

    def _check_awake(self) -> None:
        if self._asleep:
            raise RuntimeError(f"the engine is asleep (its {' and '.join(sorted(self._asleep))} let go by sleep()): "
                               f"call wake_up() first")

    def get_default_sampling_params(self) -> SamplingParams:
        """The parameters of a request that gives none (vLLM's): jaxpaged's defaults with what
        the model's generation config sets (``generation_config``)."""
        return SamplingParams(**self.default_sampling_overrides)

    def _live(self) -> ChainMap:
        """Ids in use: running, or finished with an output not yet delivered."""
        return ChainMap(self.core.requests, self._unclaimed, self._claimed)

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None, *,
                    request_id: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Queue a request; returns its id. Raises before any work if it is invalid.
        ``priority``: lower runs first (needs ``scheduling_policy="priority"``); ``lora_request``:
        its LoRA adapter (needs ``enable_lora=True``)."""
        self._check_awake()  # first: a refused request draws no id or seed
        req = self.inputs.process(prompt, params, request_id, self._live(), priority, lora_request=lora_request)
        self.core.add(req)
        return req.request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now: its blocks are freed and it produces no further output."""
        request_id = str(request_id)
        self.core.abort(request_id)
        self._unclaimed.pop(request_id, None)
        self._claimed.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        # Not the core's: with async scheduling a step dispatched past the last request's end stays
        # in flight, and holds no output; the next step collects it.
        return self.core.scheduler.has_unfinished() or bool(self._unclaimed)

    def _advance(self) -> None:
        """One engine iteration; each changed request goes to the inbox of whoever waits for it."""
        for req in self.core.step():
            inbox = self._claimed.get(req.request_id)
            (self._unclaimed if inbox is None else inbox)[req.request_id] = req

    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; returns the latest output of every request queued with
        ``add_request`` that changed since the last call (also during ``generate``/``stream``)."""
        if self.core.has_unfinished():
            self._advance()
        changed, self._unclaimed = self._unclaimed, {}
        return [self.outputs.make_output(r) for r in changed.values()]

    # ---- convenience APIs -----------------------------------------------------------

    def generate(self, prompts: PromptType | Seq[PromptType], sampling_params: SamplingParams
                 | Seq[SamplingParams] | None = None, *, use_tqdm: bool = True,
                 priority: Seq[int] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate completions for one or many prompts; outputs come back in input order.
        ``priority``: one per prompt, lower first (needs ``scheduling_policy="priority"``);
        ``lora_request``: the LoRA adapter of every prompt, or a list of one per prompt (None:
        the base model; needs ``enable_lora=True``)."""
        return self._generate(prompts, sampling_params, use_tqdm, priority, lora_request,
                              prompt_names(prompts, "prompts", one="prompt"))

    def _generate(self, prompts, sampling_params, use_tqdm: bool, priority, lora_request,
                  names: list[str]) -> list[RequestOutput]:
        """:meth:`generate` of prompts named ``names`` in errors."""
        self._check_awake()
        pairs = pair_prompts(prompts, sampling_params)
        if priority is None:
            priority = [0] * len(pairs)
        elif (isinstance(priority, (str, bytes)) or not isinstance(priority, (Seq, np.ndarray))
              or (isinstance(priority, np.ndarray) and priority.ndim != 1) or len(priority) != len(pairs)):
            raise ValueError(f"priority must be a list of one int per prompt ({len(pairs)}), got {priority!r}")
        loras = per_prompt_lora(lora_request, len(pairs))
        reqs: list[Request] = []  # all validated before any is queued: a bad prompt queues nothing
        for (p, sp), prio, lora, name in zip(pairs, priority, loras, names):
            # auto ids: distinct among themselves
            reqs.append(self.inputs.process(p, sp, None, self._live(), prio, lora_request=lora, what=name))
        return self._run_to_completion(reqs, use_tqdm=use_tqdm, desc="generate")

    def embed(self, prompts: PromptType | Seq[PromptType], pooling_params: PoolingParams | None = None, *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[EmbeddingRequestOutput]:
        """Embed one or many prompts (vLLM's ``LLM.embed``): each prompt's last-token hidden state
        after the final norm, L2-normalized (see :mod:`jaxpaged.pooling`). The prompts run through
        the paged engine like any request, beside generation ones; outputs come back in input
        order, ``out.outputs.embedding`` a list of floats."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if truncate_prompt_tokens is not None and isinstance(params, PoolingParams):  # (others: refused below)
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        pairs = pair_prompts(prompts, None)
        return self._embed([p for p, _ in pairs], prompt_names(prompts, "prompts", one="prompt"), params,
                           per_prompt_lora(lora_request, len(pairs)), use_tqdm)

    def _embed(self, prompts: list[PromptType], names: list[str], params: PoolingParams,
               loras: list[LoRARequest | None], use_tqdm: bool) -> list[EmbeddingRequestOutput]:
        """:meth:`embed` of prompts named ``names`` in errors. All are validated before any is
        queued: a bad prompt queues nothing."""
        self._check_awake()
        reqs = [self.inputs.process(p, None, None, self._live(), pooling=params, lora_request=lora, what=name)
                for p, name, lora in zip(prompts, names, loras)]
        return self._run_to_completion(reqs, use_tqdm=use_tqdm, desc="embed")

    def score(self, data_1: PromptType | Seq[PromptType], data_2: PromptType | Seq[PromptType], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              lora_request: LoRARequest | None = None) -> list[ScoringRequestOutput]:
        """Score pairs of texts (vLLM's ``LLM.score`` for an embedding model): the cosine
        similarity of the two texts' embeddings (:meth:`embed`). ``data_1`` is one text, scored
        against each text of ``data_2``, or as many texts as ``data_2``, scored pairwise. Every
        text is embedded once, all in one batch; the outputs follow ``data_2``."""
        first, second = ([p for p, _ in pair_prompts(d, None)] for d in (data_1, data_2))
        pairs = score_pairs(len(first), len(second))
        names = prompt_names(data_1, "data_1") + prompt_names(data_2, "data_2")
        params = PoolingParams(truncate_prompt_tokens=truncate_prompt_tokens)
        embs = self._embed(first + second, names, params, per_prompt_lora(lora_request, len(names)), use_tqdm)
        a, b = embs[:len(first)], embs[len(first):]
        return [ScoringRequestOutput(f"{a[i].request_id}_{b[j].request_id}",
                                     ScoringOutput(cosine(a[i].outputs.embedding, b[j].outputs.embedding)),
                                     a[i].prompt_token_ids + b[j].prompt_token_ids, finished=True)
                for i, j in pairs]

    def _run_to_completion(self, reqs: list[Request], *, use_tqdm: bool, desc: str) -> list:
        """Queue validated requests, step until all have finished, and return their outputs in order;
        those left unfinished (an exception, ^C) are aborted."""
        from tqdm.auto import tqdm

        self._check_awake()
        inbox: dict[str, Request] = {}
        for r in reqs:
            self.core.add(r)
            self._claimed[r.request_id] = inbox
        done: dict[str, Any] = {}
        bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated = time.perf_counter(), 0
        try:
            while len(done) < len(reqs):
                if self.core.has_unfinished():
                    self._advance()
                else:  # what is left was aborted (by another caller): it ends as it stands
                    inbox.update((r.request_id, r) for r in reqs if r.request_id not in done and r.finished)
                    if not inbox:
                        raise RuntimeError("the engine has no work left but requests are unfinished")
                for rid, r in list(inbox.items()):
                    if r.finished:  # outputs only for finished requests: ~20 us each
                        done[rid] = self.outputs.make_output(inbox.pop(rid))
                        bar.update(1)
                        if r.pooling is None:
                            generated += sum(len(c.token_ids) for c in done[rid].outputs)
                            bar.set_postfix_str(f"{generated / (time.perf_counter() - start):.1f} tok/s")
            while self.core.has_unfinished() and not self.core.scheduler.has_unfinished():
                self._advance()  # the step dispatched past the last request's end (async): leave the engine idle
        finally:
            bar.close()
            for r in reqs:
                if r.request_id not in done:
                    self.abort(r.request_id)
                self._claimed.pop(r.request_id, None)
        return [done[r.request_id] for r in reqs]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params=None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict] | None = None, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             continue_final_message: bool = False,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the model's chat template.

        A message is a dict with a str ``role`` and a ``content`` that is a str or a list of
        OpenAI text parts (``{"type": "text", "text": ...}``); an assistant's earlier
        ``tool_calls`` and a tool's reply (``"role": "tool"``) go to the template as the
        OpenAI API has them. ``tools`` (OpenAI's function tools) are given to the template, as
        vLLM's ``LLM.chat`` does; each output's ``prompt`` is the conversation as the template
        wrote it. ``chat_template`` (a Jinja template) replaces the model's,
        ``chat_template_kwargs`` are the template's own variables, and ``continue_final_message``
        (with ``add_generation_prompt=False``) continues the last message instead of opening a
        new turn, all as vLLM takes them (:mod:`jaxpaged.chat_template`)."""
        options = dict(chat_template=chat_template, chat_template_kwargs=chat_template_kwargs,
                       continue_final_message=continue_final_message)
        template_kwargs(add_generation_prompt=add_generation_prompt, **options)  # (its errors before the messages')
        self._check_chat_template(chat_template)
        if not isinstance(messages, list) or not messages:
            got = repr(messages) if isinstance(messages, list) else type(messages).__name__
            raise TypeError(f"messages must be a non-empty list of message dicts (one conversation) or of "
                            f"conversations, got {got}")
        convs = messages if isinstance(messages[0], list) else [messages]
        if tools is not None:
            check_tools(tools)
        prompts = [self.chat_prompt(c, add_generation_prompt, tools=tools,
                                    what=f"conversation {i}" if len(convs) > 1 else "messages", **options)
                   for i, c in enumerate(convs)]
        names = [f"conversation {i}" if len(convs) > 1 else "messages" for i in range(len(convs))]
        return self._generate(prompts, sampling_params, use_tqdm, None, lora_request, names)

    def _check_chat_template(self, chat_template: str | None) -> None:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer to chat with")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("chat_template: this model has none of its own; give one")

    def chat_prompt(self, conversation: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, what: str = "messages", **options) -> dict[str, Any]:
        """``{"prompt": text, "prompt_token_ids": ids}`` of a conversation (and ``tools``) through
        the chat template; a malformed message is refused naming it (``what[i]``). ``options``:
        ``chat_template``, ``chat_template_kwargs``, ``continue_final_message``, as
        :meth:`chat` takes them."""
        kwargs = template_kwargs(add_generation_prompt=add_generation_prompt, **options)
        self._check_chat_template(kwargs["chat_template"])
        text = self.tokenizer.apply_chat_template(chat_messages(conversation, what), tools=tools or None,
                                                  tokenize=False, **kwargs)
        return {"prompt": text, "prompt_token_ids": self.tokenizer(text, add_special_tokens=False)["input_ids"]}

    def apply_chat_template(self, conversation: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **options) -> list[int]:
        """The token ids of a conversation (and ``tools``) through the chat template
        (``options``: as :meth:`chat_prompt` takes them)."""
        return self.chat_prompt(conversation, add_generation_prompt, tools=tools, **options)["prompt_token_ids"]

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams, *,
                    use_tqdm: bool = False,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: each prompt's ``params.beam_width`` best beams, best first
        (the same search as ``generate`` with ``SamplingParams(use_beam_search=True)``); a
        sequence's ``tokens`` and ``text`` include the prompt's (the text not a final EOS)."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be BeamSearchParams, got {type(params).__name__}")
        results = []
        for out in self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request):
            beams = []
            for c in out.outputs:
                tokens = [*out.prompt_token_ids, *c.token_ids]
                shown = tokens[:-1] if c.token_ids and not params.ignore_eos and c.token_ids[-1] in self.eos_ids \
                    else tokens  # (vLLM leaves a final EOS out of the text)
                text = self.tokenizer.decode(shown) if self.tokenizer is not None else None
                beams.append(BeamSearchSequence(tokens, c.logprobs or [], c.cumulative_logprob, text, c.finish_reason,
                                                c.stop_reason))
            results.append(BeamSearchOutput(beams))
        return results

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None, *,
               lora_request: LoRARequest | None = None) -> Iterator[str]:
        """Yield the text of one request as it is generated (deltas of the first completion).

        Text that could still turn out to be the start of a stop string (its last
        ``len(longest stop) - 1`` characters) is held back until it cannot, as the server's
        streams do: a stop string cuts the text before it, and what was yielded stays yielded
        (with ``include_stop_str_in_output`` nothing is held back: the stop string stays).
        """
        self._check_awake()
        text, ids, params = self.inputs.check(prompt, sampling_params)  # raises here, not at the first next()
        # Processed (its adapter loaded and checked) here too; queued at the first next().
        req = self.inputs.process({"prompt": text, "prompt_token_ids": ids}, params, None, self._live(),
                                  lora_request=lora_request)
        return self._stream(req)

    def _stream(self, req: Request) -> Iterator[str]:
        inbox: dict[str, Request] = {}
        self._check_awake()  # (asleep since the generator was made: it never started)
        self.core.add(req)
        self._claimed[req.request_id] = inbox
        sent = 0
        try:
            while True:
                if req.finished and not inbox:  # aborted (by another caller) while we were paused
                    return
                if not inbox:  # others may have stepped the engine for us while we were paused
                    self._advance()
                if inbox.pop(req.request_id, None) is None:
                    continue
                o = self.outputs.make_output(req)
                text = o.outputs[0].text if o.outputs else ""
                end = stream_end(text, sent, req.params.output_text_buffer_length, o.finished)
                if end > sent:
                    yield text[sent:end]
                    sent = end
                if o.finished:
                    return
        finally:
            self.abort(req.request_id)  # a no-op once finished; frees the blocks if the caller stopped early

    def stats(self) -> dict[str, Any]:
        m = self.bm.stats()
        pc = self.bm.prefix_cache_stats
        t = self.core.timers
        return {
            "num_blocks": m.num_blocks, "block_size": m.block_size, "num_free_blocks": m.num_free_blocks,
            "num_used_blocks": m.num_used_blocks, "num_cached_blocks": m.num_cached_blocks,
            "kv_usage": m.num_used_blocks / m.num_blocks, "peak_kv_utilization": self.core.peak_kv_utilization,
            "prefix_cache_queries": pc.queries, "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate, "prefix_cache_evictions": pc.evictions,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_swapped_out_blocks": self.scheduler.num_swapped_out_blocks,  # total over the run
            "num_host_blocks_used": m.num_host_blocks_used,
            "num_steps": self.core.num_steps, "num_compiled_shapes": len(self.runner.compiled_shapes),
            **self.spec_decode_stats(),
            "time_schedule_s": t.schedule, "time_batch_s": self.runner.time_batch,
            "time_device_s": self.runner.time_device, "time_postprocess_s": t.update,
        }

    def spec_decode_stats(self) -> dict[str, Any]:
        """Speculative decoding's totals over the run (zeros without ``speculative_config``):
        chunks with drafts, drafts, drafts accepted, their ratio and the mean tokens a
        drafting chunk gained (vLLM's acceptance length: accepted + 1)."""
        s = self.scheduler
        return {"spec_num_drafts": s.num_drafts, "spec_num_draft_tokens": s.num_draft_tokens,
                "spec_num_accepted_tokens": s.num_accepted_tokens,
                "spec_acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0,
                "spec_mean_acceptance_length": 1 + s.num_accepted_tokens / s.num_drafts if s.num_drafts else 0.0}


def _model_config(model) -> LlamaConfig | None:
    """The config of ``LLM(model)``'s model where it is known before loading (a LoadedModel, or
    a Hugging Face folder's ``config.json``); None otherwise (a GGUF, the embedded model)."""
    if isinstance(model, LoadedModel):
        return model.config
    folder = Path(model).expanduser() if isinstance(model, (str, Path)) else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    try:
        return LlamaConfig.from_hf(json.loads((folder / "config.json").read_text()))
    except (ValueError, KeyError, TypeError):
        return None  # loading says what is wrong with it


def _source(model) -> Path | str | None:
    """Where ``LLM(model)`` loads from (None: the embedded model, or not a model)."""
    return model.source if isinstance(model, LoadedModel) else model if isinstance(model, (str, Path)) else None


def generate(prompts: PromptType | Seq[PromptType], model: str | Path | LoadedModel | None = None,
             **kwargs) -> str | list[str]:
    """One call from prompt(s) to text: ``kwargs`` go to ``LLM`` or ``SamplingParams`` by name
    (the sampling fields not given: the model's defaults, ``LLM.get_default_sampling_params``).

    Returns a str for a single str prompt, else a list of str (the first completion of each).
    """
    engine_names = set(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
    sp_names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = set(kwargs) - engine_names - sp_names - {"use_tqdm"}
    if unknown:
        raise TypeError(f"generate() got unknown options {sorted(unknown)}")
    given = {k: v for k, v in kwargs.items() if k in sp_names}
    defaults = default_sampling_overrides(kwargs.get("generation_config", "auto"), _source(model))
    params = SamplingParams(**for_request(defaults, beam_search=bool(given.get("use_beam_search"))), **given)
    llm = LLM(model, **{k: v for k, v in kwargs.items() if k in engine_names})  # (the params checked first)
    outs = llm.generate(prompts, params, use_tqdm=kwargs.get("use_tqdm", False))
    texts = [o.outputs[0].text for o in outs]
    return texts[0] if isinstance(prompts, str) else texts
