"""jaxpaged: PagedAttention LLM inference in pure JAX and Pallas.

>>> import jaxpaged
>>> jaxpaged.generate("What is paged attention?", max_tokens=32)
"""

from jaxpaged.engine import LLM, generate
from jaxpaged.loader import CheckpointError, LoadedModel, load_model
from jaxpaged.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import SamplingParams

__all__ = [
    "LLM", "generate", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestMetrics",
    "load_model", "LoadedModel", "CheckpointError",
]
__version__ = "0.1.0"
