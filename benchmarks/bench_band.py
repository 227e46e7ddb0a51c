"""A validation session's uncertainty bands drawn again with today's calibration.

    python benchmarks/bench_band.py DIR [--samples N]   # DIR: a bench_validation.py --out

Re-reads a validation session (``benchmarks/bench_validation.py --out DIR``: the calibration
replays ``DIR/cal-<scenario>/real-*``, and per validation scenario the replays and
``report.json``), fits the profile again from the calibration replays with this checkout's
``kvsim calibrate`` (the session's protocol: the validation replays stay out of the fit),
draws kvsim's p10-p90 band again for every validation scenario (``--samples``, default 10,
:mod:`sim.uncertainty`) and prints, per scenario, which headline metrics have the replays'
median inside the band as the session reported it and as drawn now, and how wide the bands
of the bounded figures (TTFT, ITL, E2E p50, throughput) are, session and now: a band that
holds more medians only by growing wider says so. Use it to judge a change
to the band (``step_residual_persistence``, the order steps draw their jitter in;
``held_out_metric_ratios``, the model error it multiplies latencies by) on replays already
measured. No vLLM needed: a fit and N simulations per scenario, a few minutes on
two cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from sim.config.calibration import CalibrationProfile, load_profile
from sim.results import load_run
from sim.scenario import parse_scenario
from sim.uncertainty import band_rows, run_samples
from validate.calibrate import calibrate
from validate.commands import model_error_line
from validate.compare import BAR_FIGURES
from validate.suite import replay_dirs


def changed_params(old: CalibrationProfile, new: CalibrationProfile) -> list[str]:
    """Cost parameters the refit moved by more than 1e-6 relative (none, with the code that
    wrote the session)."""
    before, after = old.params.model_dump(), new.params.model_dump()
    return [
        k
        for k, v in after.items()
        if isinstance(v, float) and abs(v - before.get(k, 0.0)) > 1e-6 * max(abs(v), 1e-12)
    ]


def inside(records: list[dict], metrics: tuple[str, ...] | None = None) -> tuple[int, int]:
    """(metrics with the replays' median inside the band, metrics with a verdict)."""
    judged = [
        r
        for r in records
        if r["inside"] is not None and (metrics is None or r["metric"] in metrics)
    ]
    return sum(r["inside"] for r in judged), len(judged)


def widths(records: list[dict], metrics: tuple[str, ...]) -> list[float]:
    """The p10-p90 width of each of ``metrics``' bands, as a fraction of its median."""
    return [
        (r["high"] - r["low"]) / r["median"]
        for r in records
        if r["metric"] in metrics and r["median"] and r["low"] is not None
    ]


def width_text(values: list[float], pick: Callable[[list[float]], float] = np.median) -> str:
    """``pick`` (the median, or e.g. max) of band widths, as a percentage."""
    return f"{100 * float(pick(values)):.1f}%" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("session", type=Path)
    parser.add_argument("--samples", type=int, default=10)
    args = parser.parse_args()
    console = Console()
    session: Path = args.session
    calibration_runs = [p for d in sorted(session.glob("cal-*")) for p in replay_dirs(d)]
    validation = [d for d in sorted(session.glob("val-*")) if (d / "report.json").is_file()]
    if not calibration_runs or not validation:
        sys.exit(
            f"{session}: not a bench_validation.py --out directory (it needs cal-*/real-* "
            "replays and val-*/report.json)"
        )
    if args.samples < 2:
        sys.exit(f"--samples {args.samples}: a band needs at least 2 samples")
    with console.status(f"fitting on {len(calibration_runs)} calibration replays"):
        profile = calibrate(calibration_runs, command="bench_band")
    persistence = ", ".join(f"{a:.3f} x {phi}^lag" for a, phi in profile.step_residual_persistence)
    console.print(
        f"refit on {len(calibration_runs)} calibration replays: r2 {profile.fit['r2']:.4f}; "
        f"step jitter persistence: {persistence or 'none'}"
    )
    if profile.held_out_metric_ratios:
        console.print(model_error_line(profile), highlight=False)
    for line in profile.stalled_warnings():  # runs this refit left out (sessions before
        console.print(line, style="yellow", markup=False, highlight=False)  # 2026-12-07 kept them)
    if (session / "profile.json").is_file():
        moved = changed_params(load_profile(session / "profile.json"), profile)
        if moved:
            console.print(f"[yellow]the refit moved {', '.join(moved)} from the session's fit")
    table = Table(title=f"replays' median inside kvsim's p10-p90 band ({args.samples} samples)")
    for column in ("scenario", "all: session", "all: now", "p50s, thr.: session",
                   "p50s, thr.: now", "p50s, thr.: band width, session -> now",
                   "outside now: replays' median vs band"):  # fmt: skip
        table.add_column(column)
    totals = [0] * 6
    all_widths: tuple[list[float], list[float]] = ([], [])
    for directory in validation:
        report = json.loads((directory / "report.json").read_text())
        reference = {m["metric"]: m["reference"] for m in report["metrics"]}
        first = load_run(replay_dirs(directory)[0])
        scenario = parse_scenario(yaml.safe_load(first.scenario_yaml), str(first.path))
        with console.status(f"{scenario.name}: {args.samples} samples"):
            rows = band_rows(None, run_samples(scenario, profile, args.samples)[1], profile)
        now = [{**asdict(r), "inside": r.contains(reference.get(r.metric))} for r in rows]
        width = (widths(report["band"], BAR_FIGURES), widths(now, BAR_FIGURES))
        all_widths[0].extend(width[0])
        all_widths[1].extend(width[1])
        counts = (
            inside(report["band"]),
            inside(now),
            inside(report["band"], BAR_FIGURES),
            inside(now, BAR_FIGURES),
        )
        for i, (k, _) in enumerate(counts):
            totals[i] += k
        totals[4] += counts[0][1]
        totals[5] += counts[2][1]
        outside = "; ".join(
            f"{r.metric} {reference[r.metric]:.4g} vs {r.low:.4g}-{r.high:.4g}"
            for r in rows
            if r.contains(reference.get(r.metric)) is False
        )
        table.add_row(
            scenario.name,
            *(f"{k} of {n}" for k, n in counts),
            f"{width_text(width[0])} -> {width_text(width[1])}",
            outside or "-",
        )
    console.print(table)
    console.print(
        f"all scenarios: {totals[0]} -> {totals[1]} of {totals[4]} headline metrics inside; "
        f"TTFT / ITL / E2E p50 and throughput: {totals[2]} -> {totals[3]} of {totals[5]}; "
        f"their bands' p10-p90 width, median over them: {width_text(all_widths[0])} -> "
        f"{width_text(all_widths[1])} of the band's median (widest "
        f"{width_text(all_widths[0], max)} -> {width_text(all_widths[1], max)})"
    )


if __name__ == "__main__":
    main()
