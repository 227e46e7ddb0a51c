"""A validation session's misses split in two: the replay machine's speed, and the rest.

    python benchmarks/bench_speed_matched.py DIR      # DIR: a bench_validation.py --out
    python benchmarks/bench_speed_matched.py DIR --profile REFIT/profile.json

On a shared machine one vLLM process runs the same batches up to ~25% slower or faster than the
next, and a replay's latencies follow its speed. This re-reads a validation session
(``benchmarks/bench_validation.py --out DIR``: ``DIR/profile.json`` and the replays
``DIR/val-<scenario>/real-*``) and, for every validation scenario, simulates it again at each
replay's own step speed (``step_time_scale`` = that replay's median measured / predicted step
time, :func:`validate.calibrate.step_time_ratio`). Per bounded metric it prints kvsim's error
against the replays' median as the session reported it (the profile's speed), the error of the
median of the speed-matched simulations against the same median, and the range of the
per-replay errors (each replay against kvsim at its speed). A miss that stays when the speeds
are matched is not the machine's speed. Also per scenario: the replays' step ratios on prefill
steps and on decode-only steps (medians over the replays), which shows whether one kind of step
is priced off. Then each scenario's replays, calibration and validation, against the price:
their median step and their whole run's measured / priced time (the first is the speed a band
draws, the second what latencies add up), and their decode steps against the calibration
replays' decode steps of the same batch size and context ("shape-matched": whether a scenario
runs off the price because of the shapes it runs or on its own). Last, over all of the
session's replays (calibration and validation apart), the first step after the engine sat idle,
measured / priced, by how long it sat idle: the cost model prices that wake-up as
``idle_wakeup_s`` plus ``idle_wakeup_log_s`` x ln(1 + idle / 10 ms), and this shows how well at
every gap. And the steps with a prefill chunk (wake-ups left out), measured / priced, by how
many tokens the step computes, per token budget: the cost model is linear in a step's tokens
(beyond the first step of each token count, which builds kernels: sim/kernel_builds.py), and
this shows where that is off (cells of under 20 steps are left out); and the decode-only steps,
measured / priced, by how many requests decode and the mean context they attend over. No vLLM
needed: simulations only, seconds to a minute. ``--profile`` prices and simulates with another
profile than the session's own, e.g. the one ``bench_validation.py --refit DIR --out REFIT``
fitted on the same replays."""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml
from rich.console import Console
from rich.table import Table

from sim.config.calibration import CalibrationProfile, load_profile
from sim.cost_model import CostModel
from sim.metrics import HEADLINE_METRICS, metric_value
from sim.results import RunData, load_run
from sim.runner import simulate
from sim.scenario import Scenario, parse_scenario
from validate.calibrate import MeasuredRun, step_time_ratio
from validate.compare import BAR_FIGURES
from validate.suite import replay_dirs

# Idle gaps (s) the wake-up table splits the first steps after idle by.
GAP_EDGES_S = (0.0, 0.01, 0.05, 0.2, 1.0, 5.0, float("inf"))

# Tokens in a step (prefill chunks plus decodes) the prefill table splits steps by.
TOKEN_EDGES = (1, 64, 96, 128, 160, 256, 512, 1024, 2048, 2**31)
# Decodes in a step, and mean context per decode (tokens), the decode table splits by.
DECODE_EDGES = (1, 2, 4, 8, 16, 32, 2**31)
CONTEXT_EDGES = (0, 512, 2048, 8192, 2**31)
# A cell of the prefill and decode tables with fewer steps than this prints "-".
MIN_CELL_STEPS = 20

# The bounded latency and throughput figures (preemptions and hit rate are counts that
# speed-matching does not address).
METRICS = [m for m in HEADLINE_METRICS if m[0] in BAR_FIGURES]


class StepRatio(NamedTuple):
    """One non-empty measured step against its price."""

    prefill: bool  # it computes a prefill chunk
    gap_s: float | None  # seconds the engine sat idle before it; None: it followed at once
    ratio: float  # measured / predicted time
    priced_s: float  # predicted time
    tokens: int  # tokens it computes: prefill chunks plus one per decode
    context: float  # mean context a decode of the step attends over (0 without decodes)


