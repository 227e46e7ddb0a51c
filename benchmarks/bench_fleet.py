"""Routers compared on one fleet scenario: latency, prefix hits, imbalance, SLOs, wall time.

    python benchmarks/bench_fleet.py                                   # the coding-agent fleet
    python benchmarks/bench_fleet.py scenarios/fleet/mooncake-fleet-8b-h100.yaml \
        --set workload.path=../shared/data/mooncake/conversation_trace.jsonl
    python benchmarks/bench_fleet.py --replicas 2 --router round_robin --router session_affinity

Every router runs the same scenario (its replica count, or --replicas): the scenario's own
router as configured, the others with their defaults and its view delay, one after the other
in this process; the table is what the README's fleet
section quotes.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sim.fleet.config import ROUTER_KINDS, router_section
from sim.metrics import ITL, PREEMPTIONS, TTFT
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario, parse_scenario

DEFAULT = SCENARIO_DIR / "fleet" / "coding-agents-fleet-8b-h100.yaml"


def num(value: float | None, spec: str) -> str:
    """A figure, or '-' where the run has none (no request finished, caching off)."""
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--set", action="append", default=[], help="scenario override")
    parser.add_argument("--replicas", type=int, help="replica count (default: the scenario's)")
    parser.add_argument(
        "--router", action="append", choices=ROUTER_KINDS, help="routers (default: all)"
    )
    args = parser.parse_args()
    overrides = list(args.set)
    if args.replicas is not None:
        overrides.append(f"fleet.replicas={args.replicas}")
    console = Console(width=160)
    document = load_scenario(args.scenario, overrides).model_dump(mode="json")
    if document["fleet"] is None:
        raise SystemExit(f"{args.scenario}: no fleet section (add --set fleet.replicas=N)")
    own_router = document["fleet"]["router"]
    table = None
    for kind in args.router or ROUTER_KINDS:
        document["fleet"]["router"] = router_section(own_router, kind)
        scenario = parse_scenario(document, f"{args.scenario} ({kind})")
        started = time.perf_counter()
        result = simulate(scenario)
        wall_s = time.perf_counter() - started
        s, m = result.summary, result.summary["metrics"]
        if table is None:
            table = Table(
                title=f"{scenario.name}: {s['fleet']['replicas']} replicas, "
                f"{s['num_requests']:,} requests"
            )
            columns = ("router", "finished", "TTFT p50 s", "TTFT p99 s", "ITL p99 s", "prefix hits",
                       "preempt", "imbalance req / busy", "SLOs", "wall s")  # fmt: skip
            for col in columns:
                table.add_column(col, justify="left" if col == "router" else "right")
        imbalance = s["fleet"]["load_imbalance"]
        verdicts = s["slos"].values()
        table.add_row(
            kind,
            f"{s['num_finished']:,}",
            num(m[TTFT]["p50"], ".3f"),
            num(m[TTFT]["p99"], ".3f"),
            num(m[ITL]["p99"], ".4f"),
            num(m["prefix_cache_hit_rate"], ".1%"),
            f"{m[PREEMPTIONS]['total']:,}",
            f"{num(imbalance['requests'], '.2f')} / {num(imbalance['busy_time'], '.2f')}",
            "pass" if all(v["pass"] for v in verdicts) else "fail",
            f"{wall_s:.0f}",
        )
        console.print(f"{kind}: done in {wall_s:.0f} s", highlight=False)
    console.print(table)


if __name__ == "__main__":
    main()
