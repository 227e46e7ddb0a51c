"""The validation and calibration scenarios for KV pressure run the regime they are named
after (simulated here, priced by known parameters; their replays on vLLM run in the
validation suite, ``benchmarks/bench_validation.py``)."""

from __future__ import annotations

import pandas as pd
import pytest

from sim.runner import SimulationResult, simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from tests.profiles import profile_with
from tests.validate.fake_vllm import TRUTH
from validate.calibrate import MIN_BUDGET_STEPS

VALIDATION = SCENARIO_DIR / "validation"


def run(path: str) -> SimulationResult:
    profile = profile_with(TRUTH, hardware="cpu", model="tiny-llama", vllm_version="0.32.0")
    return simulate(load_scenario(SCENARIO_DIR / path), profile)


def preempted(requests: pd.DataFrame) -> pd.DataFrame:
    return requests[requests["num_preemptions"] > 0]


def test_agents_under_kv_pressure_are_preempted_inside_their_loops() -> None:
    result = run("validation/agents-kv-pressure.yaml")
    requests = result.requests
    assert requests["finish_s"].notna().all()
    hit = preempted(requests)
    assert len(hit) >= 5
    # Preemption lands inside the closed loops: on turns that are not their session's last,
    # so the session's next turn waited on the recompute.
    last_turn = requests.groupby("session_id")["turn"].max()
    assert (hit["turn"] < hit["session_id"].map(last_turn)).any()


def test_priority_preemption_takes_background_work_first() -> None:
    result = run("validation/priority-preemption.yaml")
    requests = result.requests
    hit = preempted(requests)
    assert len(hit) >= 3
    by_class = hit["priority_class"].value_counts()
    assert by_class.get("background", 0) > by_class.get("interactive", 0)
    ttft = (
        (requests["first_token_s"] - requests["arrival_s"])
        .groupby(requests["priority_class"])
        .median()
    )
    assert ttft["interactive"] < ttft["background"]


def test_long_prompts_compute_in_chunks_under_the_threshold() -> None:
    scenario = load_scenario(VALIDATION / "long-prompts-chunked.yaml")
    threshold = scenario.engine.long_prefill_token_threshold
    assert threshold and threshold < scenario.engine.max_num_batched_tokens
    result = run("validation/long-prompts-chunked.yaml")
    steps = result.steps
    with_prefill = steps[steps["num_prefill_tokens"] > 0]
    # No prefill request computes more than the threshold in one step, unless it is alone
    # in the engine (vLLM lifts the cap then: nobody else to starve)...
    shared = with_prefill[
        with_prefill["num_requests_running"] + with_prefill["num_requests_waiting"] > 1
    ]
    assert len(shared) > len(with_prefill) // 2
    capped = threshold * shared["num_prefill_reqs"]
    assert (shared["num_prefill_tokens"] <= capped).all()
    # ... so prompts take several steps, beside running decodes.
    assert (result.requests["prompt_tokens"] > 4 * threshold).sum() >= 10
    assert (with_prefill["num_decode_tokens"] > 0).sum() > len(result.requests)
    assert result.summary["num_finished"] == result.summary["num_requests"]


def test_the_kv_pressure_calibration_runs_large_batches_near_a_full_pool_and_recomputes() -> None:
    result = run("calibration/kv-pressure.yaml")
    steps = result.steps
    assert len(preempted(result.requests)) >= 5
    assert steps["num_preemptions"].sum() >= 5
    full = steps[steps["kv_cache_usage_perc"] > 0.9]
    assert (full["num_decode_tokens"] >= 8).sum() >= 100


@pytest.mark.parametrize("budget", [256, 2048])
def test_the_budget_calibrations_chunk_prompts_beside_decodes_at_their_budget(budget: int) -> None:
    result = run(f"calibration/budget-{budget}.yaml")
    assert result.summary["num_finished"] == result.summary["num_requests"]
    tokens = result.steps["num_prefill_tokens"] + result.steps["num_decode_tokens"]
    steps = result.steps[tokens > 0]
    with_prefill = steps[steps["num_prefill_tokens"] > 0]
    # One replay has enough of both kinds of step for a fit of its budget alone.
    assert min(len(with_prefill), len(steps) - len(with_prefill)) >= MIN_BUDGET_STEPS
    # Prompts chunked by the budget (steps that fill it), prefills beside decodes, and
    # prefills larger than 512 at 2,048.
    assert (tokens[with_prefill.index] == budget).sum() >= 5
    assert (with_prefill["num_decode_tokens"] >= 4).sum() >= 20
    assert (with_prefill["num_prefill_tokens"] > 512).sum() >= (20 if budget > 512 else 0)


def test_scenario_names_and_seeds_are_distinct() -> None:
    """Calibration never replays a validation workload: names and seeds differ across both
    sets."""
    scenarios = [
        load_scenario(p)
        for kind in ("calibration", "validation")
        for p in sorted((SCENARIO_DIR / kind).glob("*.yaml"))
    ]
    names = [s.name for s in scenarios]
    seeds = [s.seed for s in scenarios]
    assert len(set(names)) == len(names)
    assert len(set(seeds)) == len(seeds)


def test_the_budget_2048_validation_runs_prefills_past_512_beside_decodes_in_closed_loops() -> None:
    """The validation scenario at 2,048 checks the profile's fit at that budget: its turns
    send prompts that a 512-token budget would chunk, beside other sessions' decodes."""
    result = run("validation/agents-budget-2048.yaml")
    assert result.summary["num_finished"] == result.summary["num_requests"]
    steps = result.steps
    with_prefill = steps[steps["num_prefill_tokens"] > 0]
    assert (with_prefill["num_prefill_tokens"] <= 2048).all()
    past_512 = with_prefill[with_prefill["num_prefill_tokens"] > 512]
    assert len(past_512) >= 30
    assert (past_512["num_decode_tokens"] > 0).sum() >= 10
    assert result.requests["turn"].max() >= 3
