"""The host block manager: pool, block tables, copy-on-write, prefix cache, swap, accounting.

No jax here: the manager is pure Python, and so are these tests. Small blocks (4 slots)
make sequences span several blocks with few tokens.
"""

import hashlib
import inspect
import itertools
import pathlib
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jaxpaged.block_manager import NULL_BLOCK, BlockManager, SwapSpaceFull
from jaxpaged.block_pool import BlockKey, BlockPool, FreeBlockQueue, sha256_block_hash
from jaxpaged.contiguous import ContiguousBlockManager

BS = 4


def computed(bm, sid, token_ids, num_new_tokens=None, **kw):
    """Admit a prompt and pretend the device wrote its K/V; returns num_cached_tokens."""
    cached = bm.allocate(sid, token_ids, num_new_tokens=num_new_tokens, **kw)
    bm.mark_computed(sid, bm.num_tokens(sid), token_ids)
    return cached


def decode(bm, sid, token_ids):
    """Append the last token of ``token_ids`` and compute it; returns the copies."""
    copies = bm.append_slots(sid, 1)
    bm.mark_computed(sid, len(token_ids), token_ids)
    return copies


# ---- pool and free queue ----------------------------------------------------------------

def test_bookkeeping_modules_import_no_jax():
    """block_pool, block_manager and contiguous import no jax themselves.

    The package ``__init__`` is bypassed (an empty stand-in package), so this checks
    these modules' own imports whatever the package re-exports.
    """
    pkg_dir = str(pathlib.Path(__file__).resolve().parents[1] / "jaxpaged")
    code = ("import sys, types; pkg = types.ModuleType('jaxpaged'); pkg.__path__ = [sys.argv[1]]; "
            "sys.modules['jaxpaged'] = pkg; import jaxpaged.block_manager, jaxpaged.contiguous; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code, pkg_dir], check=True)


def test_free_queue_pops_head_and_removes_from_the_middle():
    pool = BlockPool(6, BS)
    q = pool.free_queue
    assert [b.block_id for b in q] == [1, 2, 3, 4, 5]
    q.remove(pool.blocks[3])
    q.appendleft(pool.blocks[3])
    q.append(q.popleft())
    assert [b.block_id for b in q] == [1, 2, 4, 5, 3] and len(q) == 5
    with pytest.raises(IndexError):
        FreeBlockQueue([]).popleft()


def test_null_block_is_never_handed_out():
    bm = BlockManager(9, BS, watermark=0)
    computed(bm, "a", list(range(31)))  # 8 blocks: the whole usable pool
    assert NULL_BLOCK not in bm.block_table("a") and sorted(bm.block_table("a")) == list(range(1, 9))
    assert bm.num_allocatable_blocks == 0 and not bm.can_append_slots("a", 2)
    with pytest.raises(RuntimeError, match="needs 1 new blocks; 0 are free"):
        bm.append_slots("a", 2)
    bm.check_invariants()


def test_pool_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError, match="num_blocks=1; need at least 2"):
        BlockManager(1, BS)


# ---- block tables -------------------------------------------------------------------------

def test_prompt_takes_ceil_blocks_and_decode_grows_only_when_the_last_block_is_full():
    bm = BlockManager(16, BS)
    toks = list(range(10))
    assert computed(bm, 0, toks) == 0
    assert len(bm.block_table(0)) == 3 and bm.num_tokens(0) == 10
    for n, blocks in [(11, 3), (12, 3), (13, 4)]:
        toks.append(n)
        assert decode(bm, 0, toks) == []
        assert len(bm.block_table(0)) == blocks and bm.num_computed_tokens(0) == n
    bm.check_invariants()


