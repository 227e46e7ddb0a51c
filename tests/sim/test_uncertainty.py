"""kvsim run --samples: the scenario at the step speeds of the calibration's measured runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from sim import uncertainty
from sim.cli import app
from sim.config.calibration import save_profile
from sim.config.hardware import HARDWARE_PRESETS
from sim.config.model import MODEL_PRESETS
from sim.cost_model import CostModel, CostParams
from sim.errors import KvsimConfigError
from sim.metrics import ITL, TTFT
from sim.report import band_table
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.scheduler.output import BatchShape
from sim.uncertainty import (
    SAMPLES,
    band_records,
    band_rows,
    metric_error_factors,
    run_ratios,
    run_samples,
    sample_factors,
    speed_factors,
    truncation_warning,
)
from tests.profiles import profile_with
from tests.sim.test_interrupts import alive, start_kvsim, wait_gone, worker_pids

FITTED = CostParams(
    mode="additive",
    compute_efficiency=2.0,
    bandwidth_efficiency=1.1,
    step_overhead_s=2e-3,
    per_request_overhead_s=1e-4,
    prefill_step_overhead_s=4e-3,
    idle_wakeup_s=1e-3,
    post_prefill_decode_s=1e-3,
)
RATIOS = [0.8, 0.9, 1.0, 1.1, 1.4]
PROFILE = profile_with(FITTED, hardware="cpu", model="tiny-llama", run_step_ratios=RATIOS)
SCENARIO = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"


def test_speed_factors_are_stratified_quantiles_of_the_runs() -> None:
    assert speed_factors([1.0, 2.0], 2) == pytest.approx([1.25, 1.75])
    assert speed_factors(RATIOS, 1) == [1.0]
    assert speed_factors(RATIOS, 5) == pytest.approx([0.84, 0.92, 1.0, 1.08, 1.28])
    with pytest.raises(ValueError, match="at least 1"):
        speed_factors(RATIOS, 0)


@pytest.mark.parametrize("tp", [1, 2])
def test_a_step_time_scale_scales_every_step_but_not_pcie_copies(tp: int) -> None:
    model, hardware = MODEL_PRESETS["Llama-3.1-8B"], HARDWARE_PRESETS["H100-SXM-80GB"]
    base = CostModel(model, hardware, tp, FITTED)
    slow = CostModel(model, hardware, tp, FITTED, step_time_scale=1.25)
    shapes = [
        BatchShape(num_decode_reqs=3, decode_context_tokens=3000),
        BatchShape(num_prefill_tokens=400, num_prefill_reqs=1, prefill_attention_pairs=9e4),
    ]
    for shape in shapes:
        assert base.allreduce_time_s(shape) > 0 or tp == 1  # TP pays its all-reduces
        for idle, since in ((False, 0), (True, 0), (False, 3)):
            assert slow.step_time_s(shape, idle, since) == pytest.approx(
                1.25 * base.step_time_s(shape, idle, since), rel=1e-12
            )
    assert slow.kv_transfer_time_s(10, 1 << 20) == base.kv_transfer_time_s(10, 1 << 20)
    with pytest.raises(ValueError, match="step_time_scale=0"):
        CostModel(model, hardware, tp, FITTED, step_time_scale=0)


def test_samples_need_a_profile_fitted_on_measured_runs() -> None:
    with pytest.raises(KvsimConfigError, match="pass --calibration"):
        sample_factors(None, 3)
    with pytest.raises(KvsimConfigError, match="no measured run spread"):
        sample_factors(profile_with(FITTED), 3)


def test_samples_draw_the_runs_held_out_of_the_fit_where_the_profile_records_them() -> None:
    """A held-out run ratio carries the fit's error on an unseen scenario as well as the
    process's speed: the band draws those; a profile without them, the in-sample ones."""
    held_out = [0.7, 0.95, 1.0, 1.2, 1.5]
    both = PROFILE.model_copy(update={"held_out_run_step_ratios": held_out})
    assert run_ratios(both) == held_out and run_ratios(PROFILE) == RATIOS
    assert sample_factors(both, 5) == speed_factors(held_out, 5) != sample_factors(PROFILE, 5)
    rows = band_rows(None, [])
    assert band_records(rows, [1.0], [], both)["speeds_held_out"] is True
    assert band_records(rows, [1.0], [], PROFILE)["speeds_held_out"] is False
    with pytest.raises(ValueError, match="finite, positive"):
        PROFILE.model_validate({**PROFILE.model_dump(), "held_out_run_step_ratios": [1.0, 0.0]})


