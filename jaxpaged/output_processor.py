"""Output processing: a request's host state becomes a ``RequestOutput`` (vLLM's shape).

Outputs are cumulative: each holds the whole text and token ids so far. Logprob entries
get their tokens' text here (the scheduler records ids and numbers only). No jax here.
"""

from __future__ import annotations

import functools

from jaxpaged.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, PositionLogprobs,
                              RequestOutput)
from jaxpaged.pooling import pool
from jaxpaged.sequence import Request


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # One token's text never depends on its context here: cached per id, bounded by the vocabulary.
        self._token_text = functools.lru_cache(maxsize=1 << 16)(self._decode1)

    def _decode1(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def _decorate(self, entries: list[PositionLogprobs | None]) -> list[PositionLogprobs | None]:
        if self.tokenizer is None:
            return list(entries)
        return [None if e is None else {t: lp.with_text(self._token_text(t)) for t, lp in e.items()}
                for e in entries]

    def make_output(self, req: Request) -> RequestOutput | EmbeddingRequestOutput:
        if req.pooling is not None:  # (no embedding: aborted before its prompt's end was computed)
            embedding = pool(req.hidden, req.pooling) if req.hidden is not None else []
            return EmbeddingRequestOutput(req.request_id, EmbeddingOutput(embedding), list(req.prompt_token_ids),
                                          req.finished, req.num_cached_tokens, req.prompt)
        p = req.params
        if req.is_beam_search:
            completions = self._beam_completions(req)
        else:
            completions = [
                CompletionOutput(
                    index=s.index, text=s.detok.text if s.detok is not None else "",
                    token_ids=list(s.output_token_ids),
                    cumulative_logprob=s.cumulative_logprob if s.num_output_tokens else None,
                    logprobs=self._decorate(s.logprobs) if p.logprobs is not None else None,
                    finish_reason=s.finish_reason, stop_reason=s.stop_reason, finish_detail=s.finish_detail)
                for s in sorted(req.seqs, key=lambda s: s.index)
            ]
        prompt_lps = req.prompt_logprobs
        if prompt_lps is None and p.prompt_logprobs is not None and req.num_prompt_tokens == 1:
            prompt_lps = [None]  # nothing precedes the only token: no chunk of logprobs ever comes
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=self._decorate(prompt_lps) if prompt_lps is not None else None,
            outputs=completions, finished=req.finished, num_cached_tokens=req.num_cached_tokens,
            metrics=req.metrics)

    def _beam_completions(self, req: Request) -> list[CompletionOutput]:
        """The ``n`` best finished hypotheses once finished; the current beams before."""
        n, num_prompt = req.params.n, req.num_prompt_tokens
        if req.finished and req.beam.hypotheses:
            items = [(h.token_ids, h.cumulative_logprob, h.text, h.logprobs, h.finish_reason, h.stop_reason,
                      h.finish_detail) for h in req.beam.hypotheses[:n]]
        else:  # still running, or aborted before any hypothesis finished
            reason = "abort" if req.finished else None
            items = [(s.token_ids, s.cumulative_logprob, s.detok.text if s.detok is not None else "", s.logprobs,
                      reason, None, None) for s in req.seqs[:n]]
        return [CompletionOutput(i, text, list(ids[num_prompt:]), lp,
                                 self._decorate(lps) if req.params.logprobs is not None else None, reason, stop,
                                 detail)
                for i, (ids, lp, text, lps, reason, stop, detail) in enumerate(items)]
