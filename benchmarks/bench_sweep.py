"""Sweep and tuner on the coding-agent scenario: wall time of a 27-point grid on local
workers and on a local Ray instance, and the tuner against the grid's best point.

    python benchmarks/bench_sweep.py                  # grid (local, Ray) + tuner
    python benchmarks/bench_sweep.py --no-ray --budget 15
    python benchmarks/bench_sweep.py --compare-only    # the tuner against the grid only

The grid: ``max_num_batched_tokens`` 2048/4096/8192 x ``max_num_seqs`` 64/128/256 x
``gpu_memory_utilization`` 0.80/0.86/0.92 on ``scenarios/coding-agents-8b-h100.yaml``
(full size: 500 sessions, 4,890 requests), timed on local workers and on Ray.

The tuner (``kvsim tune --objective goodput``) searches a larger space (block size,
long-prefill threshold, prefix caching, policy too) with ``--budget`` trials. It is compared
with the same grid at a load where some configs meet every SLO (``--compare-set``, by default
the scenario at a session arrival rate of 0.16/s: at its shipped 0.2/s no config of the grid
does, so "best feasible" would compare nothing): the report says whether the tuner's best
feasible goodput reaches the grid's best, and with how many simulations against the grid's
27. Timings only, printed as a table; no assertions (design.md: speed lives in benchmarks).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table

from sim.cores import default_workers
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.sweep import plan_sweep, run_sweep
from sim.tune import tune

SCENARIO = SCENARIO_DIR / "coding-agents-8b-h100.yaml"
SETS: list[str] = []  # the scenario as shipped
# The tuner-vs-grid comparison's load: sessions arriving at 0.16/s instead of 0.2/s, where
# part of the grid meets every SLO with every request finished (at the shipped 0.2/s none
# does under the H100 kernel model).
COMPARE_SETS = ["workload.session_arrival.rate_per_s=0.16"]
GRID = [
    "engine.max_num_batched_tokens=2048,4096,8192",
    "engine.max_num_seqs=64,128,256",
    "engine.gpu_memory_utilization=0.80,0.86,0.92",
]


def timed_sweep(
    out: Path, workers: int, ray: str | None, sets: list[str] = SETS
) -> tuple[float, pd.DataFrame]:
    plan = plan_sweep(SCENARIO, GRID, sets, out)
    started = time.perf_counter()
    table = run_sweep(plan, workers, ray_address=ray)
    return time.perf_counter() - started, table


def feasible_points(table: pd.DataFrame) -> pd.DataFrame:
    """Points that ran, met every SLO and finished every request."""
    return table[(table["status"] == "ok") & (table["slo_pass"]) & (table["num_finished"]
                 == table["num_requests"])]  # fmt: skip


def feasible(table: pd.DataFrame) -> int:
    return len(feasible_points(table))


def best_goodput(table: pd.DataFrame) -> float | None:
    ok = feasible_points(table)
    return float(ok["goodput_req_s"].max()) if len(ok) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    parser.add_argument(
        "--compare-only", action="store_true", help="skip the timed grid at the shipped load"
    )
    parser.add_argument("--budget", type=int, default=15, help="tuner trials (default 15)")
    parser.add_argument("--workers", type=int, default=default_workers())
    parser.add_argument(
        "--compare-set",
        action="append",
        default=None,
        help=f"override for the tuner-vs-grid comparison (repeatable; default {COMPARE_SETS})",
    )
    args = parser.parse_args()
    compare_sets = args.compare_set or COMPARE_SETS
    console = Console(width=110)
    console.print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; scenario {SCENARIO.name} {' '.join(SETS)}"
    )
    table = Table(title="27-point sweep and the tuner")
    for column in ("run", "points / trials", "simulations", "wall s", "best goodput req/s"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        if not args.compare_only:
            wall, grid = timed_sweep(Path(tmp) / "local", args.workers, None)
            table.add_row(f"sweep, {args.workers} local workers", str(len(grid)),
                          str(int((grid["status"] == "ok").sum())), f"{wall:.1f}",
                          f"{best_goodput(grid)} ({feasible(grid)} feasible)")  # fmt: skip
        if not args.no_ray and not args.compare_only:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            wall_ray, on_ray = timed_sweep(Path(tmp) / "ray", args.workers, "local")
            same = on_ray.drop(columns="run_dir").equals(grid.drop(columns="run_dir"))
            table.add_row("sweep, --ray local", str(len(on_ray)),
                          str(int((on_ray["status"] == "ok").sum())), f"{wall_ray:.1f}",
                          f"{best_goodput(on_ray)} (same table: {same})")  # fmt: skip
        # The comparison: the same grid and the tuner at a load part of the grid holds.
        wall_cmp, compared = timed_sweep(Path(tmp) / "compare", args.workers, None, compare_sets)
    table.add_row(f"sweep at {' '.join(compare_sets)}", str(len(compared)),
                  str(int((compared["status"] == "ok").sum())), f"{wall_cmp:.1f}",
                  f"{best_goodput(compared)} ({feasible(compared)} feasible)")  # fmt: skip
    spec = load_scenario(SCENARIO, compare_sets)
    started = time.perf_counter()
    result = tune(spec, "goodput", args.budget, lambda s: simulate(s).summary)
    wall_tune = time.perf_counter() - started
    tuned = result.best.objective if result.best else None
    table.add_row(f"tune --objective goodput at {' '.join(compare_sets)}", str(len(result.trials)),
                  str(result.simulations), f"{wall_tune:.1f}", f"{tuned}")  # fmt: skip
    console.print(table)
    grid_best = best_goodput(compared)
    if tuned is not None and grid_best:
        verdict = "reaches" if tuned >= grid_best else "does not reach"
        console.print(
            f"the tuner's best ({tuned:.7g}) {verdict} the grid's best ({grid_best:.7g}; "
            f"{100 * (tuned / grid_best - 1):+.4f}%) with {result.simulations} simulations "
            f"against the grid's {len(compared)}"
        )
        if result.best is not None:
            console.print(f"the tuner's best config: {result.best.params}")
    elif not grid_best:
        console.print("no point of the comparison grid meets every SLO: choose a lighter "
                      "--compare-set")  # fmt: skip
    else:
        console.print("the tuner found no feasible config within its budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