def test_slots_address_block_times_block_size_plus_offset():
    bm = BlockManager(16, BS)
    computed(bm, "s", list(range(7)))
    t = bm.block_table("s")
    assert [bm.slot("s", p) for p in range(7)] == [t[p // BS] * BS + p % BS for p in range(7)]
    assert bm.slot_mapping("s", 2, 7).tolist() == [bm.slot("s", p) for p in range(2, 7)]
    assert bm.slot_mapping("s", 5, 5).tolist() == []
    with pytest.raises(IndexError, match="position 7 of sequence 's'; it has 7 slots"):
        bm.slot("s", 7)


def test_chunked_prefill_reserves_one_chunk_at_a_time():
    bm = BlockManager(16, BS)
    prompt = list(range(11))
    assert bm.allocate(1, prompt, num_new_tokens=5) == 0
    assert bm.num_tokens(1) == 5 and len(bm.block_table(1)) == 2
    bm.mark_computed(1, 5, prompt)
    assert bm.can_append_slots(1, 6) and bm.append_slots(1, 6) == []
    bm.mark_computed(1, 11, prompt)
    assert len(bm.block_table(1)) == 3 and bm.num_computed_tokens(1) == 11
    with pytest.raises(ValueError, match=r"num_computed_tokens=12 for sequence 1; must be in \[11, 11\]"):
        bm.mark_computed(1, 12, prompt + [0])
    bm.check_invariants()


def test_errors_name_the_sequence():
    bm = BlockManager(16, BS)
    computed(bm, "a", [1, 2])
    with pytest.raises(ValueError, match="sequence 'a' is already allocated"):
        bm.allocate("a", [1])
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        bm.free("zz")
    with pytest.raises(ValueError, match="prompt is empty"):
        bm.allocate("e", [])


# ---- reference counts, fork, copy-on-write ------------------------------------------------

def test_mid_block_copy_on_write():
    bm = BlockManager(16, BS)
    toks = list(range(6))  # blocks [full, 2 of 4]
    computed(bm, "p", toks)
    assert bm.fork("p", "c") == []
    shared_full, shared_last = bm.block_table("p")
    assert bm.block_table("c") == [shared_full, shared_last]
    assert bm.pool.blocks[shared_last].ref_cnt == 2
    copies = decode(bm, "p", toks + [100])  # parent writes position 6 into the shared block
    new_last = bm.block_table("p")[1]
    assert copies == [(shared_last, new_last)] and new_last != shared_last
    assert bm.block_table("c") == [shared_full, shared_last]  # the child keeps the original
    assert bm.pool.blocks[shared_last].ref_cnt == 1 and bm.pool.blocks[shared_full].ref_cnt == 2
    assert decode(bm, "c", toks + [200]) == []  # now private to the child: written in place
    assert bm.block_table("c") == [shared_full, shared_last]
    bm.check_invariants()


def test_no_copy_when_the_shared_last_block_is_full():
    bm = BlockManager(16, BS)
    toks = list(range(8))
    computed(bm, "p", toks)
    bm.fork("p", "c")
    assert decode(bm, "p", toks + [1]) == [] and decode(bm, "c", toks + [2]) == []
    assert bm.block_table("p")[:2] == bm.block_table("c")[:2]
    assert bm.block_table("p")[2] != bm.block_table("c")[2]


def test_fork_of_a_fork():
    bm = BlockManager(16, BS)
    toks = list(range(5))
    computed(bm, "a", toks)
    bm.fork("a", "b")
    bm.fork("b", "c")
    first, last = bm.block_table("a")
    assert bm.pool.blocks[first].ref_cnt == 3 and bm.pool.blocks[last].ref_cnt == 3
    (src_b, dst_b), = decode(bm, "b", toks + [7])
    (src_c, dst_c), = decode(bm, "c", toks + [8])
    assert src_b == src_c == last and len({dst_b, dst_c, last}) == 3
    assert decode(bm, "a", toks + [9]) == []  # the last holder writes in place
    assert {bm.block_table(s)[0] for s in "abc"} == {first}
    bm.check_invariants()


@pytest.mark.parametrize("order", list(itertools.permutations("abc")))
def test_freeing_in_any_order_leaks_nothing(order):
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    toks = list(range(6))
    computed(bm, "a", toks)
    bm.fork("a", "b")
    decode(bm, "b", toks + [1])
    bm.fork("b", "c")
    decode(bm, "a", toks + [2])
    for s in order:
        bm.free(s)
        bm.check_invariants()
    assert bm.stats().num_used_blocks == 0 and bm.num_allocatable_blocks == 15


# ---- prefix cache -------------------------------------------------------------------------

def test_prefix_hits_on_partial_prompts():
    bm = BlockManager(32, BS)
    base = list(range(100, 111))  # 11 tokens: blocks [0:4], [4:8] full, [8:11] partial
    assert computed(bm, "base", base) == 0
    assert computed(bm, 1, base[:9] + [0, 0]) == 8  # diverges inside block 2
    assert computed(bm, 2, base[:6]) == 4  # diverges inside block 1
    assert computed(bm, 3, base[:8]) == 4  # fully cached: the last block is recomputed
    assert computed(bm, 4, base[:9]) == 8
    assert computed(bm, 5, base[:3]) == 0  # no full block
    assert computed(bm, 6, [0] + base[1:]) == 0  # the first block differs
    assert bm.block_table(1)[:2] == bm.block_table("base")[:2]
    assert bm.block_table(3)[1] != bm.block_table("base")[1]
    s = bm.prefix_cache_stats
    assert (s.queries, s.hits) == (11 + 11 + 6 + 8 + 9 + 3 + 11, 8 + 4 + 4 + 8)
    assert s.hit_rate == pytest.approx(24 / 59)
    bm.check_invariants()


def test_blocks_are_cached_only_once_their_kv_is_written():
    bm = BlockManager(32, BS)
    prompt = list(range(9))
    bm.allocate("a", prompt)  # slots reserved, K/V not yet written
    assert bm.allocate("b", prompt) == 0
    bm.mark_computed("a", 5, prompt)  # one full block written
    assert bm.allocate("c", prompt) == 4
    bm.check_invariants()


def test_decode_blocks_are_cached_too():
    bm = BlockManager(32, BS)
    toks = [1, 2, 3]
    computed(bm, "a", toks)
    for t in (4, 5, 6):
        toks.append(t)
        decode(bm, "a", toks)
    assert computed(bm, "b", toks + [9]) == 4


def test_sequences_with_the_same_prompt_cache_their_own_decoded_blocks():
    bm = BlockManager(32, BS)
    prompt = [1, 2, 3, 4, 5, 6]
    computed(bm, "a", prompt)
    assert computed(bm, "b", prompt) == 4
    a, b = prompt + [7, 8], prompt + [9, 9]
    for t in range(6, 8):
        decode(bm, "a", a[:t + 1])
        decode(bm, "b", b[:t + 1])
    assert computed(bm, "a2", a + [0]) == 8 and computed(bm, "b2", b + [0]) == 8
    bm.check_invariants()


def test_released_blocks_stay_cached_until_evicted():
    bm = BlockManager(32, BS)
    prompt = list(range(9))
    computed(bm, "a", prompt)
    bm.free("a")
    st_ = bm.stats()
    assert (st_.num_cached_blocks, st_.num_free_blocks, st_.num_used_blocks) == (2, 29, 0)
    assert computed(bm, "b", prompt) == 8
    assert bm.stats().num_cached_blocks == 0
    bm.check_invariants()


def test_reset_prefix_cache_forgets_the_cached_blocks_once_none_is_in_use():
    bm = BlockManager(32, BS)
    prompt, other = list(range(9)), list(range(50, 59))
    computed(bm, "a", prompt)
    computed(bm, "b", other)
    bm.free("a")
    assert not bm.reset_prefix_cache()  # "b" holds blocks: nothing forgotten
    assert computed(bm, "a2", prompt) == 8
    bm.free("a2")
    bm.free("b")
    assert bm.stats().num_cached_blocks == 4 and bm.reset_prefix_cache()
    st_ = bm.stats()
    assert (st_.num_cached_blocks, st_.num_free_blocks, st_.num_used_blocks) == (0, 31, 0)
    bm.check_invariants()
    assert computed(bm, "c", prompt) == 0 and computed(bm, "d", other) == 0  # no hit: recomputed
    bm.check_invariants()
    assert ContiguousBlockManager(8, BS, max_model_len=16).reset_prefix_cache()


def test_eviction_is_lru_tail_first_after_free_blocks_are_used_up():
    bm = BlockManager(9, BS, watermark=0)  # 8 usable blocks
    a, b = list(range(100, 113)), list(range(200, 213))  # 4 blocks each, the first 3 full and cached
    computed(bm, "a", a)
    computed(bm, "b", b)
    a_blocks, b_blocks = bm.block_table("a"), bm.block_table("b")
    bm.free("a")  # a first: least recently used
    bm.free("b")
    evicted = []
    for i in range(8):
        sid = f"x{i}"
        computed(bm, sid, [i] * 3)
        evicted.append(bm.block_table(sid)[0])
    # Uncached blocks go first (last freed first), then a's chain tail first, then b's.
    assert evicted == [b_blocks[3], a_blocks[3], a_blocks[2], a_blocks[1], a_blocks[0],
                       b_blocks[2], b_blocks[1], b_blocks[0]]
    assert bm.prefix_cache_stats.evictions == 6
    bm.check_invariants()


def test_a_hit_moves_a_block_out_of_lru_order():
    bm = BlockManager(9, BS, watermark=0)
    a, b = list(range(100, 105)), list(range(200, 205))
    computed(bm, "a", a)
    computed(bm, "b", b)
    bm.free("a")
    bm.free("b")
    assert computed(bm, "a2", a) == 4  # a's cached block leaves the free queue...
    bm.free("a2")  # ...and comes back as most recently used
    (b_first,) = [blk for blk in bm.pool.cached.values() if blk.key.token_ids == tuple(b[:4])]
    for i in range(7):  # 6 uncached free blocks, then one eviction
        computed(bm, i, [i])
    assert b_first.block_hash is None  # b was used less recently than a
    assert len(bm.pool.find_cached_prefix(a, bm.pool.hash_blocks(a, 1, ("", None)), ("", None))) == 1


def test_salts_isolate_tenants():
    bm = BlockManager(32, BS)
    prompt = list(range(13))
    computed(bm, "t1", prompt, cache_salt="tenant-1")
    assert computed(bm, "t2", prompt, cache_salt="tenant-2") == 0
    assert computed(bm, "anon", prompt) == 0
    assert computed(bm, "t1-again", prompt, cache_salt="tenant-1") == 12
    assert computed(bm, "t2-again", prompt, cache_salt="tenant-2") == 12  # each tenant has its own copy
    bm.check_invariants()


def test_block_hash_is_sha256_chained_over_parent_tokens_and_extra_keys():
    h0 = sha256_block_hash(None, (1, 2, 3, 4), ("m", None))
    assert len(h0) == 32 and h0 == sha256_block_hash(None, [1, 2, 3, 4], ("m", None))
    variants = [sha256_block_hash(h0, (1, 2, 3, 4), ("m", None)), sha256_block_hash(None, (1, 2, 3, 5), ("m", None)),
                sha256_block_hash(None, (1, 2, 3, 4), ("m", "salt")), sha256_block_hash(None, (1, 2, 3, 4), ("n", None))]
    assert len({h0, *variants}) == 5


def test_prefix_caching_can_be_disabled():
    bm = BlockManager(32, BS, enable_prefix_caching=False)
    computed(bm, "a", list(range(9)))
    assert computed(bm, "b", list(range(9))) == 0 and not bm.pool.cached
    assert bm.prefix_cache_stats.queries == 0


# ---- colliding hashes ---------------------------------------------------------------------

def always_collide(parent_hash, token_ids, extra_keys):
    return b"x"


def ignore_parent(parent_hash, token_ids, extra_keys):
    return hashlib.sha256(repr((tuple(token_ids), extra_keys)).encode()).digest()


def test_always_colliding_hash_never_serves_other_tokens():
    bm = BlockManager(64, BS, hash_fn=always_collide)
    a = list(range(100, 113))
    computed(bm, "a", a)
    assert computed(bm, "b", list(range(200, 213))) == 0  # same hash, other tokens: a miss
    assert computed(bm, "c", a) == 4  # one entry per hash: only a's first block is registered
    assert computed(bm, "d", a[:4] + list(range(300, 309))) == 4
    assert computed(bm, "e", a, cache_salt="s") == 0
    bm.check_invariants()


def test_a_block_with_the_same_tokens_after_another_prefix_is_a_miss():
    """The hash ignores the parent, so only the parent check tells the two blocks apart."""
    bm = BlockManager(64, BS, hash_fn=ignore_parent)
    x, w, y = [1] * 4, [2] * 4, [3] * 4
    computed(bm, "xy", x + y + [0])  # registers X, then Y after X
    computed(bm, "wy", w + y + [0])  # registers W; its Y collides with X's Y and is left out
    assert computed(bm, "probe", w + y + [5]) == 4  # W hits; Y-after-X must not be served
    assert bm.block_table("probe")[1] != bm.block_table("xy")[1]
    assert computed(bm, "probe2", x + y + [5]) == 8
    bm.check_invariants()


def test_evicting_a_parent_invalidates_its_cached_children():
    pool = BlockPool(4, BS)  # 3 usable blocks
    x, y = pool.allocate(), pool.allocate()
    hx = pool.hash_fn(None, (1,) * 4, ())
    hy = pool.hash_fn(hx, (2,) * 4, ())
    assert pool.cache(x, hx, BlockKey(None, (1,) * 4, ())) is x
    assert pool.cache(y, hy, BlockKey((x.block_id, x.generation), (2,) * 4, ())) is y
    toks = [1] * 4 + [2] * 4
    assert pool.find_cached_prefix(toks, [hx, hy], ()) == [x, y]
    pool.free(x)  # y stays in use; x is the only cached free block
    pool.allocate()  # the uncached free block
    assert pool.allocate() is x and x.generation == 1  # evicted and reused
    assert pool.cache(x, hx, BlockKey(None, (1,) * 4, ())) is x  # same tokens again, new content
    assert pool.find_cached_prefix(toks, [hx, hy], ()) == [x]  # y's parent link names x's previous generation


# ---- admission and watermark --------------------------------------------------------------

def test_request_that_can_never_fit_is_rejected_with_the_numbers():
    bm = BlockManager(9, BS)  # 8 usable blocks = 32 slots
    with pytest.raises(ValueError, match="prompt has 32 tokens; with one generated token it needs 9 blocks of 4 "
                                         "slots, but the pool has 8 usable blocks"):
        bm.can_allocate(list(range(32)))
    with pytest.raises(ValueError, match="needs 9 blocks"):
        bm.allocate("big", list(range(32)))
    assert bm.can_allocate(list(range(31)))  # fits exactly: admitted on an empty pool
    bm.check_fits(31)
    with pytest.raises(ValueError, match="prompt has 32 tokens"):
        bm.check_fits(32)  # at submission, before any scheduling
    # n sequences share the prompt's full blocks and need one block each for what follows.
    bm.check_fits(28, num_seqs=1)
    bm.check_fits(23, num_seqs=3)  # 5 shared + 3 = 8 blocks
    with pytest.raises(ValueError, match="prompt has 24 tokens; with one generated token in 3 sequences it needs "
                                         "9 blocks of 4 slots, but the pool has 8 usable blocks"):
        bm.check_fits(24, num_seqs=3)
    with pytest.raises(ValueError, match="3 sequences need 3 regions of 32 slots; the pool has 2"):
        ContiguousBlockManager(17, BS, max_model_len=32).check_fits(4, num_seqs=3)
    # final: they sample their last token from these tokens, so need no slot past them.
    assert bm.can_allocate(list(range(32)), final=True)
    with pytest.raises(ValueError, match="prompt has 33 tokens; it needs 9 blocks of 4 slots"):
        bm.check_fits(33, final=True)
    bm.check_fits(24, num_seqs=3, final=True)  # 5 shared (each one's last token in its own) + 3 = 8
    with pytest.raises(ValueError, match="prompt has 25 tokens; in 3 sequences it needs 9 blocks"):
        bm.check_fits(25, num_seqs=3, final=True)
    assert bm.allocate("whole", list(range(32)), final=True) == 0 and bm.pool.num_free == 0
    bm = BlockManager(64, BS, max_model_len=20)
    with pytest.raises(ValueError, match="prompt has 20 tokens; with one generated token that exceeds "
                                         "max_model_len=20"):
        bm.can_allocate(list(range(20)))
    computed(bm, "a", list(range(19)))
    decode(bm, "a", list(range(20)))
    with pytest.raises(ValueError, match="sequence would reach 21 tokens; max_model_len is 20"):
        bm.can_append_slots("a")


def test_watermark_keeps_blocks_free_for_running_sequences():
    bm = BlockManager(21, BS, watermark=0.1)  # 20 usable, watermark 2
    assert bm.watermark_blocks == 2
    computed(bm, "run", list(range(16)))  # 4 blocks, 16 free
    assert bm.can_allocate(list(range(100, 156)))  # 14 blocks leave 2
    assert not bm.can_allocate(list(range(100, 157)))  # 15 would leave 1
    computed(bm, "big", list(range(100, 156)))
    assert bm.can_append_slots("run", 8)  # running sequences may use the watermark
    assert not bm.can_allocate([1])
    assert BlockManager(101, BS).watermark_blocks == 1  # default: 1% of the pool


def test_watermark_is_waived_on_an_empty_pool():
    bm = BlockManager(21, BS, watermark=0.5)
    assert bm.can_allocate(list(range(79)))  # 20 blocks: all of them, no one to reserve for
    computed(bm, "a", [1])
    assert not bm.can_allocate(list(range(44)))


def test_can_allocate_counts_prefix_hits_and_evictable_hits():
    bm = BlockManager(9, BS, watermark=0)  # 8 usable blocks
    prompt = list(range(24))  # 6 blocks; the first 5 can hit
    computed(bm, "a", prompt[:21])  # 6 blocks, the 5 full ones cached; 2 free
    assert bm.can_allocate(prompt)  # shares 5 blocks, needs 1 new
    assert not bm.can_allocate(list(range(100, 124)))  # needs 6 new
    bm.free("a")  # its 5 cached blocks are now free, but a hit takes them off the free queue
    computed(bm, "x", list(range(200, 208)))  # 2 blocks: 6 left, 5 of them a's cached blocks
    assert bm.can_allocate(prompt)  # 5 evictable hits + 1 new = 6
    computed(bm, "y", [7])
    assert not bm.can_allocate(prompt)  # 6 > 5, though only 1 block is new
    bm.free("y")
    assert computed(bm, "b", prompt) == 20
    assert bm.prefix_cache_stats.queries == 21 + 8 + 1 + 24  # can_allocate counts nothing
    bm.check_invariants()


# ---- swap space ---------------------------------------------------------------------------

def test_swap_round_trip():
    bm = BlockManager(16, BS, swap_space=4 * 1024, block_bytes=1024)
    assert bm.num_host_blocks == bm.num_free_host_blocks == 4
    toks = list(range(10))
    computed(bm, "s", toks)
    dev = bm.block_table("s")
    assert bm.can_swap_out("s")
    out = bm.swap_out("s")
    assert [d for d, _ in out] == dev and len({h for _, h in out}) == 3
    assert bm.is_swapped("s") and bm.stats().num_used_blocks == 0 and bm.stats().num_host_blocks_used == 3
    with pytest.raises(ValueError, match="sequence 's' is swapped out; swap it in first"):
        bm.append_slots("s")
    assert bm.can_swap_in("s")
    back = bm.swap_in("s")
    assert [h for h, _ in back] == [h for _, h in out] and [d for _, d in back] == bm.block_table("s")
    assert not bm.is_swapped("s") and bm.num_computed_tokens("s") == 10
    assert bm.stats().num_host_blocks_used == 0
    assert decode(bm, "s", toks + [10]) == []
    bm.check_invariants()


def test_swapping_out_a_fork_leaves_the_sibling_its_blocks():
    bm = BlockManager(16, BS, swap_space=8, block_bytes=1)
    computed(bm, "a", list(range(6)))
    bm.fork("a", "b")
    bm.swap_out("a")
    assert all(bm.pool.blocks[b].ref_cnt == 1 for b in bm.block_table("b"))
    bm.swap_in("a")
    assert not set(bm.block_table("a")) & set(bm.block_table("b"))
    bm.free("b")
    bm.free("a")
    bm.check_invariants()


def test_forks_swapped_together_keep_sharing_their_blocks():
    """A request's samples swap out as one group: a block they share is copied once, to one
    host block, and comes back as one device block they share again (copy-on-write as before)."""
    bm = BlockManager(16, BS, swap_space=8, block_bytes=1)
    toks = list(range(10))  # 2 full blocks and a partly filled one
    computed(bm, "a", toks)
    bm.fork("a", "b")
    bm.fork("a", "c")
    assert decode(bm, "a", toks + [7]) and decode(bm, "b", toks + [8])  # both copy the shared last block
    assert bm.can_swap_out("a", "b", "c")
    out = bm.swap_out("a", "b", "c")
    assert len(out) == 5 and bm.stats().num_host_blocks_used == 5  # 2 shared + a's, b's, c's own last
    ha, hb, hc = (bm.host_block_table(s) for s in "abc")
    assert ha[:2] == hb[:2] == hc[:2] and len({ha[2], hb[2], hc[2]}) == 3
    assert bm.swap_in_blocks(["a", "b", "c"]) == 5
    back = bm.swap_in("a", "b", "c")
    assert sorted(h for h, _ in back) == sorted(h for _, h in out) and bm.stats().num_host_blocks_used == 0
    ta, tb, tc = (bm.block_table(s) for s in "abc")
    assert ta[:2] == tb[:2] == tc[:2] and all(bm.pool.blocks[b].ref_cnt == 3 for b in ta[:2])
    bm.check_invariants()
    # Swapped out apart, each takes its own copy of what they share (and comes back unshared).
    assert bm.can_swap_out("a") and len(bm.swap_out("a")) == 3 and len(bm.swap_out("b", "c")) == 4
    assert bm.swap_in_blocks(["b", "c"], [1, 0]) == 4 + 0  # b's last block is its own: no copy
    bm.swap_in("b", "c")
    bm.check_invariants()
    for s in "abc":
        bm.free(s)
    assert bm.stats().num_used_blocks == 0 and bm.stats().num_host_blocks_used == 0
    bm.check_invariants()


def test_swap_in_counts_the_copy_of_a_shared_last_block():
    bm = BlockManager(16, BS, swap_space=8, block_bytes=1)
    toks = list(range(6))  # one full block and a shared, partly filled one
    computed(bm, "a", toks)
    for child in "bcd":
        bm.fork("a", child)
    bm.swap_out("a", "b", "c", "d")
    assert bm.stats().num_host_blocks_used == 2
    # Three of the four write into the shared last block: each copies it (the last holder
    # would write in place), and one of them needs a new block too.
    assert bm.swap_in_blocks(list("abcd"), [1, 1, 3, 0]) == 2 + 3 + 1
    assert bm.swap_in_blocks(list("abcd"), [1, 1, 1, 1]) == 2 + 3
    bm.swap_in(*"abcd")
    free = bm.pool.num_free
    copies = [c for s, n in zip("abcd", [1, 1, 3, 0]) if n for c in bm.append_slots(s, n)]
    assert len(copies) == 3 and free - bm.pool.num_free == 4
    bm.check_invariants()


def test_fork_prefix_shares_whole_blocks_then_takes_the_childs_own_cached_blocks():
    """How a preempted sample comes back: the first sample's whole prompt blocks, then the
    blocks of its own output that the prefix cache still holds (not the first sample's)."""
    bm = BlockManager(32, BS)
    prompt = list(range(10))  # 2 whole blocks and 2 tokens
    mine, theirs = prompt + [50, 51, 52, 53, 54, 55, 56], prompt + [60, 61, 62, 63, 64, 65, 66]
    computed(bm, "old", mine)  # the sample before its preemption: its blocks stay cached
    bm.free("old")
    computed(bm, "root", theirs[:12])
    root = bm.block_table("root")
    n, copies = bm.fork_prefix("root", "child", 8, mine)
    assert copies == [] and n == 16  # blocks 0-1 shared, block 2 ([8, 9, 50, 51]) and 3 its own, cached
    table = bm.block_table("child")
    assert table[:2] == root[:2] and table[2] != root[2] and bm.num_computed_tokens("child") == 16
    assert all(bm.pool.blocks[b].ref_cnt == 2 for b in root[:2])
    assert bm.append_slots("child", 1) == []  # its last token, in a block of its own
    bm.mark_computed("child", 17, mine)
    bm.check_invariants()
    with pytest.raises(ValueError, match="multiple of 4"):
        bm.fork_prefix("root", "c2", 6, mine)
    with pytest.raises(ValueError, match="before the child's last token"):
        bm.fork_prefix("root", "c2", 8, mine[:8])
    # Prefix caching off: the whole blocks only.
    off = BlockManager(32, BS, enable_prefix_caching=False)
    computed(off, "root", theirs[:12])
    assert off.fork_prefix("root", "child", 8, mine) == (8, [])
    # The contiguous baseline copies the parent's blocks into a region of the child's.
    cb = ContiguousBlockManager(17, BS, max_model_len=32)
    computed(cb, "root", theirs[:12])
    assert cb.fork_prefix("root", "child", 8, mine) == (8, [(1, 9), (2, 10)])
    assert cb.num_tokens("child") == 8 and cb.block_table("child") == [9, 10]


def test_host_pool_full_means_recompute():
    bm = BlockManager(16, BS, swap_space=2 * 64, block_bytes=64)
    computed(bm, "s", list(range(9)))  # 3 blocks, 2 host blocks
    assert not bm.can_swap_out("s")
    with pytest.raises(SwapSpaceFull, match="needs 3 host blocks; 2 of 2 are free. Preempt it by recompute"):
        bm.swap_out("s")
    bm.free("s")  # recompute: its full blocks stay cached, so re-admission is cheap
    assert computed(bm, "s", list(range(9))) == 8
    no_swap = BlockManager(16, BS)
    computed(no_swap, "s", [1])
    assert not no_swap.can_swap_out("s")


def test_swap_in_respects_the_watermark():
    bm = BlockManager(11, BS, watermark=0.2, swap_space=8, block_bytes=1)  # 10 usable, watermark 2
    computed(bm, "a", list(range(8)))
    bm.swap_out("a")
    computed(bm, "b", list(range(20, 46)))  # 7 blocks: 3 free
    assert not bm.can_swap_in("a")  # 2 blocks would leave 1
    bm.free("b")
    assert bm.can_swap_in("a")


# ---- accounting and the contiguous baseline ------------------------------------------------

def test_stats_count_stored_tokens_against_allocated_slots():
    bm = BlockManager(16, BS)
    computed(bm, "a", list(range(6)))
    bm.fork("a", "b")
    s = bm.stats()
    assert (s.num_used_blocks, s.slots_allocated, s.num_tokens, s.tokens_stored) == (2, 8, 12, 6)
    assert s.utilization == pytest.approx(0.75)
    assert s.num_free_blocks + s.num_cached_blocks + s.num_used_blocks == s.num_blocks == 15
    bm.free("a")
    bm.free("b")
    assert bm.stats().peak_used_blocks == 2


def test_contiguous_baseline_reserves_max_model_len_and_wastes_it():
    num_blocks, max_len = 41, 32  # 40 usable blocks = 160 slots; regions of 8 blocks
    prompts = [list(range(i, i + 5)) for i in range(10)]
    cb = ContiguousBlockManager(num_blocks, BS, max_model_len=max_len)
    pb = BlockManager(num_blocks, BS, max_model_len=max_len, watermark=0)
    admitted = {}
    for name, bm in (("contiguous", cb), ("paged", pb)):
        admitted[name] = 0
        for i, p in enumerate(prompts):
            if bm.can_allocate(p):
                computed(bm, i, p)
                admitted[name] += 1
        bm.check_invariants()
    assert admitted == {"contiguous": 5, "paged": 10}
    c, p = cb.stats(), pb.stats()
    assert (c.num_used_blocks, c.tokens_stored, c.num_unusable_blocks) == (40, 25, 0)
    assert c.utilization == pytest.approx(25 / 160) and p.utilization == pytest.approx(50 / 80)
    assert ContiguousBlockManager(45, BS, max_model_len=max_len).stats().num_unusable_blocks == 4
    assert cb.block_table(0) == [1, 2] and cb.slot(1, 0) == 9 * BS


def test_contiguous_fork_copies_and_never_swaps():
    cb = ContiguousBlockManager(17, BS, max_model_len=32)  # two regions
    computed(cb, "a", list(range(6)))
    assert cb.can_fork(1) and not cb.can_fork(2)
    assert cb.fork("a", "b") == [(1, 9), (2, 10)]
    assert not cb.can_fork(1) and not cb.can_allocate([1])
    assert cb.append_slots("a", 20) == [] and cb.slot_mapping("a", 24, 26).tolist() == [28, 29]
    assert not cb.can_swap_out("a")
    with pytest.raises(SwapSpaceFull, match="recompute"):
        cb.swap_out("a")
    with pytest.raises(ValueError, match="sequence would reach 33 tokens; max_model_len is 32"):
        cb.can_append_slots("a", 7)
    cb.free("a")
    cb.free("b")
    cb.check_invariants()
    assert cb.stats().peak_used_blocks == 16


def test_both_managers_have_the_same_interface():
    def api(cls):
        return {n: list(inspect.signature(m).parameters)[1:] for n, m in vars(cls).items()
                if not n.startswith("_") and callable(m)}
    assert api(BlockManager) == api(ContiguousBlockManager)


def test_check_invariants_catches_a_bad_ref_count():
    bm = BlockManager(16, BS)
    computed(bm, "a", list(range(6)))
    bm.pool.blocks[bm.block_table("a")[0]].ref_cnt += 1
    with pytest.raises(AssertionError, match="ref_cnt 2, 1 block-table references"):
        bm.check_invariants()


# ---- stateful property test against a reference model --------------------------------------

PREFIXES = [(), (1, 2, 3, 0), (1, 2, 3, 0, 1, 2, 3, 0), (3, 3, 3, 3, 2)]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / append / fork / free / swap / prefix-hit traffic against a plain model.

    The model keeps each sequence's tokens, and a simulated device (and host) pool keeps,
    for every slot, the identity of the K/V written there: the salt and the whole token
    prefix up to that position. After every operation each sequence must read exactly
    its own K/V through its block table: a wrong prefix hit, a missing copy-on-write or a
    lost swap copy would show up as a foreign identity in one of its slots.
    """

    NUM_BLOCKS, NUM_HOST_BLOCKS, MAX_LEN = 20, 6, 40
    hash_fn = staticmethod(sha256_block_hash)

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(self.NUM_BLOCKS, BS, max_model_len=self.MAX_LEN, watermark=0.1,
                               swap_space=self.NUM_HOST_BLOCKS, block_bytes=1, hash_fn=self.hash_fn)
        self.device = [[None] * BS for _ in range(self.NUM_BLOCKS)]
        self.host = [[None] * BS for _ in range(self.NUM_HOST_BLOCKS)]
        self.seqs = {}  # id -> dict(tokens, salt, host: list | None)
        self.next_id = 0

    # helpers
    def ident(self, sid, p):
        s = self.seqs[sid]
        return s["salt"], tuple(s["tokens"][:p + 1])

    def pick(self, i, on_device=None):
        ids = [k for k, s in self.seqs.items() if on_device is None or (s["host"] is None) == on_device]
        return ids[i % len(ids)] if ids else None

    def apply(self, copies, src, dst):
        for a, b in copies:
            dst[b] = list(src[a])

    def compute(self, sid, stop):
        """The device step: write K/V of positions [computed, stop), then tell the manager."""
        for p in range(self.bm.num_computed_tokens(sid), stop):
            blk, off = divmod(self.bm.slot(sid, p), BS)
            block = self.bm.pool.blocks[blk]
            assert block.ref_cnt == 1 and block.block_hash is None, "write into a shared or cached block"
            self.device[blk][off] = self.ident(sid, p)
        self.bm.mark_computed(sid, stop, self.seqs[sid]["tokens"])

    def admit(self, prompt, salt, chunk):
        try:
            ok = self.bm.can_allocate(prompt, cache_salt=salt, num_new_tokens=chunk)
        except ValueError:
            assert len(prompt) + 1 > self.MAX_LEN
            return None
        if not ok:
            return None
        sid, self.next_id = self.next_id, self.next_id + 1
        self.seqs[sid] = dict(tokens=list(prompt), salt=salt, host=None)
        cached = self.bm.allocate(sid, prompt, cache_salt=salt, num_new_tokens=chunk)
        assert cached % BS == 0 and cached <= len(prompt) - 1
        assert self.bm.num_tokens(sid) == cached + min(len(prompt) - cached, len(prompt) if chunk is None else chunk)
        self.check_reads(sid)  # the hit blocks hold exactly this prompt's prefix
        self.compute(sid, self.bm.num_tokens(sid))
        return sid, cached

    # rules
    @rule(prefix=st.sampled_from(PREFIXES), rest=st.lists(st.integers(0, 3), max_size=12),
          salt=st.sampled_from([None, "tenant"]), chunk=st.none() | st.integers(0, 6))
    def admit_prompt(self, prefix, rest, salt, chunk):
        self.admit(list(prefix) + rest or [0], salt, chunk)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), cut=st.integers(0, 40), extra=st.lists(st.integers(0, 3), max_size=3))
    def prefix_hit(self, i, cut, extra):
        """Admit a prompt that repeats the start of a live sequence."""
        src = self.pick(i)
        s = self.seqs[src]
        prompt = s["tokens"][:max(1, cut)] + extra
        # Blocks the source holds and has registered cannot be evicted: they must hit.
        held = 0
        if s["host"] is None:
            for b in self.bm.block_table(src):
                if self.bm.pool.blocks[b].block_hash is None:
                    break
                held += 1
        limit = (len(prompt) - 1) // BS
        common = next((k for k in range(min(len(prompt), len(s["tokens"]))) if prompt[k] != s["tokens"][k]),
                      min(len(prompt), len(s["tokens"])))
        out = self.admit(prompt, s["salt"], None)
        if out is not None:
            assert out[1] >= min(held, limit, common // BS) * BS

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), new=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def append(self, i, new):
        """Next prefill chunk if the prompt is not all in, else decode the new tokens."""
        sid = self.pick(i, on_device=True)
        if sid is None:
            return
        s, n = self.seqs[sid], self.bm.num_tokens(sid)
        k = min(len(new), len(s["tokens"]) - n) if n < len(s["tokens"]) else len(new)
        if n + k > self.MAX_LEN:
            with pytest.raises(ValueError, match="max_model_len"):
                self.bm.can_append_slots(sid, k)
            return
        if not self.bm.can_append_slots(sid, k):
            assert self.bm.num_allocatable_blocks < -(-(n + k) // BS) - -(-n // BS) + 1
            return
        if n == len(s["tokens"]):
            s["tokens"] += new
        self.apply(self.bm.append_slots(sid, k), self.device, self.device)
        self.compute(sid, n + k)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self.pick(i, on_device=True)
        if parent is None or self.bm.num_computed_tokens(parent) < self.bm.num_tokens(parent):
            return
        child, self.next_id = self.next_id, self.next_id + 1
        assert self.bm.fork(parent, child) == []
        self.seqs[child] = dict(self.seqs[parent], tokens=list(self.seqs[parent]["tokens"]))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), blocks=st.integers(0, 5), cut=st.integers(0, 40),
          extra=st.lists(st.integers(0, 3), max_size=8))
    def fork_prefix(self, i, blocks, cut, extra):
        """A recomputed sample: the parent's first whole blocks, then its own tokens (often
        another sequence's, so the prefix cache has blocks for them)."""
        parent = self.pick(i, on_device=True)
        if parent is None:
            return
        ptoks, k = self.seqs[parent]["tokens"], min(blocks, self.bm.num_tokens(parent) // BS)
        tokens = ptoks[:max(k * BS, min(cut, len(ptoks)))] + extra
        if len(tokens) <= k * BS or len(tokens) > self.MAX_LEN:
            return
        child, self.next_id = self.next_id, self.next_id + 1
        computed, copies = self.bm.fork_prefix(parent, child, k * BS, tokens)
        assert copies == [] and computed % BS == 0 and k * BS <= computed <= len(tokens) - 1
        assert self.bm.block_table(child)[:k] == self.bm.block_table(parent)[:k]
        self.seqs[child] = dict(tokens=list(tokens), salt=self.seqs[parent]["salt"], host=None)
        self.check_reads(child)  # the hits after the shared blocks hold exactly its own tokens' K/V

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        sid = self.pick(i)
        self.bm.free(sid)
        del self.seqs[sid]

    def pick_group(self, picks, on_device):
        return list(dict.fromkeys(sid for i in picks if (sid := self.pick(i, on_device=on_device)) is not None))

    @precondition(lambda self: self.seqs)
    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=3))
    def swap_out(self, picks):
        """Swap out one sequence or several together (a request's samples): shared blocks once."""
        ids = self.pick_group(picks, on_device=True)
        if not ids:
            return
        need = len({b for sid in ids for b in self.bm.block_table(sid)})
        if not self.bm.can_swap_out(*ids):  # the host pool is full: recompute instead
            assert need > self.NUM_HOST_BLOCKS - self.bm.stats().num_host_blocks_used
            for sid in ids:
                self.bm.free(sid)
                del self.seqs[sid]
            return
        copies = self.bm.swap_out(*ids)
        assert len(copies) == need
        self.apply(copies, self.device, self.host)
        for sid in ids:
            self.seqs[sid]["host"] = self.bm.host_block_table(sid)

    @precondition(lambda self: self.seqs)
    @rule(picks=st.lists(st.integers(0, 99), min_size=1, max_size=3))
    def swap_in(self, picks):
        ids = self.pick_group(picks, on_device=False)
        if not ids or not self.bm.can_swap_in(*ids):
            return
        free = self.bm.pool.num_free
        copies = self.bm.swap_in(*ids)
        assert free - self.bm.pool.num_free == len(copies) == len({h for sid in ids for h in self.seqs[sid]["host"]})
        self.apply(copies, self.host, self.device)
        for sid in ids:
            self.seqs[sid]["host"] = None

    # checks
    def check_reads(self, sid):
        s = self.seqs[sid]
        for p in range(self.bm.num_computed_tokens(sid)):
            if s["host"] is None:
                blk, off = divmod(self.bm.slot(sid, p), BS)
                got = self.device[blk][off]
            else:
                got = self.host[s["host"][p // BS]][p % BS]
            assert got == self.ident(sid, p), f"sequence {sid} position {p} reads K/V of {got}"

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        fill = {}  # device block -> the most tokens any table holds in it
        for sid, s in self.seqs.items():
            assert self.bm.is_swapped(sid) == (s["host"] is not None)
            assert self.bm.num_computed_tokens(sid) == self.bm.num_tokens(sid) <= len(s["tokens"])
            self.check_reads(sid)
            if s["host"] is None:
                n = self.bm.num_tokens(sid)
                for j, b in enumerate(self.bm.block_table(sid)):
                    fill[b] = max(fill.get(b, 0), min(max(n - j * BS, 0), BS))
        assert self.bm.stats().tokens_stored == sum(fill.values())  # shared blocks counted once

    def teardown(self):
        for sid in list(self.seqs):
            self.bm.free(sid)
        self.bm.check_invariants()
        s = self.bm.stats()
        assert s.num_used_blocks == 0 and s.num_host_blocks_used == 0 and s.num_tokens == 0
        assert s.num_free_blocks + s.num_cached_blocks == self.NUM_BLOCKS - 1


class AlwaysCollidingMachine(BlockManagerMachine):
    hash_fn = staticmethod(always_collide)


class ParentBlindMachine(BlockManagerMachine):
    hash_fn = staticmethod(ignore_parent)


SETTINGS = settings(max_examples=40, stateful_step_count=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestAlwaysCollidingHashStateful = AlwaysCollidingMachine.TestCase
TestParentBlindHashStateful = ParentBlindMachine.TestCase
for _case in (TestBlockManagerStateful, TestAlwaysCollidingHashStateful, TestParentBlindHashStateful):
    _case.settings = SETTINGS
del _case  # pytest would collect it as a fourth test class
