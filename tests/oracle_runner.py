"""A runner with no model that still checks paging: the engine core's stand-in for a device.

Its "KV pool" is a host array holding, for each slot, the (token, position) written there.
A step applies the scheduler's block moves (copy-on-write and fork copies, swap-out and
swap-in through a host pool), builds the real padded batch (``build_batch``), writes every
scheduled token into its slot, then reads each sampling row's whole context back through
its block table. Any slot that does not hold the token the sequence has at that position
(a wrong block table, a lost copy-on-write, a bad swap, a prefix-cache hit on other
tokens) fails at once. The next token is a hash of the context read back (plus the row's
seed for sampled rows), so a request's tokens depend only on its context, as with a
model, and must equal those it gets alone. Beam search gets deterministic top-k logprobs.

It follows the model runner's protocol, async scheduling included: ``dispatch`` runs the
step at once but the host only sees its tokens in ``collect``; a step dispatched before
the previous one was collected takes each pending token from the previous step's rows.
Speculative decoding's rows at a sequence's drafts read the drafts back too.

``markov``: the distribution depends on the context's last ``markov`` tokens only (0: on the
whole context) and its ids are :data:`MARKOV_ALPHABET` (word pieces of the default tokenizer,
so that stop strings still match), so that outputs soon repeat themselves and n-gram drafts
are accepted.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from jaxpaged.batch import build_batch
from jaxpaged.runner import row_seed
from jaxpaged.sampler import SamplerOutput
from jaxpaged.scheduler import RunnerOutput, SchedulerOutput

TOP_K = 8
MARKOV_ALPHABET = range(260, 272)


def _hash(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


@dataclasses.dataclass
class _Step:
    result: RunnerOutput
    rows: dict[int, int]  # sequence id -> its sampled row


class OracleRunner:
    def __init__(self, *, num_blocks: int, block_size: int, num_host_blocks: int, max_model_len: int,
                 vocab_size: int, eos_ids: tuple[int, ...], markov: int = 0):
        self.block_size = block_size
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.pool = np.full((num_blocks, block_size, 2), -1, np.int64)  # (token, position) per slot
        self.host = np.full((max(num_host_blocks, 1), block_size, 2), -1, np.int64)
        self.num_steps = 0
        self.markov = markov

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        return self.collect(self.dispatch(out))

    def collect(self, step: _Step | None) -> RunnerOutput:
        return step.result if step is not None else RunnerOutput(None)

    def dispatch(self, out: SchedulerOutput, prev: _Step | None = None) -> _Step | None:
        for kind, a, b in out.block_ops:
            if kind == "copy":
                self.pool[b] = self.pool[a]
            elif kind == "out":
                self.host[b] = self.pool[a]
            else:
                self.pool[b] = self.host[a]
        if not out.scheduled:
            return None
        self.num_steps += 1
        batch = build_batch(out, block_size=self.block_size, max_blocks_per_seq=self.max_blocks_per_seq,
                            pending_rows=prev.rows if prev is not None else None)
        n = batch.num_tokens
        step_tokens = batch.tokens.copy()
        if batch.token_src is not None:  # what the device does: read the previous step's samples
            src = batch.token_src >= 0
            step_tokens[src] = prev.result.sampled.tokens[batch.token_src[src]]
        flat = self.pool.reshape(-1, 2)
        flat[batch.slot_mapping[:n], 0] = step_tokens[:n]
        flat[batch.slot_mapping[:n], 1] = batch.positions[:n]
        rows = len(batch.rows)
        tokens, logprobs = np.zeros(rows, np.int64), np.zeros(rows)
        top_ids, top_lps = np.zeros((rows, TOP_K), np.int64), np.zeros((rows, TOP_K))
        seq_row = {id(s.seq): i for i, s in enumerate(out.scheduled)}
        chunks = {id(s.seq): s for s in out.scheduled}
        for r, row in enumerate(batch.rows):  # (not split_decodes: sequence i is row i)
            seq, i = row.seq, seq_row[id(row.seq)]
            ctx = int(batch.context_lens[i]) - row.ahead  # a draft's row sees the positions up to it
            table = batch.block_tables[i]
            got = self.pool[table[np.arange(ctx) // self.block_size], np.arange(ctx) % self.block_size]
            known = (seq.token_ids + chunks[id(seq)].draft)[:ctx]
            if ctx > len(known):  # its last input is pending: the previous step sampled it
                known = known + [int(prev.result.sampled.tokens[prev.rows[seq.seq_id]])]
            want = np.asarray(known)
            bad = np.flatnonzero((got[:, 0] != want) | (got[:, 1] != np.arange(ctx)))
            assert not bad.size, (f"sequence {seq.seq_id} of request {seq.request.request_id}: position {bad[0]} "
                                  f"reads (token, position) {tuple(got[bad[0]])}, wants ({want[bad[0]]}, {bad[0]})")
            top_ids[r], top_lps[r] = self._distribution(tuple(want.tolist()[-self.markov:]))
            p = seq.request.params
            num_outputs = ctx - seq.num_prompt_tokens  # tokens before the one this row draws
            banned = set(self.eos_ids) | set(p.stop_token_ids) if num_outputs < p.min_tokens else set()
            allowed = [k for k in range(TOP_K) if top_ids[r, k] not in banned]
            if p.temperature == 0:
                k = allowed[0]
            else:  # seeded: the draw depends on the seed, the sample's index and the output position
                k = allowed[_hash(row_seed(seq.request.seed, row.index), num_outputs) % len(allowed)]
            tokens[r], logprobs[r] = top_ids[r, k], top_lps[r, k]
        sampled = SamplerOutput(tokens, logprobs, np.asarray([list(t).index(x) + 1 for t, x in zip(top_ids, tokens)]),
                                top_ids, top_lps)
        return _Step(RunnerOutput(sampled), {r.seq.seq_id: i for i, r in enumerate(batch.rows)})

    def _distribution(self, context: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """TOP_K distinct token ids with descending logprobs, a function of the context only."""
        ids, h = [], _hash(context)
        alphabet = MARKOV_ALPHABET if self.markov else range(3, self.vocab_size)
        while len(ids) < TOP_K:
            t = alphabet[h % len(alphabet)]
            if t not in ids:
                ids.append(t)
            h = _hash(h)
        lps = -np.cumsum(0.1 + (np.asarray([_hash(context, k) for k in range(TOP_K)]) % 1000) / 500.0)
        return np.asarray(ids), lps
