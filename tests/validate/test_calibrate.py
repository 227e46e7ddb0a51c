"""``kvsim calibrate`` on runs whose step times are known exactly (simulated, relabelled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.errors import KvsimConfigError
from sim.results import load_run
from sim.scenario import SCENARIO_DIR, load_scenario
from tests.validate.fake_vllm import TRUTH, fake_replay
from validate.calibrate import calibrate, step_shapes, step_time_ratio


def measured_looking_run(tmp_path: Path, name: str, source: str = "vllm") -> Path:
    scenario = load_scenario(SCENARIO_DIR / "calibration" / f"{name}.yaml")
    return fake_replay(scenario, tmp_path / name, source).path


def test_after_idle_flags_come_from_gaps_between_steps(tmp_path: Path) -> None:
    run = load_run(measured_looking_run(tmp_path, "agentic-contexts"))
    shapes, durations, after_idle = step_shapes(run)
    assert len(shapes) == len(durations) == len(after_idle) == len(run.steps)
    assert after_idle[0]
    start = run.steps["start_s"].to_numpy()
    end = start + run.steps["duration_s"].to_numpy()
    gaps = start[1:] - end[:-1]
    assert after_idle[1:] == [bool(g > 1e-9) for g in gaps]
    # Closed-loop agents with tool waits leave the engine idle now and then, not always.
    assert 0 < sum(after_idle) < len(after_idle) / 2


def test_calibrate_recovers_the_parameters_that_priced_the_steps(tmp_path: Path) -> None:
    runs = [measured_looking_run(tmp_path, n) for n in ("prefill-sweep", "agentic-contexts")]
    profile = calibrate(runs)
    assert profile.fit["r2"] > 0.999
    assert profile.fit["outlier_frac"] == 0.0
    assert (profile.model, profile.hardware, profile.vllm_version) == (
        "tiny-llama",
        "cpu",
        "0.32.0",
    )
    # Every calibration scenario runs at one token budget; a run at another gets a warning.
    assert profile.max_num_batched_tokens == [512]
    assert profile.budget_warning(512) is None
    for field in (
        "compute_efficiency",
        "bandwidth_efficiency",
        "step_overhead_s",
        "prefill_step_overhead_s",
        "idle_wakeup_s",
        "post_prefill_decode_s",
    ):
        assert getattr(profile.params, field) == pytest.approx(getattr(TRUTH, field), rel=0.02)


def test_step_time_ratio_is_one_against_the_pricing_that_made_the_steps(tmp_path: Path) -> None:
    scenario = load_scenario(SCENARIO_DIR / "calibration" / "agentic-contexts.yaml")
    run = load_run(measured_looking_run(tmp_path, "agentic-contexts"))
    assert step_time_ratio(run, scenario, TRUTH) == pytest.approx(1.0, rel=1e-9)
    # Priced 1 ms dearer per step, the same measured steps look faster than the model.
    dearer = TRUTH.model_copy(update={"step_overhead_s": TRUTH.step_overhead_s + 1e-3})
    ratio = step_time_ratio(run, scenario, dearer)
    assert ratio is not None and 0.3 < ratio < 0.9


def test_calibrate_refuses_simulated_runs(tmp_path: Path) -> None:
    run = measured_looking_run(tmp_path, "prefill-sweep", source="sim")
    with pytest.raises(KvsimConfigError, match="source='sim'"):
        calibrate([run])
