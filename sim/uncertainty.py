"""An uncertainty band on a simulation: the scenario run at the step speeds real engine
processes were measured at, metric by metric as a median and a p10-p90 band.

One deterministic number hides how much a real run moves: on the shared 2-vCPU validation
machines one vLLM process ran the same batches at 0.8x to 1.5x the speed of the next, and a
closed loop under pressure compounds a slower step into later preemptions and arrivals. A
profile fitted by ``kvsim calibrate`` records, per measured run, the median of its steps'
measured / fitted time (``CalibrationProfile.run_step_ratios``) and, where it was fitted on
runs of several scenarios, the same ratio against a fit without the run's own scenario
(``held_out_run_step_ratios``): the process's speed times the fit's error on a scenario it
has not seen, which a prediction for the user's own scenario carries too. ``kvsim run
--samples N`` simulates the scenario N times, sample ``i`` with every step time multiplied
by the ``(i + 0.5) / N`` quantile of the held-out ratios (the in-sample ones for a profile
without them; ``CostModel``'s ``step_time_scale``; swap and offload copies keep their speed;
a stratified draw: a stable band from a few samples), and
with ``vary_seed`` also with workload seed ``seed + i``. Where the profile records the
step-to-step spread within a process (``step_residual_quantiles``), each step of sample ``i``
is also multiplied by its own draw from it (:mod:`sim.step_jitter`, stream ``i``), in the
order the measured steps persist in where the profile records that
(``step_residual_persistence``): independent draws move the p99 latencies, persistent ones
the medians and run-level figures too. Where the profile records the fit's error at the level
of the metrics on scenarios held out of it (``held_out_metric_ratios``,
:mod:`validate.metric_error`: a measured run's TTFT, ITL, E2E or throughput over kvsim's at
that run's own speed), sample ``i``'s latencies and throughput are also multiplied by a
stratified draw from those (:func:`metric_error_factors`): what a fit off on one kind of step
(prefill chunks, say) and right at the median step does to a metric, which no step speed
carries. Each sample is a whole run of the same engine, so the band costs N runs, spread
over worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.config.calibration import CalibrationProfile
from sim.cores import default_workers
from sim.errors import KvsimConfigError
from sim.interrupts import result_of, sigint_deferred, stop_pool, submit, worker_pool
from sim.metrics import HEADLINE_METRICS, metric_value
from sim.scenario import Scenario
from sim.step_jitter import JitterSpec

# The band, in the run directory of kvsim run --samples.
SAMPLES = "samples.json"
# The band reported: these percentiles of the samples' values.
BAND_PERCENTILES = (10.0, 90.0)
# Units of the headline metrics a model error multiplies: latencies and throughput (not the
# counts and fractions the scheduler decides: preemptions, hit rate, KV usage).
MODEL_ERROR_UNITS = frozenset({"s", "tok/s"})
# Seeds the order in which samples take the model-error quantiles (independent of the
# speeds, which samples take in ascending order).
MODEL_ERROR_SEED = 0


def speed_factors(run_step_ratios: Sequence[float], num_samples: int) -> list[float]:
    """The step-time scale of each sample: the ``(i + 0.5) / num_samples`` quantiles of the
    measured runs' ratios (linear interpolation between them)."""
    if num_samples < 1:
        raise ValueError(f"num_samples={num_samples}: must be at least 1")
    if not run_step_ratios:
        raise ValueError("no measured run ratios to draw step speeds from")
    quantiles = (np.arange(num_samples) + 0.5) / num_samples
    return [float(q) for q in np.quantile(np.asarray(run_step_ratios, dtype=float), quantiles)]


def sample_factors(profile: CalibrationProfile | None, num_samples: int) -> list[float]:
    """The step-time scale of each sample; a clear error for a profile without runs."""
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
    return speed_factors(run_ratios(profile), num_samples)


def run_ratios(profile: CalibrationProfile) -> list[float]:
    """The measured runs' speeds a band draws from: held out of the fit where the profile
    records them (the process's speed and the fit's error on an unseen scenario), else in
    sample (the process's speed only)."""
    return profile.held_out_run_step_ratios or profile.run_step_ratios


