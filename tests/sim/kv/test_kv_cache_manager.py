"""The KV cache manager's block tables, prefix hits and admission checks, as vLLM V1's.

Block size 16 throughout; every expectation is an exact block id, ref count or free-queue order.
The manager does not advance ``num_computed_tokens`` (the scheduler does), so the tests do it
where a later call depends on it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from sim.kv.kv_cache_manager import KVCacheManager
from sim.request import Request

BLOCK_SIZE = 16


def make_manager(
    num_gpu_blocks: int = 10,
    *,
    enable_caching: bool = True,
    watermark: float = 0.0,
    max_model_len: int = 1024,
) -> KVCacheManager:
    return KVCacheManager(
        num_gpu_blocks=num_gpu_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=max_model_len,
        enable_caching=enable_caching,
        watermark=watermark,
    )


def make_request(
    request_id: str, num_tokens: int = 0, *, tokens: Sequence[int] | None = None
) -> Request:
    """A request whose prompt is ``tokens``, or ``num_tokens`` tokens unique to the request."""
    if tokens is None:
        base = 1000 * (1 + sum(ord(c) for c in request_id))
        tokens = range(base, base + num_tokens)
    return Request(request_id, list(tokens), max_tokens=1, block_size=BLOCK_SIZE)


def schedule_prefill(kv: KVCacheManager, request: Request, num_new_tokens: int) -> list[int]:
    """Allocate a chunk as the scheduler does for a running request; new block ids."""
    new_blocks = kv.allocate_slots(request, num_new_tokens)
    assert new_blocks is not None
    request.num_computed_tokens += num_new_tokens
    return list(new_blocks)


def admit(kv: KVCacheManager, request: Request) -> tuple[int, list[int]]:
    """Look up a waiting request's prefix and allocate the rest of its prompt, as admission."""
    hit_blocks, num_hit = kv.get_computed_blocks(request)
    new_blocks = kv.allocate_slots(
        request,
        request.num_tokens - num_hit,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hit_blocks,
        full_sequence_must_fit=True,
    )
    assert new_blocks is not None
    request.mark_running(num_hit)
    request.num_computed_tokens = request.num_tokens
    return num_hit, list(new_blocks)


def ref_cnts(kv: KVCacheManager, block_ids: Sequence[int]) -> list[int]:
    return [int(kv.block_pool.ref_cnt[i]) for i in block_ids]


def test_allocate_slots_fresh_request() -> None:
    kv = make_manager(10)
    request = make_request("a", 40)
    assert schedule_prefill(kv, request, 40) == [1, 2, 3]
    assert kv.block_table("a") == [1, 2, 3]
    assert kv.block_pool.free_block_ids() == [4, 5, 6, 7, 8, 9]
    assert ref_cnts(kv, [1, 2, 3]) == [1, 1, 1]
    # The 41st token still fits the third block.
    request.append_output_token_id(7)
    assert schedule_prefill(kv, request, 1) == []
    assert kv.block_table("a") == [1, 2, 3]


def test_allocate_slots_decode_past_a_block_boundary_takes_the_next_free_block() -> None:
    kv = make_manager(10)
    request = make_request("a", 48)
    assert schedule_prefill(kv, request, 48) == [1, 2, 3]
    request.append_output_token_id(7)  # token 49 opens a fourth block
    assert schedule_prefill(kv, request, 1) == [4]
    assert kv.block_table("a") == [1, 2, 3, 4]
    assert kv.block_pool.free_block_ids() == [5, 6, 7, 8, 9]


def test_allocate_slots_with_lookahead() -> None:
    kv = make_manager(10)
    request = make_request("a", 40)
    new_blocks = kv.allocate_slots(request, 16, num_lookahead_tokens=4)
    assert new_blocks is not None
    assert list(new_blocks) == [1, 2]  # 16 + 4 tokens need two blocks
    assert kv.block_table("a") == [1, 2]


def test_allocate_slots_returns_none_when_short_and_allocates_nothing() -> None:
    kv = make_manager(4)  # 3 usable blocks
    request = make_request("a", 64)
    assert kv.allocate_slots(request, 64) is None
    assert kv.block_table("a") == []
    assert kv.block_pool.free_block_ids() == [1, 2, 3]


