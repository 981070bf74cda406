"""BlockPool and FreeBlockQueue: exact block ids, LRU reuse order, ref counts and the prefix-cache map."""

from __future__ import annotations

import pytest

from paxserve.core.block_pool import NULL_BLOCK_ID, BlockHash, BlockPool, FreeBlockQueue, KVCacheBlock, hash_block


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(*tokens: int, parent: BlockHash | None = None) -> BlockHash:
    return hash_block(parent, tokens)


# ---------------------------------------------------------------- FreeBlockQueue


def test_free_queue_order_popleft_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5
    assert q.block_ids() == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.block_ids() == [2, 3, 4]
    q.append(blocks[0])
    assert q.block_ids() == [2, 3, 4, 0]
    assert len(q) == 4


def test_free_queue_remove_from_middle_head_and_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4]
    assert blocks[2].prev_free is None and blocks[2].next_free is None
    q.remove(blocks[0])
    assert q.block_ids() == [1, 3, 4]
    q.remove(blocks[4])
    assert q.block_ids() == [1, 3]
    assert len(q) == 2
    # Links of the neighbours are consistent both ways.
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    # Removing a block that is not in the list fails loudly and changes nothing.
    with pytest.raises(RuntimeError, match="not in the free list"):
        q.remove(blocks[2])
    assert q.block_ids() == [1, 3]
    assert len(q) == 2
    q.append(blocks[2])
    assert q.block_ids() == [1, 3, 2]


def test_free_queue_empty_popleft_raises():
    q = FreeBlockQueue([KVCacheBlock(1)])
    q.popleft()
    assert len(q) == 0 and q.block_ids() == []
    with pytest.raises(RuntimeError, match="no free"):
        q.popleft()


# ---------------------------------------------------------------- BlockPool basics


def test_pool_needs_two_blocks():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, enable_caching=True)
    pool = BlockPool(2, enable_caching=True)
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.num_free_blocks == 0


def test_null_block_never_handed_out():
    pool = BlockPool(6, enable_caching=True)
    assert pool.null_block.block_id == NULL_BLOCK_ID == 0
    assert pool.num_free_blocks == 5
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    got = pool.get_new_blocks(5)
    assert ids(got) == [1, 2, 3, 4, 5]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.null_block.ref_cnt == 0
    with pytest.raises(RuntimeError, match="asked for 1 KV blocks, 0 free"):
        pool.get_new_blocks(1)
    pool.free_blocks(got)
    # Churn: block 0 never comes back out no matter how often everything is recycled.
    for _ in range(3):
        again = pool.get_new_blocks(5)
        assert NULL_BLOCK_ID not in ids(again)
        pool.free_blocks(again)


def test_get_new_blocks_in_free_list_order():
    pool = BlockPool(10, enable_caching=False)
    assert ids(pool.get_new_blocks(3)) == [1, 2, 3]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.get_new_blocks(0) == []
    assert pool.free_queue.block_ids() == [6, 7, 8, 9]


def test_asking_for_too_many_changes_nothing():
    pool = BlockPool(4, enable_caching=False)
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(4)
    assert pool.num_free_blocks == 3
    assert pool.free_queue.block_ids() == [1, 2, 3]


def test_free_order_is_reuse_order_lru():
    pool = BlockPool(8, enable_caching=False)
    b = {x.block_id: x for x in pool.get_new_blocks(5)}  # 1..5; free list now [6, 7]
    pool.free_blocks([b[4]])
    pool.free_blocks([b[2], b[5]])
    assert pool.free_queue.block_ids() == [6, 7, 4, 2, 5]
    # The earliest freed is reused first (after the never-used ones ahead of it).
    assert ids(pool.get_new_blocks(3)) == [6, 7, 4]
    assert ids(pool.get_new_blocks(2)) == [2, 5]
    assert pool.free_queue.block_ids() == []


def test_ref_counts_shared_blocks():
    pool = BlockPool(5, enable_caching=True)
    (blk,) = pool.get_new_blocks(1)
    pool.cache_block(blk, h(1, 2))
    pool.touch([blk])  # a second request shares it
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1
    assert pool.free_queue.block_ids() == [2, 3, 4]  # still in use
    assert pool.num_free_blocks == 3
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0
    assert pool.free_queue.block_ids() == [2, 3, 4, 1]


