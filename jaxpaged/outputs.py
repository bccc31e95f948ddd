"""What the engine returns, shaped like vLLM's ``RequestOutput`` / ``CompletionOutput``."""

from __future__ import annotations

import dataclasses
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True)
class Logprob:
    """Log-probability of one token under the model's raw distribution."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None

    def with_text(self, text: str | None) -> Logprob:
        return Logprob(self.logprob, self.rank, text)


# One dict per position: token id -> Logprob (the sampled/prompt token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Why the engine, not the model or the parameters, ended this completion: e.g. its request
    # outgrew the whole KV pool (finish_reason is then "length", as vLLM reports a capacity
    # cut). A sample or beam hypothesis that had finished before the cut keeps its own reason
    # and no detail; the cut beams still compete with it for the ranking.
    finish_detail: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class BeamSearchSequence:
    """One beam of :meth:`jaxpaged.LLM.beam_search`, as vLLM's: ``tokens`` and ``text`` include
    the prompt's (the text decoded from all the tokens, special ones kept)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]  # one dict a generated token
    cum_logprob: float
    text: str | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


@dataclasses.dataclass
class BeamSearchOutput:
    """A prompt's beams, best (by the length-penalised score) first."""

    sequences: list[BeamSearchSequence]


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]  # [dimensions or hidden_size]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class EmbeddingRequestOutput:
    """An embedding request's result (vLLM's ``EmbeddingRequestOutput``): ``outputs.embedding``."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None


@dataclasses.dataclass
class ScoringOutput:
    score: float  # the cosine similarity of the two texts' embeddings


@dataclasses.dataclass
class ScoringRequestOutput:
    """A pair of texts scored (vLLM's ``ScoringRequestOutput``): ``outputs.score``."""

    request_id: str  # the two embedding requests' ids, joined by "_"
    outputs: ScoringOutput
    prompt_token_ids: list[int]  # the first text's then the second's
    finished: bool
