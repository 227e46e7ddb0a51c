"""Swap preemption (``engine.preemption_mode=swap``), a what-if with vLLM V0's semantics.

Exact expectations: which blocks move where and when, how long the copies take (bytes over
PCIe bandwidth x the cost model's transfer efficiency), the recompute fallback when the CPU
pool is full, swapped requests resuming before new admissions, priority victims; then the
sanity checks against theory (ample HBM: same results as recompute; free transfers: swap
never loses to recompute) and the config errors.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pandas as pd
import pydantic
import pytest
import simpy

from sim.config.engine import EngineConfig
from sim.config.hardware import GIB, HARDWARE_PRESETS
from sim.config.limits import MAX_BANDWIDTH_BYTES_PER_S
from sim.config.model import resolve_model
from sim.config.sizing import num_cpu_blocks
from sim.cost_model import CostModel, CostParams
from sim.engine import Engine
from sim.errors import KvsimConfigError
from sim.kv.swap import CpuBlockPool
from sim.recorder import STEP_COLUMNS, Recorder
from sim.request import RequestStatus
from sim.runner import simulate
from sim.scenario import load_scenario, parse_scenario
from sim.scheduler.output import BatchShape
from sim.scheduler.scheduler import Scheduler
from sim.step_record import SWAP_STEP_COLUMNS
from sim.workload.base import RequestMeta
from tests.sim.scheduler.test_scheduler import make_request, step

BLOCK_SIZE = 16
ENGINE: dict[str, Any] = {
    "block_size": BLOCK_SIZE,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "max_model_len": 4096,
}


def swap_scheduler(
    num_gpu_blocks: int, num_cpu: int, bytes_per_block: int = 100, **engine: Any
) -> Scheduler:
    """A swap-preemption scheduler whose CPU pool holds exactly ``num_cpu`` blocks."""
    config = EngineConfig(
        **(ENGINE | engine),
        preemption_mode="swap",
        swap_space_gib=num_cpu * bytes_per_block / GIB,
    )
    scheduler = Scheduler(config, num_gpu_blocks, bytes_per_block)
    assert scheduler.swapper is not None
    assert scheduler.swapper.cpu.num_blocks == num_cpu
    return scheduler


# -- the CPU pool -------------------------------------------------------------------------------
def test_num_cpu_blocks_is_swap_bytes_over_block_bytes() -> None:
    assert num_cpu_blocks(4.0, 2 * 1024 * 1024) == 2048
    assert num_cpu_blocks(1.0, 3 << 20) == 341  # floor, as V0's int(bytes // block bytes)
    with pytest.raises(ValueError, match="bytes_per_block=0"):
        num_cpu_blocks(1.0, 0)


def test_cpu_pool_hands_out_and_reuses_blocks() -> None:
    pool = CpuBlockPool(5)
    assert pool.allocate("a", 2) == [0, 1]
    assert pool.allocate("b", 2) == [2, 3]
    assert pool.allocate("c", 2) is None  # one free block left
    assert pool.num_free_blocks == 1
    assert pool.free("a") == [0, 1]
    assert pool.num_free_blocks == 3
    assert pool.allocate("c", 3) == [0, 1, 4]
    assert pool.tables == {"b": [2, 3], "c": [0, 1, 4]}


# -- which blocks move where, and when -----------------------------------------------------------
def test_victim_blocks_go_to_cpu_and_come_back_into_fresh_blocks() -> None:
    # 6 usable GPU blocks (ids 1..6), 3 CPU blocks. a and b: 32-token prompts (2 blocks each).
    scheduler = swap_scheduler(num_gpu_blocks=7, num_cpu=3)
    kv = scheduler.kv_cache_manager
    a = make_request("a", 32, max_tokens=20)
    b = make_request("b", 32, max_tokens=40)
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = []
    for _ in range(17):
        outputs.append(step(scheduler)[0])
    # Step 1 admits both ([1, 2] and [3, 4]); step 2's decodes take blocks 5 and 6.
    assert outputs[0].admitted_ids == ["a", "b"]
    assert kv.block_table("a") == [1, 2, 5] and kv.block_table("b") == [3, 4, 6]
    assert all(o.swap is not None and not o.swap.num_blocks_moved for o in outputs)
    assert kv.block_pool.num_free_blocks == 0

    # Step 18: a (48 tokens computed) needs a 4th block; the fcfs victim is b (the last
    # running), whose 48 computed tokens fill 3 blocks: GPU 3, 4, 6 -> CPU 0, 1, 2.
    output, _ = step(scheduler)
    swap = output.swap
    assert swap is not None
    assert output.preempted_ids == ["b"]
    assert swap.swap_out == [(3, 0), (4, 1), (6, 2)]
    assert swap.swap_in == [] and swap.swapped_out_ids == ["b"] and swap.num_swapped == 1
    assert output.num_scheduled_tokens == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 48 and b.num_preemptions == 1  # computed tokens kept
    assert scheduler.swapper is not None
    assert scheduler.swapper.cpu.tables == {"b": [0, 1, 2]}
    # b's freed blocks are evictable prefix-cache blocks: a's 4th block evicted block 6 (the
    # tail, freed first), 3 and 4 still hold b's first two hashes.
    assert kv.block_table("a") == [1, 2, 5, 6]
    pool = kv.block_pool
    assert [pool.get_cached_block(h) for h in b.block_hashes[:3]] == [3, 4, None]
    assert list(scheduler.swapped) == [b]

    # Steps 19-20: a runs; b needs 4 blocks (49 tokens), only 2 are free: it stays swapped.
    for _ in range(2):
        output, update = step(scheduler)
        assert output.num_scheduled_tokens == {"a": 1}
        assert output.swap is not None and not output.swap.num_blocks_moved
    assert [r.request_id for r in update.finished] == ["a"]

    # Step 21: b resumes and decodes one token, nothing recomputed. Its first two blocks
    # are still cached in HBM (3, 4): reused, not copied. Its third (evicted) is copied from
    # CPU block 2 into a fresh block (6, the head of the free queue), and block 5 takes the
    # new token.
    output, _ = step(scheduler)
    swap = output.swap
    assert swap is not None
    assert kv.block_table("b") == [3, 4, 6, 5]
    assert swap.swap_in == [(2, 6)] and swap.reused_blocks == 2
    assert swap.swapped_in_ids == ["b"]
    assert output.num_scheduled_tokens == {"b": 1}
    assert output.shape.num_decode_reqs == 1 and output.shape.num_prefill_tokens == 0
    assert output.admitted_ids == [] and swap.num_swapped == 0
    assert scheduler.swapper.cpu.tables == {}
    assert scheduler.swapper.cpu.num_free_blocks == 3
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert b.num_output_tokens == 40 and b.num_preemptions == 1


def test_full_cpu_pool_falls_back_to_recompute() -> None:
    # Same pressure as above, but the CPU pool holds 2 blocks and b needs 3.
    scheduler = swap_scheduler(num_gpu_blocks=7, num_cpu=2)
    a = make_request("a", 32, max_tokens=20)
    b = make_request("b", 32, max_tokens=40)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(17):
        step(scheduler)
    output, _ = step(scheduler)
    swap = output.swap
    assert swap is not None
    assert output.preempted_ids == ["b"]
    assert swap.swap_out == [] and swap.fallback_ids == ["b"] and swap.num_swapped == 0
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0  # recompute
    assert list(scheduler.waiting) == [b] and not len(scheduler.swapped)
    assert scheduler.swapper is not None and scheduler.swapper.num_fallbacks == 1
    assert scheduler.swapper.cpu.num_free_blocks == 2


def test_swapped_requests_resume_before_new_admissions() -> None:
    scheduler = swap_scheduler(num_gpu_blocks=7, num_cpu=3)
    a = make_request("a", 32, max_tokens=20)
    b = make_request("b", 32, max_tokens=40)
    scheduler.add_request(a)
    scheduler.add_request(b)
    for _ in range(18):
        step(scheduler)
    assert list(scheduler.swapped) == [b]
    # A 16-token newcomer fits in the 2 free blocks (b needs 4): it still waits behind b.
    c = make_request("c", 16, max_tokens=2)
    scheduler.add_request(c)
    for _ in range(2):
        output, _ = step(scheduler)
        assert output.admitted_ids == [] and "c" not in output.num_scheduled_tokens
    # a finished: b resumes first, then, the SWAPPED queue empty, c is admitted behind it.
    output, _ = step(scheduler)
    assert output.swap is not None and output.swap.swapped_in_ids == ["b"]
    assert output.admitted_ids == ["c"]
    assert list(output.num_scheduled_tokens) == ["b", "c"]
    assert scheduler.kv_cache_manager.block_table("c") == [2]


def test_priority_victims_are_swapped_while_interactive_ones_keep_hbm() -> None:
    scheduler = swap_scheduler(num_gpu_blocks=7, num_cpu=8, scheduling_policy="priority")
    kv = scheduler.kv_cache_manager
    # The interactive request arrives last, so fcfs would have picked it.
    background = make_request("bg", 32, max_tokens=40, priority=1, arrival_time_s=0.0)
    interactive = make_request("int", 32, max_tokens=20, priority=0, arrival_time_s=1.0)
    scheduler.add_request(background)
    scheduler.add_request(interactive)
    preempting = []
    for _ in range(21):
        output, _ = step(scheduler)
        if output.preempted_ids:
            preempting.append(output)
    assert len(preempting) == 1
    swap = preempting[0].swap
    assert swap is not None and swap.swapped_out_ids == ["bg"] and len(swap.swap_out) == 3
    assert interactive.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert interactive.num_preemptions == 0
    assert background.num_preemptions == 1 and background.status is RequestStatus.RUNNING
    assert len(kv.block_table("bg")) == 4


# -- transfer time -------------------------------------------------------------------------------
class FixedStepCost:
    """Every step's model time is 10 ms; KV transfers priced by the real cost model."""

    STEP_S = 0.01
    kernel_build_min_tokens = None

    def __init__(self, cost_model: CostModel) -> None:
        self.cost_model = cost_model

    def step_time_s(
        self,
        shape: BatchShape,
        after_idle: bool = False,
        steps_since_prefill: int = 0,
        idle_s: float = 0.0,
        kernel_build: bool = False,
    ) -> float:
        return self.STEP_S

    def kv_transfer_time_s(self, num_blocks: int, bytes_per_block: int) -> float:
        return self.cost_model.kv_transfer_time_s(num_blocks, bytes_per_block)


