"""Step-to-step jitter (sim/step_jitter.py): per-step factors drawn from measured residuals,
by step index, so the fast path and the step-by-step reference price every step alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from sim.runner import simulate
from sim.scenario import parse_scenario
from sim.step_jitter import JitterSpec, StepJitter, residual_quantiles
from tests.sim.test_fast_path import assert_identical, scenarios

QUANTILES = (0.8, 0.95, 1.0, 1.1, 3.0)


def test_a_steps_factor_depends_on_its_index_only() -> None:
    forward = StepJitter(QUANTILES, (1, 0, 0))
    values = [forward(k) for k in range(10_000)]
    backward = StepJitter(QUANTILES, (1, 0, 0))
    assert [backward(k) for k in reversed(range(10_000))][::-1] == values
    assert [forward(k) for k in (5, 5, 9_999)] == [values[5], values[5], values[9_999]]
    assert min(values) >= 0.8 and max(values) <= 3.0
    # The quantile function through the given points: a quarter of the draws in each span.
    spans = np.histogram(values, bins=[0.8, 0.95, 1.0, 1.1, 3.0])[0] / len(values)
    assert spans == pytest.approx([0.25] * 4, abs=0.02)
    assert StepJitter(QUANTILES, (1, 1, 0))(7) != values[7]  # another stream


@pytest.mark.parametrize(
    ("quantiles", "message"),
    [((1.0,), "at least 2"), ((1.0, 0.9), "non-decreasing"), ((0.0, 1.0), "positive")],
)
def test_bad_quantiles_are_refused(quantiles: tuple[float, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepJitter(quantiles, (0,))


def test_residuals_are_ratios_over_their_runs_median() -> None:
    runs = [np.array([1.0, 2.0, 3.0]), np.array([10.0, 10.0, 20.0]), np.array([])]
    # Over their medians: 0.5, 1, 1.5 and 1, 1, 2.
    assert residual_quantiles(runs, 3) == pytest.approx([0.5, 1.0, 2.0])
    assert len(residual_quantiles(runs)) == 101
    assert residual_quantiles([np.array([])]) == []


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_jittered_fast_path_gives_the_step_by_step_results(raw: dict[str, Any]) -> None:
    scenario = parse_scenario(raw, "jitter")
    jitter = JitterSpec(QUANTILES, 2)
    fast = simulate(scenario, step_jitter=jitter)
    assert_identical(fast, simulate(scenario, exact_reference=True, step_jitter=jitter))
    if len(fast.steps) > 1:  # the jitter changed the step times
        plain = simulate(scenario)
        assert not np.array_equal(
            plain.steps["duration_s"].to_numpy(), fast.steps["duration_s"].to_numpy()
        )
