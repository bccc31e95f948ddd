"""The device block pool: free queue, reference counts and the prefix cache.

A block is ``block_size`` token slots of every layer's K and V (see ``kv_cache.py``).
Block 0 is the null block: padding entries of block tables point at it, so it is never
handed out and belongs to none of the free / used / cached sets counted here.

Free queue: why a doubly linked list
------------------------------------
Every block with ``ref_cnt == 0`` sits in one doubly linked list, and each block
carries its own ``prev`` / ``next`` links (as vLLM v1's ``FreeKVCacheBlockQueue``):

- allocation pops the head, O(1);
- a prefix-cache hit on a free block that still holds a cached prefix unlinks it from
  the *middle*, O(1). A stack (LIFO) or a FIFO list serves allocate and free in O(1)
  as well, but cannot take a block out of the middle without an O(n) search;
- a freed block is linked back in O(1). A block holding a cached prefix goes to the
  tail, so the head side holds the least recently used cached blocks and eviction is
  LRU. A block without a hash holds nothing reusable and goes to the head, so it is
  reused (LIFO) before any cached block is evicted.

Prefix cache
------------
A full block whose K/V has been written is registered under
``hash_fn(parent_hash, token_ids, extra_keys)``: SHA-256 by default, chained through
the parent block's hash so one key stands for the whole prefix. A hit also compares
the block's :class:`BlockKey` (its tokens, the extra keys, and the identity of its
cached parent block), so even a hash function that always collides can only lower the
hit rate: it can never serve K/V computed for other tokens, another prefix or another
tenant. A block's ``generation`` is bumped whenever its cached content is dropped,
which turns the parent links of its former children stale.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from jaxpaged.padding import NULL_BLOCK

HashFn = Callable[[bytes | None, tuple[int, ...], tuple], bytes]


def sha256_block_hash(parent_hash: bytes | None, token_ids: Sequence[int], extra_keys: tuple) -> bytes:
    """SHA-256 of one full block: its parent block's hash, the extra keys, its token ids.

    Args:
      parent_hash: hash of the previous block of the sequence; ``None`` for the first block.
      token_ids: the ``block_size`` token ids the block holds.
      extra_keys: anything else the K/V depends on, e.g. ``(model_id, cache_salt)``;
        strings, bytes, ints and ``None`` (their ``repr`` is hashed).
    """
    h = hashlib.sha256(repr((parent_hash, extra_keys)).encode())
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockKey(NamedTuple):
    """What a cached block's K/V depends on; compared in full on every hit."""

    parent: tuple[int, int] | None  # (block_id, generation) of the cached parent; None: first block
    token_ids: tuple[int, ...]
    extra_keys: tuple


