"""The interleaved calibrate-and-validate protocol, with the real engine stood in for by the
simulator priced by known parameters (the replays themselves are tested with vLLM elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.errors import KvsimConfigError
from sim.results import RunData
from sim.scenario import SCENARIO_DIR, Scenario, load_scenario
from tests.validate.fake_vllm import TRUTH, fake_replay
from validate import suite


def test_replays_alternate_and_the_simulation_meets_the_engine_it_was_fitted_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []

    def fake_real(scenario: Scenario, device: str, model: str | None, out_dir: Path) -> RunData:
        order.append(f"{scenario.name} -> {out_dir.relative_to(tmp_path / 'suite')}")
        return fake_replay(scenario, out_dir)

    monkeypatch.setattr(suite, "run_real", fake_real)
    calibration = [
        load_scenario(SCENARIO_DIR / "calibration" / f"{n}.yaml")
        for n in ("prefill-sweep", "agentic-contexts")
    ]
    validation = [load_scenario(SCENARIO_DIR / "validation" / "agentic-multiturn.yaml")]
    result = suite.run_suite(calibration, validation, tmp_path / "suite", rounds=2, samples=2)
    assert order == [
        "cal-prefill-sweep -> cal-prefill-sweep/real-1",
        "val-agentic-multiturn -> val-agentic-multiturn/real-1",
        "cal-agentic-contexts -> cal-agentic-contexts/real-1",
        "cal-prefill-sweep -> cal-prefill-sweep/real-2",
        "val-agentic-multiturn -> val-agentic-multiturn/real-2",
        "cal-agentic-contexts -> cal-agentic-contexts/real-2",
    ]
    assert len(result.calibration_runs) == 4
    assert (tmp_path / "suite" / suite.PROFILE_NAME).is_file()
    assert result.profile.params.idle_wakeup_s == pytest.approx(TRUTH.idle_wakeup_s, rel=0.02)
    report = result.reports["val-agentic-multiturn"]
    assert len(report.real_runs) == 2
    # The replays' steps were priced by TRUTH and the fit recovered it.
    assert report.step_time_ratios == pytest.approx([1.0, 1.0], rel=0.02)
    assert report.to_json()["step_time_vs_sim"] == report.step_time_ratios
    rows = {r.metric: r for r in report.rows}
    for metric in ("TTFT p50", "ITL p50", "E2E p50", "output throughput", "preemptions"):
        assert abs(rows[metric].relative_error) < 0.01, rows[metric]
        assert len(rows[metric].reference_runs) == 2
    # Noise-free replays at one speed: the band over their run ratios is a point.
    assert result.profile.run_step_ratios == pytest.approx([1.0] * 4, rel=1e-6)
    assert result.profile.step_residual_quantiles == pytest.approx([1.0] * 1000, rel=1e-6)
    band = {b["metric"]: b for b in report.to_json()["band"]}
    assert band["ITL p50"]["low"] == pytest.approx(rows["ITL p50"].value, rel=1e-6)


def test_a_refit_of_a_sessions_replays_gives_that_sessions_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(suite, "run_real", lambda s, d, m, out: fake_replay(s, out))
    calibration = [
        load_scenario(SCENARIO_DIR / "calibration" / f"{n}.yaml")
        for n in ("agentic-contexts", "prefill-sweep")
    ]
    validation = [load_scenario(SCENARIO_DIR / "validation" / "agentic-multiturn.yaml")]
    session = tmp_path / "session"
    first = suite.run_suite(calibration, validation, session, rounds=2)
    names = ["cal-agentic-contexts", "cal-prefill-sweep"], ["val-agentic-multiturn"]
    again = suite.refit_suite(session, *names, tmp_path / "refit")
    assert again.rounds == 2
    # The calibration replays in the order the session fitted them: round by round.
    assert [r.path for r in again.calibration_runs] == [r.path for r in first.calibration_runs]
    assert again.profile.created_by == first.profile.created_by
    assert again.profile.params == first.profile.params
    before = first.reports["val-agentic-multiturn"].to_json()
    after = again.reports["val-agentic-multiturn"].to_json()
    # The same figures; only the paths to the profile and the simulation differ.
    assert after["calibration"] == str(tmp_path / "refit" / suite.PROFILE_NAME)
    assert after["sim_run"] == str(tmp_path / "refit" / "val-agentic-multiturn" / "sim")
    paths = ("calibration", "sim_run")
    assert {k: v for k, v in after.items() if k not in paths} == {
        k: v for k, v in before.items() if k not in paths
    }
    # The new folder holds the new profile and simulation; the session is left as it was.
    assert (tmp_path / "refit" / suite.PROFILE_NAME).is_file()
    assert (tmp_path / "refit" / "val-agentic-multiturn" / "sim").is_dir()
    with pytest.raises(KvsimConfigError, match="no replays of cal-decode-sweep"):
        suite.refit_suite(session, ["cal-decode-sweep"], names[1], tmp_path / "other")


def test_replay_dirs_are_in_round_order(tmp_path: Path) -> None:
    for name in ("real-10", "real-2", "real-1", "real-9", "real-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "real-3").write_text("a file, not a replay")
    assert [p.name for p in suite.replay_dirs(tmp_path)] == [
        "real-1",
        "real-2",
        "real-9",
        "real-10",
    ]


def test_suite_refuses_an_empty_side_a_reused_name_or_no_rounds(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIO_DIR / "validation" / "agentic-multiturn.yaml")
    with pytest.raises(ValueError, match="at least one calibration"):
        suite.run_suite([], [scenario], tmp_path / "a")
    with pytest.raises(ValueError, match="names must differ"):
        suite.run_suite([scenario], [scenario, scenario], tmp_path / "b")
    with pytest.raises(ValueError, match="at least one round"):
        suite.run_suite([scenario], [scenario], tmp_path / "c", rounds=0)


@pytest.mark.parametrize(
    ("max_duration_s", "rounds_run"),
    [(None, 6), (125.0, 6), (119.0, 5), (99.0, 4), (79.0, 3), (1.0, 3)],
)
def test_a_time_budget_stops_starting_rounds_but_never_below_three(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, max_duration_s: float | None, rounds_run: int
) -> None:
    now = [0.0]

    def fake_real(scenario: Scenario, device: str, model: str | None, out_dir: Path) -> RunData:
        now[0] += 10.0  # every replay takes 10 s: a round of two takes 20 s
        return fake_replay(scenario, out_dir)

    monkeypatch.setattr(suite, "run_real", fake_real)
    calibration = [load_scenario(SCENARIO_DIR / "calibration" / "prefill-sweep.yaml")]
    validation = [load_scenario(SCENARIO_DIR / "validation" / "agentic-multiturn.yaml")]
    result = suite.run_suite(
        calibration,
        validation,
        tmp_path / "suite",
        rounds=6,
        max_duration_s=max_duration_s,
        clock=lambda: now[0],
    )
    assert result.rounds == rounds_run
    assert len(result.calibration_runs) == rounds_run
    assert len(result.reports["val-agentic-multiturn"].real_runs) == rounds_run
    with pytest.raises(ValueError, match="max_duration_s=0"):
        suite.run_suite(calibration, validation, tmp_path / "x", max_duration_s=0)
