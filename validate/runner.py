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

from sim import __version__
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
from validate.preflight import installed_vllm, plan_replay, version_note
from validate.progress import ReplayProgress, wait_relaying_progress
from validate.replay import ReplayResult

# The module each replay runs in, in a fresh interpreter (tests stand a simulator in for it).
WORKER_MODULE = "validate.replay_worker"
# How often (seconds) the command looks at the replay's progress while it waits.
PROGRESS_POLL_S = 1.0


class EngineFailure(RuntimeError):
    """vLLM could not start or run the scenario; the message says why."""


def measured_summary(scenario: Scenario, result: ReplayResult) -> dict[str, Any]:
    """summary.json of a measured run (:func:`sim.summary.build_summary`, as the simulator's)."""
    provenance = {
        "source": "vllm",
        "kvsim_version": __version__,
        "vllm_version": result.vllm_version,
        "device": result.device,
        "served_model": result.model,
        "load_format": result.load_format,
        "device_name": result.device_name,  # vLLM's name of it, e.g. "NVIDIA H100 80GB HBM3"
        # What the scenario says the engine runs on, as a simulation records it (summaries
        # before 2026-12-06 recorded the device here; kvsim calibrate reads their scenario's).
        "hardware": scenario.hardware.name,
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


def vllm_log_path(out_dir: Path) -> Path:
    """Where a replay into ``out_dir`` keeps vLLM's own log: ``<out_dir>.vllm.log``."""
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".vllm.log")


def run_real(
    scenario: Scenario,
    device: str,
    model: str | None,
    out_dir: Path,
    on_progress: Callable[[ReplayProgress], None] | None = None,
) -> RunData:
    """Replay on vLLM (in a fresh process) and write the measured run directory, also when
    the engine failed mid-run (the summary then says ``complete: false``). Refuses what
    :func:`validate.preflight.plan_replay` refuses before starting it. Raises EngineFailure
    when vLLM could not start or its process died without writing anything; vLLM's own log
    is kept next to the run as ``<out_dir>.vllm.log``. ``on_progress`` gets the replay's
    progress now and then while it runs (validate.progress)."""
    model_dir = plan_replay(scenario, device, model).model_dir
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; kvsim never overwrites a run")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = vllm_log_path(out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        scenario_path = Path(tmp) / "scenario.yaml"
        scenario_path.write_text(scenario_to_yaml(scenario))
        progress_path = Path(tmp) / "progress.json"
        command = [
            sys.executable,
            "-m",
            WORKER_MODULE,
            str(scenario_path),
            device,
            model_dir,
            str(out_dir),
            "--progress",
            str(progress_path),
        ]
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=worker_env(device)
            )
            try:
                returncode = wait_relaying_progress(
                    proc, progress_path, on_progress, PROGRESS_POLL_S
                )
            finally:
                if proc.poll() is None:  # interrupted (Ctrl-C): stop the replay too
                    proc.kill()
                    proc.wait()
    if returncode != 0 or not out_dir.is_dir():
        raise EngineFailure(failure_reason(log_path, returncode))
    return load_run(out_dir)


def failure_reason(log_path: Path, returncode: int) -> str:
    """Why the replay process wrote no run: its "could not start" line, else its last line;
    with the installed vLLM's version when kvsim is not checked against it."""
    lines = [ln for ln in log_path.read_text().splitlines() if ln.strip()]
    reason = next((ln for ln in reversed(lines) if "could not start" in ln), None)
    if reason is None:
        tail = lines[-1] if lines else "no output"
        reason = f"the vLLM process exited with status {returncode} ({tail})"
    vllm = installed_vllm()
    return f"{reason}{version_note(vllm.version if vllm else None)}; full log: {log_path}"


