"""``kvsim calibrate``: fit the cost model's parameters to steps measured on real vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import yaml

from sim.config.calibration import CalibrationProfile
from sim.config.hardware import Hardware
from sim.config.model import ModelGeometry
from sim.cost_model import CostModel, CostParams
from sim.errors import KvsimConfigError
from sim.results import RunData, load_run
from sim.scenario import Scenario, parse_scenario
from sim.scheduler.output import BatchShape
from sim.step_record import shapes_of_steps
from validate.fit import fit_cost_params, steps_since_prefill

# A step slower than this many times its fitted prediction is a stall, not a batch cost.
OUTLIER_FACTOR = 2.0


# A step that starts this much after the previous one ended followed an idle engine.
IDLE_GAP_S = 1e-9


def step_shapes(run: RunData) -> tuple[list[BatchShape], list[float], list[bool]]:
    """The batch composition, measured duration and after-idle flag of every step of a run.

    Both engines start the next step the moment the previous one ends unless nothing is
    queued, so a gap between steps means the engine sat idle (the first step always does).
    """
    s = run.steps
    shapes = shapes_of_steps(s)
    start_s = s["start_s"].to_numpy(dtype=float)
    duration_s = s["duration_s"].to_numpy(dtype=float)
    after_idle = np.ones(len(start_s), dtype=bool)
    after_idle[1:] = start_s[1:] > start_s[:-1] + duration_s[:-1] + IDLE_GAP_S
    return shapes, duration_s.tolist(), after_idle.tolist()


def step_time_ratio(run: RunData, scenario: Scenario, params: CostParams) -> float | None:
    """Median over a measured run's steps of measured / predicted step time (None without
    steps): how much slower (above 1) or faster that engine process ran the steps than
    ``params`` prices them.

    It splits a validation error in two: a replay whose steps ran 8% slow will show latencies
    ~8% above kvsim's however exact the scheduling, and on a shared machine one process can
    run up to ~20% slower than the next.
    """
    shapes, durations_s, after_idle = step_shapes(run)
    cost = CostModel(
        scenario.model, scenario.hardware, scenario.engine.tensor_parallel_size, params
    )
    since = steps_since_prefill(shapes)
    ratios = []
    for shape, measured_s, idle, n in zip(shapes, durations_s, after_idle, since, strict=True):
        predicted_s = cost.step_time_s(shape, idle, n)
        if predicted_s > 0:
            ratios.append(measured_s / predicted_s)
    return float(np.median(ratios)) if ratios else None


def robust_fit(
    shapes: list[BatchShape],
    durations_s: list[float],
    after_idle: list[bool],
    since_prefill: list[int],
    model: ModelGeometry,
    hardware: Hardware,
    tensor_parallel_size: int,
    max_rounds: int = 4,
) -> tuple[CostParams, dict[str, float]]:
    """A median fit that ignores stalls: steps that took over ``OUTLIER_FACTOR`` times the
    fitted prediction are dropped and the fit repeated.

    The median, not the mean: the same batch shape takes +-20% from one step to the next on
    a shared CPU, and ITL and TTFT percentiles read the steps' distribution, whose middle a
    median fit prices (on the CI machines a squared loss relative to the measured time
    priced the median decode step ~4% fast, pulled down by the fast steps).

    A shared CPU (or a GPU box running other work) now and then stalls a step for hundreds of
    milliseconds; those are not a property of the batch, and a squared loss would let a few of
    them drag every coefficient. The share of steps dropped is reported as ``outlier_frac``.
    """
    keep = np.ones(len(shapes), dtype=bool)
    idle = np.asarray(after_idle, dtype=bool)
    since = np.asarray(since_prefill, dtype=int)
    # Decode-only steps outnumber prefill steps ~30 to 1 in agent traffic, but prefill steps
    # set TTFT: each class gets half of the loss.
    has_prefill = np.array([s.num_prefill_tokens > 0 for s in shapes])
    for _ in range(max_rounds):
        kept_shapes = [s for s, k in zip(shapes, keep, strict=True) if k]
        kept_durations = [d for d, k in zip(durations_s, keep, strict=True) if k]
        kept_idle = idle[keep].tolist()
        kept_since = since[keep].tolist()
        kept_prefill = has_prefill[keep]
        num_prefill = max(int(kept_prefill.sum()), 1)
        num_decode = max(int((~kept_prefill).sum()), 1)
        weights = np.where(kept_prefill, 0.5 / num_prefill, 0.5 / num_decode)
        params, fit = fit_cost_params(
            kept_shapes,
            kept_durations,
            model,
            hardware,
            tensor_parallel_size,
            relative=True,
            weights=weights,
            loss="median",
            after_idle=kept_idle,
            since_prefill=kept_since,
        )
        cost = CostModel(model, hardware, tensor_parallel_size, params)
        predicted = np.array(
            [cost.step_time_s(*step) for step in zip(shapes, idle, since, strict=True)]
        )
        new_keep = np.asarray(durations_s) <= OUTLIER_FACTOR * predicted
        if (new_keep == keep).all():
            break
        keep = new_keep
    fit = {**fit, "outlier_frac": float(1.0 - keep.mean()) if len(keep) else 0.0}
    return params, fit


def calibrate(run_dirs: Sequence[Path], command: str = "kvsim calibrate") -> CalibrationProfile:
    """Fit one profile to the measured steps of ``run_dirs`` (same model, device, TP)."""
    if not run_dirs:
        raise KvsimConfigError("kvsim calibrate needs at least one measured run directory")
    runs = [load_run(p) for p in run_dirs]
    for run in runs:
        if run.summary.get("source") != "vllm":
            raise KvsimConfigError(
                f"{run.path}: source={run.summary.get('source')!r}; calibrate on measured runs "
                "(written by kvsim validate or kvsim replay), not simulated ones"
            )
    scenarios = [parse_scenario(yaml.safe_load(r.scenario_yaml), str(r.path)) for r in runs]
    models = {s.model.name for s in scenarios}
    devices = {r.summary.get("device") for r in runs}
    tps = {s.engine.tensor_parallel_size for s in scenarios}
    if len(models) > 1 or len(devices) > 1 or len(tps) > 1:
        raise KvsimConfigError(
            f"runs mix models {sorted(models)}, devices {sorted(map(str, devices))} or "
            f"tensor_parallel_size {sorted(tps)}; a profile describes one of each"
        )
    shapes: list[BatchShape] = []
    durations: list[float] = []
    after_idle: list[bool] = []
    since_prefill: list[int] = []
    for run in runs:
        s, d, a = step_shapes(run)
        shapes += s
        durations += d
        after_idle += a
        since_prefill += steps_since_prefill(s)
    base = scenarios[0]
    params, fit = robust_fit(
        shapes,
        durations,
        after_idle,
        since_prefill,
        base.model,
        base.hardware,
        base.engine.tensor_parallel_size,
    )
    return CalibrationProfile(
        params=params,
        hardware=str(runs[0].summary.get("device")),
        model=base.model.name,
        vllm_version=str(runs[0].summary.get("vllm_version")),
        tensor_parallel_size=base.engine.tensor_parallel_size,
        fit=fit,
        num_steps=int(fit.get("num_steps", len(shapes))),
        created_by=f"{command} {' '.join(str(p) for p in run_dirs)}",
        max_num_batched_tokens=sorted({s.engine.max_num_batched_tokens for s in scenarios}),
    )
