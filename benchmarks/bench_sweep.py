"""Sweep and tuner on the coding-agent scenario: wall time of a 27-point grid on local
workers and on a local Ray instance, and the tuner against the grid's best point.

    python benchmarks/bench_sweep.py                  # grid (local, Ray) + tuner
    python benchmarks/bench_sweep.py --no-ray --budget 15

The grid: ``max_num_batched_tokens`` 2048/4096/8192 x ``max_num_seqs`` 64/128/256 x
``gpu_memory_utilization`` 0.80/0.86/0.92 on ``scenarios/coding-agents-8b-h100.yaml``
(full size: 500 sessions, 4,890 requests). The tuner (``kvsim tune --objective goodput``) searches
a larger space (block size, long-prefill threshold, prefix caching, policy too) with
``--budget`` trials; the report says whether its best feasible goodput reaches the grid's
best feasible goodput and with how many simulations. Timings only, printed as a table; no
assertions (design.md: speed lives in benchmarks).
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

from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.sweep import default_workers, plan_sweep, run_sweep
from sim.tune import tune

SCENARIO = SCENARIO_DIR / "coding-agents-8b-h100.yaml"
SETS: list[str] = []  # the scenario as shipped
GRID = [
    "engine.max_num_batched_tokens=2048,4096,8192",
    "engine.max_num_seqs=64,128,256",
    "engine.gpu_memory_utilization=0.80,0.86,0.92",
]


def timed_sweep(out: Path, workers: int, ray: str | None) -> tuple[float, pd.DataFrame]:
    plan = plan_sweep(SCENARIO, GRID, SETS, out)
    started = time.perf_counter()
    table = run_sweep(plan, workers, ray_address=ray)
    return time.perf_counter() - started, table


def best_goodput(table: pd.DataFrame) -> float | None:
    ok = table[(table["status"] == "ok") & (table["slo_pass"]) & (table["num_finished"]
               == table["num_requests"])]  # fmt: skip
    return float(ok["goodput_req_s"].max()) if len(ok) else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray run")
    parser.add_argument("--budget", type=int, default=15, help="tuner trials (default 15)")
    parser.add_argument("--workers", type=int, default=default_workers())
    args = parser.parse_args()
    console = Console(width=110)
    console.print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}; scenario {SCENARIO.name} {' '.join(SETS)}"
    )
    table = Table(title="27-point sweep and the tuner")
    for column in ("run", "points / trials", "simulations", "wall s", "best goodput req/s"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        wall, grid = timed_sweep(Path(tmp) / "local", args.workers, None)
        table.add_row(f"sweep, {args.workers} local workers", str(len(grid)),
                      str(int((grid["status"] == "ok").sum())), f"{wall:.1f}",
                      f"{best_goodput(grid)}")  # fmt: skip
        if not args.no_ray:
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            wall_ray, on_ray = timed_sweep(Path(tmp) / "ray", args.workers, "local")
            same = on_ray.drop(columns="run_dir").equals(grid.drop(columns="run_dir"))
            table.add_row("sweep, --ray local", str(len(on_ray)),
                          str(int((on_ray["status"] == "ok").sum())), f"{wall_ray:.1f}",
                          f"{best_goodput(on_ray)} (same table: {same})")  # fmt: skip
    spec = load_scenario(SCENARIO, SETS)
    started = time.perf_counter()
    result = tune(spec, "goodput", args.budget, lambda s: simulate(s).summary)
    wall_tune = time.perf_counter() - started
    tuned = result.best.objective if result.best else None
    table.add_row("tune --objective goodput", str(len(result.trials)), str(result.simulations),
                  f"{wall_tune:.1f}", f"{tuned}")  # fmt: skip
    console.print(table)
    grid_best = best_goodput(grid)
    if tuned is not None and grid_best is not None:
        verdict = "reaches" if tuned >= grid_best else "does not reach"
        console.print(
            f"the tuner's best ({tuned:.4g}) {verdict} the grid's best ({grid_best:.4g}) with "
            f"{result.simulations} simulations against the grid's {len(grid)}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
