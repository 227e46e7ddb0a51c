"""The block pool orders its free queue exactly as vLLM V1's ``BlockPool``.

Exact expectations on block ids and free-queue order: the null block, pop-front allocation,
un-hashed frees to the front (LIFO), hashed frees to the tail (LRU), prefix-hit touches and
evictions, duplicate hashes, and the usage gauge.
"""

from __future__ import annotations

import pytest

from sim.kv.block_pool import BlockPool, KVBlock


def make_pool(num_gpu_blocks: int = 8, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_gpu_blocks, enable_caching)


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def cache(pool: BlockPool, blocks: list[KVBlock], hashes: list[int]) -> None:
    """Register ``blocks`` under ``hashes`` as one request's full blocks."""
    pool.cache_full_blocks(hashes, blocks, 0, len(blocks))


def test_null_block_is_block_0_and_never_free() -> None:
    pool = make_pool(8)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.block_id == 0
    assert 0 not in pool.free_block_ids()
    assert pool.num_usable_blocks == 7
    assert pool.num_free_blocks == 7
    # Allocating every usable block never hands out the null block.
    assert ids(pool.get_new_blocks(7)) == [1, 2, 3, 4, 5, 6, 7]
    assert pool.free_block_ids() == []


def test_initial_free_order_is_block_id_order() -> None:
    assert make_pool(8).free_block_ids() == [1, 2, 3, 4, 5, 6, 7]
    assert make_pool(2).free_block_ids() == [1]


def test_needs_the_null_block_plus_one() -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks=1"):
        BlockPool(1, enable_caching=True)


def test_get_new_blocks_pops_from_the_front() -> None:
    pool = make_pool(8)
    first = pool.get_new_blocks(2)
    assert ids(first) == [1, 2]
    assert [b.ref_cnt for b in first] == [1, 1]
    assert ids(pool.get_new_blocks(3)) == [3, 4, 5]
    assert pool.free_block_ids() == [6, 7]


def test_get_new_blocks_beyond_free_raises() -> None:
    pool = make_pool(4)
    with pytest.raises(ValueError, match="cannot get 4 free blocks from 3"):
        pool.get_new_blocks(4)
    assert pool.free_block_ids() == [1, 2, 3]


def test_free_unhashed_tail_first_goes_to_front_in_given_order() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 6, 7]
    assert [b.ref_cnt for b in blocks] == [0, 0, 0]
    # LIFO reuse: the next allocation takes the request's last block first.
    assert ids(pool.get_new_blocks(2)) == [3, 2]


def test_free_hashed_goes_to_tail_in_given_order() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    cache(pool, blocks, [101, 102, 103])
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    # Still cached: a free block keeps its hash until it is popped again.
    assert pool.get_cached_block(101) is blocks[0]
    assert pool.num_cached_free_blocks == 3


def test_free_mixed_unhashed_front_hashed_tail() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(4)  # [1, 2, 3, 4]; the last two hold a partial tail
    cache(pool, blocks[:2], [101, 102])
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 2, 1]


def test_free_with_caching_disabled_puts_everything_at_the_front() -> None:
    pool = make_pool(8, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    # Even a block that carries a hash is reused first when caching is off.
    blocks[0].block_hash = 101
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 6, 7]


def test_free_of_a_shared_block_only_drops_a_reference() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [101, 102])
    pool.touch(blocks)  # a second request hits both
    assert [b.ref_cnt for b in blocks] == [2, 2]
    pool.free_blocks(reversed(blocks))
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]


def test_touch_removes_a_free_cached_block_and_bumps_ref_counts() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [101, 102, 103])
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]

    hit = [pool.get_cached_block(101), pool.get_cached_block(102)]
    assert ids(hit) == [1, 2]
    pool.touch(hit)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3]
    assert [b.ref_cnt for b in blocks] == [1, 1, 0]
    # A second hit on blocks already in use leaves the free queue alone.
    pool.touch(hit)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3]
    assert [b.ref_cnt for b in blocks] == [2, 2, 0]
    assert pool.usage == pytest.approx(1 - 5 / 7)


def test_get_new_blocks_evicts_the_hash_of_a_popped_cached_block() -> None:
    pool = make_pool(4)  # usable blocks 1, 2, 3
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [101, 102, 103])
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1]
    assert pool.num_evicted_blocks == 0

    popped = pool.get_new_blocks(1)
    assert ids(popped) == [3]
    assert popped[0].block_hash is None
    assert popped[0].ref_cnt == 1
    assert pool.get_cached_block(103) is None
    assert pool.get_cached_block(102) is blocks[1]
    assert pool.num_evicted_blocks == 1
    assert pool.num_cached_free_blocks == 2


def test_same_hash_twice_lookup_returns_earliest_then_the_other() -> None:
    pool = make_pool(8)
    first = pool.get_new_blocks(1)
    second = pool.get_new_blocks(1)
    cache(pool, first, [777])
    cache(pool, second, [777])  # vLLM does not de-duplicate identical blocks
    assert pool.get_cached_block(777) is first[0]

    # Free the earliest one and pop it back out: that evicts it, the other remains.
    pool.free_blocks(first)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 1]
    pool.get_new_blocks(5)
    assert ids(pool.get_new_blocks(1)) == [1]
    assert first[0].block_hash is None
    assert pool.get_cached_block(777) is second[0]

    # Evicting the last holder removes the hash altogether.
    pool.evict(second[0])
    assert pool.get_cached_block(777) is None
    assert pool.cached_blocks == {}


def test_usage_is_one_minus_free_over_usable() -> None:
    pool = make_pool(11)  # 10 usable blocks
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(4)
    assert pool.usage == pytest.approx(1 - 6 / 10)
    pool.get_new_blocks(6)
    assert pool.usage == 1.0
    pool.free_blocks(reversed(blocks))
    assert pool.usage == pytest.approx(1 - 4 / 10)
