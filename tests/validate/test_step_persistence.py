"""The persistence of the step jitter, fitted on measured runs (validate/step_persistence.py)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.step_jitter import StepJitter
from validate.step_persistence import (
    fit_components,
    normal_scores,
    residual_persistence,
    score_autocorrelation,
)

QUANTILES = tuple(np.exp(np.linspace(-0.2, 0.6, 200)))  # a skewed spread, as measured


def runs(components: tuple[tuple[float, float], ...], num_runs: int, steps: int) -> list:
    """Ratios of ``num_runs`` runs drawn by the simulator's own jitter."""
    out = []
    for run in range(num_runs):
        jitter = StepJitter(QUANTILES, (run,), components)
        out.append(np.array([jitter(k) for k in range(steps)]))
    return out


def test_normal_scores_rank_the_values_and_share_ties() -> None:
    scores = normal_scores(np.array([3.0, 1.0, 2.0]))
    assert scores[1] < 0 == scores[2] < scores[0]
    assert scores[0] == pytest.approx(-scores[1])
    assert normal_scores(np.array([5.0, 5.0, 5.0])) == pytest.approx([0.0] * 3)


def test_the_fit_recovers_a_fast_and_a_slow_component() -> None:
    truth = ((0.25, 0.9), (0.2, 0.994))
    fitted = residual_persistence(runs(truth, 12, 8_000))
    assert len(fitted) == 2
    (fast_share, fast), (slow_share, slow) = fitted
    assert fast == pytest.approx(0.9, abs=0.04)
    assert slow == pytest.approx(0.994, abs=0.004)
    assert fast_share + slow_share == pytest.approx(0.45, abs=0.06)
    assert slow_share == pytest.approx(0.2, abs=0.06)


def test_independent_steps_fit_no_persistence() -> None:
    fitted = residual_persistence(runs((), 6, 8_000))
    assert sum(share for share, _ in fitted) < 0.02


def test_too_few_steps_or_constant_ratios_fit_nothing() -> None:
    assert residual_persistence([np.linspace(1, 2, 150)]) == []  # under 200 pairs at any lag
    assert residual_persistence([np.ones(5_000), np.ones(3_000)]) == []  # no order to measure
    assert residual_persistence([]) == []


def test_lags_without_enough_pairs_are_left_out() -> None:
    lags, acf = score_autocorrelation([np.random.default_rng(0).random(400)], max_lag=300)
    assert lags.tolist() == list(range(1, 201))  # 400 - lag >= 200 pairs
    assert len(acf) == 200


def test_a_pure_decay_fits_one_component() -> None:
    lags = np.arange(1, 301)
    fitted = fit_components(lags, 0.3 * 0.97**lags)
    assert len(fitted) == 1
    assert fitted[0] == pytest.approx((0.3, 0.97), abs=1e-3)
    assert fit_components(lags, np.zeros(300)) == []
    # Nearly all of the variance persistent: the rounded shares still sum to at most 1.
    whole = fit_components(lags, 0.55 * 0.9**lags + 0.44996 * 0.99**lags)
    assert 0.999 < sum(a for a, _ in whole) <= 1.0
    assert fit_components(lags, -0.1 * 0.5**lags) == []  # anti-persistence: none fitted