def test_transfer_time_is_bytes_over_pcie_bandwidth_and_charged_to_its_step() -> None:
    model = resolve_model("Llama-3.1-8B")
    hardware = HARDWARE_PRESETS["H100-SXM-80GB"]
    bytes_per_block = model.kv_bytes_per_token(1) * BLOCK_SIZE
    assert bytes_per_block == 2 * 32 * 8 * 128 * 2 * BLOCK_SIZE  # K+V, layers, heads, dim, bf16
    scheduler = swap_scheduler(num_gpu_blocks=7, num_cpu=3, bytes_per_block=bytes_per_block)
    env = simpy.Environment()
    recorder = Recorder(BLOCK_SIZE)
    engine = Engine(env, scheduler, FixedStepCost(CostModel(model, hardware)), recorder)
    assert not engine.fast  # a what-if runs step by step
    engine.submit(make_request("a", 32, max_tokens=20), RequestMeta())
    engine.submit(make_request("b", 32, max_tokens=40), RequestMeta())
    env.run()
    steps = recorder.steps_frame()
    assert list(steps.columns) == STEP_COLUMNS + list(SWAP_STEP_COLUMNS)
    moved = steps[steps["swap_transfer_s"] > 0]
    assert moved["step"].tolist() == [18, 21]
    assert moved["swap_out_blocks"].tolist() == [3, 0]
    # The swap-in reuses 2 blocks still cached in HBM and copies 1 (see the test above).
    assert moved["swap_in_blocks"].tolist() == [0, 1]
    assert moved["swap_in_reused_blocks"].tolist() == [0, 2]
    assert moved["swap_out_bytes"].tolist() == [3 * bytes_per_block, 0]
    assert moved["swap_in_bytes"].tolist() == [0, bytes_per_block]
    bandwidth = hardware.pcie_bandwidth_bytes_per_s * CostParams().kv_transfer_efficiency
    expected_s = [3 * bytes_per_block / bandwidth, bytes_per_block / bandwidth]
    assert moved["swap_transfer_s"].tolist() == expected_s
    # The step lasts the model's time plus the copies' (end - start, as recorded).
    starts = moved["start_s"].tolist()
    assert moved["duration_s"].tolist() == [
        (start + (FixedStepCost.STEP_S + transfer_s)) - start
        for start, transfer_s in zip(starts, expected_s, strict=True)
    ]
    still = steps[steps["swap_transfer_s"] == 0]
    assert (still["duration_s"] - FixedStepCost.STEP_S).abs().max() < 1e-12
    assert steps["num_swap_outs"].tolist()[17] == 1 and steps["num_swap_ins"].tolist()[20] == 1
    assert steps["num_requests_swapped"].tolist()[17:21] == [1, 1, 1, 0]