def step_ratio_rows(
    run: RunData, scenario: Scenario, profile: CalibrationProfile
) -> list[StepRatio]:
    """Every non-empty step of a measured run against the profile's price."""
    params = profile.params_for(scenario.engine.max_num_batched_tokens)
    m = MeasuredRun.of(run, scenario)
    engine = scenario.engine
    cost = CostModel(scenario.model, scenario.hardware, engine.tensor_parallel_size, params)
    rows = []
    for step, duration in zip(m.steps(), m.durations_s, strict=True):
        shape, idle, _, idle_s, _ = step
        if shape.num_tokens:
            priced_s = cost.step_time_s(*step)
            prefill = bool(shape.num_prefill_reqs)
            context = shape.decode_context_tokens / max(shape.num_decode_reqs, 1)
            gap_s = idle_s if idle else None
            ratio = duration / priced_s
            rows.append(StepRatio(prefill, gap_s, ratio, priced_s, shape.num_tokens, context))
    return rows


def median_of(values: list[float], digits: int = 2) -> str:
    return f"{statistics.median(values):.{digits}f}" if values else "-"


# Per kind of replay ("cal", "val"): each replay's scenario and its steps against the price.
SessionSteps = dict[str, list[tuple[Scenario, list[StepRatio]]]]


def session_steps(session: Path, profile: CalibrationProfile) -> SessionSteps:
    """Every replay of a session, calibration and validation apart, priced once for the
    tables that read them."""
    steps: SessionSteps = {}
    for kind in ("cal", "val"):
        steps[kind] = []
        for run_dir in (p for d in sorted(session.glob(f"{kind}-*")) for p in replay_dirs(d)):
            run = load_run(run_dir)
            scenario = parse_scenario(yaml.safe_load(run.scenario_yaml), str(run_dir))
            steps[kind].append((scenario, step_ratio_rows(run, scenario, profile)))
    return steps


def bin_label(low: int, high: int, edges: tuple[int, ...]) -> str:
    """A column or row label for the bin [low, high) of ``edges`` (the last one open)."""
    return f"{low}-{high - 1}" if high < edges[-1] else f"{low}+"


def median_cell(ratios: Sequence[float] | np.ndarray, minimum: int = MIN_CELL_STEPS) -> str:
    """A table cell: the median ratio and how many steps, or "-" under ``minimum`` steps."""
    if len(ratios) < max(minimum, 1):
        return "-"
    return f"{np.median(ratios):.2f} ({len(ratios)})"


def replays_label(kind: str) -> str:
    """The row label of a session's calibration (``cal``) or validation replays."""
    return "calibration" if kind == "cal" else "validation"


def decode_cell(step: StepRatio) -> tuple[int, int] | None:
    """The (decodes, mean context) cell of :func:`decode_table` a decode-only step that
    followed another at once lies in; None for other steps."""
    if step.prefill or step.gap_s is not None:
        return None
    batch = int(np.searchsorted(DECODE_EDGES, step.tokens, side="right"))
    context = int(np.searchsorted(CONTEXT_EDGES, step.context, side="right"))
    return batch, context


def calibration_cells(session: SessionSteps) -> dict[tuple[int, int], float]:
    """The median measured / priced ratio of the calibration replays' decode-only steps in
    each :func:`decode_cell` of at least ``MIN_CELL_STEPS`` of them."""
    by_cell: dict[tuple[int, int], list[float]] = defaultdict(list)
    for _, steps in session.get("cal", []):
        for step in steps:
            cell = decode_cell(step)
            if cell is not None:
                by_cell[cell].append(step.ratio)
    return {
        cell: float(np.median(ratios))
        for cell, ratios in by_cell.items()
        if len(ratios) >= MIN_CELL_STEPS
    }


def shape_matched(steps: Sequence[StepRatio], cells: dict[tuple[int, int], float]) -> float | None:
    """The median over a replay's decode-only steps of their ratio over the calibration
    replays' median ratio in the same cell (steps in cells the calibration lacks left out);
    None without such steps. Below 1: the replay ran its decodes faster than the
    calibration replays ran decodes of the same batch size and context."""
    matched = [
        step.ratio / cells[cell]
        for step in steps
        if (cell := decode_cell(step)) is not None and cell in cells
    ]
    return float(np.median(matched)) if matched else None


