"""``kvsim calibrate`` on runs whose step times are known exactly (simulated, relabelled)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.config.calibration import hardware_warning, load_profile, save_profile
from sim.cost_model import CostParams
from sim.errors import KvsimConfigError
from sim.results import load_run
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.shape_coverage import fitted_cells
from sim.step_record import shapes_of_steps
from tests.profiles import profile_with
from tests.validate.fake_vllm import TRUTH, fake_replay
from validate import calibrate as calibrate_module
from validate.calibrate import (
    BudgetFits,
    MeasuredRun,
    budget_of,
    calibrate,
    fit_calibration,
    held_out_fits,
    held_out_run_ratios,
    incomplete_warnings,
    leave_one_scenario_out,
    load_measured,
    stalled_runs,
    step_ratios,
    step_shapes,
    step_time_ratio,
)
from validate.runner import build_report


def measured_looking_run(
    tmp_path: Path,
    name: str,
    source: str = "vllm",
    budget: int | None = None,
    params: CostParams = TRUTH,
    step_time_scale: float = 1.0,
) -> Path:
    scenario = load_scenario(SCENARIO_DIR / "calibration" / f"{name}.yaml")
    if budget is not None:
        engine = scenario.engine.model_copy(update={"max_num_batched_tokens": budget})
        scenario = scenario.model_copy(update={"engine": engine})
    out = tmp_path / (name if budget is None else f"{name}-{budget}")
    return fake_replay(scenario, out, source, params, step_time_scale).path


# Prefill steps dearer at a large token budget, as vLLM-CPU's are at 2,048 against 512.
AT_2048 = TRUTH.model_copy(update={"prefill_step_overhead_s": 12e-3, "compute_efficiency": 2.0})
BUDGETS = {512: TRUTH, 2048: AT_2048}


@pytest.fixture(scope="module")
def two_budgets(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The prefill and decode sweeps at 512 (priced by TRUTH) and at 2,048 (AT_2048)."""
    tmp_path = tmp_path_factory.mktemp("budgets")
    return [
        measured_looking_run(tmp_path, name, budget=budget, params=params)
        for budget, params in BUDGETS.items()
        for name in ("prefill-sweep", "decode-sweep")
    ]


def test_runs_at_several_budgets_get_a_fit_each_and_the_pooled_one_prices_neither(
    two_budgets: list[Path],
) -> None:
    runs = two_budgets
    profile = calibrate(runs)
    assert profile.max_num_batched_tokens == [512, 2048]
    assert sorted(profile.params_by_budget) == [512, 2048]
    for budget, truth in BUDGETS.items():
        fitted = profile.params_for(budget)
        assert profile.fit[f"r2@{budget}"] > 0.999
        for field in ("compute_efficiency", "step_overhead_s", "prefill_step_overhead_s"):
            assert getattr(fitted, field) == pytest.approx(getattr(truth, field), rel=0.02)
        assert profile.budget_warning(budget) is None
    # Each run against the fit of its own budget: every process ran at the model's speed.
    assert profile.run_step_ratios == pytest.approx([1.0] * 4, abs=0.01)
    # One fit over both budgets cannot price the prefill steps of both.
    pooled_off = []
    for m in load_measured(runs):
        budget = m.scenario.engine.max_num_batched_tokens
        prefill = [s.num_prefill_tokens > 0 for s in m.shapes if s.num_tokens]
        own = step_ratios(m, profile.params_for(budget))[prefill]
        assert np.median(own) == pytest.approx(1.0, abs=0.01)
        pooled_off.append(abs(np.median(step_ratios(m, profile.params)[prefill]) - 1.0))
    assert max(pooled_off) > 0.1
    assert "was not calibrated" in (profile.budget_warning(1024) or "")


def test_a_budgets_fit_takes_attention_from_the_fit_over_all_budgets(
    two_budgets: list[Path],
) -> None:
    """Attention per query-key pair is the kernel's, not the budget's: every budget's fit
    holds the pooled fit's attention term and fits the rest."""
    profile = calibrate(two_budgets)
    pooled = profile.params.attention_compute_efficiency
    assert pooled == pytest.approx(TRUTH.attention_compute_efficiency, rel=0.05)
    for budget in BUDGETS:
        assert profile.params_by_budget[budget].attention_compute_efficiency == pooled


