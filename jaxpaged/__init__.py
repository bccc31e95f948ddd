"""jaxpaged: PagedAttention LLM inference in pure JAX and Pallas.

>>> import jaxpaged
>>> jaxpaged.generate("What is paged attention?", max_tokens=32)
"""

import importlib
import logging

from jaxpaged.xla_flags import set_default_xla_flags

set_default_xla_flags()


def _drop_transformers_torch_advice(record: logging.LogRecord) -> bool:
    """transformers says at import, where PyTorch is not installed, that "Models won't be
    available": jaxpaged takes only its tokenizers and chat templates and never needs torch,
    and the CLI's users would read that line as an error. Its other messages pass."""
    return "Models won't be available" not in record.getMessage()  # transformers 4.x and 5.x say it so


logging.getLogger("transformers").addFilter(_drop_transformers_torch_advice)

# Lazy, so the host-side modules (block manager, scheduler, sampling params) import
# without pulling in jax.
_EXPORTS = {
    "LLM": "jaxpaged.engine", "generate": "jaxpaged.engine",
    "load_model": "jaxpaged.loader", "LoadedModel": "jaxpaged.loader", "CheckpointError": "jaxpaged.loader",
    "RequestOutput": "jaxpaged.outputs", "CompletionOutput": "jaxpaged.outputs", "Logprob": "jaxpaged.outputs",
    "RequestMetrics": "jaxpaged.outputs", "SamplingParams": "jaxpaged.sampling_params",
    "BeamSearchParams": "jaxpaged.sampling_params", "BeamSearchOutput": "jaxpaged.outputs",
    "BeamSearchSequence": "jaxpaged.outputs",
    "StructuredOutputsParams": "jaxpaged.structured_output", "SpeculativeConfig": "jaxpaged.spec_decode",
    "PoolingParams": "jaxpaged.pooling", "EmbeddingRequestOutput": "jaxpaged.outputs",
    "EmbeddingOutput": "jaxpaged.outputs", "ScoringRequestOutput": "jaxpaged.outputs",
    "ScoringOutput": "jaxpaged.outputs", "LoRARequest": "jaxpaged.lora",
}


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpaged' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "LLM", "generate", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
    "RequestMetrics", "load_model", "LoadedModel", "CheckpointError", "SpeculativeConfig", "BeamSearchParams",
    "BeamSearchOutput", "BeamSearchSequence", "PoolingParams", "EmbeddingRequestOutput", "EmbeddingOutput",
    "ScoringRequestOutput", "ScoringOutput", "LoRARequest",
]
__version__ = "0.1.0"
