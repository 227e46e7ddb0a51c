"""How fast the simulator runs a shipped scenario end to end (default: the coding-agent fleet).

    python benchmarks/bench_runner.py [SCENARIO ...] [--repeat N]

Reports wall seconds, simulated seconds per wall second and requests per wall second, best
of N repeats, with the machine it ran on. The brief's bar: the coding-agent scenario (500
sessions x 10 turns) under 30 s wall on a 2-core machine.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sim.runner import simulate
from sim.scenario import DEFAULT_SCENARIO, load_scenario


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", type=Path, default=[DEFAULT_SCENARIO])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    table = Table(title=f"kvsim end-to-end simulation speed (best of {args.repeat})")
    columns = ("scenario", "requests", "steps", "sim s", "wall s", "sim s / wall s", "req / wall s")
    for col in columns:
        table.add_column(col, justify="right" if col != "scenario" else "left")
    for path in args.scenarios:
        scenario = load_scenario(path)
        best = float("inf")
        for _ in range(args.repeat):
            started = time.perf_counter()
            result = simulate(scenario)
            best = min(best, time.perf_counter() - started)
        s = result.summary
        table.add_row(
            scenario.name,
            f"{s['num_requests']:,}",
            f"{s['metrics']['num_steps']:,}",
            f"{s['duration_s']:,.0f}",
            f"{best:.2f}",
            f"{s['duration_s'] / best:,.0f}",
            f"{s['num_requests'] / best:,.0f}",
        )
    console = Console()
    console.print(table)
    console.print(
        f"machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}"
    )


if __name__ == "__main__":
    main()
