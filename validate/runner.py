"""``kvsim validate``: replay on real vLLM, simulate the same scenario, report the error."""

from __future__ import annotations

import ctypes.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.config.calibration import CalibrationProfile, load_profile, shipped_profile
from sim.cost_model import CostParams
from sim.report import partial_run_line
from sim.results import RunData, load_run
from sim.runner import simulate
from sim.scenario import Scenario, scenario_to_yaml
from sim.step_record import shapes_of_steps
from sim.summary import build_summary
from sim.uncertainty import BandRow
from validate.calibrate import step_time_ratio
from validate.compare import ComparisonRow, compare_to_runs, rows_to_records
from validate.engine_args import resolve_model_dir
from validate.replay import ReplayResult


class EngineFailure(RuntimeError):
    """vLLM could not start or run the scenario; the message says why."""


def measured_summary(scenario: Scenario, result: ReplayResult) -> dict[str, Any]:
    """summary.json of a measured run (:func:`sim.summary.build_summary`, as the simulator's)."""
    provenance = {
        "source": "vllm",
        "vllm_version": result.vllm_version,
        "device": result.device,
        "served_model": result.model,
        "hardware": result.device,
        "allocator": "tcmalloc" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "default",
        "dtype": result.dtype,
        "error": result.error,
    }
    return build_summary(
        provenance,
        scenario,
        result.recorder.requests_frame(),
        result.recorder.steps_frame(),
        workload_run=result.workload_run,
        complete=result.error is None,
        truncated_at_limit=result.truncated_at_limit,
        duration_s=result.duration_s,
        kv_cache={
            "block_size": scenario.engine.block_size,
            "num_gpu_blocks": result.num_gpu_blocks,
        },
        num_usable_blocks=max(result.num_gpu_blocks - 1, 1),
    )


def worker_env(device: str) -> dict[str, str]:
    """The replay process's environment: on CPU, tcmalloc preloaded when the machine has it.

    vLLM's CPU backend asks for tcmalloc in ``LD_PRELOAD`` (it warns without it). Measured on
    a 2-core x86 VM with the tiny model, median of 5 fresh processes each: decode steps ~10%
    faster, warm-up ~15% faster, and no noisier from one process to the next. Without it
    (non-Debian machine, no libtcmalloc-minimal4) the replay runs on glibc malloc; the
    summary's ``allocator`` says which.
    """
    env = dict(os.environ)
    preload = env.get("LD_PRELOAD", "")
    if device == "cpu" and "tcmalloc" not in preload:
        library = ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library(
            "tcmalloc"
        )
        if library:
            env["LD_PRELOAD"] = f"{library}:{preload}" if preload else library
    return env


def run_real(scenario: Scenario, device: str, model: str | None, out_dir: Path) -> RunData:
    """Replay on vLLM (in a fresh process) and write the measured run directory, also when
    the engine failed mid-run (the summary then says ``complete: false``). Raises
    EngineFailure when vLLM could not start or its process died without writing anything;
    vLLM's own log is kept next to the run as ``<out_dir>.vllm.log``."""
    model_dir = resolve_model_dir(scenario, model)
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; kvsim never overwrites a run")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_dir.with_name(out_dir.name + ".vllm.log")
    with tempfile.TemporaryDirectory() as tmp:
        scenario_path = Path(tmp) / "scenario.yaml"
        scenario_path.write_text(scenario_to_yaml(scenario))
        with log_path.open("w") as log:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "validate.replay_worker",
                    str(scenario_path),
                    device,
                    model_dir,
                    str(out_dir),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
                env=worker_env(device),
            )
    if proc.returncode != 0 or not out_dir.is_dir():
        lines = [ln for ln in log_path.read_text().splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if "could not start" in ln), None)
        if reason is None:
            tail = lines[-1] if lines else "no output"
            reason = f"the vLLM process exited with status {proc.returncode} ({tail})"
        raise EngineFailure(f"{reason}; full log: {log_path}")
    return load_run(out_dir)


