"""Step-to-step jitter: each step's time times a draw from the measured residuals.

A real engine process does not run every step of a batch shape in the same time: on the
validation machines a decode step of one shape ran anywhere from ~0.8x to ~1.5x its run's
median, a few steps far slower (a page fault, another process on the core). ``kvsim
calibrate`` records the spread as ``CalibrationProfile.step_residual_quantiles``: the 0th to
100th percentiles of every measured step's measured / fitted time divided by its run's
median ratio (the run's own speed is ``run_step_ratios``, drawn per sample by
:mod:`sim.uncertainty`).

:class:`StepJitter` gives step ``k`` (the scheduler's step counter) the factor
``Q(u_k)``: ``Q`` the piecewise-linear quantile function through those percentiles and
``u_k`` the ``k``-th uniform draw of a generator seeded by the run. The factor depends on
the step's index only, never on how often the engine priced it, so the fast path and the
step-by-step reference (``tests/sim/test_fast_path.py``) draw the same factor for the same
step. Steps are independent draws: the slow drifts within one process are the per-sample
speed, not this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Uniform draws made at a time (the factors of steps not reached are never used).
_CHUNK = 4096


class StepJitter:
    """Callable: the time factor of step ``k`` (k >= 0)."""

    __slots__ = ("_factors", "_grid", "_quantiles", "_rng")

    def __init__(self, quantiles: Sequence[float], seed: Sequence[int]) -> None:
        q = np.asarray(quantiles, dtype=float)
        if q.ndim != 1 or len(q) < 2:
            raise ValueError(f"step residual quantiles: need at least 2, got {len(q)}")
        if not (np.all(np.isfinite(q)) and np.all(q > 0) and np.all(np.diff(q) >= 0)):
            raise ValueError("step residual quantiles must be positive and non-decreasing")
        self._quantiles = q
        self._grid = np.linspace(0.0, 1.0, len(q))
        self._rng = np.random.default_rng(list(seed))
        self._factors: list[float] = []

    def __call__(self, step: int) -> float:
        factors = self._factors
        while step >= len(factors):
            u = self._rng.random(_CHUNK)
            factors.extend(np.interp(u, self._grid, self._quantiles).tolist())
        return factors[step]


@dataclass(frozen=True)
class JitterSpec:
    """What a run draws its step jitter from: the residual quantiles and a stream number
    (the sample's index); each engine of the run gets its own generator."""

    quantiles: tuple[float, ...]
    stream: int = 0

    def for_engine(self, seed: int, replica: int) -> StepJitter:
        """The jitter of one engine (a fleet replica) of a run with workload seed ``seed``."""
        return StepJitter(self.quantiles, (seed, self.stream, replica))


def residual_quantiles(ratios_per_run: Sequence[np.ndarray], num: int = 101) -> list[float]:
    """The ``num`` evenly spaced quantiles (0th to 100th percentile) of every step's ratio
    over its run's median ratio, all runs pooled; empty without steps."""
    pooled = [r / np.median(r) for r in ratios_per_run if len(r)]
    if not pooled:
        return []
    values = np.quantile(np.concatenate(pooled), np.linspace(0.0, 1.0, num))
    return [float(v) for v in values]