def metric_error_factors(
    profile: CalibrationProfile | None, num_samples: int
) -> dict[str, list[float]]:
    """Per headline metric the profile measured a held-out model error for on at least two
    calibration scenarios (``held_out_metric_ratios``): the factor each sample's value is
    multiplied by. Sample ``i`` takes the quantile at ``(p_i + 0.5) / num_samples`` of the
    scenarios' ratios, ``p`` a fixed permutation (:data:`MODEL_ERROR_SEED`), the same for
    every metric: a stratified draw, as the speeds', paired with them at random. Empty
    without a profile or such ratios."""
    if profile is None or not profile.held_out_metric_ratios:
        return {}
    order = np.random.default_rng(MODEL_ERROR_SEED).permutation(num_samples)
    levels = (order + 0.5) / num_samples
    factors = {}
    for label, _, unit in HEADLINE_METRICS:
        ratios = [r[label] for r in profile.held_out_metric_ratios.values() if label in r]
        if unit in MODEL_ERROR_UNITS and len(ratios) >= 2:
            factors[label] = [float(q) for q in np.quantile(np.asarray(ratios), levels)]
    return factors


@dataclass(frozen=True)
class BandRow:
    metric: str
    unit: str
    point: float | None  # the run at the profile as fitted
    median: float | None  # over the samples
    low: float | None  # BAND_PERCENTILES[0] of the samples
    high: float | None  # BAND_PERCENTILES[1]
    samples: tuple[float | None, ...]  # one per sample, None where it lacks the metric
    # Whether the samples' values include a model-error factor (metric_error_factors).
    model_error: bool = False

    def contains(self, value: float | None) -> bool | None:
        """Whether ``value`` lies in [low, high]; None when either side is missing."""
        if value is None or self.low is None or self.high is None:
            return None
        return self.low <= value <= self.high


def band_rows(
    point: dict[str, Any] | None,
    samples: Sequence[dict[str, Any]],
    profile: CalibrationProfile | None = None,
) -> list[BandRow]:
    """One row per headline metric over the samples' summaries, each sample's value times
    its :func:`metric_error_factors` of ``profile`` where it records them."""
    errors = metric_error_factors(profile, len(samples))
    rows = []
    for label, path, unit in HEADLINE_METRICS:
        values = [metric_value(s, path) for s in samples]
        if label in errors:
            values = [
                None if v is None else v * f for v, f in zip(values, errors[label], strict=True)
            ]
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
                samples=tuple(values),
                model_error=label in errors,
            )
        )
    return rows


def truncated_samples(summaries: Sequence[dict[str, Any]]) -> list[int]:
    """The samples (by index) that hit ``limits.max_duration_s``: their latencies leave out
    the requests they did not finish."""
    return [i for i, s in enumerate(summaries) if s.get("truncated_at_limit")]


def truncation_warning(point: dict[str, Any], summaries: Sequence[dict[str, Any]]) -> str | None:
    """Why the band may read better than the truth, or None."""
    cut = truncated_samples(summaries)
    if not cut or point.get("truncated_at_limit"):
        return None  # a truncated run says so itself
    return (
        f"{len(cut)} of {len(summaries)} samples hit limits.max_duration_s (the run itself did "
        "not): their latencies leave out the requests they did not finish, so the band's slow "
        "side reads better than it is; raise limits.max_duration_s"
    )