def run_real_repeated(
    scenario: Scenario,
    device: str,
    model: str | None,
    out_dir: Path,
    repeats: int,
    on_start: Callable[[int], None] | None = None,
) -> list[RunData]:
    """``repeats`` replays, one after another, each in a fresh process: ``out_dir/real`` for
    one, ``out_dir/real-1`` ... ``real-N`` for more. ``on_start(i)`` runs before replay i."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be at least 1")
    names = ["real"] if repeats == 1 else [f"real-{i}" for i in range(1, repeats + 1)]
    runs = []
    for i, name in enumerate(names, start=1):
        if on_start is not None:
            on_start(i)
        runs.append(run_real(scenario, device, model, out_dir / name))
    return runs


def run_sim(scenario: Scenario, profile: CalibrationProfile | None, out_dir: Path) -> RunData:
    result = simulate(scenario, profile)
    result.write(out_dir)
    return load_run(out_dir)


@dataclass
class ValidationReport:
    scenario: str
    sim_run: str
    real_runs: list[str]
    vllm_version: str
    calibration: str | None
    rows: list[ComparisonRow]
    # Per real run: median measured / simulated step time over its steps (see step_time_ratio).
    step_time_ratios: list[float | None]
    # Runs that left requests out (unfinished_warnings), and what the calibration did not
    # cover (CalibrationProfile.budget_warning, and the simulation's steps outside the
    # profile's fitted batch shapes).
    warnings: list[str]
    # Share of the simulation's steps in the profile's fitted shape cells (sim.shape_coverage);
    # None when the profile records none.
    shape_coverage: float | None = None
    # kvsim's band over step-speed samples (sim.uncertainty), when asked for.
    band: list[BandRow] = field(default_factory=list)

    def band_records(self) -> list[dict[str, Any]]:
        """Per metric: kvsim's median and p10-p90 band, the replays' median, and whether
        that lies inside the band."""
        reference = {r.metric: r.reference for r in self.rows}
        return [
            {
                "metric": b.metric,
                "unit": b.unit,
                "median": b.median,
                "low": b.low,
                "high": b.high,
                "reference": reference.get(b.metric),
                "inside": b.contains(reference.get(b.metric)),
            }
            for b in self.band
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "sim_run": self.sim_run,
            "real_runs": self.real_runs,
            "vllm_version": self.vllm_version,
            "calibration": self.calibration,
            "metrics": rows_to_records(self.rows),
            "step_time_vs_sim": self.step_time_ratios,
            "shape_coverage": self.shape_coverage,
            "band": self.band_records(),
            "warnings": self.warnings,
        }


def build_report(
    scenario: Scenario,
    sim: RunData,
    reals: list[RunData],
    calibration: Path | None,
    band: Sequence[BandRow] = (),
) -> ValidationReport:
    """The simulation against the measured runs (against their median when repeated), with
    each run's step times against the cost parameters the simulation used, and ``band``
    (kvsim's step-speed samples, :mod:`sim.uncertainty`) against the runs' median."""
    profile = (
        load_profile(calibration)
        if calibration
        else shipped_profile(scenario.hardware, scenario.model)
    )
    params = profile.params_for(scenario.engine.max_num_batched_tokens) if profile else CostParams()
    coverage = None
    warnings: list[str | None] = [*unfinished_warnings(sim, reals)]
    if profile is not None:
        warnings.append(profile.budget_warning(scenario.engine.max_num_batched_tokens))
        coverage = profile.coverage(
            shapes_of_steps(sim.steps), scenario.engine.max_num_batched_tokens
        )
        warnings.append(coverage.warning() if coverage else None)
    return ValidationReport(
        scenario=scenario.name,
        sim_run=str(sim.path),
        real_runs=[str(r.path) for r in reals],
        vllm_version=str(reals[0].summary.get("vllm_version", "?")),
        calibration=str(calibration)
        if calibration
        else (f"shipped kernel fit for {profile.hardware}" if profile else None),
        rows=compare_to_runs(sim.summary, [r.summary for r in reals]),
        step_time_ratios=[step_time_ratio(r, scenario, params) for r in reals],
        warnings=[w for w in warnings if w],
        shape_coverage=coverage.fraction if coverage else None,
        band=list(band),
    )


def unfinished_warnings(sim: RunData, reals: Sequence[RunData]) -> list[str]:
    """Why the error table may not compare like with like: a replay that vLLM failed in, or
    a replay or simulation cut at ``limits.max_duration_s``, leaves its unfinished requests
    out of its figures, and those are the slowest ones (:func:`sim.report.partial_run_line`)."""
    sides = [(r, f"the replay {r.path}") for r in reals] + [(sim, "the simulation")]
    return [line for run, side in sides if (line := partial_run_line(run.summary, side))]


def write_report(report: ValidationReport, path: Path) -> None:
    """report.json, as strict JSON: a figure that is not a number (a step-time ratio or band
    over no samples) is null, never the bare ``NaN``/``Infinity`` that jq, JavaScript and Go
    reject (the metric rows say why theirs are: ``relative_error_missing``)."""
    document = _finite_json(report.to_json())
    path.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")


def _finite_json(value: Any) -> Any:
    """``value`` with every float that is not finite replaced by None, at any depth."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite_json(item) for item in value]
    return value
