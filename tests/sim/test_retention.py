"""Session-aware KV retention during tool waits (a what-if): which blocks a finished turn pins,
when each pin goes, and what retention does to whole runs.

Block size 16; the unit tests drive a KV cache manager by hand with a settable clock, and every
expectation is an exact block id, ref count, free-queue order or count.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
import pytest

from sim.config.retention import RetentionConfig
from sim.errors import KvsimConfigError
from sim.kv.kv_cache_manager import KVCacheManager
from sim.request import Request
from sim.runner import SimulationResult, simulate
from sim.scenario import load_scenario, parse_scenario, scenario_to_yaml
from sim.workload.base import SessionHint
from sim.workload.distributions import FixedLatency, LogNormalLatency

BLOCK_SIZE = 16


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_manager(num_gpu_blocks: int = 12, **policy: Any) -> tuple[KVCacheManager, Clock]:
    kv = KVCacheManager(num_gpu_blocks, BLOCK_SIZE, max_model_len=1024)
    clock = Clock()
    kv.enable_retention(RetentionConfig(**policy), clock)
    return kv, clock


def make_request(
    request_id: str,
    tokens: list[int],
    session_id: int | None = None,
    returns: bool = True,
    tool_latency: FixedLatency | LogNormalLatency | None = None,
) -> Request:
    hint = None if session_id is None else SessionHint(session_id, returns, None, tool_latency)
    return Request(request_id, tokens, max_tokens=1, block_size=BLOCK_SIZE, session_hint=hint)


def admit(kv: KVCacheManager, request: Request, has_scheduled_reqs: bool = True) -> list[int]:
    """Lookup and allocation of a waiting request's whole prompt (as the scheduler admits)."""
    hits, num_hit = kv.get_computed_blocks(request)
    new_blocks = kv.allocate_slots(
        request,
        request.num_tokens - num_hit,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        full_sequence_must_fit=True,
        has_scheduled_reqs=has_scheduled_reqs,
    )
    assert new_blocks is not None
    request.mark_running(request.num_tokens)
    return kv.block_table(request.request_id)


def finish(kv: KVCacheManager, request: Request) -> None:
    request.mark_finished()
    kv.free(request)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# -- which blocks are pinned, and when they go -----------------------------------------------
def test_finish_pins_the_full_blocks_and_frees_the_partial_one() -> None:
    kv, clock = make_manager(policy="ttl", ttl_s=5.0)
    pool = kv.block_pool
    turn0 = make_request("s0-t0", tokens(100, 40), session_id=0)
    assert admit(kv, turn0) == [1, 2, 3]
    clock.now_s = 10.0
    finish(kv, turn0)
    retention = kv.retention
    assert retention is not None
    holder = retention.holders[0]
    assert holder.block_ids == [1, 2]
    assert (holder.start_s, holder.expiry_s) == (10.0, 15.0)
    assert pool.ref_cnt[[1, 2, 3]].tolist() == [1, 1, 0]
    # The partial block (no hash) went to the front, as free puts it; the pinned ones are
    # in no queue, so nothing can evict them.
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert pool.num_free_blocks == 9
    assert kv.usage == pytest.approx(2 / 11)
    assert retention.num_held_blocks == 2


def test_a_last_turn_or_a_request_without_session_is_freed_as_today() -> None:
    kv, _ = make_manager(policy="ttl", ttl_s=5.0)
    last = make_request("s0-t9", tokens(100, 40), session_id=0, returns=False)
    other = make_request("x", tokens(500, 40))
    admit(kv, last)
    admit(kv, other)
    finish(kv, last)
    finish(kv, other)
    assert kv.retention is not None and not kv.retention.holders
    assert kv.block_pool.num_free_blocks == 11


