"""Step-to-step jitter (sim/step_jitter.py): per-step factors drawn from measured residuals,
by step index, so the fast path and the step-by-step reference price every step alike."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import sim.engine
from sim.runner import simulate
from sim.scenario import parse_scenario
from sim.step_jitter import NUM_QUANTILES, JitterSpec, StepJitter, residual_quantiles
from tests.sim.fleet.test_fleet_run import agents, fleets
from tests.sim.test_fast_path import assert_identical, scenarios
from validate.step_persistence import score_autocorrelation

QUANTILES = (0.8, 0.95, 1.0, 1.1, 3.0)
JITTER = JitterSpec(QUANTILES, 2)
# A fast and a slow AR(1) component, as the vLLM-CPU calibration replays show.
PERSISTENCE = ((0.25, 0.9), (0.2, 0.994))
PERSISTENT = JitterSpec(QUANTILES, 2, PERSISTENCE)


def test_a_steps_factor_depends_on_its_index_only() -> None:
    forward = StepJitter(QUANTILES, (1, 0, 0))
    values = [forward(k) for k in range(10_000)]
    backward = StepJitter(QUANTILES, (1, 0, 0))
    assert [backward(k) for k in reversed(range(10_000))][::-1] == values
    assert [forward(k) for k in (5, 5, 9_999)] == [values[5], values[5], values[9_999]]
    # A uniform pick among the recorded quantiles: each about a fifth of the steps.
    share = [values.count(q) / len(values) for q in QUANTILES]
    assert share == pytest.approx([0.2] * 5, abs=0.02)
    other = StepJitter(QUANTILES, (1, 1, 0))  # another stream
    assert [other(k) for k in range(50)] != values[:50]


def test_persistent_draws_keep_the_distribution_and_take_the_order() -> None:
    quantiles = tuple(np.linspace(0.8, 1.6, 100))
    forward = StepJitter(quantiles, (4, 0, 0), PERSISTENCE)
    values = np.array([forward(k) for k in range(60_000)])
    backward = StepJitter(quantiles, (4, 0, 0), PERSISTENCE)
    assert [backward(k) for k in reversed(range(0, 60_000, 7))][::-1] == list(values[::7])
    # The same factors as independent draws, each quantile about a hundredth of the steps...
    assert set(values) <= set(quantiles)
    counts = np.bincount(np.searchsorted(quantiles, values), minlength=100) / len(values)
    assert counts == pytest.approx([0.01] * 100, abs=0.004)
    # ...in an order whose autocorrelation is the components' sum a * phi**lag.
    lags, acf = score_autocorrelation([values[i : i + 6_000] for i in range(0, 60_000, 6_000)])
    by_lag = dict(zip(lags.tolist(), acf, strict=True))
    for lag in (1, 10, 100):
        expected = sum(a * phi**lag for a, phi in PERSISTENCE)
        assert by_lag[lag] == pytest.approx(expected, abs=0.06), lag
    independent = StepJitter(quantiles, (4, 0, 0))
    lags, acf = score_autocorrelation([[independent(k) for k in range(20_000)]])
    assert np.abs(acf[:10]).max() < 0.03
    # A stretch of a hundred steps wanders further from the median than independent draws.
    means = np.log(values).reshape(-1, 100).mean(axis=1)
    plain = np.log([independent(k) for k in range(60_000)]).reshape(-1, 100).mean(axis=1)
    assert means.std() > 2.5 * plain.std()


@pytest.mark.parametrize(
    ("components", "message"),
    [
        (((0.5, 1.0),), "coefficient in 0..1"),
        (((1.2, 0.5),), "share in 0..1"),
        (((0.6, 0.5), (0.6, 0.9)), "sum to 1.2"),
    ],
)
def test_bad_persistence_is_refused(
    components: tuple[tuple[float, float], ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        StepJitter(QUANTILES, (0,), components)


@pytest.mark.parametrize(
    ("quantiles", "message"),
    [((), "none given"), ((1.0, 0.0), "positive"), ((float("nan"),), "finite")],
)
def test_bad_quantiles_are_refused(quantiles: tuple[float, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StepJitter(quantiles, (0,))


def test_residuals_are_ratios_over_their_runs_median() -> None:
    runs = [np.array([1.0, 2.0, 3.0]), np.array([10.0, 10.0, 20.0]), np.array([])]
    # Over their medians: 0.5, 1, 1.5 and 1, 1, 2; quantiles at 1/4 and 3/4.
    assert residual_quantiles(runs, 2) == pytest.approx([1.0, 1.375])
    assert len(residual_quantiles(runs)) == NUM_QUANTILES
    assert residual_quantiles([np.array([])]) == []


def test_one_outlier_step_weighs_as_one_step() -> None:
    # 999 steps at the median and one 20x hiccup: mean factor 1.019. The recorded quantiles
    # keep that mean (an interpolation through the maximum would give every hundredth step
    # ~10x and a mean near 1.1).
    ratios = np.ones(1000)
    ratios[17] = 20.0
    quantiles = residual_quantiles([ratios])
    jitter = StepJitter(quantiles, (3,))
    draws = [jitter(k) for k in range(200_000)]
    assert np.mean(quantiles) == pytest.approx(1.0105, abs=1e-3)
    assert np.mean(draws) == pytest.approx(1.0105, abs=3e-3)
    assert np.median(draws) == 1.0


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_jittered_fast_path_gives_the_step_by_step_results(raw: dict[str, Any]) -> None:
    scenario = parse_scenario(raw, "jitter")
    fast = simulate(scenario, step_jitter=JITTER)
    assert_identical(fast, simulate(scenario, exact_reference=True, step_jitter=JITTER))
    if len(fast.steps) > 1:  # the jitter changed the step times
        plain = simulate(scenario)
        assert not np.array_equal(
            plain.steps["duration_s"].to_numpy(), fast.steps["duration_s"].to_numpy()
        )


@settings(
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_persistent_jitter_gives_the_step_by_step_results(raw: dict[str, Any]) -> None:
    scenario = parse_scenario(raw, "persistent")
    fast = simulate(scenario, step_jitter=PERSISTENT)
    assert_identical(fast, simulate(scenario, exact_reference=True, step_jitter=PERSISTENT))


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fleets())
def test_a_jittered_fleet_gives_the_step_by_step_results(raw: dict[str, Any]) -> None:
    scenario = parse_scenario(raw, "jitter-fleet")
    assert_identical(
        simulate(scenario, step_jitter=JITTER),
        simulate(scenario, exact_reference=True, step_jitter=JITTER),
    )


def test_a_jittered_run_still_takes_stretches(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = parse_scenario(agents(replicas=2, router={"kind": "round_robin"}), "stretches")
    end = sim.engine.Engine._end_stretch
    taken: list[int] = []

    def counting(self: sim.engine.Engine, num_steps: int) -> Any:
        taken.append(num_steps)
        return end(self, num_steps)

    monkeypatch.setattr(sim.engine.Engine, "_end_stretch", counting)
    fast = simulate(scenario, step_jitter=JITTER)
    assert sum(taken) > len(fast.steps) // 4  # a good part of the steps in bulk
    monkeypatch.undo()
    assert_identical(fast, simulate(scenario, exact_reference=True, step_jitter=JITTER))
    # Each replica draws its own: the two engines' factors are not the same sequence.
    a, b = JITTER.for_engine(scenario.seed, 0), JITTER.for_engine(scenario.seed, 1)
    assert [a(k) for k in range(50)] != [b(k) for k in range(50)]
