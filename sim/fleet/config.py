"""The ``fleet`` section of a scenario: how many replicas, and the router in front of them.

Every replica is a whole kvsim engine with the scenario's model, hardware and engine
settings (its own block pool, scheduler and cost model), all on one SimPy clock. The router
places each request on one replica when it arrives; the routers and the systems they model
are described in :mod:`sim.fleet.routers`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from sim.config.limits import MAX_NUM_GPU_BLOCKS, MAX_REQUESTS, MAX_SECONDS, KvsimModel

# Replicas of one fleet (each a full engine with its own block pool in memory).
MAX_REPLICAS = 1024
# Virtual nodes per replica on a consistent-hash ring.
MAX_VIRTUAL_NODES = 10_000
# A router score weight.
MAX_ROUTER_WEIGHT = 1e6


class _RouterBase(KvsimModel):
    view_delay_s: float = Field(
        0.0,
        ge=0,
        le=MAX_SECONDS,
        description="How stale the router's view of replica metrics is: it sees each "
        "replica's KV usage and queue lengths as reported by the last step that ended more "
        "than this many seconds ago (0: the last step that ended before now). Only the "
        "routers that read those metrics (least_loaded by kv_usage, weighted) are affected; "
        "the router's own count of requests in flight per replica is always current.",
    )


class RoundRobinRouter(_RouterBase):
    """Replicas in turn (vLLM production-stack's default ``roundrobin`` router)."""

    kind: Literal["round_robin"] = "round_robin"


class LeastLoadedRouter(_RouterBase):
    """The replica with the least load; ties go to the lowest index."""

    kind: Literal["least_loaded"] = "least_loaded"
    metric: Literal["in_flight", "kv_usage"] = Field(
        "in_flight",
        description="in_flight: fewest requests sent there and not yet finished (running + "
        "waiting, as the router counts them); kv_usage: lowest reported KV cache usage.",
    )


class SessionAffinityRouter(_RouterBase):
    """Consistent hashing of the session id (a request without one hashes its request id),
    with bounded loads: a replica already holding ``load_factor`` times its fair share of
    the requests in flight is skipped for the next one on the ring (Mirrokni, Thorup and
    Zadimoghaddam, "Consistent Hashing with Bounded Loads", 2018). vLLM production-stack's
    session router is the plain ring (``load_factor`` 1e6 never spills), though it sends a
    request without a session id to the replica with the least traffic instead."""

    kind: Literal["session_affinity"] = "session_affinity"
    load_factor: float = Field(
        1.25,
        ge=1.0,
        le=MAX_ROUTER_WEIGHT,
        description="A replica takes a request only while its in-flight count is below "
        "ceil(load_factor * (total in flight + 1) / replicas); 1.0 balances strictly, a very "
        "large value never spills.",
    )
    virtual_nodes: int = Field(
        100, gt=0, le=MAX_VIRTUAL_NODES, description="Points per replica on the hash ring."
    )


class _PrefixIndexed(_RouterBase):
    max_prefix_blocks: int | None = Field(
        None,
        gt=0,
        le=MAX_NUM_GPU_BLOCKS,
        description="Only the first this many blocks of a prompt are matched (llm-d's "
        "maxPrefixBlocksToMatch, 256 there); none: the whole prompt.",
    )
    index_capacity_blocks: int | None = Field(
        None,
        gt=0,
        le=MAX_NUM_GPU_BLOCKS,
        description="Block hashes the router remembers per replica, least recently routed "
        "first out (llm-d's lruCapacityPerServer); none: the replica's number of KV blocks.",
    )


class PrefixAwareRouter(_PrefixIndexed):
    """SGLang's cache-aware router, on the router's own prefix index (the block hashes of
    the prompts it sent to each replica, least recently routed forgotten first, like the
    approximate index of llm-d's prefix-cache scorer). In this order: when the requests in
    flight are imbalanced (max - min above ``balance_abs_threshold`` and max above
    ``balance_rel_threshold`` times min), the fewest in flight; else, when some replica
    holds more than ``cache_threshold`` of the prompt, the longest match; else the replica
    whose index holds the fewest blocks (the most room). Ties go to the fewest in flight,
    then the lowest index."""

    kind: Literal["prefix_aware"] = "prefix_aware"
    cache_threshold: float = Field(
        0.5,
        ge=0,
        le=1,
        description="The longest match wins only when it covers more than this share of "
        "the prompt (SGLang's default 0.5); 0: any match wins.",
    )
    balance_abs_threshold: int = Field(
        32,
        ge=0,
        le=MAX_REQUESTS,
        description="Requests in flight max - min above which (with the relative one) load "
        "wins over cache (SGLang's default 32).",
    )
    balance_rel_threshold: float = Field(
        1.0001,
        ge=1,
        le=MAX_ROUTER_WEIGHT,
        description="max / min of requests in flight above which (with the absolute one) "
        "load wins over cache (SGLang's default 1.0001).",
    )


class WeightedRouter(_PrefixIndexed):
    """llm-d's inference scheduler: a weighted sum of scorers, highest total wins (ties to
    the fewest in flight, then the lowest index). Prefix scorer: matched prefix blocks /
    prompt blocks (the same index as ``prefix_aware``); queue scorer: (max - own) / (max -
    min) of the replicas' reported waiting queues (1 when all are equal); KV-usage scorer:
    1 - reported KV cache usage.
    Default weights as in llm-d's examples (prefix 3, queue 2, KV usage 2)."""

    kind: Literal["weighted"] = "weighted"
    prefix_weight: float = Field(3.0, ge=0, le=MAX_ROUTER_WEIGHT, description="Prefix scorer.")
    queue_weight: float = Field(2.0, ge=0, le=MAX_ROUTER_WEIGHT, description="Queue scorer.")
    kv_usage_weight: float = Field(
        2.0, ge=0, le=MAX_ROUTER_WEIGHT, description="KV-cache-usage scorer."
    )

    @model_validator(mode="after")
    def _some_weight(self) -> WeightedRouter:
        if not (self.prefix_weight or self.queue_weight or self.kv_usage_weight):
            raise ValueError(
                "prefix_weight, queue_weight and kv_usage_weight are all 0: every replica "
                "would score alike; give at least one a weight"
            )
        return self


RouterConfig = Annotated[
    RoundRobinRouter
    | LeastLoadedRouter
    | SessionAffinityRouter
    | PrefixAwareRouter
    | WeightedRouter,
    Field(discriminator="kind"),
]

# The ``kind`` of each router, in the order of the table in sim.fleet.routers.
ROUTER_KINDS: tuple[str, ...] = tuple(
    model.model_fields["kind"].default
    for model in (
        RoundRobinRouter,
        LeastLoadedRouter,
        SessionAffinityRouter,
        PrefixAwareRouter,
        WeightedRouter,
    )
)


# Why a fleet is a what-if, the end of every fleet's what-if line.
ROUTING_WHAT_IF = "(vLLM 0.32 serves one engine; the routing is kvsim's model)"


def fleet_what_if(replicas: int, router: str) -> str:
    """The what-if line of a fleet, for the outputs: vLLM serves one engine, and the router
    that spreads the traffic over the replicas is kvsim's model of one."""
    return (
        f"fleet of {replicas} replica{'s' if replicas != 1 else ''} behind a simulated "
        f"{router} router {ROUTING_WHAT_IF}"
    )


def router_section(current: dict[str, Any], kind: str) -> dict[str, Any]:
    """A ``fleet.router`` section (as in a scenario document) for router ``kind``: ``current``
    itself when it is of that kind, else ``kind`` with its defaults, seeing the replicas as
    stale as ``current`` does (its ``view_delay_s``), so that routers compare alike."""
    if current.get("kind") == kind:
        return current
    return {"kind": kind, "view_delay_s": current.get("view_delay_s", 0.0)}


class FleetConfig(KvsimModel):
    """Replicas of the scenario's engine behind one router."""

    replicas: int = Field(
        gt=0,
        le=MAX_REPLICAS,
        description="Number of engine replicas (GPUs or tensor-parallel groups).",
    )
    router: RouterConfig = Field(
        default_factory=RoundRobinRouter, description="How requests are placed (kind: ...)."
    )

    @field_validator("router", mode="before")
    @classmethod
    def _router_has_a_kind(cls, value: Any) -> Any:
        if isinstance(value, dict) and "kind" not in value:
            raise ValueError(f"a router needs a kind: one of {', '.join(ROUTER_KINDS)}")
        return value
