"""Routers: where each arriving request goes, one small class per policy.

A router sees the replicas only through :class:`ReplicaView` (its own count of requests in
flight per replica, and each replica's reported queue lengths and KV usage, possibly
stale), plus what it remembers itself (the prefix index of the prefix-aware routers). It
never reads a replica's block pool: real routers cannot either.

- ``round_robin``: replicas in turn (vLLM production-stack's ``roundrobin``; any L4
  balancer).
- ``least_loaded``: fewest requests in flight, or lowest reported KV usage (least-request
  balancing: Envoy, production-stack).
- ``session_affinity``: consistent hash of the session id with a bounded load
  (production-stack's ``session`` routing; Envoy's ring hash, HAProxy's hash-balance-factor).
- ``prefix_aware``: SGLang's cache-aware router on the router's own index of what it sent
  where (as llm-d's approximate prefix-cache scorer keeps it): load when the fleet is
  imbalanced, else the longest match when it covers enough of the prompt, else the
  replica with the most room in the index.
- ``weighted``: prefix, queue and KV-usage scores, weighted (llm-d's inference scheduler).

Every choice is deterministic: ties go to the fewest requests in flight, then the lowest
replica index (real routers often break them at random; a seeded choice would make results
depend on the number of ties).
"""

from __future__ import annotations

import hashlib
import math
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from sim.fleet.config import (
    LeastLoadedRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    RouterConfig,
    SessionAffinityRouter,
    WeightedRouter,
)
from sim.request import Request


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a router knows about one replica when a request arrives."""

    index: int
    # Requests the router sent there that have not finished: always current.
    in_flight: int
    # As reported by the replica's last step that ended before (now - view_delay_s).
    num_running: int
    num_waiting: int
    kv_usage: float


@dataclass(frozen=True, slots=True)
class RoutingKey:
    """The request being placed: its prompt's block hashes and its session (if any)."""

    request: Request
    session_id: int | None

    @property
    def affinity_key(self) -> str:
        if self.session_id is not None:
            return f"session:{self.session_id}"
        return f"request:{self.request.request_id}"


class Router:
    """Base of every router: ``choose`` returns the index of the replica to use."""

    def __init__(self, num_replicas: int) -> None:
        self.num_replicas = num_replicas

    def choose(self, key: RoutingKey, views: Sequence[ReplicaView]) -> int:
        raise NotImplementedError


class RoundRobin(Router):
    def __init__(self, num_replicas: int) -> None:
        super().__init__(num_replicas)
        self._next = 0

    def choose(self, key: RoutingKey, views: Sequence[ReplicaView]) -> int:
        index = self._next
        self._next = (index + 1) % self.num_replicas
        return index


def fewest_in_flight(views: Sequence[ReplicaView]) -> int:
    """The replica with the fewest requests in flight (ties: the lowest index)."""
    return min(views, key=lambda v: (v.in_flight, v.index)).index


class LeastLoaded(Router):
    def __init__(self, num_replicas: int, metric: Literal["in_flight", "kv_usage"]) -> None:
        super().__init__(num_replicas)
        self.metric = metric

    def choose(self, key: RoutingKey, views: Sequence[ReplicaView]) -> int:
        if self.metric == "kv_usage":
            # Reported usage changes only when a step ends: between two reports every
            # arrival sees the same figures, so ties go to the fewest in flight.
            return min(views, key=lambda v: (v.kv_usage, v.in_flight, v.index)).index
        return fewest_in_flight(views)


