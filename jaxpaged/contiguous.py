"""Contiguous-allocation baseline: the pre-vLLM scheme behind ``BlockManager``'s interface.

Every request reserves ``max_model_len`` slots at admission: a *region* of
``ceil(max_model_len / block_size)`` consecutive blocks, whatever its real length.
What that costs, and what ``stats()`` shows next to the paged manager at the same
memory budget:

- internal fragmentation: the reserved slots a request never fills (most of them);
- external fragmentation: the pool's tail that cannot hold a whole region
  (``num_unusable_blocks``);
- no sharing: a fork copies the parent's filled blocks into a region of its own, and
  there is no prefix cache (``num_cached_tokens`` is always 0).

Block tables are ranges of consecutive blocks after the null block, so the same paged
kernel runs on both managers. Growth never needs memory (it was reserved), so
``can_append_slots`` is always true within ``max_model_len``. There is no swap space:
``can_swap_out`` is false and preemption is by recompute.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from jaxpaged.block_manager import SwapSpaceFull
from jaxpaged.block_pool import MemoryStats, PrefixCacheStats, invariant
from jaxpaged.padding import NULL_BLOCK


@dataclasses.dataclass(slots=True, eq=False)
class _Reservation:
    region: int
    num_tokens: int
    num_computed_tokens: int = 0


class ContiguousBlockManager:
    """Reserves ``max_model_len`` slots per request; same methods as ``BlockManager``.

    Args:
      num_blocks: blocks in the device pool, null block 0 included.
      block_size: token slots per block.
      max_model_len: slots each request reserves at admission.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, max_model_len: int):
        if block_size < 1 or max_model_len < 2:
            raise ValueError(f"block_size={block_size}, max_model_len={max_model_len}; need >= 1 and >= 2")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.num_usable_blocks = num_blocks - 1
        self.blocks_per_region = -(-max_model_len // block_size)
        self.num_regions = self.num_usable_blocks // self.blocks_per_region
        if self.num_regions < 1:
            raise ValueError(f"one request reserves {self.blocks_per_region} blocks (max_model_len="
                             f"{max_model_len}); the pool has {self.num_usable_blocks} usable blocks")
        self._free_regions = list(range(self.num_regions - 1, -1, -1))  # stack; pops region 0 first
        self._seqs: dict[Hashable, _Reservation] = {}
        self._peak_regions = 0
        self.num_host_blocks = 0  # no swap space
        self.watermark_blocks = 0

    def check_fits(self, num_prompt_tokens: int, num_seqs: int = 1, *, final: bool = False) -> None:
        """Raise ``ValueError`` if the prompt plus one token (none if ``final``) exceeds
        ``max_model_len``, or if ``num_seqs`` sequences need more regions than the pool has."""
        if num_prompt_tokens < 1:
            raise ValueError("prompt is empty; it needs at least one token")
        if num_prompt_tokens + (not final) > self.max_model_len:
            plus = "" if final else " with one generated token"
            raise ValueError(f"prompt has {num_prompt_tokens} tokens;{plus} that exceeds "
                             f"max_model_len={self.max_model_len}")
        if num_seqs > self.num_regions:
            raise ValueError(f"{num_seqs} sequences need {num_seqs} regions of {self.max_model_len} slots; "
                             f"the pool has {self.num_regions}")

    def can_allocate(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                     num_new_tokens: int | None = None, final: bool = False) -> bool:
        """Whether a region is free. Raises ``ValueError`` if the prompt could never fit."""
        self.check_fits(len(token_ids), final=final)
        return bool(self._free_regions)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, cache_salt: str | None = None,
                 num_new_tokens: int | None = None, final: bool = False) -> int:
        """Reserve a region; the first ``num_new_tokens`` (default: all) prompt tokens get slots.

        Returns:
          0: nothing is ever cached.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        self.check_fits(len(token_ids), final=final)
        if not self._free_regions:
            raise RuntimeError(f"all {self.num_regions} regions of {self.max_model_len} slots are in use")
        if num_new_tokens is not None and num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens}; must be >= 0")
        n = len(token_ids) if num_new_tokens is None else min(len(token_ids), num_new_tokens)
        self._seqs[seq_id] = _Reservation(self._free_regions.pop(), n)
        self._peak_regions = max(self._peak_regions, len(self._seqs))
        return 0

    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Always true: the slots were reserved at admission."""
        self._check_len(self._get(seq_id).num_tokens + num_new_tokens)
        return True

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Give the next ``num_new_tokens`` positions their reserved slots; never copies."""
        s = self._get(seq_id)
        self._check_len(s.num_tokens + num_new_tokens)
        s.num_tokens += num_new_tokens
        return []

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int, token_ids: Sequence[int]) -> None:
        """Record that K/V of positions ``[0, num_computed_tokens)`` is written."""
        s = self._get(seq_id)
        if not s.num_computed_tokens <= num_computed_tokens <= min(s.num_tokens, len(token_ids)):
            raise ValueError(f"num_computed_tokens={num_computed_tokens} for sequence {seq_id!r}; must be in "
                             f"[{s.num_computed_tokens}, {s.num_tokens}] and <= {len(token_ids)} token ids")
        s.num_computed_tokens = num_computed_tokens

    def can_fork(self, num_children: int = 1) -> bool:
        """Whether ``num_children`` regions are free."""
        return num_children <= len(self._free_regions)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """Reserve a region for ``child_id`` and copy the parent's filled blocks into it.

        Returns:
          ``(src, dst)`` device block copies to apply before the step.
        """
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        p = self._get(parent_id)
        if not self._free_regions:
            raise RuntimeError(f"all {self.num_regions} regions are in use; cannot fork {parent_id!r}")
        self._seqs[child_id] = dataclasses.replace(p, region=self._free_regions.pop())
        self._peak_regions = max(self._peak_regions, len(self._seqs))
        return list(zip(self.block_table(parent_id), self.block_table(child_id)))

    def fork_prefix(self, parent_id: Hashable, child_id: Hashable, num_tokens: int,
                    token_ids: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """Reserve a region for ``child_id`` and copy the parent's first ``num_tokens`` positions
        (whole blocks) into it; see ``BlockManager.fork_prefix``.

        Returns:
          ``(num_tokens, copies)``: the ``(src, dst)`` device block copies to apply first.
        """
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        p = self._get(parent_id)
        if num_tokens % self.block_size or not 0 <= num_tokens <= min(p.num_tokens, len(token_ids) - 1):
            raise ValueError(f"num_tokens={num_tokens} for a fork of sequence {parent_id!r}; must be a multiple "
                             f"of {self.block_size}, at most its {p.num_tokens} slots and before the child's last "
                             f"token")
        if not self._free_regions:
            raise RuntimeError(f"all {self.num_regions} regions are in use; cannot fork {parent_id!r}")
        self._seqs[child_id] = _Reservation(self._free_regions.pop(), num_tokens, num_tokens)
        self._peak_regions = max(self._peak_regions, len(self._seqs))
        k = num_tokens // self.block_size
        return num_tokens, list(zip(self.block_table(parent_id)[:k], self.block_table(child_id)))

    def free(self, seq_id: Hashable) -> None:
        """Release the sequence's region."""
        self._free_regions.append(self._get(seq_id).region)
        del self._seqs[seq_id]

    def can_swap_out(self, *seq_ids: Hashable) -> bool:
        """Always false: no swap space; preempt by recompute."""
        for i in seq_ids:
            self._get(i)
        return False

    def swap_out(self, *seq_ids: Hashable) -> list[tuple[int, int]]:
        raise SwapSpaceFull(f"the contiguous baseline has no swap space; preempt {', '.join(map(repr, seq_ids))} "
                            f"by recompute: free them")

    def can_swap_in(self, *seq_ids: Hashable) -> bool:
        raise ValueError(f"sequences {', '.join(map(repr, seq_ids))} are not swapped out")

    def swap_in_blocks(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int] = ()) -> int:
        raise ValueError(f"sequences {', '.join(map(repr, seq_ids))} are not swapped out")

    def swap_in(self, *seq_ids: Hashable) -> list[tuple[int, int]]:
        raise ValueError(f"sequences {', '.join(map(repr, seq_ids))} are not swapped out")

    def host_block_table(self, seq_id: Hashable) -> list[int]:
        raise ValueError(f"sequence {seq_id!r} is not swapped out")

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: Hashable) -> bool:
        self._get(seq_id)
        return False

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_computed_tokens

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The region's first ``ceil(num_tokens / block_size)`` blocks."""
        s = self._get(seq_id)
        start = NULL_BLOCK + 1 + s.region * self.blocks_per_region
        return list(range(start, start + -(-s.num_tokens // self.block_size)))

    def slot(self, seq_id: Hashable, position: int) -> int:
        """Slot ``block * block_size + offset`` of the token at ``position``."""
        s = self._get(seq_id)
        if not 0 <= position < s.num_tokens:
            raise IndexError(f"position {position} of sequence {seq_id!r}; it has {s.num_tokens} slots")
        return (NULL_BLOCK + 1 + s.region * self.blocks_per_region) * self.block_size + position

    def slot_mapping(self, seq_id: Hashable, start: int, stop: int) -> np.ndarray:
        """Slots of positions ``[start, stop)``, int32 ``[stop - start]``."""
        s = self._get(seq_id)
        if not 0 <= start <= stop <= s.num_tokens:
            raise IndexError(f"positions [{start}, {stop}) of sequence {seq_id!r}; it has {s.num_tokens} slots")
        base = (NULL_BLOCK + 1 + s.region * self.blocks_per_region) * self.block_size
        return np.arange(base + start, base + stop, dtype=np.int32)

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks of the free regions."""
        return len(self._free_regions) * self.blocks_per_region

    @property
    def num_free_host_blocks(self) -> int:
        return 0

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats()

    def reset_prefix_cache(self) -> bool:
        return True  # (no prefix cache)

    def stats(self) -> MemoryStats:
        """Memory accounting: every reserved slot counts as allocated."""
        tokens = sum(s.num_tokens for s in self._seqs.values())
        return MemoryStats(
            num_blocks=self.num_usable_blocks, block_size=self.block_size, num_free_blocks=self.num_allocatable_blocks,
            num_cached_blocks=0, num_used_blocks=len(self._seqs) * self.blocks_per_region,
            num_unusable_blocks=self.num_usable_blocks - self.num_regions * self.blocks_per_region,
            peak_used_blocks=self._peak_regions * self.blocks_per_region, num_tokens=tokens, tokens_stored=tokens)

    def check_invariants(self) -> None:
        """Every region is free or held by exactly one sequence; counts within bounds."""
        held = [s.region for s in self._seqs.values()]
        invariant(sorted(held + self._free_regions) == list(range(self.num_regions)),
                  f"regions leaked or held twice: held {sorted(held)}, free {sorted(self._free_regions)}")
        for sid, s in self._seqs.items():
            invariant(0 <= s.num_computed_tokens <= s.num_tokens <= self.max_model_len,
                      f"sequence {sid!r}: {s.num_computed_tokens} computed, {s.num_tokens} tokens, "
                      f"max_model_len {self.max_model_len}")

    def _get(self, seq_id: Hashable) -> _Reservation:
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return s

    def _check_len(self, n: int) -> None:
        if n > self.max_model_len:
            raise ValueError(f"sequence would reach {n} tokens; max_model_len is {self.max_model_len}")
