"""An uncertainty band on a simulation: the scenario run at the step speeds real engine
processes were measured at, metric by metric as a median and a p10-p90 band.

One deterministic number hides how much a real run moves: on the shared 2-vCPU validation
machines one vLLM process ran the same batches at 0.8x to 1.5x the speed of the next, and a
closed loop under pressure compounds a slower step into later preemptions and arrivals. A
profile fitted by ``kvsim calibrate`` records, per measured run, the median of its steps'
measured / fitted time (``CalibrationProfile.run_step_ratios``). ``kvsim run --samples N``
simulates the scenario N times, sample ``i`` with every step time scaled by the
``(i + 0.5) / N`` quantile of those ratios (a stratified draw: a stable band from a few
samples), and with ``vary_seed`` also with workload seed ``seed + i``. Each sample is a whole
run of the same engine, so the band costs N runs, spread over worker processes.

Not modelled: step-to-step jitter within one process (a step's own residual), which moves the
p99 latencies more than the medians.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.config.calibration import CalibrationProfile
from sim.cost_model import COST_TERMS, CostParams
from sim.errors import KvsimConfigError
from sim.metrics import HEADLINE_METRICS, metric_value
from sim.scenario import Scenario

# The band, in the run directory of kvsim run --samples.
SAMPLES = "samples.json"
# The band reported: these percentiles of the samples' values.
BAND_PERCENTILES = (10.0, 90.0)


def speed_factors(run_step_ratios: Sequence[float], num_samples: int) -> list[float]:
    """The step-time scale of each sample: the ``(i + 0.5) / num_samples`` quantiles of the
    measured runs' ratios (linear interpolation between them)."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: must be at least 1")
    if not run_step_ratios:
        raise ValueError("no measured run ratios to draw step speeds from")
    quantiles = (np.arange(num_samples) + 0.5) / num_samples
    return [float(q) for q in np.quantile(np.asarray(run_step_ratios, dtype=float), quantiles)]


def scaled_params(params: CostParams, factor: float) -> CostParams:
    """``params`` with every step-time term ``factor`` times as costly (efficiencies divided,
    overheads multiplied); PCIe transfers are not engine steps and keep their speed."""
    if params.mode == "operators":
        raise KvsimConfigError(
            "kvsim run --samples scales a profile fitted on measured runs (kvsim calibrate); "
            "this one is a GPU kernel fit (cost mode 'operators'), which has no run spread"
        )
    update: dict[str, float] = {"allreduce_latency_s": params.allreduce_latency_s * factor}
    for term in COST_TERMS:
        value: float = getattr(params, term.param)
        update[term.param] = value / factor if term.efficiency else value * factor
    return params.model_copy(update=update)


def sample_profiles(
    profile: CalibrationProfile | None, num_samples: int
) -> list[tuple[float, CalibrationProfile]]:
    """(speed factor, profile) of each sample; a clear error for a profile without runs."""
    if profile is None:
        raise KvsimConfigError(
            f"--samples {num_samples} draws step speeds from the measured runs a calibration "
            "profile was fitted on; pass --calibration with a profile written by kvsim "
            "calibrate"
        )
    if not profile.run_step_ratios:
        raise KvsimConfigError(
            f"--samples {num_samples}: the calibration profile records no measured run "
            "spread to draw step speeds from (run_step_ratios is empty: it was not fitted by "
            "kvsim calibrate on measured runs, or before kvsim recorded them; refit it)"
        )
    return [
        (f, profile.model_copy(update={"params": scaled_params(profile.params, f)}))
        for f in speed_factors(profile.run_step_ratios, num_samples)
    ]


@dataclass(frozen=True)
class BandRow:
    metric: str
    unit: str
    point: float | None  # the run at the profile as fitted
    median: float | None  # over the samples
    low: float | None  # BAND_PERCENTILES[0] of the samples
    high: float | None  # BAND_PERCENTILES[1]
    samples: tuple[float, ...]

    def contains(self, value: float | None) -> bool | None:
        """Whether ``value`` lies in [low, high]; None when either side is missing."""
        if value is None or self.low is None or self.high is None:
            return None
        return self.low <= value <= self.high


def band_rows(point: dict[str, Any] | None, samples: Sequence[dict[str, Any]]) -> list[BandRow]:
    """One row per headline metric over the samples' summaries."""
    rows = []
    for label, path, unit in HEADLINE_METRICS:
        values = [metric_value(s, path) for s in samples]
        present = tuple(v for v in values if v is not None)
        complete = len(present) == len(values) and bool(present)
        low, high = (
            (float(np.percentile(present, q)) for q in BAND_PERCENTILES)
            if complete
            else (None, None)
        )
        rows.append(
            BandRow(
                metric=label,
                unit=unit,
                point=None if point is None else metric_value(point, path),
                median=float(np.median(present)) if complete else None,
                low=low,
                high=high,
                samples=present,
            )
        )
    return rows


def band_records(rows: Sequence[BandRow], factors: Sequence[float]) -> dict[str, Any]:
    """JSON-ready band (``samples.json`` of a run directory)."""
    return {
        "percentiles": list(BAND_PERCENTILES),
        "speed_factors": list(factors),
        "metrics": [
            {
                "metric": r.metric,
                "unit": r.unit,
                "point": r.point,
                "median": r.median,
                "low": r.low,
                "high": r.high,
                "samples": list(r.samples),
            }
            for r in rows
        ],
    }


def _simulate_summary(scenario: Scenario, profile: CalibrationProfile) -> dict[str, Any]:
    from sim.runner import simulate

    return simulate(scenario, profile).summary


def run_samples(
    scenario: Scenario,
    profile: CalibrationProfile | None,
    num_samples: int,
    vary_seed: bool = False,
    workers: int | None = None,
    on_done: Callable[[int], None] | None = None,
) -> tuple[list[float], list[dict[str, Any]]]:
    """The speed factors and summaries of ``num_samples`` runs (see the module docstring),
    in sample order, on up to ``workers`` processes (default: every core, at most one per
    sample). ``on_done(k)`` runs after each finished sample, with the number done."""
    samples = sample_profiles(profile, num_samples)
    jobs = [
        (scenario.model_copy(update={"seed": scenario.seed + i}) if vary_seed else scenario, p)
        for i, (_, p) in enumerate(samples)
    ]
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    summaries: list[dict[str, Any]] = []
    if workers == 1:
        for spec, p in jobs:
            summaries.append(_simulate_summary(spec, p))
            if on_done:
                on_done(len(summaries))
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(_simulate_summary, spec, p) for spec, p in jobs]
            for future in futures:  # in sample order: the result does not depend on timing
                summaries.append(future.result())
                if on_done:
                    on_done(len(summaries))
    return [f for f, _ in samples], summaries
