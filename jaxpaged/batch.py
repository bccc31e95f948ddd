"""Turn a scheduler decision into fixed-shape, padded numpy arrays. No jax here.

Every axis is padded to a power of two (with a floor; sequences and sampling rows past 32,
and tokens past 256, in quarter-octave steps: ``padding.row_bucket``,
``padding.token_bucket``), so the number of distinct step shapes,
and so of compilations, is bounded by the product of a few short bucket lists:
tokens ``T``, sequences ``S``, block-table width ``W``, sampling rows ``R`` and prompt
logprob rows ``P``. A decode-only batch uses ``T == S``.

Padding conventions (see ``attention.AttentionMetadata``): padding tokens write into the
null block and belong to no sequence; padding sequences have zero query and context
length and a block table of null blocks; padding sampling rows read token 0's logits and
are dropped on the host.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import numpy as np

from jaxpaged.padding import NULL_BLOCK, bucket, row_bucket, token_bucket
from jaxpaged.scheduler import SchedulerOutput
from jaxpaged.sequence import Sequence


@dataclasses.dataclass
class SampleRow:
    seq: Sequence
    index: int  # which sample of the request this row draws (n > 1 fans out at the first token)


@dataclasses.dataclass
class PromptLogprobRows:
    seq: Sequence
    start: int  # prompt position whose next-token logprob is row 0 of this group
    count: int


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # [T] int32
    positions: np.ndarray  # [T] int32
    slot_mapping: np.ndarray  # [T] int32
    block_tables: np.ndarray  # [S, W] int32
    context_lens: np.ndarray  # [S] int32
    query_start_loc: np.ndarray  # [S + 1] int32
    decode_only: bool
    logits_indices: np.ndarray  # [R] int32: token index whose logits each sampling row uses
    rows: list[SampleRow]  # the first len(rows) of R
    prompt_lp_indices: np.ndarray  # [P] int32 token index (P = 0 when nobody asked)
    prompt_lp_targets: np.ndarray  # [P] int32 the next prompt token, scored at that index
    prompt_lp_rows: list[PromptLogprobRows]
    num_tokens: int  # real tokens, before padding
    # [T] int32: -1, or for a token the host does not know yet (async scheduling) the row of
    # the previous step's sampled tokens that holds it. None when every token is known.
    token_src: np.ndarray | None = None

    @property
    def shape_key(self) -> tuple:
        """What the model's compilation depends on: (T, (S, W), R + P, decode_only)."""
        return (self.tokens.shape[0], self.block_tables.shape,
                self.logits_indices.shape[0] + self.prompt_lp_indices.shape[0], self.decode_only)


