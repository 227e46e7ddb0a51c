"""The memory-policy what-ifs together: combinations run to the end, and pins never make a
lone running request preempt itself."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from sim.runner import simulate
from sim.scenario import parse_scenario
from tests.sim.test_swap import PRESSURE, scenario_with

# test_swap's pressure scenario, its sessions in two priority classes.
BASE: dict[str, Any] = copy.deepcopy(PRESSURE)
BASE["workload"]["priority_classes"] = [
    {"name": "interactive", "priority": 0, "weight": 0.3},
    {"name": "background", "priority": 1, "weight": 0.7},
]
SWAP = {"preemption_mode": "swap", "swap_space_gib": 1.0}
TTL = {"kv_retention": {"policy": "ttl", "ttl_s": 5}}
FLOOR = {"kv_retention": {"policy": "free_floor", "ttl_s": 5, "free_floor": 0.2}}
PRIORITY = {"scheduling_policy": "priority"}


def scenario(engine: dict[str, Any], fleet: dict[str, Any] | None = None) -> dict[str, Any]:
    raw = scenario_with(BASE, **engine)
    if fleet is not None:
        raw["fleet"] = fleet
    return raw


@pytest.mark.parametrize(
    ("engine", "fleet", "kv_waste"),
    [
        (SWAP | TTL, None, False),
        (SWAP | FLOOR | PRIORITY | {"num_gpu_blocks_override": 130, "watermark": 0.05}, None, True),
        (PRIORITY | {"allocator": "orca_oracle"}, None, True),
        (SWAP, {"replicas": 2, "router": {"kind": "session_affinity"}}, False),
        (TTL, {"replicas": 2, "router": {"kind": "round_robin"}}, False),
        ({"allocator": "orca_pow2"}, {"replicas": 2, "router": {"kind": "session_affinity"}}, True),
    ],
    ids=[
        "swap+ttl",
        "swap+floor+priority-tiny",
        "oracle+priority",
        "fleet-swap",
        "fleet-ttl",
        "fleet-pow2",
    ],
)
def test_combined_policies_finish_every_request(
    engine: dict[str, Any], fleet: dict[str, Any] | None, kv_waste: bool
) -> None:
    result = simulate(parse_scenario(scenario(engine, fleet), "combo"), kv_waste=kv_waste)
    summary = result.summary
    assert summary["num_finished"] == summary["num_requests"] == 72
    assert summary["what_if"]  # every run here is a what-if and says so
    if kv_waste:
        shares = summary["kv_waste_breakdown"]["shares_of_capacity"]
        assert sum(shares.values()) == pytest.approx(1.0)


def test_pins_give_way_before_a_lone_running_request_preempts_itself() -> None:
    solo = {"max_num_seqs": 1}
    plain = simulate(parse_scenario(scenario(solo), "solo")).summary
    pinned = simulate(parse_scenario(scenario(solo | TTL), "solo")).summary
    assert plain["metrics"]["vllm:num_preemptions"]["total"] == 0
    assert pinned["metrics"]["vllm:num_preemptions"]["total"] == 0
    assert pinned["retention"]["num_starved_releases"] > 0