def stable_hash(text: str) -> int:
    """A 64-bit hash that is the same in every process (str hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class SessionAffinity(Router):
    """Consistent hashing with bounded loads (see :class:`SessionAffinityRouter`)."""

    def __init__(self, num_replicas: int, load_factor: float, virtual_nodes: int) -> None:
        super().__init__(num_replicas)
        self.load_factor = load_factor
        ring = sorted(
            (stable_hash(f"replica:{r}:{v}"), r)
            for r in range(num_replicas)
            for v in range(virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def capacity(self, total_in_flight: int) -> int:
        """In-flight requests a replica may hold before the next request spills past it."""
        return math.ceil(self.load_factor * (total_in_flight + 1) / self.num_replicas)

    def choose(self, key: RoutingKey, views: Sequence[ReplicaView]) -> int:
        cap = self.capacity(sum(v.in_flight for v in views))
        points, owners = self._points, self._owners
        start = bisect_left(points, stable_hash(key.affinity_key)) % len(points)
        seen: set[int] = set()
        for i in range(start, start + len(points)):
            owner = owners[i % len(points)]
            if owner in seen:
                continue
            if views[owner].in_flight < cap:
                return owner
            seen.add(owner)
            if len(seen) == self.num_replicas:
                break
        # Unreachable with load_factor >= 1 (the least loaded replica is always under the
        # cap); kept as a safe answer.
        return fewest_in_flight(views)


class PrefixIndex:
    """The block hashes a router has sent to each replica, least recently routed dropped
    first once a replica's share exceeds ``capacity`` (one LRU per replica, as llm-d's
    approximate prefix indexer). ``owners`` maps a hash to a bit mask of replicas."""

    def __init__(self, num_replicas: int, capacity: int) -> None:
        self.capacity = capacity
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.owners: dict[int, int] = {}

    def matches(self, hashes: Sequence[int]) -> list[int]:
        """Per replica, how many of ``hashes`` (from the first) it holds in a row."""
        depth = [0] * len(self.lru)
        alive = (1 << len(self.lru)) - 1
        get = self.owners.get
        for n, block_hash in enumerate(hashes):
            held = get(block_hash, 0) & alive
            dropped = alive & ~held
            while dropped:
                low = dropped & -dropped
                depth[low.bit_length() - 1] = n
                dropped ^= low
            alive = held
            if not alive:
                return depth
        n = len(hashes)
        while alive:
            low = alive & -alive
            depth[low.bit_length() - 1] = n
            alive ^= low
        return depth

    def add(self, replica: int, hashes: Sequence[int]) -> None:
        """Remember that ``hashes`` (a prompt's blocks, first block first) were sent to
        ``replica``. They are touched last block first, so the first block is the most
        recent and the index forgets a prompt from its tail, as vLLM evicts (a chain
        without its head can never match again). A prompt longer than the capacity keeps
        its first ``capacity`` blocks."""
        lru = self.lru[replica]
        bit = 1 << replica
        owners = self.owners
        move = lru.move_to_end
        for block_hash in reversed(hashes[: self.capacity]):
            if block_hash in lru:
                move(block_hash)
            else:
                lru[block_hash] = None
                owners[block_hash] = owners.get(block_hash, 0) | bit
        while len(lru) > self.capacity:
            gone, _ = lru.popitem(last=False)
            left = owners[gone] & ~bit
            if left:
                owners[gone] = left
            else:
                del owners[gone]

    def size(self, replica: int) -> int:
        """Blocks the index holds for ``replica``."""
        return len(self.lru[replica])


class _PrefixRouter(Router):
    def __init__(
        self, num_replicas: int, config: PrefixAwareRouter | WeightedRouter, num_gpu_blocks: int
    ) -> None:
        super().__init__(num_replicas)
        self.max_prefix_blocks = config.max_prefix_blocks
        self.index = PrefixIndex(num_replicas, config.index_capacity_blocks or num_gpu_blocks)

    def prompt_hashes(self, key: RoutingKey) -> list[int]:
        hashes = key.request.block_hashes
        if self.max_prefix_blocks is not None:
            return hashes[: self.max_prefix_blocks]
        return list(hashes)

    def choose(self, key: RoutingKey, views: Sequence[ReplicaView]) -> int:
        hashes = self.prompt_hashes(key)
        choice = self.pick(hashes, self.index.matches(hashes), views)
        self.index.add(choice, hashes)
        return choice

    def pick(self, hashes: list[int], depth: list[int], views: Sequence[ReplicaView]) -> int:
        raise NotImplementedError


class PrefixAware(_PrefixRouter):
    """SGLang's cache-aware policy (see :class:`PrefixAwareRouter`)."""

    def __init__(self, num_replicas: int, config: PrefixAwareRouter, num_gpu_blocks: int) -> None:
        super().__init__(num_replicas, config, num_gpu_blocks)
        self.cache_threshold = config.cache_threshold
        self.balance_abs = config.balance_abs_threshold
        self.balance_rel = config.balance_rel_threshold

    def pick(self, hashes: list[int], depth: list[int], views: Sequence[ReplicaView]) -> int:
        loads = [v.in_flight for v in views]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            return fewest_in_flight(views)
        if hashes and max(depth) > self.cache_threshold * len(hashes):
            return min(views, key=lambda v: (-depth[v.index], v.in_flight, v.index)).index
        size = self.index.size
        return min(views, key=lambda v: (size(v.index), v.in_flight, v.index)).index


class Weighted(_PrefixRouter):
    def __init__(self, num_replicas: int, config: WeightedRouter, num_gpu_blocks: int) -> None:
        super().__init__(num_replicas, config, num_gpu_blocks)
        self.weights = (config.prefix_weight, config.queue_weight, config.kv_usage_weight)

    def scores(
        self, hashes: list[int], depth: list[int], views: Sequence[ReplicaView]
    ) -> list[float]:
        """Each replica's weighted score (higher is better)."""
        w_prefix, w_queue, w_kv = self.weights
        queues = [v.num_waiting for v in views]
        low, high = min(queues), max(queues)
        spread = high - low
        out = []
        for v, queue in zip(views, queues, strict=True):
            prefix = depth[v.index] / len(hashes) if hashes else 0.0
            queue_score = (high - queue) / spread if spread else 1.0
            out.append(w_prefix * prefix + w_queue * queue_score + w_kv * (1.0 - v.kv_usage))
        return out

    def pick(self, hashes: list[int], depth: list[int], views: Sequence[ReplicaView]) -> int:
        scores = self.scores(hashes, depth, views)
        # Highest score; ties (common: reported metrics change only when a step ends) to
        # the fewest in flight, then the lowest index.
        return min(views, key=lambda v: (-scores[v.index], v.in_flight, v.index)).index


def build_router(config: RouterConfig, num_replicas: int, num_gpu_blocks: int) -> Router:
    """The router a ``fleet.router`` section describes, for ``num_replicas`` replicas of
    ``num_gpu_blocks`` KV blocks each."""
    if isinstance(config, RoundRobinRouter):
        return RoundRobin(num_replicas)
    if isinstance(config, LeastLoadedRouter):
        return LeastLoaded(num_replicas, config.metric)
    if isinstance(config, SessionAffinityRouter):
        return SessionAffinity(num_replicas, config.load_factor, config.virtual_nodes)
    if isinstance(config, PrefixAwareRouter):
        return PrefixAware(num_replicas, config, num_gpu_blocks)
    if isinstance(config, WeightedRouter):
        return Weighted(num_replicas, config, num_gpu_blocks)
    raise TypeError(f"unknown router config {config!r}")


__all__ = [
    "LeastLoaded",
    "PrefixAware",
    "PrefixIndex",
    "ReplicaView",
    "RoundRobin",
    "Router",
    "RoutingKey",
    "SessionAffinity",
    "Weighted",
    "build_router",
    "fewest_in_flight",
]