def test_coverage_at_a_budget_with_its_own_fit_counts_only_that_budgets_shapes(
    two_budgets: list[Path],
) -> None:
    """A run at 2,048 is priced by the 2,048 fit alone: shapes only the 512 runs reached
    are extrapolated for it, though the profile as a whole was fitted on them."""
    runs = two_budgets
    profile = calibrate(runs)
    by_budget = {
        budget: [s for m in load_measured(runs) if budget_of(m) == budget for s in m.shapes]
        for budget in BUDGETS
    }
    assert profile.shape_cells_by_budget == {b: fitted_cells(s) for b, s in by_budget.items()}
    only_512 = set(profile.shape_cells_by_budget[512]) - set(profile.shape_cells_by_budget[2048])
    assert only_512  # chunked at 512, whole at 2,048: different prefill shapes
    at_512 = by_budget[512]
    pooled = profile.coverage(at_512)
    own = profile.coverage(at_512, 512)
    at_2048 = profile.coverage(at_512, 2048)
    assert pooled is not None and own is not None and at_2048 is not None
    # The pooled shapes hold the 2,048 runs' too, which some 512 steps share.
    assert pooled.fraction >= own.fraction > 0.9
    assert at_2048.fraction < own.fraction
    # A budget without a fit of its own is priced by the pooled fit: the pooled shapes.
    assert profile.coverage(at_512, 1024) == pooled
    # Profiles written before the per-budget cells fall back to the pooled shapes.
    older = profile.model_copy(update={"shape_cells_by_budget": {}})
    assert older.coverage(at_512, 2048) == pooled