def speeds_table(session: SessionSteps) -> Table:
    """Each scenario's replays against the price: the median step (the run speed a band
    draws), the run's measured time over its priced time (what its latencies add up) and
    the median decode step against the calibration replays' decodes of the same shape
    (:func:`shape_matched`: whether a scenario's speed is its batch shapes' or its own),
    each the median over the scenario's replays, then over all calibration and all
    validation replays. Where the validation replays run faster than the calibration ones
    on both, the band (drawn at the calibration's speeds) sits slow of them."""
    table = Table(
        title="replays against the price: median step, measured / priced time of the whole "
        "run, and decodes against the calibration's of the same shape (medians over the "
        "replays)"
    )
    columns = ("replays", "scenario", "runs", "median step", "whole run", "shape-matched")
    for col in columns:
        table.add_column(col, justify="left" if col in ("replays", "scenario") else "right")
    cells = calibration_cells(session)
    for kind, replays in session.items():
        by_scenario: dict[str, list[tuple[float, float, float | None]]] = defaultdict(list)
        for scenario, steps in replays:
            if not steps:
                continue
            ratios = np.array([s.ratio for s in steps])
            priced = np.array([s.priced_s for s in steps])
            whole = float(np.sum(ratios * priced) / np.sum(priced))  # measured / priced time
            matched = shape_matched(steps, cells)
            by_scenario[scenario.name].append((float(np.median(ratios)), whole, matched))
        every = [run for runs in by_scenario.values() for run in runs]
        rows = [*sorted(by_scenario.items()), (f"all {replays_label(kind)}", every)]
        for k, (name, runs) in enumerate(rows):
            table.add_row(
                replays_label(kind) if k == 0 else "",
                name,
                str(len(runs)),
                median_of([median for median, _, _ in runs], digits=3),
                median_of([whole for _, whole, _ in runs], digits=3),
                median_of([m for _, _, m in runs if m is not None], digits=3),
            )
        table.add_section()
    return table


def wakeup_table(session: SessionSteps) -> Table:
    """The first steps after idle of all the session's replays, by idle gap."""
    table = Table(
        title="first step after idle, measured / priced, by the idle gap before it "
        "(median, and number of steps)"
    )
    table.add_column("replays")
    bins = list(itertools.pairwise(GAP_EDGES_S))
    for low, high in bins:
        table.add_column(f"{low:g}-{high:g} s", justify="right")
    for kind, replays in session.items():
        gaps, ratios = [], []
        for _scenario, steps in replays:
            for step in steps:
                if step.gap_s is not None:
                    gaps.append(step.gap_s)
                    ratios.append(step.ratio)
        gap_array, ratio_array = np.array(gaps), np.array(ratios)
        cells = [
            median_cell(ratio_array[(gap_array >= low) & (gap_array < high)], minimum=1)
            for low, high in bins
        ]
        table.add_row(replays_label(kind), *cells)
    return table


def prefill_tokens_table(session: SessionSteps) -> Table:
    """Steps with a prefill chunk (wake-ups after idle left out) of all the session's
    replays, measured / priced, by how many tokens the step computes, per token budget: the
    cost model prices a step linearly in its tokens, and this shows where that is off."""
    table = Table(
        title="steps with a prefill chunk, measured / priced, by the tokens the step computes "
        f"(median, and number of steps; cells of under {MIN_CELL_STEPS} steps left out)"
    )
    table.add_column("replays")
    table.add_column("budget", justify="right")
    bins = list(itertools.pairwise(TOKEN_EDGES))
    for low, high in bins:
        table.add_column(bin_label(low, high, TOKEN_EDGES), justify="right")
    for kind, replays in session.items():
        by_budget: dict[int, list[StepRatio]] = defaultdict(list)
        for scenario, steps in replays:
            by_budget[scenario.engine.max_num_batched_tokens] += [
                s for s in steps if s.prefill and s.gap_s is None
            ]
        for budget, steps in sorted(by_budget.items()):
            cells = [
                median_cell([s.ratio for s in steps if low <= s.tokens < high])
                for low, high in bins
            ]
            table.add_row(replays_label(kind), str(budget), *cells)
    return table