def test_prefix_hit_of_a_second_request_sharing_two_full_blocks() -> None:
    kv = make_manager(10)
    shared = list(range(32))
    first = make_request("a", tokens=shared + [900 + i for i in range(8)])
    assert admit(kv, first) == (0, [1, 2, 3])

    second = make_request("b", tokens=shared + [500 + i for i in range(8)])
    hit_blocks, num_hit = kv.get_computed_blocks(second)
    assert list(hit_blocks) == [1, 2]
    assert num_hit == 32
    assert admit(kv, second) == (32, [4])
    assert kv.block_table("b") == [1, 2, 4]
    assert ref_cnts(kv, [1, 2, 3, 4]) == [2, 2, 1, 1]
    assert kv.block_pool.free_block_ids() == [5, 6, 7, 8, 9]


def test_prefix_hit_on_freed_blocks_takes_them_out_of_the_free_queue() -> None:
    kv = make_manager(10)
    shared = list(range(32))
    first = make_request("a", tokens=[*shared, 900])
    admit(kv, first)
    kv.free(first)
    assert kv.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]

    second = make_request("b", tokens=[*shared, 500])
    assert admit(kv, second) == (32, [3])
    assert kv.block_table("b") == [1, 2, 3]
    assert ref_cnts(kv, [1, 2, 3]) == [1, 1, 1]
    assert kv.block_pool.free_block_ids() == [4, 5, 6, 7, 8, 9]


def test_prefix_lookup_is_capped_at_num_tokens_minus_one() -> None:
    kv = make_manager(10)
    prompt = list(range(32))
    first = make_request("a", tokens=prompt)
    admit(kv, first)
    assert kv.block_pool.get_cached_block(first.block_hashes[1]) is not None

    # Both blocks are cached, but the last token must be computed: only one block hits.
    repeat = make_request("b", tokens=prompt)
    hit_blocks, num_hit = kv.get_computed_blocks(repeat)
    assert list(hit_blocks) == [1]
    assert num_hit == 16
    assert admit(kv, repeat) == (16, [3])
    assert kv.block_table("b") == [1, 3]


def test_prefix_lookup_stops_at_the_first_miss() -> None:
    kv = make_manager(10)
    first = make_request("a", tokens=range(48))
    admit(kv, first)
    # Same first block, different second block, same third block: only the first can hit,
    # because each hash chains its parent.
    tokens = list(range(48))
    tokens[20] = -1
    second = make_request("b", tokens=[*tokens, 99])
    hit_blocks, num_hit = kv.get_computed_blocks(second)
    assert list(hit_blocks) == [1]
    assert num_hit == 16


def test_cache_blocks_registers_only_full_blocks_at_scheduling_time() -> None:
    kv = make_manager(10)
    request = make_request("a", 40)
    pool = kv.block_pool

    assert schedule_prefill(kv, request, 20) == [1, 2]
    assert pool.block_hash_of(1) == request.block_hashes[0]
    assert pool.block_hash_of(2) is None  # half full
    assert pool.get_cached_block(request.block_hashes[0]) == 1
    assert pool.get_cached_block(request.block_hashes[1]) is None

    assert schedule_prefill(kv, request, 20) == [3]
    assert pool.block_hash_of(2) == request.block_hashes[1]
    assert pool.block_hash_of(3) is None  # tokens 32..39 of 48
    assert kv.num_cached_block["a"] == 2
    assert len(pool.cached_blocks) == 2


def test_free_returns_blocks_tail_first() -> None:
    kv = make_manager(10)
    request = make_request("a", 40)
    schedule_prefill(kv, request, 40)  # blocks 1, 2 hashed; block 3 partial
    kv.free(request)
    # The partial tail is reused first; the hashed blocks wait at the tail, the sequence's
    # tail (2) before its head (1), so the head survives longest in the prefix cache.
    assert kv.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]
    assert kv.block_table("a") == []
    assert "a" not in kv.num_cached_block
    assert ref_cnts(kv, [1, 2, 3]) == [0, 0, 0]


