"""Each router's choice on hand-built replica states, ties and the bounded-load spill."""

from __future__ import annotations

import pytest

from sim.fleet.config import PrefixAwareRouter, WeightedRouter
from sim.fleet.routers import (
    LeastLoaded,
    PrefixAware,
    PrefixIndex,
    ReplicaView,
    RoundRobin,
    RoutingKey,
    SessionAffinity,
    Weighted,
    stable_hash,
)
from sim.request import Request


def views(
    in_flight: list[int], waiting: list[int] | None = None, usage: list[float] | None = None
) -> list[ReplicaView]:
    n = len(in_flight)
    waiting = waiting or [0] * n
    usage = usage or [0.0] * n
    return [ReplicaView(i, in_flight[i], 0, waiting[i], usage[i]) for i in range(n)]


def key(session: int | None = None, hashes: list[int] | None = None) -> RoutingKey:
    request = Request("r", [1, 2, 3, 4], max_tokens=4, block_size=2)
    if hashes is not None:
        request.block_hashes = list(hashes)
    return RoutingKey(request, session)


def test_round_robin_cycles_through_the_replicas() -> None:
    router = RoundRobin(3)
    assert [router.choose(key(), views([5, 0, 0])) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_takes_the_fewest_in_flight_ties_to_the_lowest_index() -> None:
    router = LeastLoaded(4, "in_flight")
    assert router.choose(key(), views([3, 1, 2, 1])) == 1
    assert router.choose(key(), views([0, 0, 0, 0])) == 0


def test_least_loaded_by_kv_usage_reads_the_reported_usage() -> None:
    router = LeastLoaded(3, "kv_usage")
    assert router.choose(key(), views([0, 9, 9], usage=[0.5, 0.2, 0.3])) == 1
    # Equal reports (between two step ends): the fewest in flight, then the lowest index.
    assert router.choose(key(), views([2, 1, 1], usage=[0.4, 0.4, 0.4])) == 1
    assert router.choose(key(), views([0, 0, 0], usage=[0.4, 0.4, 0.4])) == 0


def ring_order(router: SessionAffinity, text: str) -> list[int]:
    """Distinct replicas in ring order from the key's position (the spill order)."""
    from bisect import bisect_left

    start = bisect_left(router._points, stable_hash(text))
    out: list[int] = []
    for i in range(len(router._points)):
        owner = router._owners[(start + i) % len(router._points)]
        if owner not in out:
            out.append(owner)
    return out


def test_session_affinity_keeps_a_session_on_one_replica() -> None:
    router = SessionAffinity(4, load_factor=1.25, virtual_nodes=50)
    home = ring_order(router, "session:42")[0]
    picks = {router.choose(key(session=42), views([1, 1, 1, 1])) for _ in range(5)}
    assert picks == {home}
    # Requests without a session hash their request id.
    assert router.choose(key(), views([0, 0, 0, 0])) == ring_order(router, "request:r")[0]


def test_session_affinity_spills_past_a_replica_at_its_bounded_load() -> None:
    router = SessionAffinity(4, load_factor=1.25, virtual_nodes=50)
    # ceil(1.25 * (7 + 1) / 4) = 3 requests per replica before the next one is skipped.
    assert router.capacity(7) == 3
    order = ring_order(router, "session:42")
    load = [1, 1, 1, 1]
    load[order[0]] = 3
    load[order[1]] = 1  # total 6 -> capacity ceil(1.25 * 7 / 4) = 3
    assert router.choose(key(session=42), views(load)) == order[1]
    load[order[0]] = 2  # total 5 -> capacity ceil(1.25 * 6 / 4) = 2: still full
    assert router.choose(key(session=42), views(load)) == order[1]
    load[order[0]] = 1  # total 4 -> capacity 2: back home
    assert router.choose(key(session=42), views(load)) == order[0]


def test_a_large_load_factor_never_spills() -> None:
    router = SessionAffinity(3, load_factor=1e6, virtual_nodes=10)
    home = ring_order(router, "session:7")[0]
    load = [0, 0, 0]
    load[home] = 100
    assert router.choose(key(session=7), views(load)) == home


def test_prefix_index_matches_consecutive_blocks_per_replica() -> None:
    index = PrefixIndex(3, capacity=10)
    index.add(0, [1, 2, 3])
    index.add(1, [1, 2, 9])
    assert index.matches([1, 2, 3, 4]) == [3, 2, 0]
    # Block hashes chain to their parent (sim.request.hash_block), so a hash stands for its
    # whole prefix: the index needs no positions.
    assert index.matches([1, 2, 3]) == [3, 2, 0]
    assert index.matches([]) == [0, 0, 0]


def test_prefix_index_forgets_the_least_recently_routed_blocks_first_tails_first() -> None:
    index = PrefixIndex(2, capacity=4)
    index.add(0, [1, 2, 3])  # touched 3, 2, 1: the head is the most recent
    assert list(index.lru[0]) == [3, 2, 1]
    index.add(0, [1, 5])  # 5, then 1 again
    assert list(index.lru[0]) == [3, 2, 5, 1]
    index.add(0, [7])  # over capacity: the oldest, 3 (a tail), goes
    assert list(index.lru[0]) == [2, 5, 1, 7]
    assert index.matches([1, 2, 3]) == [2, 0]
    assert 3 not in index.owners
    index.add(1, [2])
    assert index.owners[2] == 0b11
    assert (index.size(0), index.size(1)) == (4, 1)


def test_a_prompt_longer_than_the_index_keeps_its_head() -> None:
    index = PrefixIndex(2, capacity=3)
    index.add(0, [1, 2, 3, 4, 5])
    assert list(index.lru[0]) == [3, 2, 1]
    assert index.matches([1, 2, 3, 4, 5]) == [3, 0]


def test_prefix_aware_takes_the_longest_prefix_then_the_fewest_in_flight() -> None:
    router = PrefixAware(3, PrefixAwareRouter(), num_gpu_blocks=100)
    router.index.add(1, [10, 11, 12])
    router.index.add(2, [10, 11])
    assert router.choose(key(hashes=[10, 11, 12, 13]), views([0, 5, 0])) == 1
    # The chosen replica now holds all four.
    assert router.index.matches([10, 11, 12, 13]) == [0, 4, 2]
    # Equal longest matches go to the fewest in flight, then the lowest index.
    router.index.add(0, [10, 11, 12, 13])
    assert router.choose(key(hashes=[10, 11, 12, 13, 14]), views([3, 2, 0])) == 1
    assert router.choose(key(hashes=[10, 11, 12, 13, 15]), views([2, 2, 0])) == 0


def test_a_match_at_or_below_the_cache_threshold_goes_to_the_most_room() -> None:
    # Replica 0 holds a system prompt of 2 blocks that every conversation starts with.
    router = PrefixAware(3, PrefixAwareRouter(), num_gpu_blocks=100)
    router.index.add(0, [1, 2])
    router.index.add(1, [8])
    # 2 of 4 blocks is not more than half: the smallest index (replica 2, empty) takes it.
    assert router.choose(key(hashes=[1, 2, 6, 7]), views([0, 0, 5])) == 2
    # 2 of 3 is more than half: the match wins over load.
    router = PrefixAware(3, PrefixAwareRouter(), num_gpu_blocks=100)
    router.index.add(0, [1, 2])
    assert router.choose(key(hashes=[1, 2, 6]), views([5, 0, 0])) == 0
    # cache_threshold 0: any match wins.
    pure = PrefixAware(3, PrefixAwareRouter(cache_threshold=0), num_gpu_blocks=100)
    pure.index.add(0, [1, 2])
    assert pure.choose(key(hashes=[1, 2, 3, 4, 5]), views([9, 0, 0])) == 0


def test_an_imbalanced_fleet_goes_by_load_before_cache() -> None:
    def route(in_flight: list[int]) -> int:
        config = PrefixAwareRouter(balance_abs_threshold=4, balance_rel_threshold=1.5)
        router = PrefixAware(3, config, num_gpu_blocks=100)
        router.index.add(0, [1, 2, 3])
        return router.choose(key(hashes=[1, 2, 3, 4]), views(in_flight))

    # max - min = 5 > 4 and 6 > 1 * 1.5: the fewest in flight, whatever the cache says.
    assert route([6, 1, 2]) == 1
    # max - min = 4 is not above 4: the cache decides.
    assert route([5, 1, 2]) == 0
    # Above the absolute threshold but not the relative one (14 <= 10 * 1.5): cache.
    assert route([14, 10, 10]) == 0


def test_prefix_aware_matches_only_the_first_max_prefix_blocks() -> None:
    router = PrefixAware(2, PrefixAwareRouter(max_prefix_blocks=2), num_gpu_blocks=100)
    router.index.add(1, [1, 2, 3])
    router.index.add(0, [1, 2])
    # Both match the 2 blocks looked at: the tie goes to replica 0.
    assert router.choose(key(hashes=[1, 2, 3]), views([0, 0])) == 0
    assert list(router.index.lru[0]) == [2, 1]


def test_weighted_scores_prefix_queue_and_kv_usage_as_llm_d() -> None:
    router = Weighted(3, WeightedRouter(), num_gpu_blocks=100)
    router.index.add(0, [1, 2])
    state = views([0, 0, 0], waiting=[4, 0, 2], usage=[0.5, 0.9, 0.0])
    scores = router.scores([1, 2, 3, 4], router.index.matches([1, 2, 3, 4]), state)
    # prefix 3 * matched / blocks + queue 2 * (max - own) / (max - min) + kv 2 * (1 - usage)
    expected = [3 * 0.5 + 2 * 0.0 + 2 * 0.5, 0 + 2 * 1.0 + 2 * 0.1, 0 + 2 * 0.5 + 2 * 1.0]
    assert scores == pytest.approx(expected)
    assert router.choose(key(hashes=[1, 2, 3, 4]), state) == 2
    # Equal queues score 1 each; a tie goes to the fewest in flight, then the lowest index.
    even = Weighted(2, WeightedRouter(), num_gpu_blocks=100)
    assert even.scores([5], [0, 0], views([0, 0], waiting=[3, 3])) == [4.0, 4.0]
    assert even.choose(key(hashes=[5]), views([1, 0], waiting=[3, 3])) == 1
    assert even.choose(key(hashes=[6]), views([0, 0], waiting=[3, 3])) == 0


def test_weighted_refuses_all_zero_weights() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="all 0"):
        WeightedRouter(prefix_weight=0, queue_weight=0, kv_usage_weight=0)


def test_stable_hash_does_not_depend_on_the_process() -> None:
    # blake2b of the text, first 8 bytes big-endian: fixed across processes and runs.
    assert stable_hash("session:1") == 0xFF7E0519C6E95B1C
    assert stable_hash("session:1") != stable_hash("session:2")
