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

A mixed step (decodes beside prompt chunks) with at least ``SPLIT_MIN_ROWS`` one-token
rows may be laid out in two parts (``split_decodes``, the XLA attention path's choice:
``runner.ModelRunner``): its one-token rows first, ``D = row_bucket(count)`` rows of one
token each (padding rows: context 0, the token written into the null block), then the
other rows and their tokens; ``S = row_bucket(D + others)``, ``T = D +
token_bucket(other tokens)``. Sampling rows keep the scheduler's order. Attention runs
the first ``D`` rows as a decode batch and the rest as a ragged one
(``AttentionMetadata.num_decode_rows``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping

import numpy as np

from jaxpaged.padding import NULL_BLOCK, bucket, row_bucket, token_bucket
from jaxpaged.scheduler import SchedulerOutput
from jaxpaged.sequence import Sequence


# A split step compiles a shape per one-token part's row bucket: below this many one-token
# rows the step stays in one ragged part, so that small batches add no shapes. A process that
# compiles thousands of step shapes runs out of memory mappings (each XLA:CPU executable
# holds ~170; Linux allows 65,530): the model tier's random traffic (three pool geometries,
# new engine settings every round) reached ~64k maps in 320 rounds when every count split.
SPLIT_MIN_ROWS = 8


@dataclasses.dataclass
class SampleRow:
    seq: Sequence
    index: int  # which sample of the request this row draws (n > 1 fans out at the first token)
    # Positions before its chunk's end: 0, or for the row sampled at a sequence's last token
    # or one of its drafts, how many drafts follow it (speculative decoding).
    ahead: int = 0
    # The drafts before its position: output tokens as far as this row is concerned (penalties).
    drafted: list[int] = dataclasses.field(default_factory=list)
    # A draft's row of a structured output: the grammar's state after the drafts before it.
    draft_matcher: object = None

    @property
    def matcher(self):
        """The structured output's matcher at this row's position, or None."""
        return self.seq.matcher if self.draft_matcher is None else self.draft_matcher


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
    # Rows [0, num_decode_rows) hold one token each, tokens [0, num_decode_rows), and form a
    # decode batch of their own; 0 when the step is not split (see the module docstring).
    num_decode_rows: int = 0
    # [T] int32: each token's LoRA adapter slot (-1: none; jaxpaged.lora), None in a step
    # without adapters.
    lora_slots: np.ndarray | None = None

    @property
    def shape_key(self) -> tuple:
        """What the model's compilation depends on: (T, (S, W), R + P, decode_only, num_decode_rows)."""
        return (self.tokens.shape[0], self.block_tables.shape,
                self.logits_indices.shape[0] + self.prompt_lp_indices.shape[0], self.decode_only,
                self.num_decode_rows)


def build_batch(out: SchedulerOutput, *, block_size: int, max_blocks_per_seq: int, token_floor: int = 8,
                pending_rows: Mapping[int, int] | None = None, split_decodes: bool = False,
                seq_lora: np.ndarray | None = None) -> Batch:
    """Padded arrays for one step, from what the scheduler decided (block tables included).

    The scheduler's block moves (``out.block_ops``) are the runner's to apply, before the step.
    ``pending_rows`` maps a sequence id to the row of the previous step that sampled its
    pending token (async scheduling); a chunk may end with that token, and ``token_src``
    says where the device finds it. ``split_decodes``: lay a mixed step out as its
    one-token rows, then the others (see the module docstring). ``seq_lora``: each scheduled
    sequence's LoRA adapter slot (-1: none), given to its tokens.
    """
    sched = out.scheduled
    num_seqs = len(sched)
    counts = np.fromiter((s.num_new_tokens for s in sched), np.int32, num_seqs)
    num_tokens = int(counts.sum())
    num_ones = int((counts == 1).sum())
    decode_only = num_ones == num_seqs
    # The row of each scheduled sequence: in order, or (split) the one-token rows first, then
    # the others past the one-token part's padding. Sampling rows stay in the scheduler's
    # order (its update_from_output reads them so).
    seq_row = np.arange(num_seqs)
    D = 0  # padded one-token rows leading a split step
    if split_decodes and not decode_only and num_ones >= SPLIT_MIN_ROWS:
        one = counts == 1
        D = row_bucket(num_ones)
        seq_row[one] = np.arange(num_ones)
        seq_row[~one] = D + np.arange(num_seqs - num_ones)
        S = row_bucket(D + num_seqs - num_ones)  # a bucket as unsplit steps' S: the sampler's rows R follow it
        T = D + token_bucket(num_tokens - num_ones, token_floor)
    else:
        S = max(row_bucket(num_seqs), 1)
        T = S if decode_only else token_bucket(num_tokens, token_floor)
    tables = [s.block_table for s in sched]
    W = min(bucket(max(len(t) for t in tables), 4), bucket(max_blocks_per_seq, 4))

    # Per-sequence values as Python lists, turned into arrays once: per-row numpy slicing
    # costs ~20 us a sequence, ~5 ms a step at 256 sequences.
    starts = np.fromiter((s.start for s in sched), np.int32, num_seqs)
    widths = np.fromiter(map(len, tables), np.int64, num_seqs)
    block_tables = np.full((S, W), NULL_BLOCK, np.int32)
    block_tables[np.repeat(seq_row, widths), np.arange(int(widths.sum())) - np.repeat(
        np.cumsum(widths) - widths, widths)] = np.fromiter(itertools.chain.from_iterable(tables), np.int32)
    context_lens = np.zeros(S, np.int32)
    context_lens[seq_row] = starts + counts
    row_counts = np.zeros(S, np.int32)
    row_counts[seq_row] = counts
    row_counts[:D] = 1  # the one-token part's padding rows too: a token each, in the null block
    qsl = np.zeros(S + 1, np.int32)
    qsl[1:] = np.cumsum(row_counts)
    # The token index and position of every real token, sequence by sequence.
    within = np.arange(num_tokens) - np.repeat(np.cumsum(counts) - counts, counts)
    tok_index = np.repeat(qsl[seq_row], counts) + within
    pos = (np.repeat(starts, counts) + within).astype(np.int32)
    tok_seq = np.repeat(seq_row, counts)  # row of each real token
    tokens = np.zeros(T, np.int32)
    known = np.fromiter(itertools.chain.from_iterable(s.input_ids for s in sched), np.int32)
    token_src = None
    if len(known) == num_tokens:
        tokens[tok_index] = known
    else:  # chunks that end with a pending token: one per sequence at most, the last of its chunk
        lens = np.fromiter((len(s.seq.token_ids) + len(s.draft) for s in sched), np.int32, num_seqs)
        missing = np.flatnonzero(starts + counts > lens)
        if (starts + counts - lens)[missing].max() > 1 or pending_rows is None:
            s = sched[missing[0]]
            raise IndexError(f"positions [{s.start}, {s.start + s.num_new_tokens}) of sequence {s.seq.seq_id!r}; "
                             f"the host knows {len(s.seq.token_ids)} of its tokens")
        last = qsl[seq_row[missing] + 1] - 1  # the pending tokens' indices
        is_known = np.ones(T, bool)
        is_known[last] = False
        tokens[tok_index[is_known[tok_index]]] = known
        token_src = np.full(T, -1, np.int32)
        token_src[last] = [pending_rows[sched[i].seq.seq_id] for i in missing]
    positions = np.zeros(T, np.int32)
    positions[tok_index] = pos
    # A chunk past the slots the block manager reserved would write into someone else's
    # block (or skip copy-on-write): the scheduler and the block manager disagree.
    reserved = np.fromiter((s.num_slots for s in sched), np.int64, num_seqs)
    if (over := np.flatnonzero(starts + counts > reserved)).size:
        s = sched[over[0]]
        raise IndexError(f"positions [{s.start}, {s.start + s.num_new_tokens}) of sequence {s.seq.seq_id!r}; "
                         f"it has {reserved[over[0]]} slots")
    bs = block_size
    slots = np.full(T, NULL_BLOCK, np.int32)  # padding tokens write into the null block
    slots[tok_index] = block_tables[tok_seq, pos // bs] * bs + pos % bs

    rows: list[SampleRow] = []
    logits_indices: list[int] = []
    lp_rows: list[PromptLogprobRows] = []
    lp_idx: list[np.ndarray] = []
    lp_tgt: list[np.ndarray] = []
    for i, s in enumerate(sched):
        seq, a, n, t = s.seq, s.start, s.num_new_tokens, int(qsl[seq_row[i]])
        req = seq.request
        for k in range(s.num_samples):  # n > 1 fans out at the first token: sample k of n
            rows.append(SampleRow(seq, k if s.num_samples > 1 else seq.index))
            logits_indices.append(t + n - 1)
        if s.draft:  # the last token's row and each draft's, in position order
            d = len(s.draft)
            rows[-1:] = [SampleRow(seq, seq.index, ahead=d - j, drafted=s.draft[:j],
                                   draft_matcher=s.draft_matchers[j - 1] if j and s.draft_matchers else None)
                         for j in range(d + 1)]
            logits_indices[-1:] = range(t + n - 1 - d, t + n)
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
    lora_slots = None
    if seq_lora is not None:
        lora_slots = np.full(T, -1, np.int32)
        lora_slots[tok_index] = np.repeat(seq_lora, counts)
    return Batch(tokens, positions, slots, block_tables, context_lens, qsl, decode_only, li, rows,
                 pi, pt, lp_rows, num_tokens, token_src, D, lora_slots)
