"""The stop rule: when appending a token ends a sequence. One pure function, used everywhere.

The scheduler applies it to every sampled token and to every beam candidate; scripts
that simulate the engine drive the same scheduler, so they apply it too. No jax here.
"""

from __future__ import annotations

from collections.abc import Collection

from jaxpaged.outputs import FinishReason
from jaxpaged.sampling_params import SamplingParams


def check_stop(params: SamplingParams, token: int, *, num_output_tokens: int, num_tokens: int,
               stop_string: str | None, eos_ids: Collection[int], max_model_len: int
               ) -> tuple[FinishReason, int | str | None] | None:
    """``(finish_reason, stop_reason)`` if appending ``token`` ends the sequence, else None.

    Args:
      params: the request's sampling parameters.
      token: the token just appended.
      num_output_tokens: generated tokens, ``token`` included.
      num_tokens: prompt plus generated tokens, ``token`` included.
      stop_string: the stop string the detokenizer found completed by ``token``, if any.
      eos_ids: the model's end-of-sequence tokens.
      max_model_len: most tokens a sequence may hold.

    Stop strings, ``stop_token_ids`` and EOS count only from ``min_tokens`` on (vLLM's
    rule); ``stop_reason`` is the stop string or stop token id, None for EOS and length.
    """
    if num_output_tokens >= params.min_tokens and stop_string is not None:
        return "stop", stop_string
    if is_stop_token(params, token, num_output_tokens=num_output_tokens, eos_ids=eos_ids):
        return "stop", token if token in params.stop_token_ids else None
    if (params.max_tokens is not None and num_output_tokens >= params.max_tokens) or num_tokens >= max_model_len:
        return "length", None
    return None


def is_stop_token(params: SamplingParams, token: int, *, num_output_tokens: int, eos_ids: Collection[int]) -> bool:
    """Whether ``token`` ends the sequence as a stop token id or EOS (``check_stop``'s rule).
    Its text is left out of the output, as vLLM does; the id stays in ``token_ids``."""
    return num_output_tokens >= params.min_tokens and (
        token in params.stop_token_ids or (not params.ignore_eos and token in eos_ids))
