"""Fleet runs: one replica is today's engine, the fast path holds across replicas, round
robin balances, and the tables and summary say which replica did what."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.engine
from sim.errors import KvsimConfigError
from sim.fleet.config import ROUTER_KINDS
from sim.runner import simulate
from sim.scenario import parse_scenario, scenario_to_yaml
from tests.sim.test_fast_path import assert_identical, long_prompt_scenarios, scenarios

ROUTERS = list(ROUTER_KINDS)


def agents(**fleet: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "name": "fleet",
        "seed": 5,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {"max_model_len": 4096, "num_gpu_blocks_override": 600},
        "workload": {
            "kind": "agent_sessions",
            "sessions": 12,
            "session_arrival": {"kind": "poisson", "rate_per_s": 4.0},
            "turns": {"kind": "fixed", "value": 3},
            "system_prompt_tokens": 300,
            "tool_schema_tokens": 100,
            "user_message_tokens": {"kind": "uniform", "low": 20, "high": 80},
            "tool_result_tokens": {"kind": "uniform", "low": 50, "high": 400},
            "output_tokens": {"kind": "uniform", "low": 20, "high": 120},
            "tool_latency": {"kind": "lognormal", "median_s": 0.3, "p95_s": 2.0},
            "max_context_tokens": 4096,
        },
    }
    if fleet:
        raw["fleet"] = fleet
    return raw


def without_replica(frame: Any) -> Any:
    return frame.drop(columns="replica")


@pytest.mark.parametrize("kind", ROUTERS)
def test_one_replica_is_the_single_engine_for_every_router(kind: str) -> None:
    single = simulate(parse_scenario(agents(), "single"))
    fleet = simulate(parse_scenario(agents(replicas=1, router={"kind": kind}), "fleet"))
    summary = dict(fleet.summary)
    assert summary.pop("fleet")["per_replica"][0]["num_requests"] == len(single.requests)
    assert json.dumps(summary, sort_keys=True) == json.dumps(single.summary, sort_keys=True)
    assert without_replica(fleet.requests).equals(single.requests)
    assert without_replica(fleet.steps).equals(single.steps)
    assert set(fleet.requests["replica"]) == {0}


@st.composite
def fleets(draw: st.DrawFn) -> dict[str, Any]:
    raw = draw(scenarios())
    router: dict[str, Any] = {"kind": draw(st.sampled_from(ROUTERS))}
    if draw(st.booleans()):
        router["view_delay_s"] = draw(st.sampled_from([0.001, 0.05, 0.5]))
    raw["fleet"] = {"replicas": draw(st.integers(1, 3)), "router": router}
    return raw


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fleets())
def test_a_fleet_gives_the_step_by_step_results_on_the_fast_path(raw: dict[str, Any]) -> None:
    scenario = parse_scenario(raw, "fleet-fast-path")
    assert_identical(simulate(scenario), simulate(scenario, exact_reference=True))


@st.composite
def long_prompt_fleets(draw: st.DrawFn) -> dict[str, Any]:
    """Replicas whose batches often hold a prompt chunked beside decodes: the prefill
    stretches a submit cuts short."""
    raw = draw(long_prompt_scenarios())
    router = {"kind": draw(st.sampled_from(ROUTERS))}
    raw["fleet"] = {"replicas": draw(st.integers(2, 3)), "router": router}
    return raw


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(long_prompt_fleets())
def test_a_fleet_with_prefill_stretches_gives_the_step_by_step_results(
    raw: dict[str, Any],
) -> None:
    scenario = parse_scenario(raw, "fleet-prefill-stretches")
    assert_identical(simulate(scenario), simulate(scenario, exact_reference=True))


@pytest.mark.parametrize("prefill", [False, True])
def test_a_submit_cuts_a_replicas_stretch_short_with_the_step_by_step_results(
    engines: list[sim.engine.Engine], prefill: bool
) -> None:
    # A replica's stretch runs past other replicas' steps and is cut after the step in
    # which a request is submitted to it: decode stretches, and (a small token budget
    # under long tool results) stretches that chunk a prompt beside the decodes.
    raw = agents(replicas=2, router={"kind": "round_robin"})
    workload = raw["workload"]
    workload["sessions"] = 20
    workload["tool_latency"] = {"kind": "lognormal", "median_s": 0.05, "p95_s": 0.3}
    if prefill:
        raw["engine"].update(max_num_batched_tokens=64, max_num_seqs=16)
        workload["tool_result_tokens"] = {"kind": "uniform", "low": 600, "high": 1500}
    scenario = parse_scenario(raw, "cuts")
    fast = simulate(scenario)
    assert sum(engine.num_stretch_cuts[prefill] for engine in engines) >= 5
    assert sum(engine.num_stretch_steps for engine in engines) > len(fast.steps) // 3
    assert_identical(fast, simulate(scenario, exact_reference=True))


def test_round_robin_shares_independent_traffic_evenly() -> None:
    n = 4
    raw = {
        "name": "rr",
        "seed": 11,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {"max_model_len": 4096},
        "workload": {
            "kind": "open_loop",
            "num_requests": 400,
            "arrival": {"kind": "poisson", "rate_per_s": 40.0},
            "prompt_tokens": {"kind": "lognormal", "median": 300, "sigma": 0.5, "max": 2000},
            "output_tokens": {"kind": "lognormal", "median": 100, "sigma": 0.5, "max": 1000},
        },
        "fleet": {"replicas": n, "router": {"kind": "round_robin"}},
    }
    result = simulate(parse_scenario(raw, "rr"))
    requests = result.requests
    assert requests["replica"].tolist() == [i % n for i in range(400)]
    # Output tokens per replica: a sum of 100 independent draws each; within 4 standard
    # deviations of a quarter of the total.
    tokens = requests["output_tokens"].to_numpy(dtype=float)
    per_replica = np.bincount(requests["replica"], weights=tokens, minlength=n)
    sigma = np.sqrt(len(tokens) / n) * tokens.std()
    assert np.all(np.abs(per_replica - tokens.sum() / n) < 4 * sigma)
    fleet = result.summary["fleet"]
    assert [r["num_requests"] for r in fleet["per_replica"]] == [100] * n
    assert fleet["load_imbalance"]["requests"] == 1.0
    assert fleet["load_imbalance"]["output_tokens"] == pytest.approx(
        per_replica.max() / per_replica.mean()
    )


def test_fleet_tables_and_summary_add_up() -> None:
    result = simulate(
        parse_scenario(
            agents(replicas=3, router={"kind": "session_affinity", "load_factor": 1000}), "fleet"
        )
    )
    requests, steps, summary = result.requests, result.steps, result.summary
    # Submit order across the fleet; every session stays on one replica (no spill at this
    # load factor).
    assert requests["arrival_s"].is_monotonic_increasing
    assert requests.groupby("session_id")["replica"].nunique().max() == 1
    # Steps ordered by start time, each replica counting its own from 1.
    assert steps["start_s"].is_monotonic_increasing
    for index in range(3):
        own = steps[steps["replica"] == index]["step"].tolist()
        assert own == list(range(1, len(own) + 1))
    fleet = summary["fleet"]
    assert fleet["replicas"] == 3 and fleet["router"]["kind"] == "session_affinity"
    per = fleet["per_replica"]
    assert sum(r["num_requests"] for r in per) == summary["num_requests"]
    assert sum(r["num_steps"] for r in per) == summary["metrics"]["num_steps"] == len(steps)
    assert sum(r["preemptions"] for r in per) == summary["metrics"]["vllm:num_preemptions"]["total"]
    assert fleet["what_if"].endswith("each replica is the vLLM-exact engine")
    assert "what_if" not in summary


def test_a_fleet_of_what_if_engines_says_so() -> None:
    from sim.fleet.outputs import fleet_section

    result = simulate(parse_scenario(agents(replicas=2), "two"))
    config = result.scenario.fleet
    assert config is not None
    section = fleet_section(
        config, result.requests, result.steps, result.summary["duration_s"], True
    )
    assert section["what_if"].endswith("the what-if policies listed under the summary's what_if")


def test_a_single_engine_scenario_file_has_no_fleet_key() -> None:
    assert "\nfleet:" not in scenario_to_yaml(parse_scenario(agents(), "single"))
    assert "\nfleet:" in scenario_to_yaml(parse_scenario(agents(replicas=2), "two"))


@pytest.mark.parametrize(
    ("fleet", "names"),
    [
        ({"replicas": 0}, ["fleet.replicas", "0"]),
        ({"replicas": 2, "router": {"kind": "random"}}, ["fleet.router", "random"]),
        (
            {"replicas": 2, "router": {"kind": "session_affinity", "load_factor": 0.5}},
            ["load_factor", "0.5"],
        ),
        (
            {"replicas": 2, "router": {"kind": "round_robin", "view_delay_s": -1}},
            ["view_delay_s", "-1"],
        ),
    ],
)
def test_a_bad_fleet_section_is_refused_naming_the_field(
    fleet: dict[str, Any], names: list[str]
) -> None:
    raw = agents()
    raw["fleet"] = fleet
    with pytest.raises(KvsimConfigError) as error:
        parse_scenario(raw, "bad.yaml")
    message = str(error.value)
    assert "\n" not in message and message.startswith("bad.yaml: fleet")
    for name in names:
        assert name in message


def test_merged_requests_follow_the_fleet_submit_order() -> None:
    from array import array

    import numpy as np
    import pandas as pd

    from sim.fleet.outputs import fleet_requests, fleet_steps

    # Submit order: a->1, b->0, c->1, d->2, e->0; each replica lists its own in order.
    frames = [
        pd.DataFrame({"request_id": ["b", "e"]}),
        pd.DataFrame({"request_id": ["a", "c"]}),
        pd.DataFrame({"request_id": ["d"]}),
    ]
    merged = fleet_requests(frames, [1, 0, 1, 2, 0])
    assert merged["request_id"].tolist() == ["a", "b", "c", "d", "e"]
    assert merged["replica"].tolist() == [1, 0, 1, 2, 0]
    # Each replica's step columns (a recorder's arrays); equal starts keep replica order.
    steps = fleet_steps(
        [
            {"step": array("q", [1, 2]), "start_s": array("d", [0.0, 2.0])},
            {"step": array("q", []), "start_s": array("d", [])},
            {"step": array("q", [1, 2]), "start_s": array("d", [1.0, 2.0])},
        ]
    )
    assert steps["start_s"].tolist() == [0.0, 1.0, 2.0, 2.0]
    assert steps["step"].tolist() == [1, 1, 2, 2]
    assert steps["replica"].tolist() == [0, 2, 0, 2]
    assert list(steps.dtypes) == [np.int64, np.float64, np.int64]