@dataclasses.dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0  # number of block-table entries pointing here
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache
    key: BlockKey | None = None  # set together with block_hash
    generation: int = 0  # bumped whenever the cached content is dropped
    prev: Block | None = dataclasses.field(default=None, repr=False)  # free-queue links
    next: Block | None = dataclasses.field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of the blocks with ``ref_cnt == 0``; every operation is O(1)."""

    def __init__(self, blocks: Iterable[Block]):
        self._head, self._tail = Block(-1), Block(-1)  # sentinels: no None checks in the links
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for b in blocks:
            self.append(b)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        b = self._head.next
        while b is not self._tail:
            yield b
            b = b.next

    def _link(self, block: Block, prev: Block, nxt: Block) -> None:
        block.prev, block.next = prev, nxt
        prev.next = nxt.prev = block
        self._len += 1

    def append(self, block: Block) -> None:
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: Block) -> None:
        self._link(block, self._head, self._head.next)

    def remove(self, block: Block) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> Block:
        if not self._len:
            raise IndexError("pop from an empty free queue")
        block = self._head.next
        self.remove(block)
        return block


def invariant(ok: bool, msg: str) -> None:
    """``assert`` that survives ``python -O``: invariant checks are an API, not debug code."""
    if not ok:
        raise AssertionError(msg)


@dataclasses.dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # of which served from the cache
    evictions: int = 0  # cached blocks whose content was dropped to reuse the block

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """A snapshot of the device pool; block counts exclude the null block."""

    num_blocks: int  # usable blocks: free + cached + used + unusable
    block_size: int
    num_free_blocks: int  # ref 0, holding nothing
    num_cached_blocks: int  # ref 0, holding a cached prefix: evictable
    num_used_blocks: int  # ref > 0
    num_unusable_blocks: int  # free, but too fragmented to hand out (contiguous baseline)
    peak_used_blocks: int
    num_tokens: int  # slots reserved by sequences on the device; a shared slot once per sequence
    tokens_stored: int  # distinct occupied slots: a shared slot once
    num_host_blocks_used: int = 0

    @property
    def slots_allocated(self) -> int:
        return self.num_used_blocks * self.block_size

    @property
    def utilization(self) -> float:
        """Occupied fraction of the allocated slots: 1 - internal fragmentation."""
        return self.tokens_stored / self.slots_allocated if self.slots_allocated else 1.0


class BlockPool:
    """``num_blocks`` device blocks: allocation, reference counts, the prefix cache.

    Knows nothing of sequences; :class:`~jaxpaged.block_manager.BlockManager` does.

    Args:
      num_blocks: blocks in the device pool, the null block 0 included.
      block_size: token slots per block.
      hash_fn: hash of one full block, chained over its parent's hash.
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = sha256_block_hash):
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks}; need at least 2 (block 0 is the null block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size}; must be >= 1")
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks[NULL_BLOCK + 1:])
        self.cached: dict[bytes, Block] = {}  # block hash -> the one block registered under it
        self.stats = PrefixCacheStats()
        self.num_used = 0  # blocks with ref_cnt > 0
        self.num_refs = 0  # sum of ref_cnt: num_used exactly when no block is shared
        self.num_cached_free = 0  # blocks with ref_cnt == 0 that hold a cached prefix
        self.peak_used = 0

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones plus evictable cached ones."""
        return len(self.free_queue)

    def allocate(self) -> Block:
        """Take the head of the free queue (evicting its cached prefix, if any); ref = 1."""
        if not self.free_queue:
            raise RuntimeError(f"out of KV blocks: all {self.num_usable} are in use")
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            self._evict(block)
        block.ref_cnt = 1
        self.num_refs += 1
        self._count_used()
        return block

    def share(self, block: Block) -> None:
        """ref + 1; a free cached block (a prefix hit) leaves the free queue."""
        if block.ref_cnt == 0:
            if block.block_hash is None:
                raise RuntimeError(f"block {block.block_id} is free and caches nothing; allocate it instead")
            self.free_queue.remove(block)
            self.num_cached_free -= 1
            self._count_used()
        block.ref_cnt += 1
        self.num_refs += 1

    def free(self, block: Block) -> None:
        """ref - 1; at zero a cached block joins the LRU tail, any other the head."""
        if block.ref_cnt <= 0:
            raise RuntimeError(f"block {block.block_id} freed with ref_cnt={block.ref_cnt}")
        block.ref_cnt -= 1
        self.num_refs -= 1
        if block.ref_cnt == 0:
            self.num_used -= 1
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)
                self.num_cached_free += 1

    def lookup(self, block_hash: bytes, key: BlockKey) -> Block | None:
        """The block cached under ``block_hash`` if its key matches in full, else ``None``."""
        block = self.cached.get(block_hash)
        return block if block is not None and block.key == key else None

    def hash_blocks(self, token_ids: Sequence[int], num_blocks: int, extra_keys: tuple,
                    parent_hash: bytes | None = None, first: int = 0) -> list[bytes]:
        """Chained hashes of full blocks ``first .. first + num_blocks - 1`` of ``token_ids``."""
        bs, hashes = self.block_size, []
        for i in range(first, first + num_blocks):
            parent_hash = self.hash_fn(parent_hash, tuple(token_ids[i * bs:(i + 1) * bs]), extra_keys)
            hashes.append(parent_hash)
        return hashes

    def find_cached_prefix(self, token_ids: Sequence[int], block_hashes: Sequence[bytes],
                           extra_keys: tuple) -> list[Block]:
        """The cached blocks holding the first full blocks of ``token_ids``.

        Looks up one block per hash in ``block_hashes`` (from ``hash_blocks``) and stops
        at the first miss; every hit is verified against its full :class:`BlockKey`.
        Nothing is shared or counted: the caller decides.
        """
        bs, parent = self.block_size, None
        hits: list[Block] = []
        for i, h in enumerate(block_hashes):
            block = self.lookup(h, BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs]), extra_keys))
            if block is None:
                break
            hits.append(block)
            parent = (block.block_id, block.generation)
        return hits

    def cache(self, block: Block, block_hash: bytes, key: BlockKey) -> Block | None:
        """Register a full, computed block under ``block_hash``.

        Returns:
          The block now cached for ``key``: ``block`` itself, or an earlier block with the
          same content (``block`` then stays unregistered and is freed normally). ``None``
          when the hash is taken by a different key (a collision): nothing is registered.
        """
        existing = self.cached.get(block_hash)
        if existing is not None:
            return existing if existing.key == key else None
        if block.block_hash is not None:  # already registered under another hash
            return block if block.key == key else None
        block.block_hash, block.key = block_hash, key
        self.cached[block_hash] = block
        return block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's, for when the weights changed): the cached blocks
        become plain free ones. False, and nothing forgotten, while any block is in use."""
        if self.num_used:
            return False
        for block in self.cached.values():
            block.block_hash = block.key = None
            block.generation += 1
        self.cached.clear()
        self.num_cached_free = 0
        return True

    def check_invariants(self, refs: Sequence[int]) -> None:
        """Check the pool against ``refs[block_id]``: block-table entries counted by the caller.

        Every usable block is exactly one of free, cached (both ref 0, in the free queue)
        or used (ref > 0, equal to its references); the cache maps each hash to the one
        block carrying it; the counters agree.

        Raises:
          AssertionError: naming the first broken invariant.
        """
        null = self.blocks[NULL_BLOCK]
        invariant(refs[NULL_BLOCK] == 0 and null.ref_cnt == 0 and null.block_hash is None, "null block handed out")
        queued = set()
        for b in self.free_queue:
            invariant(b.next.prev is b and b.block_id not in queued, f"free queue broken at block {b.block_id}")
            queued.add(b.block_id)
        invariant(len(queued) == len(self.free_queue) and NULL_BLOCK not in queued, "free queue length")
        used = cached = 0
        for b in self.blocks[NULL_BLOCK + 1:]:
            invariant(b.ref_cnt == refs[b.block_id],
                      f"block {b.block_id}: ref_cnt {b.ref_cnt}, {refs[b.block_id]} block-table references")
            invariant((b.ref_cnt == 0) == (b.block_id in queued),
                      f"block {b.block_id} with ref_cnt {b.ref_cnt}: in free queue is {b.block_id in queued}")
            used += b.ref_cnt > 0
            if b.block_hash is not None:
                invariant(self.cached.get(b.block_hash) is b and len(b.key.token_ids) == self.block_size,
                          f"block {b.block_id} has a hash the cache does not map to it")
                cached += b.ref_cnt == 0
        invariant(all(b.block_hash == h for h, b in self.cached.items()), "a cache entry's block has another hash")
        free = len(self.free_queue) - cached
        invariant(self.num_refs == sum(b.ref_cnt for b in self.blocks), f"num_refs {self.num_refs}")
        invariant(used == self.num_used and cached == self.num_cached_free and free + used + cached
                  == self.num_usable and self.peak_used >= used, f"counts: used {used} ({self.num_used}), cached "
                  f"{cached} ({self.num_cached_free}), free {free}, usable {self.num_usable}")

    def _evict(self, block: Block) -> None:
        del self.cached[block.block_hash]
        block.block_hash = block.key = None
        block.generation += 1
        self.num_cached_free -= 1
        self.stats.evictions += 1

    def _count_used(self) -> None:
        self.num_used += 1
        if self.num_used > self.peak_used:
            self.peak_used = self.num_used
