"""Host-side KV block manager: block tables, copy-on-write, prefix caching, swap space.

Pure Python (numpy only for slot arrays), no jax: it runs and is tested without a
device. The physical pool, its O(1) doubly linked LRU free queue and the prefix-cache
keys live in ``block_pool.py`` (read its docstring for why a linked list); this module
keeps one state per sequence, keyed by any hashable id (a request or sequence id):

- a block table (logical block ``i`` holds positions ``[i * block_size, (i + 1) * block_size)``),
- ``num_tokens``: positions ``[0, num_tokens)`` have a slot (reserved, maybe not written yet),
- ``num_computed_tokens``: positions ``[0, num_computed_tokens)`` have their K/V written.

How the engine drives it (like vLLM v1's ``KVCacheManager``)::

    bm.check_fits(len(prompt), num_seqs)    # at submission: ValueError if it could never fit
    # admission (can_allocate raises the same ValueError)
    if bm.can_allocate(prompt, cache_salt=salt, num_new_tokens=chunk):
        num_cached = bm.allocate(rid, prompt, cache_salt=salt, num_new_tokens=chunk)
        # the step computes positions [num_cached, bm.num_tokens(rid))
    # a running sequence's next prefill chunk or decode token
    if bm.can_append_slots(rid, n):
        copies += bm.append_slots(rid, n)   # copy-on-write (src, dst) block pairs
    elif bm.can_swap_out(victim):           # preemption
        copies += bm.swap_out(victim)       # (device, host) pairs
    else:
        bm.free(victim)                     # host pool full: recompute it later
    # the batch: bm.block_table(rid), bm.slot(rid, p) / bm.slot_mapping(rid, start, stop)
    # after the step wrote K/V: newly full blocks enter the prefix cache
    bm.mark_computed(rid, num_computed_tokens, token_ids)
    bm.fork(rid, child_id)                  # n > 1 sampling, beam search
    bm.free(rid)                            # finished

Copies returned by ``append_slots``, ``swap_out`` and ``swap_in`` must be applied in
the order the calls returned them, before the step's model run: a block freed by one
call may be the destination of the next.

Copy-on-write happens at token level: a fork shares every block (ref + 1), and the
first sequence to write into a shared, partially filled last block gets a private copy.
Full blocks are never written again, so they are shared for good.

Prefix caching: a block is registered only once it is full *and* ``mark_computed`` says
its K/V is written, so a hit never serves a slot still waiting for the device. At
admission only full blocks inside the first ``len(prompt) - 1`` tokens can hit, so a
fully cached prompt still computes its last token (logits need one) and no write ever
lands in a shared cached block. The extra keys ``(model_id, cache_salt)`` enter every
hash and are compared on a hit: tenants with different salts never share a block.

Admission keeps a watermark of free blocks (default 1% of the pool) for running
sequences to grow into; it is waived while no sequence holds a block, so any request
that passes the never-fits check (prompt + 1 token fits in the pool) is admitted
eventually instead of waiting forever.

Swap space is a host pool of ``swap_space // block_bytes`` blocks. Sequences swapped out
together (one request's samples or beams: ``swap_out(*seq_ids)``) keep sharing what they
shared: a block they share is copied once, to one host block they all reference, and
swapped in together it comes back as one device block again. Blocks shared with sequences
outside the group (prefix-cache hits) are copied for the group; swapped-in blocks are
fresh (not re-registered in the prefix cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from jaxpaged.block_pool import (Block, BlockKey, BlockPool, HashFn, MemoryStats, PrefixCacheStats,
                                  invariant, sha256_block_hash)
from jaxpaged.padding import NULL_BLOCK

__all__ = ["BlockManager", "MemoryStats", "SwapSpaceFull", "NULL_BLOCK"]


class SwapSpaceFull(RuntimeError):
    """The host pool cannot take a sequence: preempt it by recompute (``free``) instead."""


@dataclasses.dataclass(slots=True, eq=False)
class _Sequence:
    blocks: list[Block]  # the block table; empty while swapped out
    num_tokens: int
    num_computed_tokens: int
    extra_keys: tuple  # (model_id, cache_salt)
    block_hashes: list[bytes]  # chained hashes of the first full blocks (the prompt's: from admission)
    num_registered: int  # blocks [0, num_registered) have been offered to the prefix cache
    parent_key: tuple[int, int] | None  # (id, generation) of the block cached for the last registered one
    cacheable: bool = True  # False after a collision: the chain is not registered further
    host_blocks: list[int] | None = None  # set while swapped out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _named(seq_ids: Sequence[Hashable]) -> str:
    return f"sequence {seq_ids[0]!r}" if len(seq_ids) == 1 else f"sequences {', '.join(map(repr, seq_ids))}"


class BlockManager:
    """Paged KV block manager over a device pool of ``num_blocks`` blocks.

    Args:
      num_blocks: blocks in the device pool, null block 0 included.
      block_size: token slots per block.
      max_model_len: longest sequence allowed (prompt + generated); ``None``: the pool.
      watermark: fraction of the usable blocks admission keeps free.
      enable_prefix_caching: look up and register full blocks in the prefix cache.
      model_id: part of every block hash, so two models never share K/V.
      swap_space: bytes of host memory for swapped-out blocks; 0 disables swapping.
      block_bytes: bytes of one block (K and V, all layers); required with ``swap_space``.
      hash_fn: block hash function; injectable for tests.
    """

    def __init__(self, num_blocks: int, block_size: int = 16, *, max_model_len: int | None = None,
                 watermark: float = 0.01, enable_prefix_caching: bool = True, model_id: str = "",
                 swap_space: int = 0, block_bytes: int | None = None,
                 hash_fn: HashFn = sha256_block_hash):
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark={watermark}; must be in [0, 1)")
        if swap_space and not block_bytes:
            raise ValueError(f"swap_space={swap_space} bytes needs block_bytes (bytes of one block)")
        self.pool = BlockPool(num_blocks, block_size, hash_fn)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.watermark_blocks = int(watermark * self.pool.num_usable)
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.num_host_blocks = swap_space // block_bytes if swap_space else 0
        self._host_free = list(range(self.num_host_blocks - 1, -1, -1))  # stack; pops 0 first
        self._host_refs = [0] * self.num_host_blocks  # swapped-out sequences holding each host block
        self._seqs: dict[Hashable, _Sequence] = {}
        self._memo: tuple[tuple, list[bytes]] | None = None  # (prompt blocks, extra keys) -> hashes

    # ---- admission ------------------------------------------------------------------

    def check_fits(self, num_prompt_tokens: int, num_seqs: int = 1, *, final: bool = False) -> None:
        """Reject a prompt that could never be admitted, even into an empty pool.

        ``can_allocate`` and ``allocate`` call this; call it at submission to fail early.
        ``num_seqs`` sequences (``n > 1`` samples, beams) share the prompt's full blocks
        and need one block each for what follows. ``final``: the sequences sample their last
        token from these (a request readmitted one token short of ``max_tokens``), so they
        need no slot for a generated token.

        Raises:
          ValueError: the prompt is empty, or with one generated token (none if ``final``)
            it exceeds ``max_model_len`` or needs more blocks than the whole pool.
        """
        if num_prompt_tokens < 1:
            raise ValueError("prompt is empty; it needs at least one token")
        n = num_prompt_tokens + (not final)
        plus = "" if final else " with one generated token"
        if self.max_model_len is not None and n > self.max_model_len:
            raise ValueError(f"prompt has {num_prompt_tokens} tokens;{plus} that exceeds "
                             f"max_model_len={self.max_model_len}")
        need = (n - 1) // self.block_size + num_seqs  # shared full blocks + each one's last
        if need > self.pool.num_usable:
            seqs = f" in {num_seqs} sequences" if num_seqs > 1 else ""
            raise ValueError(f"prompt has {num_prompt_tokens} tokens;{plus}{seqs} it needs "
                             f"{need} blocks of {self.block_size} slots, but the pool has "
                             f"{self.pool.num_usable} usable blocks")

    def can_allocate(self, token_ids: Sequence[int], *, cache_salt: str | None = None,
                     num_new_tokens: int | None = None, final: bool = False) -> bool:
        """Whether ``allocate`` can admit this prompt now and keep the watermark free.

        Prefix hits are taken into account; the lookup counts no queries or hits.

        Raises:
          ValueError: the prompt could never fit (see ``allocate``).
        """
        *_, num_free_taken = self._plan_admission(token_ids, cache_salt, num_new_tokens, final)
        return self._admissible(num_free_taken)

    def allocate(self, seq_id: Hashable, token_ids: Sequence[int], *, cache_salt: str | None = None,
                 num_new_tokens: int | None = None, final: bool = False) -> int:
        """Admit a prompt: share its cached prefix, reserve slots for what follows it.

        Args:
          seq_id: the new sequence's id.
          token_ids: the prompt.
          cache_salt: per-tenant salt; blocks are shared only between equal salts.
          num_new_tokens: reserve slots for at most this many tokens past the cached
            prefix (this step's prefill chunk); ``None``: the rest of the prompt.
          final: it samples its last token from these: no slot past them (see ``check_fits``).

        Returns:
          ``num_cached_tokens``: positions ``[0, num_cached_tokens)`` already hold K/V,
          a multiple of ``block_size`` and at most ``len(token_ids) - 1``.

        Raises:
          ValueError: ``seq_id`` exists, or the prompt plus one generated token exceeds
            ``max_model_len`` or the whole pool.
          RuntimeError: not enough free blocks (call ``can_allocate`` first).
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        extra, hits, hashes, num_tokens, num_free_taken = self._plan_admission(token_ids, cache_salt, num_new_tokens,
                                                                               final)
        if num_free_taken > self.pool.num_free:
            raise RuntimeError(f"sequence {seq_id!r} needs {num_free_taken} free blocks; {self.pool.num_free} are")
        for b in hits:  # before allocating, so the allocation cannot evict them
            self.pool.share(b)
        num_cached = len(hits) * self.block_size
        blocks = hits + [self.pool.allocate() for _ in range(_cdiv(num_tokens, self.block_size) - len(hits))]
        if self.enable_prefix_caching:
            self.pool.stats.queries += len(token_ids)
            self.pool.stats.hits += num_cached
        parent = (hits[-1].block_id, hits[-1].generation) if hits else None
        self._seqs[seq_id] = _Sequence(blocks, num_tokens, num_cached, extra, list(hashes), len(hits), parent)
        return num_cached

    # ---- growth ---------------------------------------------------------------------

    def can_append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> bool:
        """Whether ``append_slots`` can reserve ``num_new_tokens`` more slots now."""
        s = self._on_device(seq_id)
        return self._blocks_to_append(s, num_new_tokens) <= self.pool.num_free

    def append_slots(self, seq_id: Hashable, num_new_tokens: int = 1) -> list[tuple[int, int]]:
        """Reserve slots for the next ``num_new_tokens`` tokens (prefill chunk or decode).

        New blocks are allocated only when the last one is full. Writing into a shared,
        partially filled last block first copies it to a private block.

        Returns:
          ``(src, dst)`` device block copies to apply before the step (copy-on-write).

        Raises:
          ValueError: the sequence would exceed ``max_model_len``.
          RuntimeError: not enough free blocks (call ``can_append_slots`` first).
        """
        s = self._on_device(seq_id)
        need = self._blocks_to_append(s, num_new_tokens)
        if need > self.pool.num_free:
            raise RuntimeError(f"sequence {seq_id!r} needs {need} new blocks; {self.pool.num_free} are free")
        copies = []
        if num_new_tokens and self._last_block_shared(s):
            old, new = s.blocks[-1], self.pool.allocate()
            copies.append((old.block_id, new.block_id))
            s.blocks[-1] = new
            self.pool.free(old)
        s.num_tokens += num_new_tokens
        s.blocks.extend(self.pool.allocate() for _ in range(_cdiv(s.num_tokens, self.block_size) - len(s.blocks)))
        return copies

    def mark_computed(self, seq_id: Hashable, num_computed_tokens: int, token_ids: Sequence[int]) -> None:
        """Record that K/V of positions ``[0, num_computed_tokens)`` is written.

        Blocks that are now full and computed are hashed and registered in the prefix
        cache; only these are ever served to other requests.

        Args:
          seq_id: the sequence.
          num_computed_tokens: new count; between the old count and ``num_tokens``.
          token_ids: the sequence's tokens, at least ``num_computed_tokens`` of them,
            starting with the prompt given to ``allocate`` (whose blocks were hashed then).
        """
        s = self._on_device(seq_id)
        if not s.num_computed_tokens <= num_computed_tokens <= s.num_tokens:
            raise ValueError(f"num_computed_tokens={num_computed_tokens} for sequence {seq_id!r}; must be "
                             f"in [{s.num_computed_tokens}, {s.num_tokens}] (computed so far, slots)")
        if len(token_ids) < num_computed_tokens:
            raise ValueError(f"{len(token_ids)} token ids for num_computed_tokens={num_computed_tokens}")
        s.num_computed_tokens = num_computed_tokens
        if not (self.enable_prefix_caching and s.cacheable):
            return
        bs, full = self.block_size, num_computed_tokens // self.block_size
        if full > len(s.block_hashes):  # decoded blocks; the prompt's were hashed at admission
            s.block_hashes += self.pool.hash_blocks(token_ids, full - len(s.block_hashes), s.extra_keys,
                                                    s.block_hashes[-1] if s.block_hashes else None,
                                                    first=len(s.block_hashes))
        for i in range(s.num_registered, full):
            key = BlockKey(s.parent_key, tuple(token_ids[i * bs:(i + 1) * bs]), s.extra_keys)
            cached = self.pool.cache(s.blocks[i], s.block_hashes[i], key)
            if cached is None:  # collision: a block with other content owns this hash
                s.cacheable = False
                return
            s.num_registered = i + 1
            s.parent_key = (cached.block_id, cached.generation)

    def can_fork(self, num_children: int = 1) -> bool:
        """Always true: a fork shares every block and copies nothing until a write."""
        return True

    def fork(self, parent_id: Hashable, child_id: Hashable) -> list[tuple[int, int]]:
        """Make ``child_id`` a copy of ``parent_id`` that shares all its blocks (ref + 1).

        Returns:
          ``[]``: copies are deferred to the first write into a shared block.
        """
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        p = self._on_device(parent_id)
        for b in p.blocks:
            self.pool.share(b)
        self._seqs[child_id] = dataclasses.replace(p, blocks=list(p.blocks), block_hashes=list(p.block_hashes))
        return []

    def fork_prefix(self, parent_id: Hashable, child_id: Hashable, num_tokens: int,
                    token_ids: Sequence[int]) -> tuple[int, list[tuple[int, int]]]:
        """A child that shares the parent's first ``num_tokens`` positions (whole blocks), then
        the prefix cache's blocks for what follows of its own ``token_ids``, up to its last
        token: how a preempted request's samples come back (the parent's blocks past
        ``num_tokens`` hold the parent's own tokens, so they are not shared).

        Args:
          parent_id: an on-device sequence with slots for ``num_tokens`` positions whose K/V
            is written, or will be before the child's next step runs.
          child_id: the new sequence's id.
          num_tokens: a multiple of ``block_size``.
          token_ids: the child's tokens; its first ``num_tokens`` are the parent's.

        Returns:
          ``(num_computed_tokens, [])``: positions of the child that hold K/V (``num_tokens``
          and the hits after them); no copies.
        """
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        p, bs = self._on_device(parent_id), self.block_size
        if num_tokens % bs or not 0 <= num_tokens <= min(p.num_tokens, len(token_ids) - 1):
            raise ValueError(f"num_tokens={num_tokens} for a fork of sequence {parent_id!r}; must be a multiple "
                             f"of {bs}, at most its {p.num_tokens} slots and before the child's last token")
        k = num_tokens // bs
        # The cached chain of the child's tokens: where it covers the shared blocks, its hits
        # after them are this child's own blocks from before (same tokens, same K/V).
        hashes = self._prompt_hashes(token_ids, p.extra_keys)[:(len(token_ids) - 1) // bs]
        chain = self.pool.find_cached_prefix(token_ids, hashes, p.extra_keys)
        blocks = p.blocks[:k] + chain[k:]
        for b in blocks:
            self.pool.share(b)
        if self.enable_prefix_caching:  # the whole blocks after the shared ones were looked up
            self.pool.stats.queries += max(len(hashes) - k, 0) * bs
            self.pool.stats.hits += len(blocks) * bs - num_tokens
        n, reg = len(blocks) * bs, min(len(chain), len(blocks))
        parent = (chain[reg - 1].block_id, chain[reg - 1].generation) if reg else None
        self._seqs[child_id] = _Sequence(blocks, n, n, p.extra_keys, list(hashes[:len(blocks)]), reg, parent)
        return n, []

    def free(self, seq_id: Hashable) -> None:
        """Release a finished or preempted sequence's blocks, tail first, device or host."""
        s = self._get(seq_id)
        del self._seqs[seq_id]
        for b in reversed(s.blocks):
            self.pool.free(b)
        if s.host_blocks is not None:
            self._release_host(s.host_blocks)

    # ---- swap space -----------------------------------------------------------------

    def can_swap_out(self, *seq_ids: Hashable) -> bool:
        """Whether the host pool has room for the sequences; if not, preempt by recompute."""
        return len({b.block_id for i in seq_ids for b in self._on_device(i).blocks}) <= len(self._host_free)

    def swap_out(self, *seq_ids: Hashable) -> list[tuple[int, int]]:
        """Move the sequences' blocks to the host pool and free them on the device. A block
        they share goes to one host block they all hold.

        Returns:
          ``(device_block, host_block)`` copies to apply before the blocks are reused.

        Raises:
          SwapSpaceFull: the host pool lacks room; ``free`` them and recompute them later.
        """
        seqs = [self._on_device(i) for i in seq_ids]
        need = len({b.block_id for s in seqs for b in s.blocks})
        if need > len(self._host_free):
            one = len(seq_ids) == 1
            raise SwapSpaceFull(f"{_named(seq_ids)} need{'s' if one else ''} {need} host blocks; "
                                f"{len(self._host_free)} of {self.num_host_blocks} are free. "
                                f"Preempt {'it' if one else 'them'} by recompute: free {'it' if one else 'them'}.")
        host: dict[int, int] = {}  # device block -> its host block
        copies = []
        for s in seqs:
            for b in s.blocks:
                if b.block_id not in host:
                    host[b.block_id] = self._host_free.pop()
                    copies.append((b.block_id, host[b.block_id]))
            s.host_blocks = [host[b.block_id] for b in s.blocks]
            for h in s.host_blocks:
                self._host_refs[h] += 1
        for s in seqs:
            for b in reversed(s.blocks):
                self.pool.free(b)
            s.blocks = []
        return copies

    def swap_in_blocks(self, seq_ids: Sequence[Hashable], num_new_tokens: Sequence[int] = ()) -> int:
        """Free device blocks that ``swap_in(*seq_ids)`` and then ``append_slots`` of
        ``num_new_tokens[i]`` to each take (new blocks and copy-on-write copies)."""
        seqs = [self._swapped(i) for i in seq_ids]
        if num_new_tokens and len(num_new_tokens) != len(seqs):
            raise ValueError(f"{len(num_new_tokens)} num_new_tokens for {len(seqs)} sequences")
        holders: dict[int, int] = {}  # host block -> sequences of the group holding it
        for s in seqs:
            for h in s.host_blocks:
                holders[h] = holders.get(h, 0) + 1
        need, writers = len(holders), {}
        for s, n in zip(seqs, num_new_tokens or [0] * len(seqs)):
            if n:
                need += _cdiv(s.num_tokens + n, self.block_size) - len(s.host_blocks)
                last = s.host_blocks[-1] if s.host_blocks else None
                if s.num_tokens % self.block_size and holders.get(last, 0) > 1:  # shared and partly filled
                    writers[last] = writers.get(last, 0) + 1
        # Every writer into a shared last block copies it but the last one holding it.
        return need + sum(min(w, holders[h] - 1) for h, w in writers.items())

    def can_swap_in(self, *seq_ids: Hashable) -> bool:
        """Whether ``swap_in`` can bring the sequences back and keep the watermark free."""
        return self._admissible(self.swap_in_blocks(seq_ids))

    def swap_in(self, *seq_ids: Hashable) -> list[tuple[int, int]]:
        """Bring swapped-out sequences back into fresh device blocks; a host block several of
        them hold comes back as one device block they share.

        Returns:
          ``(host_block, device_block)`` copies to apply before the step.
        """
        seqs = [self._swapped(i) for i in seq_ids]
        need = self.swap_in_blocks(seq_ids)
        if need > self.pool.num_free:
            raise RuntimeError(f"{_named(seq_ids)}: {need} blocks needed; {self.pool.num_free} are free")
        device: dict[int, Block] = {}  # host block -> its device block
        copies = []
        for s in seqs:
            for h in s.host_blocks:
                if h in device:
                    self.pool.share(device[h])
                else:
                    device[h] = self.pool.allocate()
                    copies.append((h, device[h].block_id))
            s.blocks = [device[h] for h in s.host_blocks]
        for s in seqs:
            self._release_host(s.host_blocks)
            s.host_blocks = None
        return copies

    def _release_host(self, host_blocks: list[int]) -> None:
        for h in reversed(host_blocks):
            self._host_refs[h] -= 1
            if not self._host_refs[h]:
                self._host_free.append(h)

    # ---- queries --------------------------------------------------------------------

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def is_swapped(self, seq_id: Hashable) -> bool:
        return self._get(seq_id).host_blocks is not None

    def num_tokens(self, seq_id: Hashable) -> int:
        """Positions of the sequence that have a slot."""
        return self._get(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: Hashable) -> int:
        """Positions of the sequence whose K/V is written."""
        return self._get(seq_id).num_computed_tokens

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block of each logical block of an on-device sequence."""
        return [b.block_id for b in self._on_device(seq_id).blocks]

    def host_block_table(self, seq_id: Hashable) -> list[int]:
        """Host block of each logical block of a swapped-out sequence."""
        return list(self._swapped(seq_id).host_blocks)

    def slot(self, seq_id: Hashable, position: int) -> int:
        """Slot ``block * block_size + offset`` of the token at ``position``."""
        s = self._on_device(seq_id)
        if not 0 <= position < s.num_tokens:
            raise IndexError(f"position {position} of sequence {seq_id!r}; it has {s.num_tokens} slots")
        return s.blocks[position // self.block_size].block_id * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id: Hashable, start: int, stop: int) -> np.ndarray:
        """Slots of positions ``[start, stop)``, int32 ``[stop - start]``."""
        s, bs = self._on_device(seq_id), self.block_size
        if not 0 <= start <= stop <= s.num_tokens:
            raise IndexError(f"positions [{start}, {stop}) of sequence {seq_id!r}; it has {s.num_tokens} slots")
        pos = np.arange(start, stop, dtype=np.int32)
        ids = np.array([b.block_id for b in s.blocks[start // bs:_cdiv(stop, bs)]], dtype=np.int32)
        return ids[pos // bs - start // bs] * bs + pos % bs

    @property
    def num_usable_blocks(self) -> int:
        """Blocks of the pool, the null block aside."""
        return self.pool.num_usable

    @property
    def num_allocatable_blocks(self) -> int:
        """Blocks an allocation can take now: free plus evictable cached ones."""
        return self.pool.num_free

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (:meth:`BlockPool.reset_prefix_cache`); False while any
        sequence holds blocks."""
        return self.pool.reset_prefix_cache()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return dataclasses.replace(self.pool.stats)

    def stats(self) -> MemoryStats:
        """Memory accounting; O(total block-table length)."""
        on_device = [s for s in self._seqs.values() if s.host_blocks is None]
        num_tokens = sum(s.num_tokens for s in on_device)
        p = self.pool
        return MemoryStats(
            num_blocks=p.num_usable, block_size=self.block_size, num_free_blocks=p.num_free - p.num_cached_free,
            num_cached_blocks=p.num_cached_free, num_used_blocks=p.num_used, num_unusable_blocks=0,
            peak_used_blocks=p.peak_used, num_tokens=num_tokens, tokens_stored=self._tokens_stored(on_device),
            num_host_blocks_used=self.num_host_blocks - len(self._host_free))

    def _tokens_stored(self, seqs: list[_Sequence]) -> int:
        """Slots holding a token, each shared block counted once (at its fullest use).

        Vectorised: the engine asks every step, and a dict per block took ~2 ms a step at
        256 sequences. With no block shared (prefix caching, forks and beams share them)
        each sequence's tokens fill slots of their own, and the sum is the answer.
        """
        if self.pool.num_refs == self.pool.num_used:
            return sum(min(s.num_tokens, len(s.blocks) * self.block_size) for s in seqs)
        bs = self.block_size
        nb = np.fromiter((len(s.blocks) for s in seqs), np.int64, len(seqs))
        if not nb.sum():
            return 0
        ids = np.fromiter((b.block_id for s in seqs for b in s.blocks), np.int64, int(nb.sum()))
        nth = np.arange(len(ids)) - np.repeat(np.cumsum(nb) - nb, nb)  # index of the block in its table
        fill = np.clip(np.repeat([s.num_tokens for s in seqs], nb) - nth * bs, 0, bs)
        order = np.argsort(ids, kind="stable")
        ids, fill = ids[order], fill[order]
        first = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])  # each distinct block's run
        return int(np.maximum.reduceat(fill, first).sum())

    def check_invariants(self) -> None:
        """Check the pool and every block table against each other; O(num_blocks).

        Raises:
          AssertionError: naming the first broken invariant.
        """
        bs = self.block_size
        refs = [0] * len(self.pool.blocks)
        host_refs = [0] * self.num_host_blocks
        for sid, s in self._seqs.items():
            invariant(0 <= s.num_computed_tokens <= s.num_tokens,
                      f"sequence {sid!r}: {s.num_computed_tokens} computed of {s.num_tokens} tokens")
            if s.host_blocks is not None:
                invariant(not s.blocks and len(s.host_blocks) == _cdiv(s.num_tokens, bs),
                          f"swapped sequence {sid!r}: {len(s.blocks)} device, {len(s.host_blocks)} host blocks")
                for h in s.host_blocks:
                    host_refs[h] += 1
                continue
            invariant(len(s.blocks) == _cdiv(s.num_tokens, bs),
                      f"sequence {sid!r}: {len(s.blocks)} blocks for {s.num_tokens} tokens")
            for i, b in enumerate(s.blocks):
                refs[b.block_id] += 1
                if b.block_hash is not None:  # a cached block holds exactly this sequence's tokens
                    invariant((i + 1) * bs <= s.num_computed_tokens,
                              f"sequence {sid!r} has cached block {b.block_id} at uncomputed positions")
                    invariant(i >= len(s.block_hashes) or s.block_hashes[i] == b.block_hash,
                              f"sequence {sid!r} holds block {b.block_id}, cached for other tokens")
        self.pool.check_invariants(refs)
        invariant(host_refs == self._host_refs, "host block reference counts disagree with the swapped tables")
        held = [h for h, n in enumerate(host_refs) if n]
        invariant(sorted(held + self._host_free) == list(range(self.num_host_blocks)), "host blocks leaked or held twice")

    # ---- internals ------------------------------------------------------------------

    def _get(self, seq_id: Hashable) -> _Sequence:
        s = self._seqs.get(seq_id)
        if s is None:
            raise KeyError(f"unknown sequence {seq_id!r}")
        return s

    def _on_device(self, seq_id: Hashable) -> _Sequence:
        s = self._get(seq_id)
        if s.host_blocks is not None:
            raise ValueError(f"sequence {seq_id!r} is swapped out; swap it in first")
        return s

    def _swapped(self, seq_id: Hashable) -> _Sequence:
        s = self._get(seq_id)
        if s.host_blocks is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        return s

    def _plan_admission(self, token_ids: Sequence[int], cache_salt: str | None, num_new_tokens: int | None,
                        final: bool):
        """Extra keys, prefix hits and their hashes, slots to reserve, free blocks taken."""
        self.check_fits(len(token_ids), final=final)
        if num_new_tokens is not None and num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens}; must be >= 0")
        extra = (self.model_id, cache_salt)
        hashes = self._prompt_hashes(token_ids, extra)
        # Only blocks inside the first len - 1 tokens may hit: the last token is always computed.
        hits = self.pool.find_cached_prefix(token_ids, hashes[:(len(token_ids) - 1) // self.block_size], extra)
        num_cached = len(hits) * self.block_size
        num_tokens = num_cached + min(len(token_ids) - num_cached, len(token_ids) if num_new_tokens is None
                                      else num_new_tokens)
        # A hit on a free cached block takes it off the free queue just like a new block.
        num_free_taken = _cdiv(num_tokens, self.block_size) - len(hits) + sum(b.ref_cnt == 0 for b in hits)
        return extra, hits, hashes, num_tokens, num_free_taken

    def _admissible(self, num_blocks_needed: int) -> bool:
        reserve = self.watermark_blocks if self.pool.num_used else 0
        return self.pool.num_free - num_blocks_needed >= reserve

    def _prompt_hashes(self, token_ids: Sequence[int], extra: tuple) -> list[bytes]:
        # Memoized for the last prompt: a request blocked at the head of the waiting queue
        # is asked about every step, and allocate() follows can_allocate() with the same one.
        if not self.enable_prefix_caching:
            return []
        n = len(token_ids) // self.block_size
        key = (tuple(token_ids[:n * self.block_size]), extra)
        if self._memo is None or self._memo[0] != key:
            self._memo = key, self.pool.hash_blocks(token_ids, n, extra)
        return self._memo[1]

    def _last_block_shared(self, s: _Sequence) -> bool:
        return s.num_tokens % self.block_size != 0 and s.blocks[-1].ref_cnt > 1

    def _blocks_to_append(self, s: _Sequence, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens={num_new_tokens}; must be >= 0")
        n = s.num_tokens + num_new_tokens
        if self.max_model_len is not None and n > self.max_model_len:
            raise ValueError(f"sequence would reach {n} tokens; max_model_len is {self.max_model_len}")
        cow = 1 if num_new_tokens and self._last_block_shared(s) else 0
        return _cdiv(n, self.block_size) - len(s.blocks) + cow