def test_a_budget_with_too_few_steps_is_priced_by_the_fit_over_all_budgets(
    two_budgets: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = two_budgets

    def counts(dirs: list[Path]) -> tuple[int, int]:
        shapes = [s for m in load_measured(dirs) for s in m.shapes if s.num_tokens]
        prefill = sum(s.num_prefill_tokens > 0 for s in shapes)
        return prefill, len(shapes) - prefill

    # Unchunked at 2,048, the prompts take fewer prefill steps than at 512.
    at_512, at_2048 = counts(runs[:2]), counts(runs[2:])
    assert min(at_512) > at_2048[0]
    monkeypatch.setattr("validate.calibrate.MIN_BUDGET_STEPS", at_2048[0] + 1)
    profile = calibrate(runs)
    assert list(profile.params_by_budget) == [512]
    assert profile.params_for(2048) == profile.params
    assert "no fit of its own" in (profile.budget_warning(2048) or "")
    assert "r2@2048" not in profile.fit and "r2@512" in profile.fit


def test_simulate_prices_a_scenario_by_the_fit_of_its_budget(tmp_path: Path) -> None:
    profile = profile_with(TRUTH, max_num_batched_tokens=[512, 2048], params_by_budget=BUDGETS)
    scenario = load_scenario(SCENARIO_DIR / "calibration" / "prefill-sweep.yaml")
    for budget in (512, 2048, 1024):
        engine = scenario.engine.model_copy(update={"max_num_batched_tokens": budget})
        at = scenario.model_copy(update={"engine": engine})
        expected = simulate(at, profile_with(BUDGETS.get(budget, TRUTH))).steps
        result = simulate(at, profile)
        pd.testing.assert_frame_equal(result.steps, expected)
        # The summary records the fit that priced the run, not the per-budget table.
        recorded = result.summary["calibration"]
        assert recorded["params"] == BUDGETS.get(budget, TRUTH).model_dump(mode="json")
        assert recorded["priced_at_budget"] == (budget if budget in BUDGETS else None)
        assert "params_by_budget" not in recorded


def test_after_idle_flags_and_idle_gaps_come_from_gaps_between_steps(tmp_path: Path) -> None:
    run = load_run(measured_looking_run(tmp_path, "agentic-contexts"))
    shapes, durations, after_idle, idle_s = step_shapes(run)
    assert len(shapes) == len(durations) == len(after_idle) == len(idle_s) == len(run.steps)
    assert after_idle[0]
    start = run.steps["start_s"].to_numpy()
    end = start + run.steps["duration_s"].to_numpy()
    gaps = start[1:] - end[:-1]
    assert after_idle[1:] == [bool(g > 1e-9) for g in gaps]
    # The first step waited from the run's start; the others from the step before them.
    assert idle_s[0] == start[0] > 0
    assert idle_s[1:] == [float(g) if g > 1e-9 else 0.0 for g in gaps]
    # Closed-loop agents with tool waits leave the engine idle now and then, not always.
    assert 0 < sum(after_idle) < len(after_idle) / 2


def test_calibrate_recovers_the_parameters_that_priced_the_steps(tmp_path: Path) -> None:
    runs = [measured_looking_run(tmp_path, n) for n in ("prefill-sweep", "agentic-contexts")]
    profile = calibrate(runs)
    assert profile.fit["r2"] > 0.999
    assert profile.fit["outlier_frac"] == 0.0
    # The hardware is the runs' (their scenario's hardware name), not the device string.
    assert (profile.model, profile.hardware, profile.vllm_version) == (
        "tiny-llama",
        "cpu-validation",
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
        "idle_wakeup_log_s",
        "post_prefill_decode_s",
        # The engine and the fit find the same steps building kernels (sim/kernel_builds.py).
        "kernel_build_s",
        "kernel_build_per_token_s",
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


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("yaml", "scenario.yaml: not valid YAML"),
        ("no-yaml", "no scenario.yaml, which says what the run measured"),
        ("column", "steps.parquet: lacks the column(s) start_s a fit reads"),
    ],
)
def test_calibrate_names_the_damaged_file_of_a_run(
    tmp_path: Path, damage: str, message: str
) -> None:
    run = measured_looking_run(tmp_path, "prefill-sweep")
    if damage == "yaml":
        (run / "scenario.yaml").write_text("a: [")
    elif damage == "no-yaml":
        (run / "scenario.yaml").unlink()
    else:
        steps = pd.read_parquet(run / "steps.parquet").drop(columns="start_s")
        steps.to_parquet(run / "steps.parquet")
    with pytest.raises(KvsimConfigError, match=re.escape(message)):
        calibrate([run])
    cli = CliRunner().invoke(app, ["calibrate", str(run), "-o", str(tmp_path / "p.json")])
    assert cli.exit_code == 2 and "Traceback" not in cli.output, cli.output


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
    in_sample, held_out = leave_one_scenario_out(measured, calibrate(runs).params_for)
    assert [e.scenario for e in held_out] == [f"cal-{n}" for n in names]
    for mine, out in zip(in_sample, held_out, strict=True):
        # Noise-free steps priced by one additive model: every fit recovers it.
        assert mine.median_ratio == pytest.approx(1.0, abs=0.01)
        assert out.median_ratio == pytest.approx(1.0, abs=0.02)
        assert out.num_runs == 1 and out.num_steps > 0
    decode_sweep = held_out[1]
    assert decode_sweep.coverage < 0.5 < 0.95 < in_sample[1].coverage
    with pytest.raises(KvsimConfigError, match="at least two scenarios"):
        leave_one_scenario_out(measured[:1], lambda _: TRUTH)


def test_runs_held_out_of_the_fit_carry_its_error_on_an_unseen_scenario(tmp_path: Path) -> None:
    """A scenario the others' fit prices 25% fast: in sample the fit over all three leans
    towards it, held out its runs read the whole of it (what --samples draws)."""
    slow = {"agentic-contexts": 1.25}
    names = ("prefill-sweep", "decode-sweep", "agentic-contexts")
    runs = [measured_looking_run(tmp_path, n, step_time_scale=slow.get(n, 1.0)) for n in names]
    profile = calibrate(runs)
    in_sample, held_out = profile.run_step_ratios, profile.held_out_run_step_ratios
    assert len(held_out) == len(in_sample) == 3
    assert held_out[2] == pytest.approx(1.25, abs=0.03)  # the two exact scenarios' fit
    assert in_sample[2] < held_out[2]
    assert max(held_out) - min(held_out) > max(in_sample) - min(in_sample)
    # The same from the fits the caller already has (kvsim calibrate --leave-one-out).
    measured = load_measured(runs)
    others = held_out_fits(measured)
    assert sorted(others) == [f"cal-{n}" for n in sorted(names)]
    assert held_out_run_ratios(measured, in_sample, others) == held_out
    # Runs of one scenario: nothing to hold out.
    assert calibrate(runs[:1]).held_out_run_step_ratios == []


