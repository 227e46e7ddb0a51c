"""The block pool orders its free queue exactly as vLLM V1's ``BlockPool``.

Exact expectations on block ids and free-queue order: the null block, pop-front allocation,
un-hashed frees to the front (LIFO), hashed frees to the tail (LRU), prefix-hit touches and
evictions, duplicate hashes, and the usage gauge.
"""

from __future__ import annotations

import random

import pytest

from sim.kv.block_pool import BlockPool


def make_pool(num_gpu_blocks: int = 8, enable_caching: bool = True) -> BlockPool:
    return BlockPool(num_gpu_blocks, enable_caching)


def refs(pool: BlockPool, blocks: list[int]) -> list[int]:
    return pool.ref_cnt[blocks].tolist()


def cache(pool: BlockPool, blocks: list[int], hashes: list[int]) -> None:
    """Register ``blocks`` under ``hashes`` as one request's full blocks."""
    pool.cache_full_blocks(hashes, blocks, 0, len(blocks))


def test_null_block_is_block_0_and_never_free() -> None:
    pool = make_pool(8)
    assert pool.null_block == 0
    assert 0 not in pool.free_block_ids()
    assert pool.num_usable_blocks == 7
    assert pool.num_free_blocks == 7
    # Allocating every usable block never hands out the null block.
    assert pool.get_new_blocks(7) == [1, 2, 3, 4, 5, 6, 7]
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
    assert first == [1, 2]
    assert refs(pool, first) == [1, 1]
    assert pool.get_new_blocks(3) == [3, 4, 5]
    assert pool.free_block_ids() == [6, 7]
    assert pool.get_new_blocks(0) == []  # as vLLM: nothing popped
    assert pool.free_block_ids() == [6, 7]


def test_get_new_blocks_beyond_free_raises() -> None:
    pool = make_pool(4)
    with pytest.raises(ValueError, match="cannot get 4 free blocks from 3"):
        pool.get_new_blocks(4)
    assert pool.free_block_ids() == [1, 2, 3]


def test_free_unhashed_tail_first_goes_to_front_in_given_order() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 6, 7]
    assert refs(pool, blocks) == [0, 0, 0]
    # LIFO reuse: the next allocation takes the request's last block first.
    assert pool.get_new_blocks(2) == [3, 2]


def test_free_hashed_goes_to_tail_in_given_order() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(3)  # [1, 2, 3]
    cache(pool, blocks, [101, 102, 103])
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]
    # Still cached: a free block keeps its hash until it is popped again.
    assert pool.get_cached_block(101) == blocks[0]
    assert pool.num_cached_free_blocks == 3


def test_free_mixed_unhashed_front_hashed_tail() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(4)  # [1, 2, 3, 4]; the last two hold a partial tail
    cache(pool, blocks[:2], [101, 102])
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [4, 3, 5, 6, 7, 2, 1]


def test_free_with_caching_disabled_puts_everything_at_the_front() -> None:
    pool = make_pool(8, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    # Even a block that carries a hash is reused first when caching is off.
    pool.hashed[blocks[0]] = True
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 6, 7]


def test_free_of_a_shared_block_only_drops_a_reference() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(2)
    cache(pool, blocks, [101, 102])
    assert pool.num_shared_refs == 0
    pool.touch(blocks)  # a second request hits both
    assert refs(pool, blocks) == [2, 2]
    assert pool.num_shared_refs == 2  # each block read twice: two re-reads
    pool.free_blocks(blocks[::-1])
    assert refs(pool, blocks) == [1, 1]
    assert pool.num_shared_refs == 0
    assert pool.free_block_ids() == [3, 4, 5, 6, 7]
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]


def test_touch_removes_a_free_cached_block_and_bumps_ref_counts() -> None:
    pool = make_pool(8)
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [101, 102, 103])
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [4, 5, 6, 7, 3, 2, 1]

    hit = [pool.get_cached_block(101), pool.get_cached_block(102)]
    assert hit == [1, 2]
    pool.touch(hit)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3]
    assert refs(pool, blocks) == [1, 1, 0]
    # A second hit on blocks already in use leaves the free queue alone.
    pool.touch(hit)
    assert pool.free_block_ids() == [4, 5, 6, 7, 3]
    assert refs(pool, blocks) == [2, 2, 0]
    assert pool.usage == pytest.approx(1 - 5 / 7)


def test_get_new_blocks_evicts_the_hash_of_a_popped_cached_block() -> None:
    pool = make_pool(4)  # usable blocks 1, 2, 3
    blocks = pool.get_new_blocks(3)
    cache(pool, blocks, [101, 102, 103])
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [3, 2, 1]
    assert pool.num_evicted_blocks == 0

    popped = pool.get_new_blocks(1)
    assert popped == [3]
    assert pool.block_hash_of(3) is None
    assert refs(pool, popped) == [1]
    assert pool.get_cached_block(103) is None
    assert pool.get_cached_block(102) == blocks[1]
    assert pool.num_evicted_blocks == 1
    assert pool.num_cached_free_blocks == 2


