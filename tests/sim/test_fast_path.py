"""The engine's fast path (stretches advanced in bulk) against the step-by-step path.

Random small scenarios (open loop and agent sessions with tool waits, fcfs and priority,
prefix caching on and off, chunked prefill budgets, block pools tight enough to preempt,
time limits) run through both paths; the step tables, request tables, summaries and block
maps must be identical, byte for byte once written.
"""

from __future__ import annotations

import io
import json
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sim.engine
from sim.kv.kv_cache_manager import KVCacheManager
from sim.recorder import Recorder
from sim.runner import SimulationResult, simulate
from sim.scenario import parse_scenario
from sim.scheduler.scheduler import Scheduler
from sim.stretch_blocks import delay_to


def length(draw: st.DrawFn, low: int, high: int) -> dict[str, Any]:
    if draw(st.booleans()):
        return {"kind": "fixed", "value": draw(st.integers(low, high))}
    lo = draw(st.integers(low, high))
    return {"kind": "uniform", "low": lo, "high": draw(st.integers(lo, high))}


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    max_model_len = draw(st.sampled_from([512, 1024, 2048]))
    engine: dict[str, Any] = {
        "block_size": draw(st.sampled_from([16, 32])),
        "max_model_len": max_model_len,
        "max_num_seqs": draw(st.sampled_from([2, 4, 16, 64])),
        "max_num_batched_tokens": draw(st.sampled_from([64, 256, 2048])),
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 48])),
        "enable_prefix_caching": draw(st.booleans()),
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
        "watermark": draw(st.sampled_from([0.0, 0.0, 0.05])),
    }
    if draw(st.booleans()):
        # Tight enough to preempt, large enough for one max_model_len request.
        blocks = -(-max_model_len // engine["block_size"]) + 1
        engine["num_gpu_blocks_override"] = blocks + draw(st.integers(0, 3 * blocks))
    classes = None
    if engine["scheduling_policy"] == "priority" or draw(st.booleans()):
        classes = [
            {"name": "interactive", "priority": 0, "weight": 0.4},
            {"name": "background", "priority": 1, "weight": 0.6},
        ]
    if draw(st.booleans()):
        workload: dict[str, Any] = {
            "kind": "open_loop",
            "num_requests": draw(st.integers(1, 30)),
            "arrival": {"kind": "poisson", "rate_per_s": draw(st.sampled_from([1.0, 20.0, 500.0]))},
            "prompt_tokens": length(draw, 1, max_model_len // 4),
            "output_tokens": length(draw, 1, max_model_len // 4),
            "shared_prefix_tokens": draw(st.sampled_from([0, 0, 40])),
        }
    else:
        workload = {
            "kind": "agent_sessions",
            "sessions": draw(st.integers(1, 6)),
            "session_arrival": draw(
                st.sampled_from(
                    [{"kind": "poisson", "rate_per_s": 5.0}, {"kind": "burst", "at_s": 0.0}]
                )
            ),
            "turns": {"kind": "fixed", "value": draw(st.integers(1, 4))},
            "system_prompt_tokens": draw(st.sampled_from([0, 30, 100])),
            "tool_schema_tokens": draw(st.sampled_from([0, 20])),
            "user_message_tokens": length(draw, 1, 60),
            "tool_result_tokens": length(draw, 1, 80),
            "output_tokens": length(draw, 1, 90),
            "tool_latency": draw(
                st.sampled_from(
                    [
                        {"kind": "fixed", "value_s": 0.0},
                        {"kind": "fixed", "value_s": 0.05},
                        {"kind": "lognormal", "median_s": 0.2, "p95_s": 2.0},
                    ]
                )
            ),
            "max_context_tokens": max_model_len,
        }
    if classes is not None:
        workload["priority_classes"] = classes
    scenario: dict[str, Any] = {
        "name": "fast-path",
        "seed": draw(st.integers(0, 1000)),
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": engine,
        "workload": workload,
    }
    if draw(st.booleans()):
        scenario["limits"] = {"max_duration_s": draw(st.sampled_from([0.05, 0.3, 2.0]))}
    return scenario


def parquet_bytes(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def assert_identical(fast: SimulationResult, reference: SimulationResult) -> None:
    assert list(fast.steps.dtypes) == list(reference.steps.dtypes)
    pd.testing.assert_frame_equal(fast.steps, reference.steps, check_exact=True)
    assert parquet_bytes(fast.steps) == parquet_bytes(reference.steps)
    assert parquet_bytes(fast.requests) == parquet_bytes(reference.requests)
    assert [t.tolist() for t in fast.requests["token_times_s"]] == [
        t.tolist() for t in reference.requests["token_times_s"]
    ]
    assert json.dumps(fast.summary, sort_keys=True) == json.dumps(reference.summary, sort_keys=True)
    assert fast.block_map.steps == reference.block_map.steps
    assert fast.block_map.times_s == reference.block_map.times_s
    assert all(
        np.array_equal(a, b)
        for a, b in zip(fast.block_map.states, reference.block_map.states, strict=True)
    )


def pool_state(scheduler: Any) -> tuple[Any, ...]:
    """The KV cache's state block by block: free-queue order, the prefix-cache map (first
    holders and duplicates), ref counts, hashes, block tables and cached-block counts, and
    each running request's progress (not the eviction stamps: a stretch stamps its pops'
    evictions at once, which orders prefix lookups made between steps just the same)."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    return (
        tuple(pool.free_block_ids()),
        sorted(pool.first_cached_block.items()),
        sorted((h, tuple(ids)) for h, ids in pool.duplicate_blocks.items()),
        pool.num_evicted_blocks,
        pool.ref_cnt.tobytes(),
        pool.hashed.tobytes(),
        (pool.block_hash * pool.hashed).tobytes(),
        sorted((r, tuple(ids)) for r, ids in kv.req_to_blocks.items()),
        sorted(kv.num_cached_block.items()),
        [progress(r, scheduler.num_steps) for r in scheduler.running],
    )


def progress(request: Any, last_step: int) -> tuple[str, int, int]:
    """A running request's id, computed tokens and token count after ``last_step`` (a lazy
    decode's are as of its lazy_step, one more of each per step since)."""
    computed = request.num_computed_tokens
    num_tokens = len(request.token_ids)
    if request.lazy_step >= 0:
        computed += last_step - request.lazy_step
        num_tokens = computed + 1
    return request.request_id, computed, num_tokens


def states_after_steps(
    scenario: Any, monkeypatch: pytest.MonkeyPatch, exact: bool
) -> dict[int, tuple[Any, ...]]:
    """The KV cache's state after every step the run records one by one and after the last
    step of every stretch, by step number."""
    states: dict[int, tuple[Any, ...]] = {}
    on_step = Recorder.on_step
    on_stretch_end = Recorder.on_stretch_end

    def step(self: Recorder, output: Any, update: Any, *args: Any) -> None:
        on_step(self, output, update, *args)
        states[output.step] = pool_state(args[-1])

    def stretch_end(self: Recorder, last_step: int, *args: Any) -> None:
        on_stretch_end(self, last_step, *args)
        states[last_step] = pool_state(args[-1])

    with monkeypatch.context() as patch:
        patch.setattr(Recorder, "on_step", step)
        patch.setattr(Recorder, "on_stretch_end", stretch_end)
        simulate(scenario, exact_reference=exact)
    return states


def assert_same_kv_states(
    scenario: Any, monkeypatch: pytest.MonkeyPatch, stretches: bool = True
) -> None:
    """After each step and stretch the KV cache is as the step-by-step path leaves it."""
    fast = states_after_steps(scenario, monkeypatch, exact=False)
    reference = states_after_steps(scenario, monkeypatch, exact=True)
    if stretches:
        assert len(fast) < len(reference)  # some stretches were taken
    for step, state in fast.items():
        assert state == reference[step], f"KV cache differs after step {step}"


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_fast_path_gives_the_step_by_step_results(raw: dict[str, Any]) -> None:
    scenario = parse_scenario(raw, "fast-path")
    assert_identical(simulate(scenario), simulate(scenario, exact_reference=True))


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_lazy_decodes_alone_give_the_step_by_step_results(raw: dict[str, Any]) -> None:
    # No stretch: every step goes through the scheduler, with its lazy decodes.
    scenario = parse_scenario(raw, "lazy-decodes")
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(sim.engine.Engine, "_plan_stretch", lambda self, since: None)
        lazy = simulate(scenario)
    assert_identical(lazy, simulate(scenario, exact_reference=True))


@st.composite
def long_prompt_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Prompts many token budgets long, so the running batch often holds a prefill working
    through its prompt chunk by chunk beside the decodes (the prefill stretches)."""
    raw = draw(scenarios())
    engine = raw["engine"]
    engine["max_model_len"] = 2048
    engine["max_num_batched_tokens"] = draw(st.sampled_from([32, 64, 128, 256]))
    engine["long_prefill_token_threshold"] = draw(st.sampled_from([0, 0, 24, 100]))
    engine["max_num_seqs"] = draw(st.sampled_from([4, 16, 32]))
    if "num_gpu_blocks_override" in engine:
        blocks = -(-2048 // engine["block_size"]) + 1
        engine["num_gpu_blocks_override"] = blocks + draw(st.integers(0, 2 * blocks))
    workload = raw["workload"]
    if workload["kind"] == "open_loop":
        workload["prompt_tokens"] = length(draw, 200, 1200)
        workload["output_tokens"] = length(draw, 1, 200)
    else:
        workload["tool_result_tokens"] = length(draw, 100, 400)
        workload["max_context_tokens"] = 2048
    return raw


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(long_prompt_scenarios())
def test_prefill_stretches_give_the_step_by_step_results(raw: dict[str, Any]) -> None:
    scenario = parse_scenario(raw, "prefill-stretches")
    assert_identical(simulate(scenario), simulate(scenario, exact_reference=True))


@pytest.fixture
def stretch_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Steps the engines of the test ran as stretches (decode and prefill)."""
    counted: list[int] = []
    end = sim.engine.Engine._end_stretch

    def counting(self: sim.engine.Engine, num_steps: int) -> Any:
        ended = end(self, num_steps)
        counted.append(self.num_stretch_steps)
        return ended

    monkeypatch.setattr(sim.engine.Engine, "_end_stretch", counting)
    return counted


DECODE_HEAVY: dict[str, Any] = {
    "name": "decode-heavy",
    "seed": 3,
    "model": "Llama-3.1-8B",
    "hardware": "H100-SXM-80GB",
    "engine": {"max_model_len": 4096, "block_size": 16},
    "workload": {
        "kind": "agent_sessions",
        "sessions": 8,
        "session_arrival": {"kind": "poisson", "rate_per_s": 2.0},
        "turns": {"kind": "fixed", "value": 3},
        "system_prompt_tokens": 200,
        "tool_schema_tokens": 50,
        "user_message_tokens": {"kind": "fixed", "value": 40},
        "tool_result_tokens": {"kind": "fixed", "value": 100},
        "output_tokens": {"kind": "uniform", "low": 100, "high": 300},
        "tool_latency": {"kind": "fixed", "value_s": 0.5},
        "max_context_tokens": 4096,
    },
}


def counting_grows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of KVCacheManager._grow calls (allocate_slots for a running request)."""
    grows = [0]
    grow = KVCacheManager._grow

    def counted_grow(self: KVCacheManager, *args: Any) -> Any:
        grows[0] += 1
        return grow(self, *args)

    monkeypatch.setattr(KVCacheManager, "_grow", counted_grow)
    return grows


def calling_allocate_slots_always(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """KV managers whose ``allocate_slots`` is an instance attribute, so that
    Scheduler.schedule calls it for every running request (no decode shortcut); returns a
    counter of ``_grow`` calls."""
    init = KVCacheManager.__init__

    def plain_init(self: KVCacheManager, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.allocate_slots = self.allocate_slots  # type: ignore[method-assign]

    monkeypatch.setattr(KVCacheManager, "__init__", plain_init)
    return counting_grows(monkeypatch)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_the_schedulers_decode_shortcut_changes_nothing(raw: dict[str, Any]) -> None:
    # Scheduler.schedule skips allocate_slots for a decode that needs no block and fills
    # none; the reference path takes that shortcut too, so it is checked against calls.
    scenario = parse_scenario(raw, "decode-shortcut")
    with pytest.MonkeyPatch.context() as monkeypatch:
        calling_allocate_slots_always(monkeypatch)
        called = simulate(scenario, exact_reference=True)
    assert_identical(simulate(scenario, exact_reference=True), called)


def test_the_decode_shortcut_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    scenario = parse_scenario(DECODE_HEAVY, "decode-heavy")
    with monkeypatch.context() as patch:
        shortcut = counting_grows(patch)
        simulate(scenario, exact_reference=True)
    with monkeypatch.context() as patch:
        always = calling_allocate_slots_always(patch)
        simulate(scenario, exact_reference=True)
    # One block in 16 tokens: most decodes need no allocate_slots call.
    assert 0 < shortcut[0] < always[0] / 4


def test_a_decode_heavy_run_goes_mostly_through_stretches_with_identical_results(
    stretch_counter: list[int],
) -> None:
    scenario = parse_scenario(DECODE_HEAVY, "decode-heavy")
    fast = simulate(scenario)
    num_steps = fast.summary["metrics"]["num_steps"]
    assert stretch_counter, "no stretch was taken"
    assert stretch_counter[-1] > num_steps // 2
    assert_identical(fast, simulate(scenario, exact_reference=True))


# With a 96-token long-prefill cap under a 256-token budget a chunk leaves budget to admit
# with: such chunks stretch only while nobody can be admitted (an empty queue, a full batch,
# or a head that does not fit).
@pytest.mark.parametrize(("threshold", "least_prefill_stretch_steps"), [(0, 10), (96, 2)])
def test_a_long_prompt_beside_decodes_is_chunked_in_prefill_stretches(
    engines: list[sim.engine.Engine],
    monkeypatch: pytest.MonkeyPatch,
    threshold: int,
    least_prefill_stretch_steps: int,
) -> None:
    # Long prompts arrive while others decode: with a 256-token budget a 3,000-token prompt
    # takes ~12 steps, all but the last one stretch steps when nothing else happens.
    raw = {
        "name": "long-prompt",
        "seed": 5,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {
            "max_model_len": 4096,
            "max_num_batched_tokens": 256,
            "long_prefill_token_threshold": threshold,
        },
        "workload": {
            "kind": "open_loop",
            "num_requests": 6,
            "arrival": {"kind": "poisson", "rate_per_s": 20.0},
            "prompt_tokens": {"kind": "uniform", "low": 100, "high": 3000},
            "output_tokens": {"kind": "fixed", "value": 200},
        },
    }
    scenario = parse_scenario(raw, "long-prompt")
    fast = simulate(scenario)
    assert engines[0].num_prefill_stretch_steps >= least_prefill_stretch_steps
    assert_identical(fast, simulate(scenario, exact_reference=True))
    assert_same_kv_states(scenario, monkeypatch)


def test_a_prefill_stretch_the_queue_head_would_hit_is_undone(
    engines: list[sim.engine.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two requests share a 1,000-token prefix in a pool with room for one: the second waits
    # for blocks while the first prefills, and the first's prefix blocks, once registered,
    # would become its hits, so each stretch planned over them is given up.
    raw = {
        "name": "undo",
        "seed": 0,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {
            "block_size": 32,
            "max_model_len": 2048,
            "max_num_seqs": 64,
            "max_num_batched_tokens": 128,
            "long_prefill_token_threshold": 24,
            "watermark": 0.05,
            "num_gpu_blocks_override": 65,
        },
        "workload": {
            "kind": "open_loop",
            "num_requests": 2,
            "arrival": {"kind": "poisson", "rate_per_s": 2000.0},
            "prompt_tokens": {"kind": "uniform", "low": 1000, "high": 1200},
            "output_tokens": {"kind": "uniform", "low": 20, "high": 600},
            "shared_prefix_tokens": 1000,
        },
    }
    scenario = parse_scenario(raw, "undo")
    fast = simulate(scenario)
    assert engines[0].num_stretch_undos[True] > 0
    assert engines[0].num_prefill_stretch_steps > 0
    assert_identical(fast, simulate(scenario, exact_reference=True))
    assert_same_kv_states(scenario, monkeypatch)


def test_prefill_stretch_pops_and_registrations_are_replayed_when_they_meet(
    engines: list[sim.engine.Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two sessions burst in with the same 900-token system prompt and prefill it side by
    # side: the second registers blocks the first already cached, so its stretch's pops
    # and registrations are replayed one by one in vLLM's order.
    raw = {
        "name": "replay",
        "seed": 1,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {
            "block_size": 16,
            "max_model_len": 2048,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 128,
            "long_prefill_token_threshold": 100,
        },
        "workload": {
            "kind": "agent_sessions",
            "sessions": 2,
            "session_arrival": {"kind": "burst", "at_s": 0.0},
            "turns": {"kind": "fixed", "value": 2},
            "system_prompt_tokens": 900,
            "tool_schema_tokens": 0,
            "user_message_tokens": {"kind": "fixed", "value": 50},
            "tool_result_tokens": {"kind": "fixed", "value": 100},
            "output_tokens": {"kind": "fixed", "value": 60},
            "tool_latency": {"kind": "fixed", "value_s": 0.05},
            "max_context_tokens": 2048,
        },
    }
    scenario = parse_scenario(raw, "replay")
    fast = simulate(scenario)
    assert engines[0].num_stretch_replays[True] > 0
    assert_identical(fast, simulate(scenario, exact_reference=True))
    assert_same_kv_states(scenario, monkeypatch)


def lazy_decode_counter(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[lazy decodes, decodes] over the steps the schedulers of the test ran."""
    counts = [0, 0]
    schedule = Scheduler.schedule

    def counting(self: Scheduler) -> Any:
        output = schedule(self)
        counts[0] += output.num_lazy_decodes
        counts[1] += output.shape.num_decode_reqs
        return output

    monkeypatch.setattr(Scheduler, "schedule", counting)
    return counts


def test_steady_decodes_between_arrivals_go_lazy(monkeypatch: pytest.MonkeyPatch) -> None:
    # Arrivals every few steps leave no room for stretches: the decodes beside each
    # admission are advanced lazily, and nothing changes.
    raw = {
        "name": "lazy",
        "seed": 2,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {"max_model_len": 4096, "enable_prefix_caching": True},
        "workload": {
            "kind": "open_loop",
            "num_requests": 300,
            "arrival": {"kind": "poisson", "rate_per_s": 40.0},
            "prompt_tokens": {"kind": "uniform", "low": 50, "high": 800},
            "output_tokens": {"kind": "uniform", "low": 50, "high": 400},
            "shared_prefix_tokens": 40,
        },
    }
    scenario = parse_scenario(raw, "lazy")
    with monkeypatch.context() as patch:
        counts = lazy_decode_counter(patch)
        fast = simulate(scenario)
    assert counts[0] > counts[1] / 2
    with monkeypatch.context() as patch:
        counts = lazy_decode_counter(patch)
        reference = simulate(scenario, exact_reference=True)
    assert counts[0] == 0  # the reference path schedules every request one by one
    assert_identical(fast, reference)
    assert_same_kv_states(scenario, monkeypatch, stretches=False)


def test_the_reference_path_takes_no_stretch(stretch_counter: list[int]) -> None:
    raw = {
        "name": "reference",
        "seed": 1,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {"max_model_len": 2048},
        "workload": {
            "kind": "open_loop",
            "num_requests": 5,
            "arrival": {"kind": "poisson", "rate_per_s": 50.0},
            "prompt_tokens": {"kind": "fixed", "value": 64},
            "output_tokens": {"kind": "fixed", "value": 64},
        },
    }
    simulate(parse_scenario(raw, "reference"), exact_reference=True)
    assert stretch_counter == []


@pytest.mark.parametrize(
    ("now_s", "target_s"),
    [(0.0, 0.1), (0.1, 0.30000000000000004), (1e-9, 12345.678), (2602.7, 2602.7000000001)],
)
def test_delay_to_lands_exactly_on_the_target(now_s: float, target_s: float) -> None:
    delay = delay_to(now_s, target_s)
    assert delay is not None and delay >= 0
    assert now_s + delay == target_s


def test_delay_to_says_when_rounding_skips_the_target() -> None:
    # No float d gives 0.019174534276296153 + d == 0.09857705644943048: the sums jump
    # from ...046 to ...049.
    assert delay_to(0.019174534276296153, 0.09857705644943048) is None
