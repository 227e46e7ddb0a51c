"""Capacity: the heaviest load one deployment holds within its SLOs, by bisection.

The load is one workload field (the *knob*): the number of agent sessions when they all
start at once (that many agents at the same time), the session arrival rate when sessions
arrive over time, the request rate of open-loop traffic (the request count for a burst).
A load *holds* when every request finished within the run's time limit and every SLO
(the scenario's ``slos``, overridable) passes. A rate below the scenario's own gets its
time limit stretched in proportion (the same arrivals take longer to arrive), so a light
load is not cut off unfinished. From the scenario's own load the search
doubles (or halves) until it brackets the edge, then bisects to one session or 2% of a
rate. Every simulation is a point of the curve it returns (latency percentiles vs load),
with the knee of the p99 TTFT curve.

:func:`find_min_replicas` turns the question around for a fleet: the fewest replicas (GPUs,
or tensor-parallel groups) behind a given router that hold the scenario's own load, by
doubling (or halving) the replica count, then bisecting to one replica.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from sim.config.limits import MAX_SECONDS
from sim.errors import KvsimConfigError
from sim.fleet.config import MAX_REPLICAS, router_section
from sim.scenario import Scenario, check_runnable, parse_scenario
from sim.workload.agent_sessions import AgentSessionsWorkload
from sim.workload.distributions import BurstArrivals
from sim.workload.open_loop import OpenLoopWorkload

# The most replicas kvsim capacity --replicas tries unless told (--max-replicas).
DEFAULT_MAX_REPLICAS = 64
RATE_TOLERANCE = 0.02  # bisection on a rate stops when hi / lo - 1 is below this
MAX_SIMULATIONS = 40


@dataclass(frozen=True)
class Knob:
    field: str  # dotted path in the scenario
    integer: bool
    unit: str
    minimum: float
    maximum: float


@dataclass
class LoadPoint:
    load: float
    holds: bool
    failed: list[str]  # why it does not hold: SLOs missed, unfinished requests
    num_requests: int
    num_finished: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    e2e_p99_s: float | None
    output_throughput_tok_s: float | None
    preemptions: int | None
    peak_concurrent_sessions: int | None
    prefix_cache_hit_rate: float | None = None


@dataclass
class CapacityResult:
    knob: Knob
    capacity: float | None  # the heaviest load that held
    first_failing: float | None  # the lightest load that did not
    curve: list[LoadPoint] = field(default_factory=list)  # sorted by load
    knee: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "knob": asdict(self.knob),
            "capacity": self.capacity,
            "first_failing": self.first_failing,
            "knee": self.knee,
            "simulations": len(self.curve),
            "curve": [asdict(p) for p in self.curve],
        }


def get_field(document: dict[str, Any], path: str) -> Any:
    """The value at a dotted path of a scenario document (KeyError when absent)."""
    node: Any = document
    for key in path.split("."):
        node = node[key]
    return node


def _set(document: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    node = document
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value


# Workload fields that are numbers but no load (more of them is not more traffic).
NOT_LOAD_FIELDS = frozenset(
    ("workload.time_scale", "workload.vocab_size", "workload.hash_block_tokens", "workload.until_s")
)


def knob_for(scenario: Scenario, field: str) -> Knob:
    """The knob ``--knob FIELD`` names: the default one when it is that field, else a knob
    whose type follows the field's current value (an integer stays an integer)."""
    default = default_knob(scenario, strict=False)
    if default is not None and default.field == field:
        return default
    if not field.startswith("workload.") or field in NOT_LOAD_FIELDS:
        # The search assumes more of the knob is more load: a field of the traffic.
        raise KvsimConfigError(
            f"--knob {field}: not a load; give a field of the workload (e.g. "
            "workload.sessions, workload.turns.value), or leave --knob out for the default"
        )
    try:
        value = get_field(scenario.model_dump(mode="json"), field)
    except (KeyError, TypeError):
        raise KvsimConfigError(f"--knob {field}: not a field of this scenario") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KvsimConfigError(f"--knob {field}: {value!r} is not a number to search over")
    if isinstance(value, int):
        return Knob(field, True, field, 1, 1_000_000)
    return Knob(field, False, field, 1e-6, 1e6)


def default_knob(scenario: Scenario, strict: bool = True) -> Knob | None:
    """The load field of the scenario's workload (see the module docstring)."""
    w = scenario.workload
    if isinstance(w, AgentSessionsWorkload):
        if isinstance(w.session_arrival, BurstArrivals):
            return Knob("workload.sessions", True, "concurrent sessions", 1, 100_000)
        return Knob("workload.session_arrival.rate_per_s", False, "sessions/s", 1e-6, 1e6)
    if isinstance(w, OpenLoopWorkload):
        if isinstance(w.arrival, BurstArrivals):
            return Knob("workload.num_requests", True, "requests at once", 1, 1_000_000)
        return Knob("workload.arrival.rate_per_s", False, "requests/s", 1e-6, 1e6)
    if not strict:
        return None
    raise KvsimConfigError(
        f"scenario {scenario.name!r}: a {w.kind} workload has no load knob kvsim can turn; "
        "capacity needs agent sessions or open-loop traffic (or --knob FIELD)"
    )