def band_records(
    rows: Sequence[BandRow],
    factors: Sequence[float],
    summaries: Sequence[dict[str, Any]],
    profile: CalibrationProfile | None = None,
) -> dict[str, Any]:
    """JSON-ready band (``samples.json`` of a run directory): with the ``profile`` the samples
    were drawn from, whether they drew step-to-step jitter too and its persistence."""
    jitter = profile is not None and bool(profile.step_residual_quantiles)
    held_out = profile is not None and bool(profile.held_out_run_step_ratios)
    return {
        "percentiles": list(BAND_PERCENTILES),
        "speed_factors": list(factors),
        # Drawn from runs priced by fits without their scenario (see run_ratios).
        "speeds_held_out": held_out,
        # Per metric, what each sample's value was multiplied by (metric_error_factors):
        # the samples' values below include it.
        "model_error_factors": metric_error_factors(profile, len(summaries)),
        "step_jitter": jitter,
        "step_persistence": [
            list(c) for c in (profile.step_residual_persistence if jitter and profile else [])
        ],
        "truncated_samples": truncated_samples(summaries),
        "metrics": [
            {
                "metric": r.metric,
                "unit": r.unit,
                "point": r.point,
                "median": r.median,
                "low": r.low,
                "high": r.high,
                "samples": list(r.samples),
                "model_error": r.model_error,
            }
            for r in rows
        ],
    }


def jitter_spec(profile: CalibrationProfile, sample: int) -> JitterSpec | None:
    """The step jitter of sample ``sample``, None when the profile records no step spread."""
    quantiles = profile.step_residual_quantiles
    if not quantiles:
        return None
    components = tuple((a, phi) for a, phi in profile.step_residual_persistence)
    return JitterSpec(tuple(quantiles), sample, components)


def _simulate_summary(
    scenario: Scenario, profile: CalibrationProfile, scale: float, jitter: JitterSpec | None
) -> dict[str, Any]:
    from sim.runner import simulate

    return simulate(scenario, profile, step_time_scale=scale, step_jitter=jitter).summary


Job = tuple[Scenario, float, JitterSpec | None]  # a sample's scenario, speed and jitter


def _run_in_workers(
    jobs: Sequence[Job],
    profile: CalibrationProfile,
    workers: int,
    add: Callable[[dict[str, Any]], None],
) -> None:
    """Each job's summary, in job order, to ``add``, from ``workers`` worker processes
    (:func:`sim.interrupts.worker_pool`: they die with this process and never see Ctrl-C).
    Interrupted (Ctrl-C, a dashboard rerun) or failed, the workers are terminated at once
    rather than waited for."""
    pool = worker_pool(workers)
    try:
        with sigint_deferred() as interrupt:
            futures = [submit(pool, _simulate_summary, spec, profile, f, j) for spec, f, j in jobs]
            for future in futures:  # in sample order: the result does not depend on timing
                add(result_of(future, interrupt))
    except BaseException:
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def run_samples(
    scenario: Scenario,
    profile: CalibrationProfile | None,
    num_samples: int,
    vary_seed: bool = False,
    workers: int | None = None,
    on_done: Callable[[int], None] | None = None,
    on_serial: Callable[[str], None] | None = None,
) -> tuple[list[float], list[dict[str, Any]]]:
    """The speed factors and summaries of ``num_samples`` runs (see the module docstring),
    in sample order, on up to ``workers`` processes (default: every core this process may
    use, at most one per sample; one process where worker processes cannot start, which
    ``on_serial(why)`` is told). ``on_done(k)`` runs after each finished sample, with the
    number done."""
    factors = sample_factors(profile, num_samples)
    assert profile is not None
    jobs: list[Job] = [
        (
            scenario.model_copy(update={"seed": scenario.seed + i}) if vary_seed else scenario,
            f,
            jitter_spec(profile, i),
        )
        for i, f in enumerate(factors)
    ]
    workers = min(workers or default_workers(), len(jobs))
    summaries: list[dict[str, Any]] = []

    def add(summary: dict[str, Any]) -> None:
        summaries.append(summary)
        if on_done:
            on_done(len(summaries))

    if workers > 1:
        try:
            _run_in_workers(jobs, profile, workers, add)
        except (OSError, BrokenProcessPool) as exc:
            # No worker processes here (no /dev/shm, a sandbox), or a worker died (memory):
            # the samples left run one by one in this process, with the same results.
            if on_serial is not None:
                left = len(jobs) - len(summaries)
                on_serial(
                    f"worker processes failed ({type(exc).__name__}: {exc}); the {left} "
                    "samples left run one by one in this process (same results, slower)"
                )
    for spec, f, j in jobs[len(summaries) :]:
        add(_simulate_summary(spec, profile, f, j))
    return factors, summaries
