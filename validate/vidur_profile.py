"""``kvsim calibrate --vidur``: a calibration profile from Vidur-format operator tables.

The profile has the format of one fitted on replayed vLLM runs (``sim/config/calibration.py``)
with ``source: vidur-operator-tables`` (``torch-operator-tables`` for tables that
``validate/gpu_operators.py`` measured): cost parameters in mode ``operators`` carrying the
fitted :class:`~sim.gpu_kernels.KernelParams`. The shipped H100 and A100 profiles
(``sim/config/kernel_fits/``) were written by this command on Vidur's public profiles.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sim.config.calibration import CalibrationProfile
from sim.config.hardware import Hardware, resolve_hardware
from sim.cost_model import CostParams
from sim.errors import KvsimConfigError
from validate.kernel_fit import (
    fit_kernel_params,
    fit_roofline,
    measured_layer_s,
    predicted_layer_s,
)
from validate.vidur_tables import read_tables

# Vidur's GPU folder names and the kvsim hardware presets they measured.
VIDUR_GPUS = {"h100": "H100-SXM-80GB", "a100": "A100-80GB"}
SOURCE = "vidur-operator-tables"
# Tables that validate/gpu_operators.py measured (it writes meta.json beside compute/).
TORCH_SOURCE = "torch-operator-tables"


def table_provenance(root: Path) -> tuple[str, str, dict[str, str]]:
    """(source, vllm_version, environment) of the tables under ``root``: Vidur's, or measured
    with torch by ``validate/gpu_operators.py`` (its meta.json names the device and versions)."""
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        meta = None
    if not isinstance(meta, dict) or "elementwise" not in meta:
        return SOURCE, "n/a (operator kernels, not vLLM)", {}
    keys = ("device", "sm_count", "torch", "cuda", "blas", "dtype", "elementwise")
    environment = {key: str(meta[key]) for key in keys if meta.get(key) is not None}
    version = f"none (torch {meta.get('torch', '?')} kernels, not vLLM)"
    return TORCH_SOURCE, version, environment


def vidur_profile(
    root: str | Path, gpu: str, hardware: Hardware | None = None, power_cap: bool = True
) -> CalibrationProfile:
    """Fit every kernel parameter of ``gpu`` on the tables under ``root`` (``power_cap``:
    with the GEMM model's power-cap term)."""
    tables = read_tables(root, gpu)
    command = f"kvsim calibrate --vidur {root} --gpu {gpu}"
    if hardware is not None:
        command += f" --hardware {hardware.name}"
    elif gpu in VIDUR_GPUS:
        hardware = resolve_hardware(VIDUR_GPUS[gpu])
    else:
        raise KvsimConfigError(
            f"--gpu {gpu!r} has no hardware preset to pair with; pass --hardware "
            f"(known Vidur GPUs: {', '.join(VIDUR_GPUS)})"
        )
    source, vllm_version, environment = table_provenance(Path(root))
    if not power_cap:
        command += " --no-power-cap"
    kernels = fit_kernel_params(tables, hardware, throttle=power_cap)
    compute_eff, bandwidth_eff = fit_roofline(tables.layers, hardware)
    measured = measured_layer_s(tables.layers)
    predicted = predicted_layer_s(tables.layers, kernels, hardware)
    keep = ~np.isnan(measured)
    error = np.abs(predicted[keep] / measured[keep] - 1) * 100
    return CalibrationProfile(
        params=CostParams(mode="operators", kernels=kernels),
        hardware=hardware.name,
        model=", ".join(tables.models),
        vllm_version=vllm_version,
        tensor_parallel_size=1,
        fit={
            "mape": float(error.mean()),
            "median_abs_pct_error": float(np.median(error)),
            "max_abs_pct_error": float(error.max()),
            "roofline_compute_efficiency": compute_eff,
            "roofline_bandwidth_efficiency": bandwidth_eff,
        },
        num_steps=int(keep.sum()),
        created_by=command,
        source=source,
        environment=environment,
    )


def vidur_warnings(profile: CalibrationProfile, gpu: str) -> list[str]:
    """What a user should know about a profile ``vidur_profile`` wrote: hardware other than
    the preset the tables measured, no all-reduce measurements."""
    notes = []
    expected = VIDUR_GPUS.get(gpu)
    if expected is not None and profile.hardware != expected:
        notes.append(
            f"--hardware {profile.hardware} is not {expected}, the GPU Vidur's {gpu} tables "
            f"measured: the fit's efficiencies are relative to {profile.hardware}'s datasheet "
            f"figures (median error {profile.fit['median_abs_pct_error']:.1f}% per layer)"
        )
    kernels = profile.params.kernels
    if kernels is not None and not kernels.allreduce:
        notes.append(
            f"no network/{gpu}_dgx/all_reduce.csv measurements within one node: tensor-parallel "
            "runs with this profile price all-reduce with the datasheet link bandwidth and "
            "allreduce_latency_s"
        )
    return notes