def load_point(load: float, summary: dict[str, Any]) -> LoadPoint:
    metrics = summary["metrics"]

    def pct(name: str, q: str) -> float | None:
        return (metrics.get(name) or {}).get(q)

    failed = [
        f"{name} {v['value']:.4g} > {v['target']:g}"
        if v["value"] is not None
        else f"{name}: no value (no request got that far)"
        for name, v in summary["slos"].items()
        if not v["pass"]
    ]
    unfinished = summary["num_requests"] - summary["num_finished"]
    if unfinished:
        failed.append(f"{unfinished} of {summary['num_requests']} requests unfinished at the limit")
    if not_arrived := summary.get("num_not_arrived", 0):
        failed.append(f"{not_arrived} requests had not arrived at the limit")
    if summary["num_requests"] == 0:
        failed.append("no request arrived before the time limit")
    return LoadPoint(
        load=load,
        holds=not failed,
        failed=failed,
        num_requests=summary["num_requests"],
        num_finished=summary["num_finished"],
        ttft_p50_s=pct("vllm:time_to_first_token_seconds", "p50"),
        ttft_p99_s=pct("vllm:time_to_first_token_seconds", "p99"),
        itl_p50_s=pct("vllm:inter_token_latency_seconds", "p50"),
        itl_p99_s=pct("vllm:inter_token_latency_seconds", "p99"),
        e2e_p99_s=pct("vllm:e2e_request_latency_seconds", "p99"),
        output_throughput_tok_s=metrics.get("output_throughput_tok_s"),
        preemptions=(metrics.get("vllm:num_preemptions") or {}).get("total"),
        peak_concurrent_sessions=metrics.get("peak_concurrent_sessions"),
        prefix_cache_hit_rate=metrics.get("prefix_cache_hit_rate"),
    )


def knee(curve: list[LoadPoint]) -> float | None:
    """Where p99 TTFT turns up (Kneedle on the convex increasing curve: the load farthest
    below the chord from the lightest to the heaviest load). None with under three points
    or a flat curve."""
    points = sorted((p.load, p.ttft_p99_s) for p in curve if p.ttft_p99_s is not None)
    if len(points) < 3:
        return None
    (x0, y0), (x1, y1) = points[0], points[-1]
    if x1 <= x0 or y1 <= y0:
        return None
    gaps = [((x - x0) / (x1 - x0)) - ((y - y0) / (y1 - y0)) for x, y in points]
    best = max(range(len(points)), key=gaps.__getitem__)
    return points[best][0] if gaps[best] > 0 else None


def _simulate_point(
    load: float,
    document: dict[str, Any],
    source: str,
    simulate_summary: Callable[[Scenario], dict[str, Any]],
    points: dict[Any, LoadPoint],
    on_point: Callable[[LoadPoint], None] | None,
) -> LoadPoint:
    """Simulate one point of a search (``document`` set to it) and record it in ``points``;
    past MAX_SIMULATIONS points, the search gives up."""
    if len(points) >= MAX_SIMULATIONS:
        raise KvsimConfigError(
            f"capacity: no answer within {MAX_SIMULATIONS} simulations; narrow the search"
        )
    spec = parse_scenario(document, source)
    check_runnable(spec)
    point = load_point(load, simulate_summary(spec))
    points[load] = point
    if on_point is not None:
        on_point(point)
    return point