def test_free_of_an_unknown_request_is_a_no_op() -> None:
    kv = make_manager(10)
    kv.free(make_request("ghost", 4))
    assert kv.block_pool.free_block_ids() == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_watermark_refuses_admission_when_needed_plus_watermark_exceeds_free() -> None:
    kv = make_manager(10, watermark=0.2)  # int(0.2 * 10) = 2 watermark blocks; 9 free
    assert kv.watermark_blocks == 2

    # 8 blocks + 2 watermark > 9 free: refused, but only for a waiting request while
    # something is already scheduled.
    waiting = make_request("w", 8 * BLOCK_SIZE)
    assert kv.allocate_slots(waiting, 8 * BLOCK_SIZE, has_scheduled_reqs=True) is None
    assert kv.block_pool.num_free_blocks == 9
    new_blocks = kv.allocate_slots(waiting, 8 * BLOCK_SIZE, has_scheduled_reqs=False)
    assert new_blocks is not None
    assert len(new_blocks) == 8


def test_watermark_boundary_admits_when_needed_plus_watermark_equals_free() -> None:
    kv = make_manager(10, watermark=0.2)
    waiting = make_request("w", 7 * BLOCK_SIZE)  # 7 + 2 == 9 free
    assert kv.allocate_slots(waiting, 7 * BLOCK_SIZE, has_scheduled_reqs=True) is not None


def test_watermark_does_not_apply_to_a_running_request() -> None:
    kv = make_manager(10, watermark=0.2)
    running = make_request("r", 9 * BLOCK_SIZE)
    running.mark_running(0)
    new_blocks = kv.allocate_slots(running, 9 * BLOCK_SIZE, has_scheduled_reqs=True)
    assert new_blocks is not None
    assert list(new_blocks) == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_watermark_applies_to_a_preempted_request() -> None:
    kv = make_manager(10, watermark=0.2)
    request = make_request("p", 8 * BLOCK_SIZE)
    request.mark_running(0)
    request.mark_preempted()
    assert kv.allocate_slots(request, 8 * BLOCK_SIZE, has_scheduled_reqs=True) is None


def test_full_sequence_must_fit_refuses_a_prompt_that_cannot_finish() -> None:
    kv = make_manager(5)  # 4 usable blocks
    request = make_request("big", 5 * BLOCK_SIZE)
    # The first chunk (one block) would fit, the whole 5-block prompt would not.
    assert kv.allocate_slots(request, BLOCK_SIZE, full_sequence_must_fit=True) is None
    assert kv.block_pool.num_free_blocks == 4
    new_blocks = kv.allocate_slots(request, BLOCK_SIZE, full_sequence_must_fit=False)
    assert new_blocks is not None
    assert list(new_blocks) == [1]


def test_full_sequence_must_fit_counts_prefix_hits_on_used_blocks_as_free() -> None:
    kv = make_manager(5)  # 4 usable blocks
    shared = list(range(48))
    first = make_request("a", tokens=[*shared, 1])  # 4 blocks: 1, 2, 3 full + 4 partial
    admit(kv, first)
    kv.free(first)
    first = make_request("a2", tokens=[*shared, 2])
    admit(kv, first)  # hits 1, 2, 3 again; takes block 4
    assert kv.block_pool.num_free_blocks == 0

    # A second sharer needs one new block for its tail; its three hit blocks are in use and
    # cost nothing, so the pool is one block short.
    second = make_request("b", tokens=[*shared, 3])
    hit_blocks, num_hit = kv.get_computed_blocks(second)
    assert num_hit == 48
    assert (
        kv.allocate_slots(
            second,
            1,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit_blocks,
            full_sequence_must_fit=True,
        )
        is None
    )
    # Refusal leaves the hit blocks' ref counts alone.
    assert ref_cnts(kv, [1, 2, 3, 4]) == [1, 1, 1, 1]


def test_prefix_caching_disabled_no_hits_and_frees_to_the_front() -> None:
    kv = make_manager(10, enable_caching=False)
    prompt = list(range(40))
    first = make_request("a", tokens=prompt)
    assert admit(kv, first) == (0, [1, 2, 3])
    assert not kv.block_pool.hashed.any()
    assert kv.block_pool.cached_blocks == {}

    second = make_request("b", tokens=prompt)
    assert kv.get_computed_blocks(second) == ([], 0)
    assert admit(kv, second) == (0, [4, 5, 6])

    kv.free(first)
    assert kv.block_pool.free_block_ids() == [3, 2, 1, 7, 8, 9]


def fresh_lookup(kv: KVCacheManager, request: Request) -> list[int]:
    """The prefix hit block ids with no memo from earlier lookups."""
    kv._lookup_memo = None
    return kv.get_computed_blocks(request)[0]