def test_the_next_turn_hits_the_pinned_blocks_and_releases_the_pin_at_admission() -> None:
    kv, clock = make_manager(policy="ttl", ttl_s=5.0)
    pool = kv.block_pool
    turn0 = make_request("s0-t0", tokens(100, 40), session_id=0)
    admit(kv, turn0)
    clock.now_s = 1.0
    finish(kv, turn0)
    # Another request takes every free block but two.
    assert admit(kv, make_request("x", tokens(900, 7 * BLOCK_SIZE))) == [3, 4, 5, 6, 7, 8, 9]
    assert pool.num_free_blocks == 2
    clock.now_s = 3.0
    turn1 = make_request("s0-t1", tokens(100, 40) + tokens(700, 24), session_id=0)
    kv.on_arrival(turn1)
    hits, num_hit = kv.get_computed_blocks(turn1)
    assert (hits, num_hit) == ([1, 2], 32)
    assert admit(kv, turn1) == [1, 2, 10, 11]
    retention = kv.retention
    assert retention is not None
    assert not retention.holders
    assert pool.ref_cnt[[1, 2]].tolist() == [1, 1]  # the turn's own reference only
    assert retention.num_releases == {"return": 1, "expiry": 0, "floor": 0, "starved": 0}
    assert retention.num_blocks_hit_on_return == 2
    assert retention.held_block_s == 2 * 2.0  # two blocks from t=1 to t=3


def test_a_fan_out_sibling_admitted_after_the_pin_leaves_it_for_the_next_turn() -> None:
    # A fan-out turn: f0 and f1 arrive together and share the turn's context; f0 pins it
    # when it finishes, f1 (queued, or preempted and re-admitted) is admitted only after.
    kv, clock = make_manager(num_gpu_blocks=16, policy="ttl", ttl_s=5.0)
    context = tokens(100, 32)
    f0 = make_request("s0-t1-f0", context + tokens(300, 8), session_id=0)
    f1 = make_request("s0-t1-f1", context + tokens(400, 8), session_id=0, returns=False)
    kv.on_arrival(f0)
    kv.on_arrival(f1)
    admit(kv, f0)
    clock.now_s = 1.0
    finish(kv, f0)
    retention = kv.retention
    assert retention is not None and retention.holders[0].block_ids == [1, 2]
    clock.now_s = 2.0
    assert admit(kv, f1)[:2] == [1, 2]  # it hits the pinned context...
    assert 0 in retention.holders  # ...but is not the session's next turn: the pin stays
    assert retention.num_releases["return"] == 0 and retention.num_blocks_hit_on_return == 0
    clock.now_s = 3.0
    finish(kv, f1)
    clock.now_s = 4.0
    turn2 = make_request("s0-t2", context + tokens(300, 8) + tokens(700, 24), session_id=0)
    kv.on_arrival(turn2)
    assert admit(kv, turn2)[:2] == [1, 2]
    assert not retention.holders
    assert retention.num_releases == {"return": 1, "expiry": 0, "floor": 0, "starved": 0}
    assert retention.num_blocks_hit_on_return == 2


def test_ttl_expiry_is_exact_and_frees_in_free_order() -> None:
    kv, clock = make_manager(policy="ttl", ttl_s=5.0)
    pool = kv.block_pool
    turn0 = make_request("s0-t0", tokens(100, 40), session_id=0)
    admit(kv, turn0)
    clock.now_s = 10.0
    finish(kv, turn0)
    retention = kv.retention
    assert retention is not None
    clock.now_s = 15.0  # the pin covers [finish, finish + ttl]
    kv.get_computed_blocks(make_request("probe", tokens(5000, 20)))
    assert 0 in retention.holders
    clock.now_s = math.nextafter(15.0, math.inf)
    kv.get_computed_blocks(make_request("probe2", tokens(6000, 20)))
    assert not retention.holders
    assert retention.num_releases["expiry"] == 1
    # Tail first to the LRU end, as free would have put them at finish.
    assert pool.free_block_ids()[-2:] == [2, 1]
    assert pool.ref_cnt[[1, 2]].tolist() == [0, 0]
    assert retention.held_block_s == 2 * 5.0  # counted to the expiry time, not the tick


def test_an_arrived_next_turn_keeps_its_pin_past_the_ttl_until_admitted() -> None:
    kv, clock = make_manager(policy="ttl", ttl_s=5.0)
    turn0 = make_request("s0-t0", tokens(100, 40), session_id=0)
    admit(kv, turn0)
    finish(kv, turn0)
    clock.now_s = 4.0
    turn1 = make_request("s0-t1", tokens(100, 40) + tokens(700, 24), session_id=0)
    kv.on_arrival(turn1)  # queued behind others: admitted only at t=9
    clock.now_s = 9.0
    kv.get_computed_blocks(make_request("probe", tokens(5000, 20)))
    retention = kv.retention
    assert retention is not None and 0 in retention.holders
    assert admit(kv, turn1)[:2] == [1, 2]
    assert retention.num_releases == {"return": 1, "expiry": 0, "floor": 0, "starved": 0}