def run_real_repeated(
    scenario: Scenario,
    device: str,
    model: str | None,
    out_dir: Path,
    repeats: int,
    on_start: Callable[[int, Path], None] | None = None,
    on_progress: Callable[[ReplayProgress], None] | None = None,
) -> list[RunData]:
    """``repeats`` replays, one after another, each in a fresh process: ``out_dir/real`` for
    one, ``out_dir/real-1`` ... ``real-N`` for more. ``on_start(i, run_dir)`` runs before
    replay i; ``on_progress``: see :func:`run_real`."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: must be at least 1")
    names = ["real"] if repeats == 1 else [f"real-{i}" for i in range(1, repeats + 1)]
    runs = []
    for i, name in enumerate(names, start=1):
        if on_start is not None:
            on_start(i, out_dir / name)
        runs.append(run_real(scenario, device, model, out_dir / name, on_progress))
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
                "model_error": b.model_error,
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
    profile, pricing = simulation_pricing(scenario, calibration)
    params = profile.params_for(scenario.engine.max_num_batched_tokens) if profile else CostParams()
    coverage = None
    warnings: list[str | None] = [
        *unfinished_warnings(sim, reals),
        *kv_pool_warnings(sim, reals),
        *device_warnings(sim, reals),
    ]
    if profile is not None:
        warnings.extend(profile.stalled_warnings())
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
        calibration=pricing,
        rows=compare_to_runs(sim.summary, [r.summary for r in reals]),
        step_time_ratios=[step_time_ratio(r, scenario, params) for r in reals],
        warnings=[w for w in warnings if w],
        shape_coverage=coverage.fraction if coverage else None,
        band=list(band),
    )


def simulation_pricing(
    scenario: Scenario, calibration: Path | None
) -> tuple[CalibrationProfile | None, str | None]:
    """The profile that prices the simulation of ``scenario`` (``--calibration``, else the
    kernel fit kvsim ships for its hardware preset, else none: the datasheet roofline) and
    how the report names it (None for the roofline)."""
    if calibration:
        return load_profile(calibration), str(calibration)
    profile = shipped_profile(scenario.hardware, scenario.model)
    return profile, f"shipped kernel fit for {profile.hardware}" if profile else None


# A replay's KV cache may differ from kvsim's by this share before the report says so.
KV_POOL_TOLERANCE = 0.01


def kv_pool_warnings(sim: RunData, reals: Sequence[RunData]) -> list[str]:
    """Why KV pressure may differ: vLLM sized its own KV cache (on a GPU without
    ``engine.num_gpu_blocks_override``) to another block count than the simulation's."""
    simulated = sim.summary.get("kv_cache", {}).get("num_gpu_blocks")
    if not simulated:
        return []
    by_count: dict[int, list[str]] = {}
    for real in reals:
        count = real.summary.get("kv_cache", {}).get("num_gpu_blocks")
        if count and abs(count - simulated) > KV_POOL_TOLERANCE * simulated:
            by_count.setdefault(int(count), []).append(str(real.path))
    return [
        f"vLLM's KV cache held {count:,} blocks in the replay{'s' * (len(paths) > 1)} "
        f"{', '.join(paths)} and the "
        f"simulation's {simulated:,} ({count / simulated - 1:+.1%}): preemptions, queueing "
        "and prefix-cache hits under KV pressure are not comparable; pin both with "
        f"engine.num_gpu_blocks_override={count} (e.g. --set "
        f"engine.num_gpu_blocks_override={count})"
        for count, paths in sorted(by_count.items())
    ]


def device_warnings(sim: RunData, reals: Sequence[RunData]) -> list[str]:
    """Why step times may not compare: a replay ran on a GPU the scenario's hardware preset
    does not name (its family, e.g. H100, is not in vLLM's name of the device), so the
    simulation priced another GPU than the one measured."""
    hardware = str(sim.summary.get("hardware", ""))
    family = hardware.split("-", 1)[0].lower()
    odd = sorted(
        {
            name
            for real in reals
            if (name := str(real.summary.get("device_name") or "")) not in ("", "cpu")
            and family not in name.lower()
        }
    )
    return [
        f"the replays ran on {name}, but the scenario's hardware is {hardware}: the "
        "simulation prices that hardware, not the GPU measured; set hardware to the GPU's "
        "preset (--set hardware=NAME) or calibrate on this GPU"
        for name in odd
    ]


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