# -- whole runs: sanity against theory -----------------------------------------------------------
PRESSURE: dict[str, Any] = {
    "name": "swap-pressure",
    "seed": 7,
    "model": "Llama-3.1-8B",
    "hardware": "H100-SXM-80GB",
    "engine": {
        "block_size": BLOCK_SIZE,
        "max_model_len": 2048,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 2048,
        "num_gpu_blocks_override": 300,
    },
    "workload": {
        "kind": "agent_sessions",
        "sessions": 24,
        "session_arrival": {"kind": "burst", "at_s": 0.0},
        "turns": {"kind": "fixed", "value": 3},
        "system_prompt_tokens": 200,
        "tool_schema_tokens": 100,
        "user_message_tokens": {"kind": "uniform", "low": 20, "high": 120},
        "tool_result_tokens": {"kind": "uniform", "low": 50, "high": 300},
        "output_tokens": {"kind": "uniform", "low": 50, "high": 250},
        "tool_latency": {"kind": "fixed", "value_s": 0.2},
        "max_context_tokens": 2048,
    },
}


def scenario_with(base: dict[str, Any], **engine: Any) -> dict[str, Any]:
    raw = copy.deepcopy(base)
    raw["engine"].update(engine)
    return raw


def test_with_ample_hbm_swap_gives_the_default_results() -> None:
    ample = scenario_with(PRESSURE, num_gpu_blocks_override=20_000)
    default = simulate(parse_scenario(ample, "ample"))
    swapping = simulate(
        parse_scenario(scenario_with(ample, preemption_mode="swap", swap_space_gib=4.0), "swap")
    )
    assert default.summary["metrics"]["vllm:num_preemptions"]["total"] == 0
    pd.testing.assert_frame_equal(default.requests, swapping.requests, check_exact=True)
    pd.testing.assert_frame_equal(default.steps, swapping.steps[STEP_COLUMNS], check_exact=True)
    assert (swapping.steps[list(SWAP_STEP_COLUMNS)] == 0).all().all()
    assert "swap" not in default.summary and "what_if" not in default.summary
    assert swapping.summary["what_if"] == [
        "swap preemption (vLLM V0 semantics; vLLM 0.32 preempts by recompute)"
    ]
    assert swapping.summary["swap"]["num_swap_outs"] == 0
    assert swapping.summary["metrics"] == default.summary["metrics"]


