"""The KV allocator protocol: what the scheduler and the batch builder ask of a block manager.

Two implementations: the paged :class:`~jaxpaged.block_manager.BlockManager` (vLLM's scheme:
blocks on demand, copy-on-write, prefix cache, swap space) and the pre-vLLM baseline
:class:`~jaxpaged.contiguous.ContiguousBlockManager` (one ``max_model_len`` region per
sequence). The scheduler is typed against this protocol and never branches on which one it
drives. No jax here.

Sequences are keyed by any hashable id. Block moves come back as ``(src, dst)`` pairs that
the runner applies before the step, in the order the calls returned them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

from jaxpaged.block_pool import MemoryStats, PrefixCacheStats


@runtime_checkable
class KVAllocator(Protocol):
    block_size: int
    num_host_blocks: int  # swap space in blocks; 0: preemption is by recompute only
    watermark_blocks: int  # blocks admission keeps free for running sequences to grow into

    @property
    def num_usable_blocks(self) -> int: ...

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation can take now (free, or cached and evictable)."""

    @property
    def num_free_host_blocks(self) -> int: ...

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats: ...

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing forgotten) while blocks are in use."""

    def check_fits(self, num_tokens: int, num_seqs: int = 1, *, final: bool = False) -> None:
        """Raise ``ValueError`` (naming the limit) if ``num_seqs`` sequences of ``num_tokens``
        tokens plus one generated token (none if ``final``: they sample their last token from
        these) could never fit, even in an empty pool."""

    def can_allocate(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                     num_new_tokens: int | None = None, final: bool = False) -> bool: ...

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, cache_salt: str | None = None,
                 num_new_tokens: int | None = None, final: bool = False) -> int:
        """Admit a sequence; returns how many leading tokens already hold K/V (prefix hits)."""

    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool: ...

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Reserve slots for the next tokens; returns copy-on-write ``(src, dst)`` block copies."""

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int, token_ids: Sequence[int]) -> None: ...

    def can_fork(self, num_children: int = 1) -> bool:
        """Whether ``num_children`` forks can be made now."""

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """A child that holds the parent's K/V; returns the ``(src, dst)`` copies that takes."""

    def fork_prefix(self, parent_id: Hashable, child_id: Hashable, num_tokens: int,
                    token_ids: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """A child sharing (or copying) the parent's first ``num_tokens`` positions, whole blocks,
        then whatever of its own ``token_ids`` the prefix cache holds; returns its
        ``num_computed_tokens`` and the ``(src, dst)`` copies that takes."""

    def free(self, seq_id: Hashable) -> None: ...

    def can_swap_out(self, *seq_ids: Hashable) -> bool: ...

    def swap_out(self, *seq_ids: Hashable) -> list[tuple[int, int]]:
        """Move sequences to the host pool together; blocks they share stay shared there."""

    def swap_in_blocks(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int] = ()) -> int:
        """Device blocks that swapping these in, then appending ``num_new_tokens[i]`` slots to each, takes."""

    def swap_in(self, *seq_ids: Hashable) -> list[tuple[int, int]]: ...

    def __contains__(self, seq_id: Hashable) -> bool: ...

    def num_tokens(self, seq_id: Hashable) -> int:
        """Positions of the sequence that have a slot (device or host)."""

    def block_table(self, seq_id: Hashable) -> list[int]: ...

    def stats(self) -> MemoryStats: ...

    def check_invariants(self) -> None: ...