def test_samples_are_deterministic_and_ordered_by_speed() -> None:
    spec = load_scenario(SCENARIO, ["workload.sessions=6"])
    factors, summaries = run_samples(spec, PROFILE, 3, workers=2)
    again = run_samples(spec, PROFILE, 3, workers=1)
    assert (factors, summaries) == again
    assert factors == pytest.approx([0.8 + 0.2 / 3, 1.0, 1.2])
    rows = {r.metric: r for r in band_rows(summaries[1], summaries)}
    itl = rows["ITL p50"]
    assert itl.low is not None and itl.high is not None
    assert itl.samples[0] < itl.samples[1] < itl.samples[2]  # slower steps, longer ITL
    assert itl.low < itl.point == itl.median < itl.high
    assert itl.contains(itl.median) and not itl.contains(2 * itl.high)
    # The same scheduling at every speed here: hit rate is a property of the workload.
    assert len(set(rows["prefix-cache hit rate"].samples)) == 1
    seeds = run_samples(spec, PROFILE, 2, vary_seed=True, workers=1)[1]
    assert [s["seed"] for s in seeds] == [spec.seed, spec.seed + 1]


def test_samples_draw_step_jitter_when_the_profile_records_it(tmp_path: Path) -> None:
    spec = load_scenario(SCENARIO, ["workload.sessions=6"])
    spread = [0.9] * 50 + [1.0] + [1.05] * 48 + [2.0, 4.0]  # 101 percentiles, a slow tail
    jittery = PROFILE.model_copy(update={"step_residual_quantiles": spread})
    factors, summaries = run_samples(spec, jittery, 3, workers=1)
    assert factors == run_samples(spec, PROFILE, 3, workers=1)[0]  # the same run speeds
    assert run_samples(spec, jittery, 3, workers=2) == (factors, summaries)  # deterministic
    plain = run_samples(spec, PROFILE, 3, workers=1)[1]
    itl = "vllm:inter_token_latency_seconds"
    for jittered, steady in zip(summaries, plain, strict=True):
        assert jittered["metrics"][itl] != steady["metrics"][itl]
    # Every step drawing the same factor is a slower process: the run speed times it.
    constant = PROFILE.model_copy(update={"step_residual_quantiles": [1.25] * 101})
    slower = PROFILE.model_copy(update={"run_step_ratios": [1.25 * r for r in RATIOS]})
    for a, b in zip(run_samples(spec, constant, 2, workers=1)[1],
                    run_samples(spec, slower, 2, workers=1)[1], strict=True):  # fmt: skip
        for metric in ("vllm:time_to_first_token_seconds", itl):
            assert a["metrics"][metric]["p50"] == pytest.approx(b["metrics"][metric]["p50"])
    # Drawn in a persistent order: the same distribution, other runs, still deterministic.
    persistent = jittery.model_copy(
        update={"step_residual_persistence": [(0.25, 0.9), (0.2, 0.994)]}
    )
    drawn = run_samples(spec, persistent, 3, workers=1)
    assert run_samples(spec, persistent, 3, workers=2) == drawn
    assert drawn[0] == factors and drawn[1] != summaries
    # The profile keeps the spread; a run's summary.json leaves it out, as the run ratios.
    out = tmp_path / "p.json"
    save_profile(persistent, out)
    result = CliRunner().invoke(
        app,
        ["run", str(SCENARIO), "--set", "workload.sessions=6", "--calibration", str(out),
         "--samples", "2", "--out", str(tmp_path / "run")],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "run" / SAMPLES).read_text())
    assert record["step_jitter"] is True
    assert record["step_persistence"] == [[0.25, 0.9], [0.2, 0.994]]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert "step_residual_quantiles" not in summary["calibration"]
    assert "step_residual_persistence" not in summary["calibration"]