def test_swap_with_free_transfers_never_loses_to_recompute() -> None:
    fast_link = copy.deepcopy(PRESSURE)
    fast_link["hardware"] = {
        **HARDWARE_PRESETS["H100-SXM-80GB"].model_dump(),
        "pcie_bandwidth_bytes_per_s": MAX_BANDWIDTH_BYTES_PER_S,
    }
    recompute = simulate(parse_scenario(fast_link, "recompute"))
    swapping = simulate(
        parse_scenario(
            scenario_with(fast_link, preemption_mode="swap", swap_space_gib=64.0), "swap"
        )
    )
    assert recompute.summary["metrics"]["vllm:num_preemptions"]["total"] > 0
    swap = swapping.summary["swap"]
    assert swap["num_swap_outs"] > 0 and swap["num_swap_ins"] == swap["num_swap_outs"]
    assert swap["swap_out_blocks"] == swap["swap_in_blocks"] + swap["swap_in_reused_blocks"]
    assert swap["recompute_fallbacks"] == 0
    assert swapping.summary["num_finished"] == recompute.summary["num_finished"]
    # Same requests, same finished count; swap skips the recompute prefills.
    assert swapping.steps["num_prefill_tokens"].sum() < recompute.steps["num_prefill_tokens"].sum()
    e2e = "vllm:e2e_request_latency_seconds"
    assert swapping.summary["metrics"][e2e]["mean"] <= recompute.summary["metrics"][e2e]["mean"]


