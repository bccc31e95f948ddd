"""The server's Prometheus metrics (``GET /metrics``), vLLM's set under the ``jaxpaged:`` prefix.

The engine's state (running, waiting, KV usage, prefix hit rate, preemptions, speculative
decoding's drafts) is read at
scrape time from ``AsyncLLM.stats``; token counts and latencies are recorded from the
engine thread's ``IterationStats`` after every step. Each server has its own registry.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from jaxpaged.async_engine import AsyncLLM, IterationStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineState:
    """A collector of the gauges (and the preemption counter) the engine publishes."""

    def __init__(self, engine: AsyncLLM):
        self.engine = engine
        llm = engine.llm
        # vLLM's cache_config_info: the KV cache's settings in labels, the value 1 (read at start).
        self.cache_config = {"block_size": str(llm.block_size), "cache_dtype": llm.args.kv_cache_dtype,
                             "kv_array_dtype": str(llm.kv_cache_dtype),
                             "num_gpu_blocks": str(llm.bm.num_usable_blocks + llm.data_parallel_size),
                             "num_cpu_blocks": str(llm.bm.num_host_blocks),
                             "enable_prefix_caching": str(llm.args.enable_prefix_caching)}

    def collect(self):
        info = GaugeMetricFamily("jaxpaged:cache_config_info", "The KV cache's settings (vLLM's).",
                                 labels=list(self.cache_config))
        info.add_metric(list(self.cache_config.values()), 1.0)
        yield info
        s = self.engine.stats
        for name, doc, value in (
            ("num_requests_running", "Requests running (their KV on the device or swapped out).", s.num_running),
            ("num_requests_waiting", "Requests queued and not admitted yet.", s.num_waiting),
            ("kv_cache_usage_perc", "Fraction of the KV pool's blocks in use (0 to 1).", s.kv_cache_usage),
            ("kv_cache_used_blocks", "KV blocks in use.", s.num_used_blocks),
            ("prefix_cache_hit_rate", "Prefix cache hits over queries since start (0 to 1).",
             s.prefix_cache_hit_rate),
        ):
            yield GaugeMetricFamily(f"jaxpaged:{name}", doc, value=value)
        yield CounterMetricFamily("jaxpaged:num_preemptions", "Preemptions since start.", value=s.num_preemptions)
        for name, doc, value in (
            ("spec_decode_num_drafts", "Sequence steps with drafts (speculative decoding).", s.spec_num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.spec_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.spec_num_accepted_tokens),
        ):
            yield CounterMetricFamily(f"jaxpaged:{name}", doc, value=value)
        lora = self.engine.llm.inputs.lora
        if lora is not None:  # vLLM's lora_requests_info: the adapters in labels, the value a timestamp
            info = GaugeMetricFamily("jaxpaged:lora_requests_info", "Running and waiting LoRA adapters.",
                                     labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
            info.add_metric([",".join(s.running_lora_adapters), ",".join(s.waiting_lora_adapters),
                             str(lora.config.max_loras)], time.time())
            yield info


class Metrics:
    def __init__(self, engine: AsyncLLM):
        self.started = int(time.time())
        self.registry = r = CollectorRegistry()
        r.register(_EngineState(engine))
        self.prompt_tokens = Counter("jaxpaged:prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter("jaxpaged:generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram("jaxpaged:time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("jaxpaged:inter_token_latency_seconds", "Time between a request's tokens.",
                             buckets=ITL_BUCKETS, registry=r)

    def record(self, it: IterationStats) -> None:
        """A stat logger for ``AsyncLLM`` (called on the engine thread)."""
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        for t in it.time_to_first_token:
            self.ttft.observe(t)
        for t in it.inter_token_latency:
            self.itl.observe(t)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