def test_cli_run_samples_writes_the_band(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    save_profile(PROFILE, profile)
    args = ["run", str(SCENARIO), "--set", "workload.sessions=6", "--calibration", str(profile)]
    result = CliRunner().invoke(
        app, [*args, "--samples", "3", "--out", str(tmp_path / "run")], env={"COLUMNS": "160"}
    )
    assert result.exit_code == 0, result.output
    band = json.loads((tmp_path / "run" / SAMPLES).read_text())
    assert band["speed_factors"] == pytest.approx([0.8 + 0.2 / 3, 1.0, 1.2])
    assert band["step_jitter"] is False  # the profile records no step spread
    assert [m["metric"] for m in band["metrics"]][:2] == ["TTFT p50", "TTFT p90"]
    assert "uncertainty: 3 samples at the step speeds" in result.output
    for bad, message in (
        (["--vary-seed"], "give --samples N"),
        (["--samples", "2", "--calibration", str(tmp_path / "none.json")], "cannot read"),
    ):
        out = tmp_path / f"bad-{len(bad)}"
        refused = CliRunner().invoke(app, [*args, *bad, "--out", str(out)])
        assert refused.exit_code == 2 and message in " ".join(refused.output.split())
        assert not out.exists()
    no_runs = tmp_path / "no-runs.json"
    save_profile(profile_with(FITTED), no_runs)
    refused = CliRunner().invoke(
        app, [*args, "--calibration", str(no_runs), "--samples", "2", "--out", str(tmp_path / "x")]
    )
    assert refused.exit_code == 2 and "no measured run spread" in refused.output
    assert not (tmp_path / "x").exists()


def test_samples_run_in_this_process_when_workers_cannot_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = load_scenario(SCENARIO, ["workload.sessions=3"])
    expected = run_samples(spec, PROFILE, 2, workers=1)

    def no_pool(*args: object, **kwargs: object) -> None:
        raise OSError("[Errno 38] Function not implemented: sem_open")

    monkeypatch.setattr(uncertainty, "worker_pool", no_pool)
    told: list[str] = []
    assert run_samples(spec, PROFILE, 2, workers=2, on_serial=told.append) == expected
    (why,) = told  # said once, not silently N times slower
    assert "sem_open" in why and "the 2 samples left run one by one" in why


# Per calibration scenario, the fit's held-out error on each metric (validate/metric_error.py).
ERRORS = {
    "cal-a": {"TTFT p50": 1.3, "ITL p50": 1.0, "preemptions": 2.0},
    "cal-b": {"TTFT p50": 0.9},
    "cal-c": {"TTFT p50": 1.0},
}


def test_model_error_factors_are_stratified_quantiles_paired_with_the_speeds_at_random() -> None:
    profile = PROFILE.model_copy(update={"held_out_metric_ratios": ERRORS})
    factors = metric_error_factors(profile, 10)
    # ITL p50: one scenario's error is no spread; preemptions: a count, never scaled.
    assert list(factors) == ["TTFT p50"]
    levels = (np.arange(10) + 0.5) / 10
    assert sorted(factors["TTFT p50"]) == pytest.approx(np.quantile([1.3, 0.9, 1.0], levels))
    assert factors["TTFT p50"] != sorted(factors["TTFT p50"])  # not in the speeds' order
    assert metric_error_factors(profile, 10) == factors  # a fixed order: deterministic
    assert metric_error_factors(PROFILE, 10) == metric_error_factors(None, 10) == {}
    with pytest.raises(ValueError, match="finite, positive"):
        PROFILE.model_validate(
            {**PROFILE.model_dump(), "held_out_metric_ratios": {"cal-a": {"TTFT p50": -1.0}}}
        )


def test_the_band_multiplies_each_samples_latencies_by_its_model_error() -> None:
    profile = PROFILE.model_copy(update={"held_out_metric_ratios": ERRORS})
    summaries = [{"metrics": {TTFT: {"p50": 0.1 * (i + 1)}, ITL: {"p50": 0.01}}} for i in range(4)]
    errors = metric_error_factors(profile, 4)["TTFT p50"]
    rows = {r.metric: r for r in band_rows(summaries[0], summaries, profile)}
    ttft, itl = rows["TTFT p50"], rows["ITL p50"]
    assert ttft.samples == pytest.approx([0.1 * (i + 1) * f for i, f in enumerate(errors)])
    assert ttft.point == 0.1  # the run at the profile as fitted: no error drawn
    assert ttft.model_error and not itl.model_error and itl.samples == (0.01,) * 4
    without = band_rows(None, summaries)[0]  # no profile: the simulations' own values
    assert without.samples == pytest.approx([0.1, 0.2, 0.3, 0.4]) and not without.model_error
    record = band_records(list(rows.values()), [1.0] * 4, summaries, profile)
    assert record["model_error_factors"] == {"TTFT p50": errors}
    assert record["metrics"][0]["model_error"] is True
    assert "model error held out" in band_table(list(rows.values()), 4, False).title
    assert "model error" not in band_table(band_rows(None, summaries), 4, False).title


def test_a_sample_cut_at_the_time_limit_is_flagged() -> None:
    done = {"truncated_at_limit": False, "metrics": {}}
    cut = {"truncated_at_limit": True, "metrics": {}}
    assert truncation_warning(done, [done, done]) is None
    warning = truncation_warning(done, [done, cut])
    assert warning is not None and "1 of 2 samples hit limits.max_duration_s" in warning
    assert truncation_warning(cut, [cut, cut]) is None  # the run says so itself
    record = band_records(band_rows(done, [done, cut]), [0.9, 1.1], [done, cut])
    assert record["truncated_samples"] == [1]
    # A metric a sample lacks: no band, and the sample's value stays in its place.
    assert record["metrics"][0]["samples"] == [None, None]
    assert record["metrics"][0]["low"] is None


def start_samples(tmp_path: Path) -> tuple[subprocess.Popen[str], list[int]]:
    """``kvsim run --samples 2`` in its own process group, once its 2 workers are started
    (still importing, most likely); returns the process and the workers' pids."""
    profile = tmp_path / "profile.json"
    save_profile(PROFILE, profile)
    proc = start_kvsim(
        *("run", str(SCENARIO), "--set", "workload.sessions=200", "--quiet"),
        *("--calibration", str(profile), "--samples", "2", "--out", str(tmp_path / "run")),
    )
    deadline = time.monotonic() + 120
    while len(workers := worker_pids(proc.pid)) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no workers started: {proc.communicate()[0]}")
        time.sleep(0.02)
    return proc, workers


def test_sigterm_to_kvsim_run_samples_leaves_no_worker(tmp_path: Path) -> None:
    proc, workers = start_samples(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)  # to the main process alone (a CI timeout, kill)
        proc.communicate(timeout=60)
        assert wait_gone(workers) == [], "workers outlived kvsim run"
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_ctrl_c_while_the_workers_start_stops_at_once_without_a_traceback(
    tmp_path: Path,
) -> None:
    proc, workers = start_samples(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole process group
        output, _ = proc.communicate(timeout=60)
        assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
        assert proc.returncode == 130, output  # Typer's exit for Ctrl-C
        assert wait_gone(workers) == []
        assert not (tmp_path / "run").exists()  # the claim is released
    finally:
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