def cached_owner_and_waiting(kv: KVCacheManager) -> tuple[Request, Request]:
    """An owner whose 5 blocks (1-5) were cached and freed (free queue: 6..11, then 5, 4, 3,
    2, 1, tail first), and a waiting request whose prompt extends the owner's by a block."""
    owner = make_request("owner", 5 * BLOCK_SIZE)
    admit(kv, owner)
    kv.free(owner)
    return owner, make_request("waiting", tokens=owner.token_ids + [7] * BLOCK_SIZE)


def test_repeated_lookup_sees_evictions_of_its_hits_and_new_registrations() -> None:
    # A waiting request asks again every step; between asks, blocks it hit are evicted
    # (popped from the free queue) and blocks it could hit are registered.
    kv = make_manager(num_gpu_blocks=12)
    _, waiting = cached_owner_and_waiting(kv)
    asked = kv.get_computed_blocks(waiting)[0]
    assert asked == [1, 2, 3, 4, 5]
    kv.block_pool.get_new_blocks(8)  # 6..11, then 5 and 4: the owner's blocks 4 and 5 go
    # Both stamped with the eviction count after this pop: the memo was made at 0.
    assert kv.block_pool.evicted_at[[3, 4, 5]].tolist() == [0, 2, 2]
    assert kv.get_computed_blocks(waiting)[0] == [1, 2, 3]
    assert fresh_lookup(kv, waiting) == [1, 2, 3]


def test_repeated_lookup_drops_a_hit_block_evicted_then_cached_again_behind_another() -> None:
    # The hit block holds the same hash again after its eviction, but as a duplicate behind
    # the block that registered it in between: the lookup now answers that block.
    kv = make_manager(num_gpu_blocks=14)
    owner, waiting = cached_owner_and_waiting(kv)
    pool = kv.block_pool
    assert kv.get_computed_blocks(waiting)[0] == [1, 2, 3, 4, 5]
    assert pool.get_new_blocks(9) == [6, 7, 8, 9, 10, 11, 12, 13, 5]  # evicts block 5
    fifth = owner.block_hashes[4]
    pool.cache_full_blocks([fifth], [6], 0, 1)
    pool.cache_full_blocks([fifth], [5], 0, 1)
    assert pool.cached_blocks[fifth] == [6, 5]
    assert kv.get_computed_blocks(waiting)[0] == [1, 2, 3, 4, 6]
    assert fresh_lookup(kv, waiting) == [1, 2, 3, 4, 6]


def test_a_lookup_of_another_request_in_between_drops_the_memo() -> None:
    kv = make_manager(num_gpu_blocks=12)
    owner, waiting = cached_owner_and_waiting(kv)
    other = make_request("other", tokens=owner.token_ids[: 2 * BLOCK_SIZE] + [8] * 3)
    assert len(kv.get_computed_blocks(waiting)[0]) == 5
    kv.block_pool.get_new_blocks(7)  # evicts the owner's block 5
    assert kv.get_computed_blocks(other)[0] == [1, 2]
    kv.block_pool.get_new_blocks(1)  # evicts block 4, logged after other's lookup
    assert kv.get_computed_blocks(waiting)[0] == [1, 2, 3]


def test_memoized_lookup_matches_a_fresh_one_under_random_churn() -> None:
    # Between two lookups of the waiting request, other requests register blocks (some
    # duplicating cached hashes), free them, and take free blocks (evicting cached ones).
    rng = random.Random(5)
    kv = make_manager(num_gpu_blocks=40, max_model_len=4096)
    pool = kv.block_pool
    shared = list(range(50_000, 50_000 + 12 * BLOCK_SIZE))
    waiting = make_request("waiting", tokens=shared + [9] * 3)
    num_hits = set()
    for round_ in range(300):
        if rng.random() < 0.6:
            cut = rng.randrange(1, 13) * BLOCK_SIZE
            other = make_request(f"o{round_}", tokens=shared[:cut] + [round_] * rng.randrange(40))
            if kv.allocate_slots(other, other.num_tokens, full_sequence_must_fit=True):
                kv.free(other)
        else:
            taken = pool.get_new_blocks(rng.randrange(1, pool.num_free_blocks + 1))
            pool.free_blocks(taken[::-1])
        memoized = kv.get_computed_blocks(waiting)[0]
        assert memoized == fresh_lookup(kv, waiting), round_
        num_hits.add(len(memoized))
    assert len(num_hits) > 5  # the hits grew and shrank