def find_capacity(
    scenario: Scenario,
    simulate_summary: Callable[[Scenario], dict[str, Any]],
    knob: Knob | None = None,
    on_point: Callable[[LoadPoint], None] | None = None,
) -> CapacityResult:
    """Bracket and bisect the knob; ``simulate_summary`` runs one scenario (the CLI passes
    kvsim's simulator). Raises KvsimConfigError when even the lightest load tried fails,
    naming the bounds it missed."""
    knob = knob or default_knob(scenario)
    assert knob is not None  # default_knob is strict here
    document = scenario.model_dump(mode="json")
    try:
        start = float(get_field(document, knob.field))
    except (KeyError, TypeError):
        raise KvsimConfigError(f"--knob {knob.field}: not a field of this scenario") from None
    points: dict[float, LoadPoint] = {}
    limit_s = scenario.limits.max_duration_s

    def run(load: float) -> LoadPoint:
        load = float(round(load)) if knob.integer else load
        if load in points:
            return points[load]
        _set(document, knob.field, int(load) if knob.integer else load)
        if not knob.integer and load < start:
            # A lower rate spreads the same sessions or requests over a longer time: give
            # the run that much more time, or it is cut off with its last arrivals unserved.
            document["limits"]["max_duration_s"] = min(limit_s * start / load, MAX_SECONDS)
        else:
            document["limits"]["max_duration_s"] = limit_s
        source = f"{scenario.name} at {knob.field}={load:g}"
        return _simulate_point(load, document, source, simulate_summary, points, on_point)

    def close(lo: float, hi: float) -> bool:
        return hi - lo <= 1 if knob.integer else hi / lo - 1 <= RATE_TOLERANCE

    load = min(max(start, knob.minimum), knob.maximum)
    if run(load).holds:
        lo, hi = load, None
        while hi is None:
            nxt = min(lo * 2, knob.maximum)
            if nxt == lo:
                break  # holds at the knob's ceiling
            if run(nxt).holds:
                lo = nxt
            else:
                hi = nxt
    else:
        lo, hi = None, load
        while lo is None:
            nxt = hi / 2
            if knob.integer:
                nxt = math.floor(nxt)
            if nxt < knob.minimum or nxt == hi:
                lightest = points[min(points)]
                raise KvsimConfigError(
                    f"capacity: the SLOs hold at no load tried; at the lightest, "
                    f"{knob.field}={lightest.load:g}: {'; '.join(lightest.failed)}"
                )
            if run(nxt).holds:
                lo = nxt
            else:
                hi = nxt
    while hi is not None and not close(lo, hi):
        mid = (lo + hi) / 2
        if knob.integer:
            mid = math.floor(mid)
        if run(mid).holds:
            lo = mid
        else:
            hi = mid
    curve = [points[x] for x in sorted(points)]
    return CapacityResult(knob, lo, hi, curve, knee(curve))


@dataclass
class ReplicaSearch:
    """The fewest replicas that hold the load, behind one router."""

    router: str
    fewest: int | None  # None: even the most tried does not hold
    most_failing: int | None  # the most replicas that did not hold (None: all held)
    curve: list[LoadPoint] = field(default_factory=list)  # by replica count (``load``)

    def to_json(self) -> dict[str, Any]:
        return {
            "router": self.router,
            "fewest_replicas": self.fewest,
            "most_failing_replicas": self.most_failing,
            "simulations": len(self.curve),
            "curve": [asdict(p) for p in self.curve],
        }


def find_min_replicas(
    scenario: Scenario,
    simulate_summary: Callable[[Scenario], dict[str, Any]],
    router: str | None = None,
    on_point: Callable[[LoadPoint], None] | None = None,
    max_replicas: int = DEFAULT_MAX_REPLICAS,
) -> ReplicaSearch:
    """The fewest ``fleet.replicas`` that hold the scenario's load within its SLOs, with
    the router of kind ``router`` (default: the scenario's own router, or round robin; a
    router other than the scenario's gets its defaults and the scenario's
    ``view_delay_s``).

    Starts from the scenario's replica count (1 without a fleet section) and tries at most
    ``max_replicas``, nor more replicas than the workload has requests. A point holds as
    in :func:`find_capacity`. The search assumes more replicas never hurt, which holds for
    the load-balancing routers; a router that piles traffic on one replica (pure prefix
    affinity on a shared system prompt) may hold at no count: the curve shows it.
    """
    document = scenario.model_dump(mode="json")
    fleet = document.get("fleet") or {"replicas": 1, "router": {"kind": "round_robin"}}
    if router is not None:
        fleet["router"] = router_section(fleet["router"], router)
    document["fleet"] = fleet
    kind = fleet["router"]["kind"]
    points: dict[int, LoadPoint] = {}

    def holds(replicas: int) -> bool:
        if replicas not in points:
            fleet["replicas"] = replicas
            source = f"{scenario.name} on {replicas} replicas ({kind})"
            _simulate_point(replicas, document, source, simulate_summary, points, on_point)
        return points[replicas].holds

    max_replicas = min(max_replicas, MAX_REPLICAS)
    start = min(max(int(fleet["replicas"]), 1), max_replicas)
    lo: int | None = None  # most replicas known to fail
    hi: int | None = None  # fewest known to hold
    if holds(start):
        hi = start
        while hi > 1:
            nxt = hi // 2
            if holds(nxt):
                hi = nxt
            else:
                lo = nxt
                break
    else:
        lo = start
        # More replicas than requests leaves some idle: past that, adding more cannot help.
        while hi is None and lo < max_replicas and lo < points[lo].num_requests:
            nxt = min(lo * 2, max_replicas)
            if holds(nxt):
                hi = nxt
            else:
                lo = nxt
    while lo is not None and hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            hi = mid
        else:
            lo = mid
    curve = [points[n] for n in sorted(points)]
    return ReplicaSearch(kind, hi, lo, curve)