def test_held_out_metric_ratios_carry_the_error_the_step_speed_misses(tmp_path: Path) -> None:
    """agentic-contexts' prefill steps cost 3x what the other scenarios' do: its median step
    (a decode) reads the others' fit as exact, its TTFT does not. Runs of one pricing read 1
    on every metric."""
    names = ("prefill-sweep", "decode-sweep", "agentic-contexts")
    dear = TRUTH.model_copy(update={"prefill_step_overhead_s": 3 * TRUTH.prefill_step_overhead_s})
    runs = [
        measured_looking_run(tmp_path, n, params=dear if n == "agentic-contexts" else TRUTH)
        for n in names
    ]
    profile = calibrate(runs)
    assert profile.held_out_run_step_ratios[2] == pytest.approx(1.0, abs=0.01)
    ratios = profile.held_out_metric_ratios["cal-agentic-contexts"]
    assert ratios["TTFT p50"] > 1.1 and ratios["E2E p50"] > 1.0
    assert "preemptions" not in ratios and "KV usage peak" not in ratios
    exact = [measured_looking_run(tmp_path / "exact", n) for n in names]
    for by_metric in calibrate(exact).held_out_metric_ratios.values():
        assert by_metric and all(r == pytest.approx(1.0, abs=0.02) for r in by_metric.values())
    assert calibrate(runs[:1]).held_out_metric_ratios == {}  # one scenario: nothing held out


def test_a_scenario_alone_at_its_budget_keeps_its_in_sample_ratio(tmp_path: Path) -> None:
    """Held out, the other budgets' fit would price it: that measures the budget (a user's
    scenario at a calibrated budget gets that budget's fit), so it stays in sample."""
    runs = [
        measured_looking_run(tmp_path, "prefill-sweep"),
        measured_looking_run(tmp_path, "decode-sweep"),
        measured_looking_run(tmp_path, "agentic-contexts", budget=2048, params=AT_2048),
    ]
    profile = calibrate(runs)
    assert profile.held_out_run_step_ratios[2] == profile.run_step_ratios[2]
    assert profile.held_out_run_step_ratios[:2] != profile.run_step_ratios[:2]


def test_cli_leave_one_out_prints_each_scenarios_held_out_error(tmp_path: Path) -> None:
    runs = [str(measured_looking_run(tmp_path, n)) for n in ("prefill-sweep", "decode-sweep")]
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(
        app, ["calibrate", *runs, "-o", str(out), "--leave-one-out"], env={"COLUMNS": "220"}
    )
    assert result.exit_code == 0, result.output
    assert out.exists()
    profile = load_profile(out)
    spread = profile.step_residual_quantiles
    assert (
        f"steps at {spread[100]:.2f}-{spread[900]:.2f} (p10-p90) of their run's median, two "
        "steps j apart correlated by"
    ) in " ".join(result.output.split())
    rows = [line for line in result.output.splitlines() if "cal-" in line]
    assert len(rows) == 2 and "held-out ratio" in result.output
    assert "model error held out (kvsim run --samples draws it)" in result.output
    assert "over 2 scenarios: TTFT p50 " in " ".join(result.output.split())
    one = tmp_path / "one.json"
    alone = CliRunner().invoke(app, ["calibrate", runs[0], "-o", str(one), "--leave-one-out"])
    assert alone.exit_code == 2 and "at least two scenarios" in " ".join(alone.output.split())
    assert not one.exists()  # refused before fitting, nothing written
    vidur = ["--vidur", str(tmp_path), "--leave-one-out"]
    refused = CliRunner().invoke(app, ["calibrate", *vidur, "-o", str(tmp_path / "p.json")])
    assert refused.exit_code == 2
    assert "--leave-one-out applies to run directories" in " ".join(refused.output.split())


def test_cli_prints_the_fit_of_each_budget(
    two_budgets: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = [str(r) for r in two_budgets]
    out = tmp_path / "profile.json"
    result = CliRunner().invoke(app, ["calibrate", *runs, "-o", str(out)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for budget in (512, 2048):
        assert (
            f"max_num_batched_tokens={budget}: fitted on its own runs (attention from the fit "
            "over all), r2 1.000"
        ) in result.output
    assert sorted(load_profile(out).params_by_budget) == [512, 2048]
    monkeypatch.setattr("validate.calibrate.MIN_BUDGET_STEPS", 10**9)
    none = CliRunner().invoke(
        app, ["calibrate", *runs, "-o", str(tmp_path / "none.json")], env={"COLUMNS": "200"}
    )
    assert none.exit_code == 0, none.output
    assert " ".join(none.output.split()).count("has no fit of its own for this budget") == 2


def edit_summary(run: Path, **changes: object) -> Path:
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, **changes}))
    return run