def test_swap_summary_adds_up_the_step_columns() -> None:
    result = simulate(
        parse_scenario(scenario_with(PRESSURE, preemption_mode="swap", swap_space_gib=0.3), "s")
    )
    steps = result.steps
    swap = result.summary["swap"]
    assert swap["cpu_blocks"] == 153  # 0.3 GiB of 2 MiB blocks
    assert "note" not in swap
    assert swap["transfer_time_frac"] == pytest.approx(
        swap["transfer_time_s"] / result.summary["duration_s"]
    )
    assert swap["swap_out_blocks"] == int(steps["swap_out_blocks"].sum()) > 0
    assert swap["swap_in_bytes"] == int(steps["swap_in_bytes"].sum())
    assert swap["transfer_time_s"] == float(steps["swap_transfer_s"].sum()) > 0
    assert swap["recompute_fallbacks"] == int(steps["num_swap_fallbacks"].sum())
    minutes = result.summary["duration_s"] / 60
    assert swap["swap_outs_per_minute"] == pytest.approx(swap["num_swap_outs"] / minutes)
    # Preemptions by swap and by recompute both count as vllm:num_preemptions.
    assert result.summary["metrics"]["vllm:num_preemptions"]["total"] == int(
        steps["num_preemptions"].sum()
    )
    assert int(steps["num_preemptions"].sum()) == (
        swap["num_swap_outs"] + swap["recompute_fallbacks"]
    )


def test_a_fleets_swap_section_says_which_figures_are_one_replicas() -> None:
    raw = {
        **scenario_with(PRESSURE, preemption_mode="swap", swap_space_gib=0.3),
        "fleet": {"replicas": 2},
    }
    fleet = simulate(parse_scenario(raw, "fleet"))
    swap, steps = fleet.summary["swap"], fleet.steps
    assert swap["note"].startswith("a fleet of 2 replicas, a CPU swap pool each")
    assert swap["cpu_blocks"] == 153  # one replica's pool, not two
    assert swap["transfer_time_s"] == float(steps["swap_transfer_s"].sum()) > 0
    # Each replica copies over its own link: the share of time copying is their mean.
    assert swap["transfer_time_frac"] == pytest.approx(
        swap["transfer_time_s"] / (2 * fleet.summary["duration_s"])
    )
    assert swap["peak_requests_swapped"] == int(steps["num_requests_swapped"].max())


# -- config errors -------------------------------------------------------------------------------
def test_a_swap_space_without_room_for_one_block_is_refused() -> None:
    message = (
        "engine.swap_space_gib=0.001 holds 0 KV blocks of 2 MiB (one GPU's share of a "
        "16-token block of Llama-3.1-8B): every preemption would fall back to recompute"
    )
    sets = ["engine.preemption_mode=swap", "engine.swap_space_gib=0.001"]
    with pytest.raises(KvsimConfigError, match=re.escape(message)):
        load_scenario("scenarios/agent-burst.yaml", sets)
    # Under TP a GPU's share is smaller: 1 MiB at TP2, so 0.001 GiB holds one.
    spec = load_scenario("scenarios/agent-burst.yaml", [*sets, "engine.tensor_parallel_size=2"])
    assert spec.engine.swap_space_gib == 0.001


