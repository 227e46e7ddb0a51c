"""``kvsim calibrate`` on runs whose step times are known exactly (simulated, relabelled)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.errors import KvsimConfigError
from sim.results import load_run
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.shape_coverage import fitted_cells
from sim.step_record import shapes_of_steps
from tests.validate.fake_vllm import TRUTH, fake_replay
from validate.calibrate import (
    calibrate,
    leave_one_scenario_out,
    load_measured,
    step_shapes,
    step_time_ratio,
)


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


def test_profile_records_the_shapes_it_was_fitted_on(tmp_path: Path) -> None:
    run = measured_looking_run(tmp_path, "prefill-sweep")
    profile = calibrate([run])
    shapes = shapes_of_steps(load_run(run).steps)
    assert profile.shape_cells == fitted_cells(shapes)
    coverage = profile.coverage(shapes)
    assert coverage is not None and coverage.fraction > 0.9  # cells of < 5 steps do not count
    # The decode sweep's batches of up to 32 requests: few of them are prefill-sweep shapes.
    decode = shapes_of_steps(load_run(measured_looking_run(tmp_path, "decode-sweep")).steps)
    other = profile.coverage(decode)
    assert other is not None and other.fraction < 0.5
    warning = other.warning()
    assert warning is not None and "decode-only steps of" in warning
    assert profile.model_copy(update={"shape_cells": []}).coverage(decode) is None


def test_leave_one_scenario_out_fits_without_the_held_out_runs(tmp_path: Path) -> None:
    names = ("prefill-sweep", "decode-sweep", "agentic-contexts")
    runs = [measured_looking_run(tmp_path, n) for n in names]
    measured = load_measured(runs)
    in_sample, held_out = leave_one_scenario_out(measured, calibrate(runs).params)
    assert [e.scenario for e in held_out] == [f"cal-{n}" for n in names]
    for mine, out in zip(in_sample, held_out, strict=True):
        # Noise-free steps priced by one additive model: every fit recovers it.
        assert mine.median_ratio == pytest.approx(1.0, abs=0.01)
        assert out.median_ratio == pytest.approx(1.0, abs=0.02)
        assert out.num_runs == 1 and out.num_steps > 0
    decode_sweep = held_out[1]
    assert decode_sweep.coverage < 0.5 < 0.95 < in_sample[1].coverage
    with pytest.raises(KvsimConfigError, match="at least two scenarios"):
        leave_one_scenario_out(measured[:1], TRUTH)


def test_cli_leave_one_out_prints_each_scenarios_held_out_error(tmp_path: Path) -> None:
    runs = [str(measured_looking_run(tmp_path, n)) for n in ("prefill-sweep", "decode-sweep")]
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(
        app, ["calibrate", *runs, "-o", str(out), "--leave-one-out"], env={"COLUMNS": "220"}
    )
    assert result.exit_code == 0, result.output
    assert out.exists()
    rows = [line for line in result.output.splitlines() if "cal-" in line]
    assert len(rows) == 2 and "held-out ratio" in result.output
    one = tmp_path / "one.json"
    alone = CliRunner().invoke(app, ["calibrate", runs[0], "-o", str(one), "--leave-one-out"])
    assert alone.exit_code == 2 and "at least two scenarios" in " ".join(alone.output.split())
    assert not one.exists()  # refused before fitting, nothing written
    vidur = ["--vidur", str(tmp_path), "--leave-one-out"]
    refused = CliRunner().invoke(app, ["calibrate", *vidur, "-o", str(tmp_path / "p.json")])
    assert refused.exit_code == 2
    assert "--leave-one-out applies to run directories" in " ".join(refused.output.split())
