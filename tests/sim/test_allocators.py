"""Static and Orca-style contiguous allocators (sim/kv/allocators.py) behind the KV cache
manager's interface: reservations, first-fit placement, head-of-line refusals, no preemption,
and whole runs against the paged allocator."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from sim.block_map import OWNED_BASE
from sim.config.engine import EngineConfig
from sim.errors import KvsimConfigError
from sim.kv.allocators import (
    ContiguousKVManager,
    make_kv_manager,
    next_power_of_two,
    reservation_tokens,
)
from sim.kv.kv_cache_manager import KVCacheManager
from sim.request import Request
from sim.runner import simulate
from sim.scenario import parse_scenario

BLOCK_SIZE = 16
CONTIGUOUS = ["static", "orca_max", "orca_pow2", "orca_oracle"]
# The step columns that describe KV occupancy (what an allocator changes by design).
KV_COLUMNS = ["kv_cache_usage_perc", "num_free_blocks", "kv_unused_slots"]


def request(request_id: str, prompt: int, max_tokens: int) -> Request:
    return Request(request_id, list(range(prompt)), max_tokens, block_size=BLOCK_SIZE)


def admit(kv: ContiguousKVManager, req: Request, has_scheduled: bool = True) -> list[int] | None:
    return kv.allocate_slots(
        req, req.num_tokens, full_sequence_must_fit=True, has_scheduled_reqs=has_scheduled
    )


def test_next_power_of_two() -> None:
    assert [next_power_of_two(n) for n in (1, 2, 3, 4, 5, 100, 128, 129)] == [
        1,
        2,
        4,
        4,
        8,
        128,
        128,
        256,
    ]


def test_reservations_per_allocator() -> None:
    req = request("a", prompt=100, max_tokens=37)
    assert reservation_tokens("static", req, 1024) == 1024
    assert reservation_tokens("orca_max", req, 1024) == 1024
    assert reservation_tokens("orca_pow2", req, 1024) == 100 + 64
    assert reservation_tokens("orca_oracle", req, 1024) == 100 + 37
    # Capped at max_model_len: no request can outgrow it.
    assert reservation_tokens("orca_pow2", request("b", 900, 100), 1024) == 1024
    with pytest.raises(ValueError, match="not a contiguous allocator"):
        reservation_tokens("paged", req, 1024)


def test_first_fit_regions_free_and_refusal_by_fragmentation() -> None:
    # 11 blocks: the null block 0 and 10 usable ones (ids 1..10).
    kv = ContiguousKVManager("orca_oracle", 11, BLOCK_SIZE, max_model_len=1024)
    a, b, c = request("a", 30, 2), request("b", 40, 8), request("c", 20, 12)
    assert admit(kv, a) == [1, 2]  # 32 tokens -> 2 blocks
    assert admit(kv, b) == [3, 4, 5]  # 48 tokens -> 3 blocks
    assert admit(kv, c) == [6, 7]  # 32 tokens -> 2 blocks
    assert kv.block_pool.num_free_blocks == 3
    assert kv.usage == pytest.approx(0.7)
    assert kv.gaps() == [(8, 3)]
    kv.free(b)
    assert kv.gaps() == [(3, 3), (8, 3)]
    assert kv.block_pool.num_free_blocks == 6
    # 6 blocks free, but no gap of 4: refused (external fragmentation), and nothing changes.
    d = request("d", 60, 4)
    assert kv.admission_blocked(d) == (True, None)
    assert admit(kv, d) is None
    assert kv.block_pool.num_free_blocks == 6
    # A 1-block request goes into the first gap that fits.
    e = request("e", 10, 2)
    assert admit(kv, e) == [3]
    assert kv.req_to_blocks["e"] == range(3, 4)
    kv.free(a)
    kv.free(c)
    assert kv.gaps() == [(1, 2), (4, 7)]
    assert admit(kv, d) == [4, 5, 6, 7]
    assert kv.block_table("d") == [4, 5, 6, 7]


def test_a_running_request_never_needs_more_and_gets_no_hits() -> None:
    kv = ContiguousKVManager("static", 11, BLOCK_SIZE, max_model_len=64)
    req = request("a", 20, 40)
    assert kv.get_computed_blocks(req) == ([], 0)
    assert admit(kv, req) == [1, 2, 3, 4]
    req.num_computed_tokens = 20
    for _ in range(40 - 1):
        assert kv.allocate_slots(req, 1) == []
        req.num_computed_tokens += 1
    assert kv.block_pool.num_free_blocks == 6
    kv.free(req)
    assert kv.block_pool.num_free_blocks == 10
    assert kv.gaps() == [(1, 10)]
    kv.free(req)  # freeing twice is a no-op
    assert kv.block_pool.num_free_blocks == 10


def test_watermark_applies_to_admissions_when_something_runs() -> None:
    # 21 blocks, watermark 0.1 -> int(0.1 * 21) = 2 blocks kept free.
    kv = ContiguousKVManager("orca_oracle", 21, BLOCK_SIZE, max_model_len=1024, watermark=0.1)
    big = request("big", 16 * 19 - 1, 1)  # 19 blocks
    assert admit(kv, big, has_scheduled=True) is None
    assert admit(kv, big, has_scheduled=False) == list(range(1, 20))


def test_factory_builds_the_configured_manager() -> None:
    assert isinstance(make_kv_manager(EngineConfig(), 100), KVCacheManager)
    kv = make_kv_manager(EngineConfig(allocator="orca_pow2", block_size=32), 100)
    assert isinstance(kv, ContiguousKVManager)
    assert (kv.kind, kv.block_size, kv.block_pool.num_free_blocks) == ("orca_pow2", 32, 99)
    assert kv.enable_caching is False


def test_config_default_and_what_if_lines() -> None:
    assert EngineConfig().allocator == "paged"
    assert EngineConfig().what_if_policies() == []
    lines = EngineConfig(allocator="static").what_if_policies()
    assert lines == [
        "engine.allocator=static: static allocation of max_model_len per request "
        "(HuggingFace-style); prefix caching off (a contiguous region is private to its "
        "request); vLLM 0.32 pages its KV cache"
    ]
    lines = EngineConfig(allocator="orca_oracle", enable_prefix_caching=False).what_if_policies()
    assert lines == [
        "engine.allocator=orca_oracle: Orca-style reservation of prompt + the true output "
        "length (PagedAttention's Orca (Oracle)); vLLM 0.32 pages its KV cache"
    ]


def test_an_unknown_allocator_is_one_clear_error() -> None:
    with pytest.raises(KvsimConfigError, match=r"engine\.allocator") as info:
        parse_scenario(scenario_dict("buddy"), "bad")
    assert "Traceback" not in str(info.value)


def scenario_dict(
    allocator: str, *, blocks: int | None = None, caching: bool = False, **workload: Any
) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "max_model_len": 2048,
        "block_size": BLOCK_SIZE,
        "enable_prefix_caching": caching,
        "allocator": allocator,
    }
    if blocks is not None:
        engine["num_gpu_blocks_override"] = blocks
    return {
        "name": f"alloc-{allocator}",
        "seed": 7,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": engine,
        "workload": {
            "kind": "open_loop",
            "num_requests": 60,
            "arrival": {"kind": "poisson", "rate_per_s": 40.0},
            "prompt_tokens": {"kind": "uniform", "low": 50, "high": 400},
            "output_tokens": {"kind": "uniform", "low": 10, "high": 200},
            **workload,
        },
    }


@pytest.mark.parametrize("allocator", CONTIGUOUS)
def test_with_ample_hbm_every_allocator_runs_the_same_steps_as_paged(allocator: str) -> None:
    """No KV pressure and no prefix caching: admission never fails and nobody is preempted,
    so the schedule (every step, every token time) is paged's; only the KV occupancy
    columns differ, as the reservations do."""
    paged = simulate(parse_scenario(scenario_dict("paged"), "paged"))
    other = simulate(parse_scenario(scenario_dict(allocator), allocator))
    assert paged.summary["metrics"]["vllm:num_preemptions"]["total"] == 0
    pd.testing.assert_frame_equal(
        paged.steps.drop(columns=KV_COLUMNS), other.steps.drop(columns=KV_COLUMNS)
    )
    pd.testing.assert_frame_equal(paged.requests, other.requests)
    # Reservations hold at least what paging holds.
    assert (other.steps["num_free_blocks"] <= paged.steps["num_free_blocks"]).all()
    if allocator != "orca_oracle":
        assert (other.steps["num_free_blocks"] < paged.steps["num_free_blocks"]).any()


def test_under_kv_pressure_static_admits_far_fewer_requests_than_paged() -> None:
    # 8 x 2048 tokens of KV: static fits 8 requests at once; paging fits every one that came.
    blocks = 8 * 2048 // BLOCK_SIZE + 1
    workload = {"arrival": {"kind": "burst", "at_s": 0.0}}
    paged = simulate(parse_scenario(scenario_dict("paged", blocks=blocks, **workload), "p"))
    static = simulate(parse_scenario(scenario_dict("static", blocks=blocks, **workload), "s"))
    oracle = simulate(parse_scenario(scenario_dict("orca_oracle", blocks=blocks, **workload), "o"))
    assert static.steps["num_requests_running"].max() == 8
    assert paged.steps["num_requests_running"].max() >= 40
    assert oracle.steps["num_requests_running"].max() >= 40
    for result in (paged, static, oracle):
        assert result.summary["num_finished"] == 60
    assert static.summary["metrics"]["vllm:num_preemptions"]["total"] == 0
    assert static.summary["duration_s"] > 2 * paged.summary["duration_s"]
    waste = static.summary["kv_waste_breakdown"]
    assert waste["max_live_requests"] == 8
    assert "kv_waste_breakdown" not in paged.summary


def test_the_block_map_shows_contiguous_regions() -> None:
    result = simulate(parse_scenario(scenario_dict("static"), "s"))
    states = np.stack(result.block_map.states)
    assert (states >= OWNED_BASE).any()
    # A static region is max_model_len / block_size = 128 consecutive owned blocks from id 1.
    first = next(s for s in result.block_map.states if (s >= OWNED_BASE).any())
    assert (first[1:129] >= OWNED_BASE).all()