def test_a_run_without_steps_is_refused_naming_it_and_an_incomplete_one_is_named(
    tmp_path: Path,
) -> None:
    good = measured_looking_run(tmp_path, "prefill-sweep")
    empty = measured_looking_run(tmp_path / "empty", "decode-sweep")
    steps = pd.read_parquet(empty / "steps.parquet")
    steps.iloc[:0].to_parquet(empty / "steps.parquet")
    edit_summary(empty, complete=False, error="vLLM engine step failed: boom")
    for runs in ([empty], [good, empty]):
        with pytest.raises(KvsimConfigError, match=rf"{re.escape(str(empty))}: no step ran tokens"):
            calibrate(runs)
        cli = CliRunner().invoke(app, ["calibrate", *map(str, runs), "-o", str(tmp_path / "p")])
        assert cli.exit_code == 2 and "Traceback" not in cli.output, cli.output
    failed = edit_summary(
        measured_looking_run(tmp_path / "failed", "decode-sweep"),
        complete=False,
        error="vLLM engine step failed: boom",
    )
    measured = load_measured([good, failed])
    assert incomplete_warnings(measured) == [
        f"{failed} is incomplete: vLLM failed mid-run (vLLM engine step failed: boom); its "
        f"{len(measured[1].shapes)} steps up to the failure are fitted"
    ]
    out = tmp_path / "p.json"
    args = ["calibrate", str(good), str(failed), "-o", str(out)]
    cli = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert cli.exit_code == 0 and out.exists(), cli.output
    assert f"{failed} is incomplete" in " ".join(cli.output.split())


@pytest.mark.parametrize(
    ("field", "first", "second"),
    [
        ("served_model", "/models/llama-8b", "/models/qwen-7b"),
        ("hardware", "H100-SXM-80GB", "A100-80GB"),
        ("device", "cpu", "cuda"),
        ("device_name", "NVIDIA H100 80GB HBM3", "NVIDIA H200"),
    ],
)
def test_runs_that_mix_what_a_profile_describes_are_refused_naming_both(
    tmp_path: Path, field: str, first: str, second: str
) -> None:
    a = edit_summary(measured_looking_run(tmp_path, "prefill-sweep"), **{field: first})
    b = edit_summary(measured_looking_run(tmp_path, "decode-sweep"), **{field: second})
    message = f"runs mix {field}: {a} has {first!r}, {b} has {second!r}"
    with pytest.raises(KvsimConfigError, match=re.escape(message)):
        calibrate([a, b])


def test_runs_recorded_with_the_device_as_hardware_take_their_scenarios_hardware(
    tmp_path: Path,
) -> None:
    old = edit_summary(measured_looking_run(tmp_path, "prefill-sweep"), hardware="cpu")
    new = measured_looking_run(tmp_path, "decode-sweep")
    assert load_run(new).summary["hardware"] == "cpu-validation"
    assert calibrate([old, new]).hardware == "cpu-validation"
    gpu = edit_summary(measured_looking_run(tmp_path / "gpu", "prefill-sweep"), hardware="H100")
    assert calibrate([gpu]).hardware == "H100"


def test_a_profile_naming_a_device_as_its_hardware_warns_only_of_another_kind(
    tmp_path: Path,
) -> None:
    for device, hardware in (("cpu", "cpu-validation"), ("cuda", "H100-SXM-80GB")):
        assert hardware_warning(profile_with(TRUTH, hardware=device), hardware) is None
    # The kind of device is known: a CPU fit pricing a GPU (or the reverse) still warns.
    for device, hardware in (("cpu", "H100-SXM-80GB"), ("cuda", "cpu-validation")):
        warning = hardware_warning(profile_with(TRUTH, hardware=device), hardware)
        assert warning is not None and f"fitted on {device}, not {hardware}" in warning
    a100 = profile_with(TRUTH, hardware="A100-80GB")
    assert hardware_warning(a100, "H100-SXM-80GB") == (
        "the calibration profile was fitted on A100-80GB, not H100-SXM-80GB: its fitted costs "
        "(and, for a kernel fit, its all-reduce measurements) describe that hardware"
    )
    # kvsim run on the validation scenario with a profile kvsim calibrate wrote before
    # profiles named their hardware (CI's, until 2026-12-06): no "fitted on cpu, not
    # cpu-validation".
    old = profile_with(TRUTH, hardware="cpu", model="tiny-llama", vllm_version="0.32.0")
    save_profile(old, tmp_path / "old.json")
    validation = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
    small = ["--set", "workload.sessions=2", "--set", "workload.turns.value=2"]
    args = ["run", str(validation), *small, "--calibration", str(tmp_path / "old.json")]
    cli = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "run"), "--quiet"])
    assert cli.exit_code == 0, cli.output
    assert "the calibration profile was fitted on" not in cli.output