def test_a_next_turn_arriving_after_the_expiry_finds_its_pin_gone() -> None:
    kv, clock = make_manager(policy="ttl", ttl_s=5.0)
    turn0 = make_request("s0-t0", tokens(100, 40), session_id=0)
    admit(kv, turn0)
    finish(kv, turn0)
    clock.now_s = 12.0  # no KV call since the finish: the pin expired at t=5, unnoticed
    kv.on_arrival(make_request("s0-t1", tokens(100, 40) + tokens(700, 24), session_id=0))
    retention = kv.retention
    assert retention is not None and not retention.holders
    assert retention.num_releases == {"return": 0, "expiry": 1, "floor": 0, "starved": 0}
    assert retention.held_block_s == 2 * 5.0


def test_tool_latency_policy_pins_for_the_quantile_of_the_sessions_tool_latency() -> None:
    latency = LogNormalLatency(median_s=1.5, p95_s=20.0)
    assert latency.quantile(0.5) == pytest.approx(1.5, rel=1e-12)
    assert latency.quantile(0.95) == pytest.approx(20.0, rel=1e-9)
    assert FixedLatency(value_s=2.5).quantile(0.3) == 2.5
    kv, clock = make_manager(policy="tool_latency", quantile=0.95)
    turn0 = make_request("s0-t0", tokens(100, 40), session_id=0, tool_latency=latency)
    admit(kv, turn0)
    clock.now_s = 1.0
    finish(kv, turn0)
    assert kv.retention is not None
    assert kv.retention.holders[0].expiry_s == pytest.approx(21.0, rel=1e-9)


def test_free_floor_releases_the_oldest_pins_first() -> None:
    # 11 usable blocks, floor ceil(0.3 * 11) = 4 free blocks.
    kv, clock = make_manager(policy="free_floor", ttl_s=100.0, free_floor=0.3)
    pool = kv.block_pool
    retention = kv.retention
    assert retention is not None and retention.floor_blocks == 4
    turns = [make_request(f"s{i}-t0", tokens(100 * (i + 1), 24), session_id=i) for i in range(3)]
    for turn in turns:
        admit(kv, turn)
    for i, turn in enumerate(turns):
        clock.now_s = float(i + 1)
        finish(kv, turn)
    assert [h.block_ids for h in retention.holders.values()] == [[1], [3], [5]]
    assert pool.num_free_blocks == 8
    admit(kv, make_request("a", tokens(5000, 4 * BLOCK_SIZE)))
    assert pool.num_free_blocks == 4 and len(retention.holders) == 3  # at the floor: kept
    admit(kv, make_request("b", tokens(6000, 8)))
    assert pool.num_free_blocks == 3
    kv.get_computed_blocks(make_request("probe", tokens(7000, 8)))  # below: oldest goes
    assert list(retention.holders) == [1, 2]
    assert pool.num_free_blocks == 4
    admit(kv, make_request("c", tokens(8000, 2 * BLOCK_SIZE)))
    kv.get_computed_blocks(make_request("probe2", tokens(9000, 8)))
    assert not retention.holders  # session 1, then session 2
    assert retention.num_releases == {"return": 0, "expiry": 0, "floor": 3, "starved": 0}


def test_pins_never_starve_an_engine_with_nothing_running() -> None:
    kv, clock = make_manager(policy="ttl", ttl_s=100.0)
    retention = kv.retention
    assert retention is not None
    for i in range(3):  # three sessions pin 3 full blocks each: 2 blocks stay free
        turn = make_request(f"s{i}-t0", tokens(1000 * (i + 1), 3 * BLOCK_SIZE), session_id=i)
        admit(kv, turn)
        clock.now_s = float(i)
        finish(kv, turn)
    assert kv.block_pool.num_free_blocks == 2
    big = make_request("big", tokens(50_000, 5 * BLOCK_SIZE))
    hits, _ = kv.get_computed_blocks(big)
    # With something running the queue's head waits (the pins' cost) ...
    assert kv.allocate_slots(big, big.num_tokens, 0, hits, full_sequence_must_fit=True) is None
    # ... with nothing running the oldest pins go until it fits.
    # (session 0's blocks freed tail first to the LRU end, then popped from the front)
    assert admit(kv, big, has_scheduled_reqs=False) == [10, 11, 3, 2, 1]
    assert list(retention.holders) == [1, 2]
    assert retention.num_releases["starved"] == 1


