"""Calibrate and validate in one interleaved session: what CI and the validation benchmark run.

A shared machine is not equally fast all the time: on the 2-core CI machines the same replay
runs up to ~15% faster or slower from one minute to the next, and one vLLM process up to ~20%
faster or slower than the next on the same steps. A profile fitted on replays from one
stretch of time (or one process per batch shape) and checked against replays from another
would measure that, not kvsim. So every round replays every calibration and every
validation scenario once, alternating between the two lists, each in a fresh process. The
profile is fitted on all calibration replays (so each cost-model term is averaged over as
many processes as there are rounds), each validation scenario is simulated once with it, and
compared against the median of its replays (with their spread kept in the report).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

from sim.config.calibration import CalibrationProfile, save_profile
from sim.config.loading import load_yaml
from sim.errors import KvsimConfigError
from sim.results import RunData, load_run
from sim.scenario import Scenario, parse_scenario
from sim.uncertainty import band_rows, run_samples
from validate.calibrate import calibrate
from validate.runner import ValidationReport, build_report, run_real, run_sim

PROFILE_NAME = "profile.json"
# Six: with three, the error against their median moved by up to ~8 points between sessions.
DEFAULT_ROUNDS = 6
# The fewest rounds a time budget may cut the suite to. Three to five replays are checked
# against their full range (validate.compare.median_interval: a 75-94% interval for their
# median), six against the second lowest to second highest (78%). Four until 2026-12-05: on
# a 2-core AMD EPYC with AVX2 only, a round of CI's gate (six calibration scenarios and
# one validation scenario) took ~13 minutes: four, with the fit, ran up to its time limit.
MIN_ROUNDS = 3


@dataclass
class SuiteResult:
    profile: CalibrationProfile
    calibration_runs: list[RunData]
    reports: dict[str, ValidationReport]  # by validation scenario name
    real_runs: dict[str, list[RunData]]
    sim_runs: dict[str, RunData]
    rounds: int  # rounds run: fewer than asked when max_duration_s cut the suite short


def replay_dirs(scenario_dir: Path) -> list[Path]:
    """The replays of one scenario of a session (``real-<round>`` folders), in round order:
    ``real-10`` after ``real-9``."""
    rounds = [p for p in scenario_dir.glob("real-*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(rounds, key=lambda p: int(p.name[5:]))


def replay_order(
    calibration: Sequence[Scenario], validation: Sequence[Scenario], rounds: int
) -> list[tuple[int, Scenario]]:
    """(round, scenario) in replay order: calibration and validation alternate in a round."""
    one_round = [s for pair in zip_longest(calibration, validation) for s in pair if s is not None]
    return [(r, s) for r in range(1, rounds + 1) for s in one_round]


def run_suite(
    calibration: Sequence[Scenario],
    validation: Sequence[Scenario],
    out_dir: Path,
    device: str = "cpu",
    model: str | None = None,
    on_replay: Callable[[str], None] | None = None,
    rounds: int = DEFAULT_ROUNDS,
    max_duration_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    samples: int = 0,
) -> SuiteResult:
    """Interleaved replays (``rounds`` of each scenario), fit, simulate, compare.

    Writes ``out_dir/<scenario name>/real-<round>`` for every scenario,
    ``out_dir/<validation name>/sim`` and ``out_dir/profile.json``. Raises what
    :func:`run_real` raises when vLLM fails.

    ``max_duration_s`` bounds the replays' wall time on a slow machine: once ``MIN_ROUNDS``
    rounds are done, no round starts that would, at the mean round time so far, end past
    it. The result's ``rounds`` says how many ran.

    ``samples`` adds kvsim's band over that many step-speed samples (:mod:`sim.uncertainty`,
    drawn from the fitted profile's calibration runs) to each report.
    """
    if not calibration or not validation:
        raise ValueError("run_suite needs at least one calibration and one validation scenario")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: the suite needs at least one round")
    if max_duration_s is not None and max_duration_s <= 0:
        raise ValueError(f"max_duration_s={max_duration_s}: must be positive")
    names = [s.name for s in validation]
    all_names = [s.name for s in calibration] + names
    if len(set(all_names)) != len(all_names):
        raise ValueError(f"scenario names must differ (they name the run folders): {all_names}")
    out_dir.mkdir(parents=True, exist_ok=False)
    calibrating = {s.name for s in calibration}
    measured: list[RunData] = []
    reals: dict[str, list[RunData]] = {name: [] for name in names}
    started = clock()
    done = 0
    for round_no, scenario in replay_order(calibration, validation, rounds):
        if round_no > done + 1:  # a round is complete
            done += 1
            elapsed = clock() - started
            if (
                max_duration_s is not None
                and done >= MIN_ROUNDS
                and elapsed + elapsed / done > max_duration_s
            ):
                break
        role = "calibration" if scenario.name in calibrating else "validation"
        if on_replay is not None:
            on_replay(f"round {round_no}/{rounds}: {role} {scenario.name}")
        run = run_real(scenario, device, model, out_dir / scenario.name / f"real-{round_no}")
        (measured if role == "calibration" else reals[scenario.name]).append(run)
    else:
        done = rounds
    return evaluate_suite(measured, validation, reals, out_dir, samples, done)


def evaluate_suite(
    calibration_runs: list[RunData],
    validation: Sequence[Scenario],
    real_runs: dict[str, list[RunData]],
    out_dir: Path,
    samples: int = 0,
    rounds: int = DEFAULT_ROUNDS,
) -> SuiteResult:
    """The suite after its replays: fit a profile on ``calibration_runs``, simulate each
    validation scenario with it (and its band over ``samples`` step-speed samples), compare
    against its ``real_runs``. Writes ``out_dir/profile.json`` and ``out_dir/<name>/sim``."""
    profile = calibrate([run.path for run in calibration_runs], command="kvsim validation suite")
    profile_path = out_dir / PROFILE_NAME
    save_profile(profile, profile_path)
    reports, sims = {}, {}
    for scenario in validation:
        sims[scenario.name] = sim = run_sim(scenario, profile, out_dir / scenario.name / "sim")
        band = (
            band_rows(sim.summary, run_samples(scenario, profile, samples)[1], profile)
            if samples
            else []
        )
        reports[scenario.name] = build_report(
            scenario, sim, real_runs[scenario.name], profile_path, band
        )
    return SuiteResult(profile, calibration_runs, reports, real_runs, sims, rounds)


def refit_suite(
    session_dir: Path,
    calibration_names: Sequence[str],
    validation_names: Sequence[str],
    out_dir: Path,
    samples: int = 0,
) -> SuiteResult:
    """:func:`evaluate_suite` on the replays of an earlier session (``session_dir``, a
    :func:`run_suite` ``out_dir``): the same real runs, fitted and simulated with this
    kvsim's cost model, into the new ``out_dir``. Each validation scenario is simulated as its
    replays recorded it (their ``scenario.yaml``), not as the scenario file reads now."""
    replays = {
        name: [load_run(p) for p in replay_dirs(session_dir / name)]
        for name in [*calibration_names, *validation_names]
    }
    missing = [name for name, runs in replays.items() if not runs]
    if missing:
        raise KvsimConfigError(
            f"{session_dir}: no replays of {', '.join(missing)} (no {missing[0]}/real-* folder); "
            "refit a session written by benchmarks/bench_validation.py --out"
        )
    validation = [
        parse_scenario(load_yaml(replays[name][0].scenario_yaml, name), name)
        for name in validation_names
    ]
    out_dir.mkdir(parents=True, exist_ok=False)
    # Round by round, as run_suite replayed and fitted them.
    calibration_runs = [
        run
        for one_round in zip_longest(*(replays[name] for name in calibration_names))
        for run in one_round
        if run is not None
    ]
    real_runs = {name: replays[name] for name in validation_names}
    rounds = min(len(runs) for runs in real_runs.values())
    return evaluate_suite(calibration_runs, validation, real_runs, out_dir, samples, rounds)
