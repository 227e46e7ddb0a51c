"""The first step of each token count pays for its kernels: the rule, the engine's pricing of
it, and the fast path with it (every step as the step-by-step path prices it)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.cost_model import CostModel, CostParams
from sim.kernel_builds import KernelBuilds, kernel_build_steps
from sim.runner import simulate
from sim.scenario import parse_scenario
from sim.step_record import shapes_of_steps
from tests.profiles import profile_with
from tests.sim.test_fast_path import (
    DECODE_HEAVY,
    assert_identical,
    long_prompt_scenarios,
    scenarios,
)
from tests.sim.test_fast_path import stretch_counter as stretch_counter  # a fixture


def test_only_new_counts_above_the_minimum_build_and_the_budget_is_built_at_start() -> None:
    counts = [0, 8, 100, 100, 64, 65, 512, 100, 65, 300]
    assert kernel_build_steps(counts, 64, 512) == [
        False,  # empty step
        False,  # 8 tokens: at or under the minimum
        True,
        False,  # 100 again
        False,  # exactly the minimum
        True,
        False,  # the budget: vLLM's start-up dummy run built it
        False,
        False,
        True,
    ]
    builds = KernelBuilds(64, 512)
    assert builds.is_new(100) and builds.is_new(100)  # asking records nothing
    assert builds.run(100) and not builds.is_new(100) and not builds.run(100)
    assert kernel_build_steps([], 64, 512) == []


BUILDING = CostParams(mode="additive", kernel_build_s=3e-3, kernel_build_per_token_s=2e-5)

# Every request arrives at once: what the scheduler decides does not depend on step times,
# so a run priced with kernel builds has the same steps as one without.
BURST: dict[str, Any] = {
    "name": "kernel-builds",
    "seed": 5,
    "model": "Llama-3.1-8B",
    "hardware": "H100-SXM-80GB",
    "engine": {"max_num_batched_tokens": 512, "max_num_seqs": 8},
    "workload": {
        "kind": "open_loop",
        "num_requests": 24,
        "arrival": {"kind": "burst", "at_s": 0.0},
        "prompt_tokens": {"kind": "uniform", "low": 70, "high": 900},
        "output_tokens": {"kind": "uniform", "low": 1, "high": 40},
    },
}


@pytest.mark.parametrize("exact", [False, True])
def test_the_engine_prices_each_counts_first_step_and_no_other(exact: bool) -> None:
    scenario = parse_scenario(BURST, "kernel-builds")
    plain_params = BUILDING.model_copy(update={"kernel_build_s": 0, "kernel_build_per_token_s": 0})
    plain = simulate(scenario, profile_with(plain_params), exact_reference=exact).steps
    built = simulate(scenario, profile_with(BUILDING), exact_reference=exact).steps
    assert len(plain) == len(built)
    tokens = (built["num_prefill_tokens"] + built["num_decode_tokens"]).tolist()
    first = kernel_build_steps(tokens, 64, 512)
    assert 5 < sum(first) < len(first)
    cost = CostModel(scenario.model, scenario.hardware, 1, BUILDING)
    for shape, t, is_first, with_s, without_s in zip(
        shapes_of_steps(built), tokens, first, built["duration_s"], plain["duration_s"], strict=True
    ):
        extra_s = 3e-3 + 2e-5 * t if is_first else 0.0
        assert with_s - without_s == pytest.approx(extra_s, abs=1e-9)
        # The cost model's own price of the build, for the shape the step table records.
        built_s = cost.step_time_s(shape, kernel_build=is_first) - cost.step_time_s(shape)
        assert built_s == pytest.approx(extra_s, abs=1e-12)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(raw=st.one_of(scenarios(), long_prompt_scenarios()), min_tokens=st.sampled_from([1, 8, 64]))
def test_fast_path_with_kernel_builds_gives_the_step_by_step_results(
    raw: dict[str, Any], min_tokens: int
) -> None:
    """A stretch stops short of a step that would build kernels; that step is priced and
    recorded one by one, so both paths build at the same steps."""
    scenario = parse_scenario(raw, "kernel-builds")
    profile = profile_with(BUILDING.model_copy(update={"kernel_build_min_tokens": min_tokens}))
    assert_identical(simulate(scenario, profile), simulate(scenario, profile, exact_reference=True))


def test_stretches_still_run_when_kernel_builds_are_priced(stretch_counter: list[int]) -> None:
    scenario = parse_scenario(DECODE_HEAVY, "kernel-builds")
    profile = profile_with(BUILDING.model_copy(update={"kernel_build_min_tokens": 1}))
    fast = simulate(scenario, profile)
    assert stretch_counter and stretch_counter[-1] > len(fast.steps) // 2
    reference = simulate(scenario, profile, exact_reference=True)
    assert_identical(fast, reference)
    tokens = fast.steps["num_prefill_tokens"] + fast.steps["num_decode_tokens"]
    budget = scenario.engine.max_num_batched_tokens
    assert sum(kernel_build_steps(tokens.tolist(), 1, budget)) > 3