def test_held_blocks_count_a_shared_block_once_and_live_pins_to_their_expiry() -> None:
    kv, clock = make_manager(policy="ttl", ttl_s=10.0)
    shared = tokens(100, BLOCK_SIZE)
    turns = [
        make_request(f"s{i}-t0", shared + tokens(1000 * (i + 1), 8), session_id=i) for i in range(2)
    ]
    assert admit(kv, turns[0]) == [1, 2]
    assert admit(kv, turns[1]) == [1, 3]  # the shared system prompt block is a prefix hit
    finish(kv, turns[0])
    clock.now_s = 2.0
    finish(kv, turns[1])
    retention = kv.retention
    assert retention is not None
    assert [h.block_ids for h in retention.holders.values()] == [[1], [1]]
    assert kv.block_pool.ref_cnt[1] == 2
    assert (retention.num_held_blocks, retention.peak_held_blocks) == (1, 1)
    assert retention.held_block_s_until(4.0) == 4.0
    # Session 0's pin ends at 10, session 1's at 12: the block is held from 0 to 12.
    assert retention.held_block_s_until(100.0) == 12.0
    assert len(retention.holders) == 2  # counting released nothing


# -- whole runs --------------------------------------------------------------------------------
def scenario_doc(num_gpu_blocks: int, retention: dict[str, Any] | None = None) -> dict[str, Any]:
    """16 agent sessions of 4 turns on a small pool: returning turns re-send ~300-500 tokens."""
    engine: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "max_model_len": 2048,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 512,
        "num_gpu_blocks_override": num_gpu_blocks,
    }
    if retention is not None:
        engine["kv_retention"] = retention
    return {
        "name": "retention-pressure",
        "seed": 3,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": engine,
        "workload": {
            "kind": "agent_sessions",
            "sessions": 16,
            "session_arrival": {"kind": "poisson", "rate_per_s": 4.0},
            "turns": {"kind": "fixed", "value": 4},
            "system_prompt_tokens": 64,
            "tool_schema_tokens": 0,
            "user_message_tokens": {"kind": "fixed", "value": 200},
            "tool_result_tokens": {"kind": "fixed", "value": 150},
            "output_tokens": {"kind": "fixed", "value": 40},
            "tool_latency": {"kind": "lognormal", "median_s": 0.5, "p95_s": 3.0},
            "max_context_tokens": 2048,
        },
    }


def run(num_gpu_blocks: int, retention: dict[str, Any] | None = None) -> SimulationResult:
    return simulate(parse_scenario(scenario_doc(num_gpu_blocks, retention), "test"))


def test_ttl_zero_is_no_retention() -> None:
    # A TTL of 0 pins nothing: it is vLLM 0.32's policy none, and no what-if (the summary,
    # the resolved scenario and an export see none).
    default = run(300)
    for policy in ({"policy": "ttl", "ttl_s": 0.0}, {"policy": "free_floor", "ttl_s": 0}):
        scenario = parse_scenario(scenario_doc(300, policy), "test")
        assert scenario.engine.kv_retention == RetentionConfig()
        assert scenario.what_ifs() == [] and "kv_retention" not in scenario_to_yaml(scenario)
    zero = run(300, {"policy": "ttl", "ttl_s": 0.0})
    pd.testing.assert_frame_equal(default.requests, zero.requests, check_exact=True)
    pd.testing.assert_frame_equal(default.steps, zero.steps, check_exact=True)
    assert zero.summary == default.summary
    # A setting the policy does not read is still refused, not dropped with the TTL.
    with pytest.raises(KvsimConfigError, match=r"kv_retention\.quantile is set but policy ttl"):
        parse_scenario(scenario_doc(300, {"policy": "ttl", "ttl_s": 0, "quantile": 0.5}), "t")


