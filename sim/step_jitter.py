"""Step-to-step jitter: each step's time times a draw from the measured residuals.

A real engine process does not run every step of a batch shape in the same time: the
calibration replays on vLLM-CPU show steps of one run scattered around that run's median
measured / fitted ratio, with a long slow tail (a page fault, another process on the core).
``kvsim calibrate`` records that scatter as ``CalibrationProfile.step_residual_quantiles``:
:data:`NUM_QUANTILES` quantiles, at ``(i + 0.5) / NUM_QUANTILES``, of every measured step's
measured / fitted time divided by its run's median ratio (the run's own speed is
``run_step_ratios``, drawn per sample by :mod:`sim.uncertainty`).

:class:`StepJitter` gives step ``k`` (the scheduler's step counter) one of those quantiles,
picked uniformly by the ``k``-th draw of a generator seeded by the run: a draw from the
measured distribution itself (its mean and its tail up to the 99.95th percentile; no
interpolation that would stretch one outlier over a whole percentile). The factor depends on
the step's index only, never on how often the engine priced it, so the fast path and the
step-by-step reference (``tests/sim/test_fast_path.py``) draw the same factor for the same
step. Steps are independent draws: the slow drifts within one process are the per-sample
speed, not this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Quantiles a profile records (at (i + 0.5) / NUM_QUANTILES).
NUM_QUANTILES = 1000
# Draws made at a time (the factors of steps not reached are never used).
_CHUNK = 4096


def check_quantiles(quantiles: Sequence[float]) -> None:
    """ValueError unless every value is a finite positive time factor."""
    if not all(math.isfinite(q) and q > 0 for q in quantiles):
        bad = next(q for q in quantiles if not (math.isfinite(q) and q > 0))
        raise ValueError(f"every value must be a finite, positive time factor; got {bad}")


class StepJitter:
    """Callable: the time factor of step ``k`` (k >= 0)."""

    __slots__ = ("_factors", "_quantiles", "_rng")

    def __init__(self, quantiles: Sequence[float], seed: Sequence[int]) -> None:
        if not len(quantiles):
            raise ValueError("step residual quantiles: none given")
        check_quantiles(quantiles)
        self._quantiles = np.asarray(quantiles, dtype=float)
        self._rng = np.random.default_rng(list(seed))
        self._factors = np.empty(0)

    def __call__(self, step: int) -> float:
        assert step >= 0, step
        if step >= len(self._factors):
            num_chunks = (step - len(self._factors)) // _CHUNK + 1
            picks = self._rng.integers(0, len(self._quantiles), num_chunks * _CHUNK)
            self._factors = np.concatenate([self._factors, self._quantiles[picks]])
        return float(self._factors[step])


@dataclass(frozen=True)
class JitterSpec:
    """What a run draws its step jitter from: the residual quantiles and a stream number
    (the sample's index); each engine of the run gets its own generator."""

    quantiles: tuple[float, ...]
    stream: int = 0

    def for_engine(self, seed: int, replica: int) -> StepJitter:
        """The jitter of one engine (a fleet replica) of a run with workload seed ``seed``."""
        return StepJitter(self.quantiles, (seed, self.stream, replica))


def residual_quantiles(
    ratios_per_run: Sequence[np.ndarray], num: int = NUM_QUANTILES
) -> list[float]:
    """``num`` quantiles, at ``(i + 0.5) / num``, of every step's ratio over its run's
    median ratio, all runs pooled; empty without steps."""
    pooled = [r / np.median(r) for r in ratios_per_run if len(r)]
    if not pooled:
        return []
    values = np.quantile(np.concatenate(pooled), (np.arange(num) + 0.5) / num)
    return [float(v) for v in values]