def decode_table(session: SessionSteps) -> Table:
    """Decode-only steps (wake-ups after idle left out) of all the session's replays,
    measured / priced, by how many requests decode in the step and the mean context they
    attend over: where the decode price is off, and whether the validation replays' decodes
    lie where the calibration's were priced right."""
    table = Table(
        title="decode-only steps, measured / priced, by decodes in the step and mean context "
        f"(median, and number of steps; cells of under {MIN_CELL_STEPS} steps left out)"
    )
    table.add_column("replays")
    table.add_column("context", justify="right")
    batches = list(itertools.pairwise(DECODE_EDGES))
    for low, high in batches:
        table.add_column(bin_label(low, high, DECODE_EDGES), justify="right")
    for kind, replays in session.items():
        by_cell: dict[tuple[int, int], list[float]] = defaultdict(list)
        for _, rows in replays:
            for step in rows:
                if (cell := decode_cell(step)) is not None:
                    by_cell[cell].append(step.ratio)
        for c, (c_low, c_high) in enumerate(itertools.pairwise(CONTEXT_EDGES), start=1):
            cells = [median_cell(by_cell[b, c]) for b in range(1, len(batches) + 1)]
            table.add_row(replays_label(kind), bin_label(c_low, c_high, CONTEXT_EDGES), *cells)
    return table


def pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a bench_validation.py --out directory")
    parser.add_argument(
        "--profile", type=Path, default=None, help="price with this profile (default: DIR's)"
    )
    args = parser.parse_args()
    console = Console(width=150)  # the table's width, also when piped
    profile_path = args.profile or args.dir / "profile.json"
    scenario_dirs = sorted(p for p in args.dir.glob("val-*") if p.is_dir())
    if not profile_path.is_file() or not scenario_dirs:
        sys.exit(
            f"{args.dir}: not a bench_validation.py --out directory (needs profile.json and "
            "val-<scenario>/real-* replays)"
        )
    profile = load_profile(profile_path)
    table = Table(
        title=f"kvsim vs the replays' median, at the profile's step speed and at each "
        f"replay's ({args.dir}, priced by {profile_path})"
    )
    for col in (
        "scenario",
        "replays' speed",
        "prefill / decode steps",
        "metric",
        "as reported",
        "speed-matched",
        "per replay",
    ):
        table.add_column(col, justify="left" if col in ("scenario", "metric") else "right")
    for scenario_dir in scenario_dirs:
        reals = [load_run(p) for p in replay_dirs(scenario_dir)]
        if not reals:
            continue
        scenario = parse_scenario(yaml.safe_load(reals[0].scenario_yaml), str(reals[0].path))
        params = profile.params_for(scenario.engine.max_num_batched_tokens)
        ratios = [step_time_ratio(r, scenario, params) for r in reals]
        if any(r is None for r in ratios):
            console.print(f"[yellow]{scenario_dir.name}: a replay without steps, skipped[/yellow]")
            continue
        point = simulate(scenario, profile).summary
        matched = [simulate(scenario, profile, step_time_scale=r).summary for r in ratios]
        steps = [step_ratio_rows(r, scenario, profile) for r in reals]
        prefill = [
            float(np.median([s.ratio for s in rows if s.prefill] or [np.nan])) for rows in steps
        ]
        decode = [
            float(np.median([s.ratio for s in rows if not s.prefill] or [np.nan])) for rows in steps
        ]
        speed = f"{min(ratios):.2f}-{max(ratios):.2f}"
        split = f"{median_of(prefill)} / {median_of(decode)}"
        for k, (label, path, _unit) in enumerate(METRICS):
            real_values = [metric_value(r.summary, path) for r in reals]
            sim_values = [metric_value(s, path) for s in matched]
            point_value = metric_value(point, path)
            if None in real_values or None in sim_values or point_value is None:
                continue
            reference = statistics.median(real_values)
            per_replay = [s / r - 1 for s, r in zip(sim_values, real_values, strict=True)]
            table.add_row(
                scenario.name if k == 0 else "",
                speed if k == 0 else "",
                split if k == 0 else "",
                label,
                pct(point_value / reference - 1),
                pct(statistics.median(sim_values) / reference - 1),
                f"{pct(min(per_replay))} … {pct(max(per_replay))}",
            )
        table.add_section()
    console.print(table)
    session = session_steps(args.dir, profile)
    console.print(speeds_table(session))
    console.print(wakeup_table(session))
    console.print(prefill_tokens_table(session))
    console.print(decode_table(session))


if __name__ == "__main__":
    main()