def build_batch(out: SchedulerOutput, *, block_size: int, max_blocks_per_seq: int, token_floor: int = 8,
                pending_rows: Mapping[int, int] | None = None) -> Batch:
    """Padded arrays for one step, from what the scheduler decided (block tables included).

    The scheduler's block moves (``out.block_ops``) are the runner's to apply, before the step.
    ``pending_rows`` maps a sequence id to the row of the previous step that sampled its
    pending token (async scheduling); a chunk may end with that token, and ``token_src``
    says where the device finds it.
    """
    sched = out.scheduled
    num_seqs = len(sched)
    num_tokens = sum(s.num_new_tokens for s in sched)
    decode_only = all(s.num_new_tokens == 1 for s in sched)
    S = row_bucket(num_seqs)
    T = S if decode_only else token_bucket(num_tokens, token_floor)
    S = max(S, 1)
    tables = [s.block_table for s in sched]
    W = min(bucket(max(len(t) for t in tables), 4), bucket(max_blocks_per_seq, 4))

    # Per-sequence values as Python lists, turned into arrays once: per-row numpy slicing
    # costs ~20 us a sequence, ~5 ms a step at 256 sequences.
    starts = np.fromiter((s.start for s in sched), np.int32, num_seqs)
    counts = np.fromiter((s.num_new_tokens for s in sched), np.int32, num_seqs)
    widths = np.fromiter(map(len, tables), np.int64, num_seqs)
    block_tables = np.full((S, W), NULL_BLOCK, np.int32)
    block_tables[np.repeat(np.arange(num_seqs), widths), np.arange(int(widths.sum())) - np.repeat(
        np.cumsum(widths) - widths, widths)] = np.fromiter(itertools.chain.from_iterable(tables), np.int32)
    context_lens = np.zeros(S, np.int32)
    context_lens[:num_seqs] = starts + counts
    qsl = np.zeros(S + 1, np.int32)
    qsl[1:num_seqs + 1] = np.cumsum(counts)
    qsl[num_seqs + 1:] = num_tokens
    tok_seq = np.repeat(np.arange(num_seqs), counts)  # sequence of each real token
    pos = np.arange(num_tokens, dtype=np.int32) - np.repeat(qsl[:num_seqs] - starts, counts)
    tokens = np.zeros(T, np.int32)
    known = np.fromiter(itertools.chain.from_iterable(
        s.seq.token_ids[s.start:s.start + s.num_new_tokens] for s in sched), np.int32)
    token_src = None
    if len(known) == num_tokens:
        tokens[:num_tokens] = known
    else:  # chunks that end with a pending token: one per sequence at most, the last of its chunk
        lens = np.fromiter((len(s.seq.token_ids) for s in sched), np.int32, num_seqs)
        missing = np.flatnonzero(starts + counts > lens)
        if (starts + counts - lens)[missing].max() > 1 or pending_rows is None:
            s = sched[missing[0]]
            raise IndexError(f"positions [{s.start}, {s.start + s.num_new_tokens}) of sequence {s.seq.seq_id!r}; "
                             f"the host knows {len(s.seq.token_ids)} of its tokens")
        is_known = np.ones(num_tokens, bool)
        is_known[qsl[missing + 1] - 1] = False
        tokens[:num_tokens][is_known] = known
        token_src = np.full(T, -1, np.int32)
        token_src[qsl[missing + 1] - 1] = [pending_rows[sched[i].seq.seq_id] for i in missing]
    positions = np.zeros(T, np.int32)
    positions[:num_tokens] = pos
    # A chunk past the slots the block manager reserved would write into someone else's
    # block (or skip copy-on-write): the scheduler and the block manager disagree.
    reserved = np.fromiter((s.num_slots for s in sched), np.int64, num_seqs)
    if (over := np.flatnonzero(starts + counts > reserved)).size:
        s = sched[over[0]]
        raise IndexError(f"positions [{s.start}, {s.start + s.num_new_tokens}) of sequence {s.seq.seq_id!r}; "
                         f"it has {reserved[over[0]]} slots")
    bs = block_size
    slots = np.full(T, NULL_BLOCK, np.int32)  # padding tokens write into the null block
    slots[:num_tokens] = block_tables[tok_seq, pos // bs] * bs + pos % bs

    rows: list[SampleRow] = []
    logits_indices: list[int] = []
    lp_rows: list[PromptLogprobRows] = []
    lp_idx: list[np.ndarray] = []
    lp_tgt: list[np.ndarray] = []
    for i, s in enumerate(sched):
        seq, a, n, t = s.seq, s.start, s.num_new_tokens, int(qsl[i])
        req = seq.request
        for k in range(s.num_samples):  # n > 1 fans out at the first token: sample k of n
            rows.append(SampleRow(seq, k if s.num_samples > 1 else seq.index))
            logits_indices.append(t + n - 1)
        if req.params.prompt_logprobs is not None:
            # Positions p in this chunk with a next prompt token p + 1 to score.
            stop = min(a + n, req.num_prompt_tokens - 1)
            if stop > a:
                lp_rows.append(PromptLogprobRows(seq, a, stop - a))
                lp_idx.append(np.arange(t, t + stop - a))
                lp_tgt.append(np.asarray(seq.token_ids[a + 1:stop + 1]))

    R = max(S, row_bucket(len(rows)))  # usually R == S: one fewer axis to compile shapes for
    li = np.zeros(R, np.int32)
    li[:len(logits_indices)] = logits_indices
    num_lp = sum(r.count for r in lp_rows)
    P = bucket(num_lp) if num_lp else 0
    pi, pt = np.zeros(P, np.int32), np.zeros(P, np.int32)
    if num_lp:
        pi[:num_lp] = np.concatenate(lp_idx)
        pt[:num_lp] = np.concatenate(lp_tgt)
    return Batch(tokens, positions, slots, block_tables, context_lens, qsl, decode_only, li, rows,
                 pi, pt, lp_rows, num_tokens, token_src)