def test_touch_three_times_free_three_times():
    pool = BlockPool(3, enable_caching=True)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    pool.touch([blk])
    assert blk.ref_cnt == 3
    for expected in (2, 1):
        pool.free_blocks([blk])
        assert blk.ref_cnt == expected
        assert 1 not in pool.free_queue.block_ids()
    pool.free_blocks([blk])
    assert pool.free_queue.block_ids() == [2, 1]


def test_freeing_more_than_allocated_raises():
    pool = BlockPool(4, enable_caching=False)
    (blk,) = pool.get_new_blocks(1)
    pool.free_blocks([blk])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([blk])
    assert blk.ref_cnt == 0
    assert pool.free_queue.block_ids() == [2, 3, 1]  # not appended twice
    assert pool.num_free_blocks == 3
    # A block that was never allocated cannot be freed either.
    with pytest.raises(RuntimeError):
        pool.free_blocks([pool.blocks[3]])


def test_touch_on_free_cached_block_removes_it_from_free_list():
    pool = BlockPool(6, enable_caching=True)
    blocks = pool.get_new_blocks(5)  # 1..5
    hashes = [h(i) for i in range(5)]
    for blk, hh in zip(blocks, hashes):
        pool.cache_block(blk, hh)
    pool.free_blocks(blocks)
    assert pool.free_queue.block_ids() == [1, 2, 3, 4, 5]
    hit = pool.get_cached_block(hashes[2])
    assert hit is not None and hit.block_id == 3
    pool.touch([hit])  # O(1) removal from the middle
    assert hit.ref_cnt == 1
    assert pool.free_queue.block_ids() == [1, 2, 4, 5]
    assert pool.num_free_blocks == 4
    assert hit.block_hash == hashes[2]  # a hit keeps its hash
    assert pool.get_cached_block(hashes[2]) is hit
    # Hits at the head and the tail.
    pool.touch([pool.get_cached_block(hashes[0]), pool.get_cached_block(hashes[4])])
    assert pool.free_queue.block_ids() == [2, 4]
    # The next new blocks skip the ones taken back.
    assert ids(pool.get_new_blocks(2)) == [2, 4]