def test_with_ample_hbm_retention_changes_nothing_but_the_free_blocks() -> None:
    default = run(1000)
    for policy in (
        {"policy": "ttl", "ttl_s": 3.0},
        {"policy": "tool_latency", "quantile": 0.9},
        {"policy": "free_floor", "ttl_s": 3.0, "free_floor": 0.1},
    ):
        pinned = run(1000, policy)
        pd.testing.assert_frame_equal(default.requests, pinned.requests, check_exact=True)
        # Pinned blocks are used HBM: only the free-block and usage columns differ.
        kv_columns = ["num_free_blocks", "kv_cache_usage_perc"]
        pd.testing.assert_frame_equal(
            default.steps.drop(columns=kv_columns),
            pinned.steps.drop(columns=kv_columns),
            check_exact=True,
        )
        section = pinned.summary["retention"]
        assert section["num_retentions"] == 48  # 16 sessions x 3 turns followed by another
        assert section["num_preemptions"] == 0
        assert section["num_early_releases"] == section["num_starved_releases"] == 0
        assert (default.steps["num_free_blocks"] >= pinned.steps["num_free_blocks"]).all()


def returning_hit_rate(result: SimulationResult) -> float:
    returning = result.requests[result.requests["turn"] >= 1]
    return returning["cached_tokens"].sum() / returning["prompt_tokens"].sum()


def test_under_pressure_retention_raises_the_returning_turns_hit_rate_at_a_cost() -> None:
    default = run(300)
    ttl = run(300, {"policy": "ttl", "ttl_s": 3.0})
    floor = run(300, {"policy": "free_floor", "ttl_s": 3.0, "free_floor": 0.1})
    assert "retention" not in default.summary and "what_if" not in default.summary
    base = returning_hit_rate(default)
    for result in (ttl, floor):
        section = result.summary["retention"]
        assert section["returning_turns"]["prefix_hit_rate"] == returning_hit_rate(result)
        assert (
            section["num_preemptions"] == result.summary["metrics"]["vllm:num_preemptions"]["total"]
        )
        assert section["num_blocks_hit_on_return"] > 0
        assert 0 < section["peak_held_blocks"] <= 299
    assert returning_hit_rate(ttl) > base + 0.05  # pinned contexts survive the tool waits
    assert returning_hit_rate(floor) > base + 0.02
    # The fixed TTL pins through the pressure and pays in preemptions; the floor does not.
    assert default.summary["metrics"]["vllm:num_preemptions"]["total"] == 0
    assert ttl.summary["retention"]["num_preemptions"] > 0
    assert floor.summary["retention"]["num_preemptions"] == 0
    assert floor.summary["retention"]["num_early_releases"] > 0
    assert ttl.summary["what_if"] == ["kv_retention: ttl (ttl_s=3); not in vLLM 0.32"]


@pytest.mark.parametrize(
    ("assignment", "field"),
    [
        ("engine.kv_retention.ttl_s=-1", "engine.kv_retention.ttl_s"),
        ("engine.kv_retention.quantile=1", "engine.kv_retention.quantile"),
        ("engine.kv_retention.quantile=0", "engine.kv_retention.quantile"),
        ("engine.kv_retention.free_floor=1.5", "engine.kv_retention.free_floor"),
        ("engine.kv_retention.policy=forever", "engine.kv_retention.policy"),
        ("engine.kv_retention.ttl=5", "engine.kv_retention.ttl"),
    ],
)
def test_bad_retention_configs_name_the_field(assignment: str, field: str) -> None:
    with pytest.raises(KvsimConfigError) as info:
        load_scenario(
            "scenarios/coding-agents-8b-h100.yaml",
            ["engine.kv_retention.policy=ttl", assignment],
        )
    assert field in str(info.value)
    assert "Traceback" not in str(info.value)


