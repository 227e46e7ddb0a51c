"""The replay process's environment and the validation report (no vLLM needed)."""

from __future__ import annotations

import ctypes.util
import json
import math
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from sim import __version__ as kvsim_version
from sim.config.calibration import save_profile
from sim.report import truncation_line
from sim.results import RunData
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.uncertainty import band_rows, run_samples
from sim.workload.base import WorkloadRun
from tests.validate.fake_vllm import fake_replay
from validate.calibrate import calibrate
from validate.commands import _print_run_status, uncalibrated_line
from validate.compare import ComparisonRow
from validate.replay import ReplayResult
from validate.runner import (
    ValidationReport,
    build_report,
    measured_summary,
    run_sim,
    simulation_pricing,
    worker_env,
    write_report,
)


def test_cpu_replays_preload_tcmalloc_when_the_machine_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr(ctypes.util, "find_library", found.get)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert worker_env("cpu")["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert "LD_PRELOAD" not in worker_env("cuda")
    # The user's own preloads stay, after it; a tcmalloc they chose is left alone.
    monkeypatch.setenv("LD_PRELOAD", "libfoo.so")
    assert worker_env("cpu")["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libfoo.so"
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libtcmalloc.so.4")
    assert worker_env("cpu")["LD_PRELOAD"] == "/opt/lib/libtcmalloc.so.4"
    # Without the library the replay runs on the default allocator.
    monkeypatch.setattr(ctypes.util, "find_library", {}.get)
    monkeypatch.delenv("LD_PRELOAD")
    assert "LD_PRELOAD" not in worker_env("cpu")


def test_the_report_names_a_token_budget_the_profile_was_not_fitted_at(tmp_path: Path) -> None:
    calibration = load_scenario(SCENARIO_DIR / "calibration" / "prefill-sweep.yaml")
    profile = calibrate([fake_replay(calibration, tmp_path / "cal").path])
    save_profile(profile, tmp_path / "profile.json")
    validated = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
    for budget, warned in ((512, False), (384, True)):
        spec = load_scenario(validated, [f"engine.max_num_batched_tokens={budget}"])
        real = fake_replay(spec, tmp_path / f"real-{budget}")
        sim = run_sim(spec, profile, tmp_path / f"sim-{budget}")
        report = build_report(spec, sim, [real], tmp_path / "profile.json").to_json()
        warnings = report["warnings"]
        assert (profile.budget_warning(budget) in warnings) == warned
        # Fitted on the prefill sweep alone, the agentic steps are partly extrapolated.
        assert report["shape_coverage"] < 0.9
        assert "the cost model extrapolates the step times" in warnings[-1]
    assert "engine.max_num_batched_tokens=384 was not calibrated" in warnings[0]


def test_the_report_says_whether_the_replays_median_lies_in_kvsims_band(tmp_path: Path) -> None:
    names = ("prefill-sweep", "decode-sweep", "agentic-contexts")
    runs = [
        fake_replay(load_scenario(SCENARIO_DIR / "calibration" / f"{n}.yaml"), tmp_path / n).path
        for n in names
    ]
    # Noise-free runs: every run's steps at 1.0 times the fit, in sample and held out (one
    # additive model prices them all); widen the spread the band draws from by hand.
    fitted = calibrate(runs)
    assert fitted.held_out_run_step_ratios == pytest.approx([1.0] * 3, abs=0.02)
    profile = fitted.model_copy(update={"held_out_run_step_ratios": [0.8, 1.0, 1.25]})
    save_profile(profile, tmp_path / "profile.json")
    spec = load_scenario(SCENARIO_DIR / "validation" / "agentic-multiturn.yaml")
    real = fake_replay(spec, tmp_path / "real")
    sim = run_sim(spec, profile, tmp_path / "sim")
    band = band_rows(sim.summary, run_samples(spec, profile, 4, workers=1)[1])
    records = {
        r["metric"]: r
        for r in build_report(spec, sim, [real], tmp_path / "profile.json", band).band_records()
    }
    itl = records["ITL p50"]
    # The replay ran at exactly the fitted speed, inside the band from 0.8x to 1.25x.
    assert itl["low"] < itl["reference"] < itl["high"] and itl["inside"] is True
    assert records["preemptions"]["inside"] is True  # a band of one value holds it
    assert build_report(spec, sim, [real], tmp_path / "profile.json").band_records() == []


def test_the_report_says_which_side_left_requests_unfinished(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    validated = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
    spec = load_scenario(validated)
    whole = fake_replay(spec, tmp_path / "real-1")
    sim = run_sim(spec, None, tmp_path / "sim")
    assert build_report(spec, sim, [whole], None).warnings == []
    # Cut halfway through one request: it and the turns after it are left out.
    request = whole.requests.iloc[len(whole.requests) // 2]
    limit = round((request["arrival_s"] + request["finish_s"]) / 2, 3)
    cut = load_scenario(validated, [f"limits.max_duration_s={limit}"])
    truncated = fake_replay(cut, tmp_path / "real-2")
    unfinished = truncated.summary["num_unfinished"]
    assert truncated.summary["truncated_at_limit"] and unfinished > 0
    warnings = build_report(cut, sim, [whole, truncated], None).warnings
    assert warnings == [truncation_line(truncated.summary, f"the replay {truncated.path}")]
    assert warnings[0].startswith(
        f"the replay {truncated.path} hit limits.max_duration_s ({limit:g} s) before its "
        f"workload ended with {unfinished} of its {truncated.summary['num_requests']} requests "
        "unfinished"
    )
    # The run's status line says it too (kvsim replay and validate print it).
    _print_run_status(truncated)
    assert "TRUNCATED at limits.max_duration_s" in " ".join(capsys.readouterr().out.split())
    _print_run_status(whole)
    assert capsys.readouterr().out.rstrip().endswith("complete")
    # A simulation cut at the limit says so too; a replay vLLM failed in is named as such.
    short_sim = run_sim(cut, None, tmp_path / "sim-cut")
    failed = {**whole.summary, "complete": False, "error": "vLLM engine step failed: boom"}
    warnings = build_report(cut, short_sim, [replace(whole, summary=failed)], None).warnings
    assert warnings[0] == (
        f"the replay {whole.path} is incomplete: vLLM failed mid-run (vLLM engine step "
        "failed: boom)"
    )
    assert warnings[1].startswith(f"the simulation hit limits.max_duration_s ({limit:g} s)")


class RecordedTables:
    """The tables a replay's recorder hands over, here taken from a simulated run."""

    def __init__(self, requests: pd.DataFrame, steps: pd.DataFrame) -> None:
        self.requests, self.steps = requests, steps

    def requests_frame(self) -> pd.DataFrame:
        return self.requests

    def steps_frame(self) -> pd.DataFrame:
        return self.steps


@pytest.mark.parametrize("error", [None, "vLLM engine step failed: RuntimeError: boom"])
def test_measured_and_simulated_summaries_come_from_one_builder(
    error: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LD_PRELOAD", "libtcmalloc_minimal.so.4")
    spec = load_scenario(
        SCENARIO_DIR / "validation" / "agentic-multiturn.yaml",
        ["workload.sessions=3", "workload.turns.value=2"],
    )
    sim = simulate(spec)
    tables = RecordedTables(sim.requests, sim.steps)
    result = ReplayResult(
        tables,  # type: ignore[arg-type]
        error,
        sim.summary["duration_s"],
        "0.32.0",
        "cpu",
        "tiny",
        sim.sizing.num_gpu_blocks,
        "float32",
        load_format="dummy",
        device_name="cpu",
        # The three sessions ran both turns, as in the simulation.
        workload_run=WorkloadRun(
            6,
            sessions_planned=3,
            sessions_started=3,
            context_cap_tokens=sim.summary["sessions"]["context_cap_tokens"],
        ),
    )
    measured = measured_summary(spec, result)
    provenance = {
        "source": "vllm",
        "kvsim_version": kvsim_version,
        "vllm_version": "0.32.0",
        "device": "cpu",
        "served_model": "tiny",
        "load_format": "dummy",
        "device_name": "cpu",  # vLLM's name of the device ("NVIDIA H100 80GB HBM3" on a GPU)
        # The scenario's hardware, as a simulation of it names it; the device is the device.
        "hardware": "cpu-validation",
        "allocator": "tcmalloc",
        "dtype": "float32",
        "error": error,
    }
    assert {k: measured[k] for k in provenance} == provenance
    assert measured["hardware"] == sim.summary["hardware"]
    assert measured["complete"] is (error is None)
    assert measured["truncated_at_limit"] is False
    cut = measured_summary(spec, replace(result, truncated_at_limit=True))
    assert cut["truncated_at_limit"] is True and cut["complete"] is (error is None)
    assert measured["kv_cache"] == {
        "block_size": spec.engine.block_size,
        "num_gpu_blocks": sim.sizing.num_gpu_blocks,
    }
    # Same records, same counts and metrics, whichever side ran them.
    sim_only = {"source", "kvsim_version", "hardware", "calibration", "complete", "kv_cache"}
    shared = set(sim.summary) - sim_only
    assert set(measured) == shared | set(provenance) | {"complete", "kv_cache"}
    assert {k: measured[k] for k in shared} == {k: sim.summary[k] for k in shared}
    assert sim.summary["num_requests"] == 6


def test_report_json_is_strict_json_when_vllm_counted_no_preemptions(tmp_path: Path) -> None:
    report = ValidationReport(
        scenario="s",
        sim_run="sim",
        real_runs=["real-1", "real-2", "real-3"],
        vllm_version="0.32.0",
        calibration=None,
        rows=[
            ComparisonRow("TTFT p50", "s", 0.011, 0.010, (0.009, 0.010, 0.012)),
            ComparisonRow("preemptions", "", 4.0, 0.0, (0.0, 0.0, 0.0)),
        ],
        step_time_ratios=[1.0, None, 0.98],
        warnings=[],
    )
    path = tmp_path / "report.json"
    write_report(report, path)

    def reject(token: str):
        raise AssertionError(f"report.json holds {token}, which is not JSON")

    rows = {r["metric"]: r for r in json.loads(path.read_text(), parse_constant=reject)["metrics"]}
    assert rows["TTFT p50"]["relative_error"] == pytest.approx(0.1)
    assert rows["TTFT p50"]["relative_error_missing"] is None
    preemptions = rows["preemptions"]
    assert (preemptions["value"], preemptions["reference"]) == (4.0, 0.0)
    assert preemptions["relative_error"] is None
    assert preemptions["relative_error_missing"] == "reference is 0, value is not"
    # Anything else that is not finite is null: the report of a finished validation is kept.
    write_report(replace(report, step_time_ratios=[math.nan, 0.97]), path)
    written = json.loads(path.read_text(), parse_constant=reject)
    assert written["step_time_vs_sim"] == [None, 0.97]


SMALL_H100 = ["workload.sessions=2", "workload.turns.value=2"]


def test_the_report_warns_when_vllm_sized_another_kv_cache_than_kvsim(tmp_path: Path) -> None:
    spec = load_scenario(SCENARIO_DIR / "validation" / "agentic-multiturn.yaml")
    sim = run_sim(spec, None, tmp_path / "sim")
    simulated = sim.summary["kv_cache"]["num_gpu_blocks"]
    real = fake_replay(spec, tmp_path / "real")
    assert build_report(spec, sim, [real], None).warnings == []

    def sized(count: int, name: str) -> RunData:
        kv_cache = {**real.summary["kv_cache"], "num_gpu_blocks": count}
        return replace(real, summary={**real.summary, "kv_cache": kv_cache}, path=tmp_path / name)

    # Within 1%: vLLM's own rounding, no warning. Beyond: both counts and how to pin them.
    assert build_report(spec, sim, [sized(int(simulated * 1.009), "near")], None).warnings == []
    larger = int(simulated * 1.5)
    warnings = build_report(spec, sim, [sized(larger, "a"), sized(larger, "b")], None).warnings
    assert warnings == [
        f"vLLM's KV cache held {larger:,} blocks in the replays {tmp_path / 'a'}, "
        f"{tmp_path / 'b'} and the simulation's {simulated:,} (+50.0%): preemptions, queueing "
        "and prefix-cache hits under KV pressure are not comparable; pin both with "
        f"engine.num_gpu_blocks_override={larger} (e.g. --set "
        f"engine.num_gpu_blocks_override={larger})"
    ]


def test_the_report_warns_when_the_replay_ran_on_another_gpu_than_the_scenario_names(
    tmp_path: Path,
) -> None:
    spec = load_scenario(SCENARIO_DIR / "coding-agents-8b-h100.yaml", SMALL_H100)
    sim = run_sim(spec, None, tmp_path / "sim")
    real = fake_replay(spec, tmp_path / "real")

    def on(name: str) -> RunData:
        return replace(real, summary={**real.summary, "device_name": name})

    for same in ("NVIDIA H100 80GB HBM3", "cpu", ""):  # the preset's GPU, or no GPU name
        assert build_report(spec, sim, [on(same)], None).warnings == []
    assert build_report(spec, sim, [on("NVIDIA H200")], None).warnings == [
        "the replays ran on NVIDIA H200, but the scenario's hardware is H100-SXM-80GB: the "
        "simulation prices that hardware, not the GPU measured; set hardware to the GPU's "
        "preset (--set hardware=NAME) or calibrate on this GPU"
    ]


def test_without_calibration_the_report_and_the_command_name_the_shipped_kernel_fit(
    tmp_path: Path,
) -> None:
    h100 = load_scenario(SCENARIO_DIR / "coding-agents-8b-h100.yaml")
    profile, pricing = simulation_pricing(h100, None)
    assert profile is not None and pricing == "shipped kernel fit for H100-SXM-80GB"
    assert uncalibrated_line(pricing, h100.hardware.name) == (
        "no --calibration: the simulated side uses kvsim's shipped kernel fit for H100-SXM-80GB"
    )
    cpu = load_scenario(SCENARIO_DIR / "validation" / "agentic-multiturn.yaml")
    assert simulation_pricing(cpu, None) == (None, None)
    assert uncalibrated_line(None, "cpu-validation").startswith(
        "no --calibration: the simulated side uses the datasheet roofline of cpu-validation"
    )
    # What the command prints is what the report records.
    sim = run_sim(cpu, None, tmp_path / "sim")
    real = fake_replay(cpu, tmp_path / "real")
    assert build_report(cpu, sim, [real], None).calibration is None
