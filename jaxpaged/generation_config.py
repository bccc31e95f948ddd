"""A model's ``generation_config.json`` as default sampling parameters, as vLLM takes it.

vLLM's ``--generation-config`` (default ``"auto"``): the sampling fields a model's Hugging Face
generation config sets away from transformers' defaults (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens``)
become the engine's defaults: ``LLM.get_default_sampling_params()``, what ``generate`` and
``chat`` use without sampling parameters, the fields ``jaxpaged.generate`` and
``jaxpaged-generate`` are not given, and, in the server, the value of each of those fields a
request leaves unset (``max_new_tokens`` cut to what fits beside the prompt; a beam search
request takes only that one). ``"vllm"`` keeps vLLM's (and jaxpaged's) own defaults; a folder
path reads that folder's file instead of the model's. A GGUF file carries no generation
config. No jax here.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from jaxpaged.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# The generation config's fields vLLM takes, by their SamplingParams names.
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def for_request(overrides: dict[str, Any], *, beam_search: bool) -> dict[str, Any]:
    """``overrides`` as a request takes them: a beam search request (deterministic) only their
    ``max_tokens``."""
    return {k: v for k, v in overrides.items() if k == "max_tokens"} if beam_search else overrides


def default_sampling_overrides(generation_config: Any, model_source: str | Path | None) -> dict[str, Any]:
    """The SamplingParams fields ``generation_config`` (``"auto"``, ``"vllm"`` or a folder) sets
    for the model loaded from ``model_source``; checked, with errors naming the file."""
    if not isinstance(generation_config, (str, Path)):
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a folder, got {type(generation_config).__name__}")
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        model_source = None if model_source is None else Path(model_source).expanduser()
        if model_source is None or not model_source.is_dir() or not (model_source / "generation_config.json").is_file():
            return {}
        folder = model_source
    else:
        folder = Path(generation_config).expanduser()
        if not (folder / "generation_config.json").is_file():
            raise FileNotFoundError(f"generation_config: no generation_config.json in {folder}")
    path = (folder / "generation_config.json").resolve()
    stat = path.stat()
    return dict(_read(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=16)
def _read(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    """The overrides of one version of a file (read, checked and logged once: ``jaxpaged.generate``
    and the CLI check it before the engine they make reads it)."""
    from transformers import GenerationConfig

    try:
        diff = GenerationConfig.from_pretrained(Path(path).parent).to_diff_dict()  # what differs from the defaults
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(f"generation_config: {path} could not be read: {e}") from None
    overrides = {ours: diff[theirs] for theirs, ours in FIELDS.items() if diff.get(theirs) is not None}
    try:
        SamplingParams(**overrides)
    except (ValueError, TypeError) as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    if overrides:
        log.info("default sampling parameters from %s: %s (generation_config='vllm' keeps jaxpaged's own)", path,
                 overrides)
    return overrides