def test_eviction_drops_hash_and_map_entry():
    pool = BlockPool(4, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    ha, hb = h(1, 1), h(2, 2)
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    assert pool.cached == {ha: a, hb: b}
    pool.free_blocks([b, a, c])  # free list: b, a, c
    assert pool.free_queue.block_ids() == [2, 1, 3]
    # Both still retrievable while free.
    assert pool.get_cached_block(ha) is a and pool.get_cached_block(hb) is b
    (got,) = pool.get_new_blocks(1)
    assert got is b
    assert b.block_hash is None
    assert hb not in pool.cached
    assert pool.get_cached_block(hb) is None
    assert pool.get_cached_block(ha) is a  # untouched
    assert pool.cached == {ha: a}


def test_cache_block_does_not_overwrite_existing_mapping():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    hh = h(5, 6, 7, 8)
    pool.cache_block(a, hh)
    pool.cache_block(b, hh)  # same tokens in another block: stays private
    assert pool.get_cached_block(hh) is a
    assert b.block_hash is None
    assert a.block_hash == hh
    # Freeing and re-allocating the private block does not touch the mapping.
    pool.free_blocks([b])
    assert ids(pool.get_new_blocks(2)) == [3, 2]
    assert pool.get_cached_block(hh) is a


def test_cache_block_keeps_first_hash_of_a_block():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    h1, h2 = h(1), h(2)
    pool.cache_block(a, h1)
    pool.cache_block(a, h2)  # already registered: ignored
    assert a.block_hash == h1
    assert pool.cached == {h1: a}


def test_caching_disabled_never_caches():
    pool = BlockPool(4, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    hh = h(1, 2)
    pool.cache_block(a, hh)
    assert a.block_hash is None
    assert pool.cached == {}
    assert pool.get_cached_block(hh) is None


def test_lookup_is_confirmed_by_token_ids():
    pool = BlockPool(3, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, BlockHash(b"\x01" * 32, (1, 2, 3, 4)))
    assert pool.get_cached_block(BlockHash(b"\x01" * 32, (1, 2, 3, 4))) is a
    # Same hash value, different tokens (a collision): no hit.
    assert pool.get_cached_block(BlockHash(b"\x01" * 32, (1, 2, 3, 5))) is None
    assert pool.get_cached_block(BlockHash(b"\x02" * 32, (1, 2, 3, 4))) is None


def test_hash_block_is_chained():
    root = h(1, 2, 3, 4)
    other_root = h(9, 9, 9, 9)
    a = hash_block(root, (5, 6, 7, 8))
    b = hash_block(other_root, (5, 6, 7, 8))
    assert a.token_ids == b.token_ids == (5, 6, 7, 8)
    assert a != b
    assert hash_block(root, [5, 6, 7, 8]) == a  # deterministic, list or tuple
    assert h(5, 6, 7, 8) != a  # no parent differs from a parent


def test_usage_fraction():
    pool = BlockPool(5, enable_caching=True)  # 4 usable blocks
    assert pool.usage == 0.0
    got = pool.get_new_blocks(1)
    assert pool.usage == pytest.approx(0.25)
    more = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(1.0)
    pool.cache_block(got[0], h(1))
    pool.free_blocks(got)
    # A cached block sitting in the free list counts as free.
    assert pool.usage == pytest.approx(0.75)
    pool.free_blocks(more)
    assert pool.usage == 0.0


def test_reset_prefix_cache():
    pool = BlockPool(5, enable_caching=True)
    a, b, c = pool.get_new_blocks(3)
    ha, hb = h(1), h(2)
    pool.cache_block(a, ha)
    pool.cache_block(b, hb)
    pool.free_blocks([a])  # a free and cached, b in use and cached
    pool.reset_prefix_cache()
    assert pool.cached == {}
    assert a.block_hash is None and b.block_hash is None
    assert pool.get_cached_block(ha) is None and pool.get_cached_block(hb) is None
    # Free list and ref counts untouched.
    assert pool.free_queue.block_ids() == [4, 1]
    assert (a.ref_cnt, b.ref_cnt, c.ref_cnt) == (0, 1, 1)
    # A block can be cached again afterwards.
    pool.cache_block(b, hb)
    assert pool.get_cached_block(hb) is b


def test_block_keys_are_sha256_chains_stable_across_processes():
    import hashlib
    import subprocess
    import sys

    key = h(1, 2, 3, 4)
    assert isinstance(key.value, bytes) and len(key.value) == hashlib.sha256().digest_size
    # Python's own hash() of tuples changes with PYTHONHASHSEED; these keys must not.
    code = "from paxserve.core.block_pool import hash_block; print(hash_block(None, (1, 2, 3, 4)).value.hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}, cwd=str(__import__("pathlib").Path(
                               __file__).resolve().parents[2])).stdout.strip()
    assert other == key.value.hex()


def test_cache_salt_changes_the_first_key_and_so_every_later_one():
    tokens = (1, 2, 3, 4)
    plain, salted, other, empty = (hash_block(None, tokens, salt) for salt in (None, "tenant-a", "tenant-b", ""))
    assert len({plain.value, salted.value, other.value, empty.value}) == 4
    assert hash_block(None, tokens, "tenant-a") == salted  # deterministic
    # A later block's key depends on the salt only through its parent.
    assert hash_block(salted, (5, 6, 7, 8)) != hash_block(plain, (5, 6, 7, 8))
    assert hash_block(salted, (5, 6, 7, 8), "ignored") == hash_block(salted, (5, 6, 7, 8))


def test_uncache_block_forgets_a_registration():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    ha = h(1, 2)
    assert pool.cache_block(a, ha) is True
    assert pool.cache_block(b, ha) is False  # already held by a
    pool.uncache_block(a)
    assert a.block_hash is None and pool.get_cached_block(ha) is None
    pool.uncache_block(b)  # never registered: nothing happens
    assert pool.cache_block(b, ha) is True and pool.get_cached_block(ha) is b
