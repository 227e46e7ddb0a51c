"""Calibrate and validate in one interleaved session: what CI and the validation benchmark run.

A shared machine is not equally fast all the time: on the 2-core CI machines the same replay
runs up to ~15% faster or slower from one minute to the next. A profile fitted on replays
from one stretch of time and checked against replays from another would measure that drift,
not kvsim. So the replays alternate: round ``i`` replays calibration scenario ``i`` and then
every validation scenario once. The profile is fitted on the calibration replays only, each
validation scenario is simulated once with it, and compared against the median of its
replays (with their spread kept in the report).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sim.cost_model import CalibrationProfile, save_profile
from sim.results import RunData
from sim.scenario import Scenario
from validate.calibrate import calibrate
from validate.runner import ValidationReport, build_report, run_real, run_sim

PROFILE_NAME = "profile.json"


@dataclass
class SuiteResult:
    profile: CalibrationProfile
    calibration_runs: list[RunData]
    reports: dict[str, ValidationReport]  # by validation scenario name
    real_runs: dict[str, list[RunData]]
    sim_runs: dict[str, RunData]


def run_suite(
    calibration: Sequence[Scenario],
    validation: Sequence[Scenario],
    out_dir: Path,
    device: str = "cpu",
    model: str | None = None,
    on_replay: Callable[[str], None] | None = None,
) -> SuiteResult:
    """Interleaved replays (one round per calibration scenario), fit, simulate, compare.

    Writes ``out_dir/<calibration name>``, ``out_dir/<validation name>/real-<round>``,
    ``out_dir/<validation name>/sim`` and ``out_dir/profile.json``. Raises what
    :func:`run_real` raises when vLLM fails.
    """
    if not calibration or not validation:
        raise ValueError("run_suite needs at least one calibration and one validation scenario")
    names = [s.name for s in validation]
    all_names = [s.name for s in calibration] + names
    if len(set(all_names)) != len(all_names):
        raise ValueError(f"scenario names must differ (they name the run folders): {all_names}")
    out_dir.mkdir(parents=True, exist_ok=False)
    measured: list[RunData] = []
    reals: dict[str, list[RunData]] = {name: [] for name in names}
    for round_no, cal in enumerate(calibration, start=1):
        if on_replay is not None:
            on_replay(f"round {round_no}/{len(calibration)}: calibration {cal.name}")
        measured.append(run_real(cal, device, model, out_dir / cal.name))
        for scenario in validation:
            if on_replay is not None:
                on_replay(f"round {round_no}/{len(calibration)}: validation {scenario.name}")
            run_dir = out_dir / scenario.name / f"real-{round_no}"
            reals[scenario.name].append(run_real(scenario, device, model, run_dir))
    profile = calibrate([run.path for run in measured], command="kvsim validation suite")
    profile_path = out_dir / PROFILE_NAME
    save_profile(profile, profile_path)
    reports, sims = {}, {}
    for scenario in validation:
        sims[scenario.name] = sim = run_sim(scenario, profile, out_dir / scenario.name / "sim")
        reports[scenario.name] = build_report(scenario, sim, reals[scenario.name], profile_path)
    return SuiteResult(profile, measured, reports, reals, sims)
