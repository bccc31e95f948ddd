"""Embeddings (vLLM's pooling runner, ``LLM.embed``, ``POST /v1/embeddings``). No jax here.

An embedding request runs its prompt through the engine like any other (paged, chunked, prefix
cached, preempted under pressure), beside generation requests in the same steps. The step
that computes its last prompt token also returns that token's hidden state after the model's
final norm, and the request ends there: last-token pooling, vLLM's default for a decoder
converted to embeddings (``runner="pooling"``) and what Llama- and Qwen3-based embedding models
such as Qwen3-Embedding are trained for. The vector is then L2-normalized (``normalize``) and
may be cut to its first ``dimensions`` (Matryoshka embeddings), normalized after the cut.

Scoring (vLLM's ``LLM.score``, ``POST /v1/score`` and ``/v1/rerank`` for an embedding model): two
texts' score is the cosine similarity of their embeddings (:func:`score_pairs`, :func:`cosine`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxpaged.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """How an embedding request pools its prompt (vLLM's ``PoolingParams``).

    Args:
        dimensions: keep the first ``dimensions`` of the hidden state (Matryoshka embeddings);
            None: all ``hidden_size``.
        normalize: L2-normalize the embedding (after the cut).
        truncate_prompt_tokens: keep only the prompt's last ``k`` tokens; -1: as many as fit
            (``max_model_len - 1``: an embedding runs as a request of one token).
    """

    dimensions: int | None = None
    normalize: bool = True
    truncate_prompt_tokens: int | None = None

    def verify(self, hidden_size: int | None) -> None:
        """Raise ``ValueError`` naming the field a model of ``hidden_size`` cannot honour."""
        d = self.dimensions
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1
                              or (hidden_size is not None and d > hidden_size)):
            raise ValueError(f"dimensions must be an int in [1, {hidden_size}] (the model's hidden size), got {d!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool, got {self.normalize!r}")


def sampling_params(params: PoolingParams) -> SamplingParams:
    """What an embedding request runs as: one greedy token (sampled by the step that computes the
    prompt's end, then dropped), its prompt truncated as asked."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                          truncate_prompt_tokens=params.truncate_prompt_tokens)


def pool(hidden: np.ndarray, params: PoolingParams) -> list[float]:
    """The embedding of a last-token hidden state ``[hidden_size]`` float32."""
    x = np.asarray(hidden, np.float32)[:params.dimensions]
    if params.normalize:
        x = x / max(float(np.linalg.norm(x)), 1e-12)  # as torch's F.normalize
    return x.tolist()


def score_pairs(num_first: int, num_second: int) -> list[tuple[int, int]]:
    """Which texts ``score`` compares (vLLM's rule): one first text with every second one, or
    the i-th first text with the i-th second one."""
    if not num_first or not num_second:
        raise ValueError(f"{'data_1' if not num_first else 'data_2'} is empty: give at least one text")
    if num_first == 1:
        return [(0, j) for j in range(num_second)]
    if num_first != num_second:
        raise ValueError(f"data_1 has {num_first} texts and data_2 {num_second}: give one first text for all, "
                         f"or one for each second text")
    return [(i, i) for i in range(num_first)]


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two embeddings (1 for a vector and itself)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / max(float(np.linalg.norm(a) * np.linalg.norm(b)), 1e-12))