def test_swap_without_swap_space_is_an_error_naming_the_field() -> None:
    with pytest.raises(
        pydantic.ValidationError, match=re.escape("engine.swap_space_gib is required")
    ):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(
        pydantic.ValidationError, match=re.escape("preemption_mode=recompute never swaps")
    ):
        EngineConfig(swap_space_gib=4.0)
    with pytest.raises(KvsimConfigError, match=re.escape("engine.swap_space_gib is required")):
        load_scenario("scenarios/agent-burst.yaml", ["engine.preemption_mode=swap"])


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_bad_swap_space_is_an_error_naming_the_field(value: str) -> None:
    with pytest.raises(KvsimConfigError, match=re.escape("engine.swap_space_gib")):
        load_scenario(
            "scenarios/agent-burst.yaml",
            ["engine.preemption_mode=swap", f"engine.swap_space_gib={value}"],
        )


def test_unknown_preemption_mode_is_an_error_naming_the_field() -> None:
    with pytest.raises(KvsimConfigError, match=re.escape("engine.preemption_mode")):
        load_scenario("scenarios/agent-burst.yaml", ["engine.preemption_mode=evict"])


def test_cli_reports_swap_without_swap_space_in_one_line(tmp_path: Any) -> None:
    from typer.testing import CliRunner

    from sim.cli import app

    result = CliRunner().invoke(
        app,
        [
            "run",
            "scenarios/agent-burst.yaml",
            "--set",
            "engine.preemption_mode=swap",
            "--out",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 2
    assert "engine.swap_space_gib is required" in result.output
    assert "Traceback" not in result.output


def test_the_resolved_scenario_names_memory_policies_only_when_they_are_what_ifs() -> None:
    from sim.scenario import SCENARIO_DIR, load_scenario, scenario_to_yaml

    path = SCENARIO_DIR / "agent-burst.yaml"
    plain = scenario_to_yaml(load_scenario(path))
    for key in ("allocator:", "preemption_mode:", "swap_space_gib:", "kv_retention:"):
        assert key not in plain  # vLLM's own policies: the file reads as before the what-ifs
    swapping = scenario_to_yaml(
        load_scenario(path, ["engine.preemption_mode=swap", "engine.swap_space_gib=4"])
    )
    assert "  preemption_mode: swap\n  swap_space_gib: 4.0\n" in swapping
    assert "allocator:" not in swapping


def test_swap_with_a_contiguous_allocator_is_refused() -> None:
    from sim.errors import KvsimConfigError
    from sim.scenario import SCENARIO_DIR, load_scenario

    with pytest.raises(KvsimConfigError, match="a request's contiguous reservation is never"):
        load_scenario(
            SCENARIO_DIR / "agent-burst.yaml",
            [
                "engine.allocator=orca_pow2",
                "engine.preemption_mode=swap",
                "engine.swap_space_gib=4",
            ],
        )


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_waiting_request_passes_swapped_ones_only_when_it_has_priority(policy: str) -> None:
    sched = swap_scheduler(num_gpu_blocks=7, num_cpu=8, scheduling_policy=policy)
    background = [
        make_request("bgA", 32, max_tokens=20, priority=1, arrival_time_s=0.0),
        make_request("bgB", 32, max_tokens=40, priority=1, arrival_time_s=0.5),
    ]
    for request in background:
        sched.add_request(request)
    for _ in range(18):
        step(sched)
    assert [r.request_id for r in sched.swapped] == ["bgB"]
    sched.add_request(make_request("int", 16, max_tokens=2, priority=0, arrival_time_s=2.0))
    out, _ = step(sched)
    if policy == "priority":  # the interactive turn sorts before the swapped background one
        assert out.admitted_ids == ["int"]
    else:  # V0: every new request waits for the swapped queue
        assert out.admitted_ids == []
        assert [r.request_id for r in sched.waiting] == ["int"]