def test_same_hash_twice_lookup_returns_earliest_then_the_other() -> None:
    pool = make_pool(8)
    first = pool.get_new_blocks(1)
    second = pool.get_new_blocks(1)
    cache(pool, first, [777])
    cache(pool, second, [777])  # vLLM does not de-duplicate identical blocks
    assert pool.get_cached_block(777) == first[0]
    assert pool.cached_blocks == {777: [1, 2]}

    # Free the earliest one and pop it back out: that evicts it, the other remains.
    pool.free_blocks(first)
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 1]
    pool.get_new_blocks(5)
    assert pool.get_new_blocks(1) == [1]
    assert pool.block_hash_of(1) is None
    assert pool.get_cached_block(777) == second[0]
    assert pool.duplicate_blocks == {}

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
    pool.free_blocks(blocks[::-1])
    assert pool.usage == pytest.approx(1 - 4 / 10)


def test_pops_skip_the_entries_of_touched_blocks_single_and_bulk() -> None:
    pool = make_pool(10)  # usable blocks 1..9
    blocks = pool.get_new_blocks(6)  # [1..6]
    cache(pool, blocks, [101, 102, 103, 104, 105, 106])
    pool.free_blocks(blocks[::-1])
    assert pool.free_block_ids() == [7, 8, 9, 6, 5, 4, 3, 2, 1]
    pool.touch([5, 3])  # out of the middle of the tail
    assert pool.num_free_blocks == 7
    assert pool.free_block_ids() == [7, 8, 9, 6, 4, 2, 1]
    assert pool.get_new_blocks(4) == [7, 8, 9, 6]
    assert pool.get_new_blocks(1) == [4]  # past the touched block 5
    pool.touch([2])
    assert pool.get_new_blocks(1) == [1]  # past the touched blocks 3 and 2
    assert pool.num_free_blocks == 0
    assert pool.free_block_ids() == []
    # A touched block freed again goes to the tail once, not where it was.
    pool.free_blocks([3, 5])
    assert pool.free_block_ids() == [3, 5]
    assert pool.get_cached_block(103) == 3


def test_free_queue_matches_a_list_model_over_random_operations() -> None:
    """Allocate, cache, hit and free at random (seeded) against the queue as a plain list
    (vLLM's order, removals from the middle included), through many FIFO compactions."""
    rng = random.Random(7)
    num_gpu_blocks = 40
    pool = make_pool(num_gpu_blocks)
    queue = list(range(1, num_gpu_blocks))
    hash_of: dict[int, int] = {}  # block -> hash, while cached
    refs_model = [0] * num_gpu_blocks
    owners: list[list[int]] = []
    next_hash = 1000
    for _ in range(3000):
        op = rng.random()
        if op < 0.35 and queue:
            n = rng.randint(1, min(len(queue), 8))
            got = pool.get_new_blocks(n)
            assert got == queue[:n]
            del queue[:n]
            for b in got:
                hash_of.pop(b, None)
                refs_model[b] = 1
            owners.append(got)
        elif op < 0.55 and owners:
            # Register the leading unhashed blocks of an owner under fresh hashes.
            table = rng.choice(owners)
            new = [b for b in table if b not in hash_of and refs_model[b] > 0]
            new = new[: rng.randint(0, len(new))]
            if new:
                hashes = list(range(next_hash, next_hash + len(new)))
                next_hash += len(new)
                pool.cache_full_blocks(hashes, new, 0, len(new))
                hash_of.update(zip(new, hashes, strict=True))
        elif op < 0.7 and hash_of:
            hit = rng.sample(sorted(hash_of), rng.randint(1, min(len(hash_of), 6)))
            assert [pool.get_cached_block(hash_of[b]) for b in hit] == hit
            pool.touch(hit)
            for b in hit:
                if refs_model[b] == 0:
                    queue.remove(b)
                refs_model[b] += 1
            owners.append(hit)
        elif owners:
            table = owners.pop(rng.randrange(len(owners)))
            order = table[::-1]
            pool.free_blocks(order)
            freed = []
            for b in order:
                refs_model[b] -= 1
                if refs_model[b] == 0:
                    freed.append(b)
            kept = [b for b in freed if b in hash_of]
            front = [b for b in freed if b not in hash_of]
            queue = front + queue + kept
        assert pool.free_block_ids() == queue
        assert pool.num_free_blocks == len(queue)
        assert pool.ref_cnt.tolist() == refs_model
        assert pool.num_shared_refs == sum(max(r - 1, 0) for r in refs_model)
        assert pool.first_cached_block == {h: b for b, h in hash_of.items()}
        assert pool.num_cached_free_blocks == sum(b in hash_of for b in queue)