def test_a_run_stalled_by_something_else_is_left_out_of_the_fit_and_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process whose steps all ran 5x slow (another job had the CPU) would price every step
    and widen every band: the profile is the fit without it, and says so; a run 1.5x slow is
    a process's own speed and stays."""
    names = ("prefill-sweep", "decode-sweep", "agentic-contexts")
    kept = [measured_looking_run(tmp_path, n) for n in names]
    slow = measured_looking_run(tmp_path / "slow", "decode-sweep", step_time_scale=1.5)
    stalled = measured_looking_run(tmp_path / "stalled", "decode-sweep", step_time_scale=5.0)
    profile = calibrate([*kept, slow, stalled])
    assert list(profile.stalled_runs) == [str(stalled)]
    assert profile.stalled_runs[str(stalled)] == pytest.approx(5.0, rel=0.1)
    without = calibrate([*kept, slow])
    assert without.stalled_runs == {}
    assert profile.params == without.params
    assert profile.run_step_ratios == without.run_step_ratios  # 4 runs: the stalled one out
    assert profile.held_out_metric_ratios == without.held_out_metric_ratios
    assert str(stalled) in profile.created_by  # the command as given
    (warning,) = profile.stalled_warnings()
    assert warning.startswith(f"{stalled}: its steps ran 5.") and "left out" in warning
    # Fewer than three runs: no median to be stalled against.
    assert calibrate([kept[1], stalled]).stalled_runs == {}

    fitted = fit_calibration(load_measured([*kept, slow, stalled]), [])
    assert [m.run.path for m in fitted.measured] == [*kept, slow]  # what --leave-one-out holds out
    assert sorted(fitted.others_fits) == [f"cal-{n}" for n in sorted(names)]

    out = tmp_path / "profile.json"
    args = ["calibrate", *map(str, [*kept, slow, stalled]), "-o", str(out), "--leave-one-out"]
    held_out_over: list[int] = []  # the runs of each held_out_fits call
    real_held_out_fits = calibrate_module.held_out_fits

    def counted(measured: list[MeasuredRun]) -> dict[str, BudgetFits]:
        held_out_over.append(len(measured))
        return real_held_out_fits(measured)

    monkeypatch.setattr(calibrate_module, "held_out_fits", counted)
    cli = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert cli.exit_code == 0, cli.output
    assert held_out_over == [4]  # once, over the runs kept
    assert warning in " ".join(cli.output.split())
    assert load_profile(out).stalled_runs == profile.stalled_runs  # round trip
    # kvsim validate against the profile says which runs its fit left out.
    scenario = load_scenario(SCENARIO_DIR / "calibration" / "decode-sweep.yaml")
    report = build_report(scenario, load_run(slow), [load_run(kept[1])], out)
    assert warning in report.warnings


def test_runs_are_screened_against_the_runs_at_their_token_budget(two_budgets: list[Path]) -> None:
    """A budget's runs all 4x slow under the fit that prices them is the budget's kernel
    speed, not a stall; one of them 3x its budget's median is."""
    measured = load_measured([*two_budgets, *two_budgets[2:]])  # 512: 2 runs, 2048: 4
    assert [budget_of(m) for m in measured] == [512, 512, 2048, 2048, 2048, 2048]
    assert stalled_runs(measured, [1.0, 1.0, 4.0, 4.0, 4.0, 4.0]) == {}
    assert stalled_runs(measured, [1.0, 9.0, 4.0, 4.0, 4.0, 12.0]) == {
        str(measured[5].run.path): 3.0  # the 512 pair has no median to be judged against
    }