@pytest.mark.parametrize("kind", ["open_loop", "trace"])
def test_retention_without_sessions_is_refused(kind: str, tmp_path: Any) -> None:
    # Only agent sessions give their requests a session hint; a trace's session_id and turn
    # columns do not (the trace workload submits rows open loop): retention would do nothing.
    trace = tmp_path / "sessions.jsonl"
    rows = [
        {"timestamp": t, "input_length": 200, "output_length": 20, "session_id": 0, "turn": t}
        for t in range(3)
    ]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    document = scenario_doc(300, {"policy": "tool_latency"})
    document["workload"] = (
        {"kind": "trace", "path": str(trace)}
        if kind == "trace"
        else {
            "kind": "open_loop",
            "num_requests": 10,
            "arrival": {"kind": "poisson", "rate_per_s": 1},
        }
    )
    with pytest.raises(KvsimConfigError) as info:
        parse_scenario(document, "test")
    message = str(info.value)
    assert (
        "engine.kv_retention.policy=tool_latency keeps a session's blocks for its next turn, "
        f"but workload.kind={kind} has no sessions"
    ) in message
    assert "\n" not in message
    document["engine"]["kv_retention"] = {"policy": "none"}
    assert parse_scenario(document, "test").what_ifs() == []


def test_default_outputs_do_not_mention_retention() -> None:
    scenario = parse_scenario(scenario_doc(300), "test")
    assert scenario.engine.what_if_policies() == []
    assert "kv_retention" not in scenario_to_yaml(scenario)
    pinned = parse_scenario(scenario_doc(300, {"policy": "ttl", "ttl_s": 3.0}), "test")
    assert "kv_retention" in scenario_to_yaml(pinned)
    assert json.loads(json.dumps(pinned.engine.kv_retention.model_dump()))["ttl_s"] == 3.0


def test_a_replay_on_vllm_refuses_a_retention_policy() -> None:
    from validate.engine_args import engine_kwargs

    scenario = load_scenario(
        "scenarios/validation/agentic-multiturn.yaml", ["engine.kv_retention.policy=ttl"]
    )
    with pytest.raises(KvsimConfigError, match=r"engine: kv_retention: ttl \(ttl_s=30\)"):
        engine_kwargs(scenario, "cpu", "tiny")


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["engine.allocator=static"], "engine.allocator=static has no prefix cache"),
        (["engine.enable_prefix_caching=false"], "engine.enable_prefix_caching=false caches none"),
    ],
)
def test_retention_needs_paged_prefix_caching(sets: list[str], message: str) -> None:
    from sim.errors import KvsimConfigError
    from sim.scenario import SCENARIO_DIR, load_scenario

    with pytest.raises(KvsimConfigError, match=message):
        load_scenario(
            SCENARIO_DIR / "coding-agents-8b-h100.yaml",
            ["engine.kv_retention.policy=ttl", *sets],
        )


def test_the_block_map_shows_retained_blocks() -> None:
    from sim.block_map import RETAINED
    from sim.runner import simulate
    from sim.scenario import SCENARIO_DIR, load_scenario

    spec = load_scenario(
        SCENARIO_DIR / "coding-agents-8b-h100.yaml",
        [
            "workload.sessions=20",
            "workload.session_arrival.rate_per_s=2",
            "engine.kv_retention.policy=ttl",
            "engine.kv_retention.ttl_s=60",
        ],
    )
    result = simulate(spec)
    states = np.stack(result.block_map.states)
    assert (states == RETAINED).any()
    # Only blocks held for a session that no running request owns are marked retained.
    assert result.summary["retention"]["num_retentions"] > 0


def test_a_setting_the_policy_does_not_read_is_refused_and_dumps_load_back() -> None:
    from sim.errors import KvsimConfigError
    from sim.scenario import SCENARIO_DIR, load_scenario, parse_scenario

    path = SCENARIO_DIR / "coding-agents-8b-h100.yaml"
    with pytest.raises(KvsimConfigError, match="policy none does not read it"):
        load_scenario(path, ["engine.kv_retention.ttl_s=20"])
    with pytest.raises(KvsimConfigError, match=r"kv_retention\.quantile is set but policy ttl"):
        load_scenario(path, ["engine.kv_retention.policy=ttl", "engine.kv_retention.quantile=0.5"])
    # Its default is as good as unset; a dump holds only what the policy reads.
    spec = load_scenario(
        path, ["engine.kv_retention.policy=ttl", "engine.kv_retention.quantile=0.9"]
    )
    dumped = spec.model_dump(mode="json")["engine"]["kv_retention"]
    assert dumped == {"policy": "ttl", "ttl_s": 30.0}
    assert parse_scenario(spec.model_dump(mode="json"), "x").engine == spec.engine
