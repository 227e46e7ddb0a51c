"""The V1 scheduler step by step: token budget, chunked prefill, admission, preemption.

Each test builds a tiny engine (``make_scheduler``) and a few requests (``make_request``) and
checks exact step outputs: tokens per request, admitted and preempted ids, block tables and
free-queue order, as vLLM V1's ``Scheduler`` would produce them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import pydantic
import pytest

from sim.config.engine import EngineConfig
from sim.request import Request, RequestStatus
from sim.scheduler.output import SchedulerOutput, StepUpdate
from sim.scheduler.policy import make_policy
from sim.scheduler.scheduler import Scheduler

DEFAULT_ENGINE: dict[str, Any] = {
    "block_size": 16,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 256,
    "max_model_len": 4096,
}


def make_scheduler(*, num_gpu_blocks: int = 1000, **engine_overrides: Any) -> Scheduler:
    """A scheduler over ``num_gpu_blocks`` blocks (null block included)."""
    return Scheduler(EngineConfig(**(DEFAULT_ENGINE | engine_overrides)), num_gpu_blocks)


def make_request(
    request_id: str,
    num_prompt_tokens: int = 0,
    max_tokens: int = 1,
    *,
    prompt: Sequence[int] | None = None,
    block_size: int = 16,
    priority: int = 0,
    arrival_time_s: float = 0.0,
) -> Request:
    """A request with ``prompt``, or ``num_prompt_tokens`` tokens no other request shares."""
    if prompt is None:
        base = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:6], "big")
        prompt = range(base, base + num_prompt_tokens)
    return Request(
        request_id,
        list(prompt),
        max_tokens,
        block_size=block_size,
        priority=priority,
        arrival_time_s=arrival_time_s,
    )


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, StepUpdate]:
    """One engine step: schedule, then apply the (simulated) model output."""
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output)


def ids(requests: Sequence[Request]) -> list[str]:
    return [r.request_id for r in requests]


# -- token budget and chunked prefill -------------------------------------------------------------
def test_token_budget_split_between_running_decodes_and_a_chunked_prefill() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add_request(make_request(f"d{i}", 10, max_tokens=10))
    output, update = step(scheduler)
    assert output.num_scheduled_tokens == {"d0": 10, "d1": 10, "d2": 10}
    assert ids(update.sampled) == ["d0", "d1", "d2"]

    scheduler.add_request(make_request("p", 100))
    output, update = step(scheduler)
    # Running decodes first (one token each), then the newcomer takes the rest of the budget.
    assert output.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "p": 61}
    assert output.total_num_scheduled_tokens == 64
    assert output.admitted_ids == ["p"]
    shape = output.shape
    assert (shape.num_prefill_tokens, shape.num_prefill_reqs) == (61, 1)
    assert (shape.num_decode_reqs, shape.decode_context_tokens) == (3, 30)
    assert shape.prefill_attention_pairs == 61 * (0 + 61 / 2)
    assert shape.num_tokens == 64
    assert ids(update.sampled) == ["d0", "d1", "d2"]  # p's chunk did not reach its end

    output, update = step(scheduler)
    assert output.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "p": 39}
    shape = output.shape
    assert (shape.num_prefill_tokens, shape.num_decode_reqs) == (39, 3)
    assert shape.decode_context_tokens == 3 * 11
    assert shape.prefill_attention_pairs == 39 * (61 + 39 / 2)
    assert ids(update.sampled) == ["d0", "d1", "d2", "p"]
    assert ids(update.finished) == ["p"]


def test_a_long_prompt_is_chunked_by_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=48)
    scheduler.add_request(make_request("r", 100, max_tokens=1))
    chunks = [step(scheduler)[0].num_scheduled_tokens for _ in range(3)]
    assert chunks == [{"r": 48}, {"r": 48}, {"r": 4}]
    assert not scheduler.has_unfinished_requests()


def test_long_prefill_threshold_is_lifted_for_a_lone_request() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=1000, long_prefill_token_threshold=32)
    scheduler.add_request(make_request("r", 100))
    assert step(scheduler)[0].num_scheduled_tokens == {"r": 100}


def test_long_prefill_threshold_caps_chunks_when_two_requests_are_eligible() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=1000, long_prefill_token_threshold=32)
    scheduler.add_request(make_request("a", 100))
    scheduler.add_request(make_request("b", 100))
    chunks = [step(scheduler)[0].num_scheduled_tokens for _ in range(4)]
    assert chunks == [{"a": 32, "b": 32}] * 3 + [{"a": 4, "b": 4}]


def test_long_prefill_threshold_lifts_once_the_other_request_finishes() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=1000, long_prefill_token_threshold=32)
    scheduler.add_request(make_request("long", 200))
    scheduler.add_request(make_request("short", 20))
    output, update = step(scheduler)
    assert output.num_scheduled_tokens == {"long": 32, "short": 20}
    assert ids(update.finished) == ["short"]
    assert step(scheduler)[0].num_scheduled_tokens == {"long": 168}


def test_chunked_prefill_off_waits_for_a_budget_that_holds_the_whole_prompt() -> None:
    scheduler = make_scheduler(
        max_num_batched_tokens=4096, enable_chunked_prefill=False, max_model_len=4096
    )
    scheduler.add_request(make_request("a", 4000, max_tokens=2))
    scheduler.add_request(make_request("b", 200, max_tokens=1))
    # b does not fit the 96 tokens left after a; without chunking it waits whole.
    assert step(scheduler)[0].num_scheduled_tokens == {"a": 4000}
    assert step(scheduler)[0].num_scheduled_tokens == {"a": 1, "b": 200}


# -- admission ------------------------------------------------------------------------------------
def test_max_num_seqs_limits_admission() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 16, max_tokens=2))
    output, _ = step(scheduler)
    assert output.admitted_ids == ["a", "b"]
    assert output.num_scheduled_tokens == {"a": 16, "b": 16}
    assert (output.num_running, output.num_waiting) == (2, 1)

    output, update = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1, "b": 1}
    assert output.admitted_ids == []
    assert ids(update.finished) == ["a", "b"]

    output, _ = step(scheduler)
    assert output.admitted_ids == ["c"]
    assert output.num_scheduled_tokens == {"c": 16}


def test_head_of_line_blocking_a_large_waiting_request_blocks_a_small_one() -> None:
    scheduler = make_scheduler(num_gpu_blocks=11)  # 10 usable blocks
    scheduler.add_request(make_request("running", 64, max_tokens=4))  # 4 blocks
    scheduler.add_request(make_request("large", 160))  # needs all 10 blocks
    scheduler.add_request(make_request("small", 16))  # 1 block would fit
    output, _ = step(scheduler)
    assert output.admitted_ids == ["running"]
    assert output.num_scheduled_tokens == {"running": 64}
    assert output.num_free_blocks == 6
    assert ids(scheduler.waiting) == ["large", "small"]
    # Still blocked next step although 5 blocks are free for a 1-block request.
    output, _ = step(scheduler)
    assert output.admitted_ids == []
    assert output.num_free_blocks == 5


def test_a_waiting_high_priority_request_does_not_preempt() -> None:
    scheduler = make_scheduler(num_gpu_blocks=3, scheduling_policy="priority", block_size=16)
    scheduler.add_request(make_request("low", 20, max_tokens=8, priority=5))  # 2 blocks
    step(scheduler)
    scheduler.add_request(make_request("high", 8, priority=0, arrival_time_s=1.0))
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"low": 1}
    assert output.preempted_ids == []
    assert output.admitted_ids == []
    assert ids(scheduler.waiting) == ["high"]


# -- preemption -----------------------------------------------------------------------------------
def test_fcfs_preempts_the_last_running_request_to_the_front_of_waiting() -> None:
    scheduler = make_scheduler(num_gpu_blocks=5)  # 4 usable blocks
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, 32, max_tokens=10))
    output, _ = step(scheduler)
    assert output.admitted_ids == ["a", "b"]  # c finds no free block
    kv = scheduler.kv_cache_manager
    assert (kv.block_table("a"), kv.block_table("b")) == ([1, 2], [3, 4])
    assert output.num_free_blocks == 0

    # a's 33rd token needs a third block: b (last admitted) is preempted and recomputes.
    output, _ = step(scheduler)
    assert output.preempted_ids == ["b"]
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.admitted_ids == []
    b = scheduler.requests["b"]
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_computed_tokens, b.num_tokens, b.num_preemptions) == (0, 33, 1)
    assert ids(scheduler.running) == ["a"]
    assert ids(scheduler.waiting) == ["b", "c"]
    assert scheduler.num_preemptions == 1
    # b's blocks were hashed, so they went to the tail (4 before 3); a popped 4 from the front,
    # evicting b's second block from the prefix cache.
    assert kv.block_table("a") == [1, 2, 4]
    assert kv.block_pool.free_block_ids() == [3]
    assert kv.block_pool.get_cached_block(b.block_hashes[1]) is None
    assert kv.block_pool.get_cached_block(b.block_hashes[0]) == 3


def test_fcfs_request_that_is_its_own_victim_stops_the_running_pass() -> None:
    scheduler = make_scheduler(num_gpu_blocks=5)
    scheduler.add_request(make_request("a", 20, max_tokens=10))  # 2 blocks, room to grow
    scheduler.add_request(make_request("b", 32, max_tokens=10))  # 2 blocks, full
    step(scheduler)
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 1}
    assert output.preempted_ids == ["b"]
    assert ids(scheduler.running) == ["a"]


def test_priority_preempts_max_priority_and_arrival_and_restores_its_budget() -> None:
    # block_size 4 and a budget of 4 keep the step where the refund matters small enough to
    # follow by hand. Priorities: b (0) before c (1) before a (2); a arrived first.
    scheduler = make_scheduler(
        num_gpu_blocks=6, block_size=4, max_num_batched_tokens=4, scheduling_policy="priority"
    )

    scheduler.add_request(make_request("a", 2, 30, block_size=4, priority=2))
    assert step(scheduler)[0].num_scheduled_tokens == {"a": 2}
    scheduler.add_request(make_request("b", 2, 30, block_size=4, arrival_time_s=1.0))
    scheduler.add_request(make_request("c", 8, 1, block_size=4, priority=1, arrival_time_s=2.0))
    outputs = [step(scheduler)[0].num_scheduled_tokens for _ in range(3)]
    assert outputs == [
        {"a": 1, "b": 2, "c": 1},  # b before c: the waiting heap orders by priority
        {"a": 1, "b": 1, "c": 2},
        {"a": 1, "b": 1, "c": 2},  # a takes block 4, c block 5: the pool is full
    ]
    kv = scheduler.kv_cache_manager
    assert [kv.block_table(r) for r in ("a", "b", "c")] == [[1, 4], [2], [3, 5]]
    assert ids(scheduler.running) == ["a", "b", "c"]

    # a decodes into its second block (scheduled, budget 3 left); b's 5th token needs a block,
    # none is free, the victim is max (priority, arrival) = a, already scheduled: its token
    # goes back to the budget, so c gets 3 tokens (2 without the refund).
    output = scheduler.schedule()
    assert output.preempted_ids == ["a"]
    assert output.num_scheduled_tokens == {"b": 1, "c": 3}
    assert output.total_num_scheduled_tokens == 4
    assert [kv.block_table(r) for r in ("b", "c")] == [[2, 4], [3, 5]]
    # a's partial block 4 went to the front (and to b), its full block 1 to the tail.
    assert kv.block_pool.free_block_ids() == [1]
    assert scheduler.requests["a"].num_computed_tokens == 0
    assert ids(scheduler.running) == ["b", "c"]
    assert ids(scheduler.waiting) == ["a"]
    # c's prompt is done: it samples its only token and finishes; b samples too.
    update = scheduler.update_from_output(output)
    assert (ids(update.sampled), ids(update.finished)) == (["b", "c"], ["c"])
    assert kv.block_pool.free_block_ids() == [1, 5, 3]


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_gpu_blocks=6, block_size=4, scheduling_policy="priority")
    scheduler.add_request(make_request("a", 8, 30, block_size=4, priority=2))  # 2 blocks
    scheduler.add_request(make_request("b", 12, 30, block_size=4, arrival_time_s=1.0))  # 3
    output, _ = step(scheduler)
    assert output.admitted_ids == ["b", "a"]
    assert output.num_free_blocks == 0

    # A small high-priority request arrives; b's 13th token then needs a block and preempts
    # a, which frees 2 blocks: b takes one, the other would fit the newcomer, but nobody is
    # admitted in a step that preempted.
    scheduler.add_request(make_request("h", 3, block_size=4, arrival_time_s=0.5))
    output, _ = step(scheduler)
    assert output.preempted_ids == ["a"]
    assert output.num_scheduled_tokens == {"b": 1}
    assert output.admitted_ids == []
    assert output.num_free_blocks == 1
    assert ids(scheduler.waiting) == ["h", "a"]

    output, _ = step(scheduler)
    assert output.admitted_ids == ["h"]
    assert output.num_scheduled_tokens == {"b": 1, "h": 3}


def test_a_preempted_request_re_hits_its_own_cached_blocks() -> None:
    scheduler = make_scheduler(num_gpu_blocks=7)  # 6 usable blocks
    scheduler.add_request(make_request("a", 48, max_tokens=3))  # 3 full blocks
    scheduler.add_request(make_request("b", 40, max_tokens=3))  # 2 full blocks + 8 tokens
    output, _ = step(scheduler)
    assert output.num_scheduled_tokens == {"a": 48, "b": 40}
    kv = scheduler.kv_cache_manager
    assert kv.block_table("b") == [4, 5, 6]

    output, _ = step(scheduler)
    assert output.preempted_ids == ["b"]
    # b's partial block 6 went to the front and to a; its hashed blocks 5, 4 wait at the tail.
    assert kv.block_table("a") == [1, 2, 3, 6]
    assert kv.block_pool.free_block_ids() == [5, 4]

    # b (41 tokens) needs 3 blocks and would re-hit 2 free ones: 3 > 2 free, so it waits.
    output, update = step(scheduler)
    assert output.admitted_ids == []
    assert ids(update.finished) == ["a"]

    output, _ = step(scheduler)
    assert output.admitted_ids == ["b"]
    assert output.num_resumed_prefix_hit_tokens == 32
    # A resumed request's re-hit is not a first lookup (vllm:prefix_cache_* stay 0).
    assert (output.num_prefix_query_tokens, output.num_prefix_hit_tokens) == (0, 0)
    assert output.num_scheduled_tokens == {"b": 9}
    assert kv.block_table("b") == [4, 5, 6]


def test_a_preempted_request_re_hits_nothing_with_caching_off() -> None:
    scheduler = make_scheduler(num_gpu_blocks=7, enable_prefix_caching=False)
    scheduler.add_request(make_request("a", 48, max_tokens=3))
    scheduler.add_request(make_request("b", 40, max_tokens=3))
    step(scheduler)
    assert step(scheduler)[0].preempted_ids == ["b"]
    step(scheduler)
    output, _ = step(scheduler)
    assert output.admitted_ids == ["b"]
    assert output.num_resumed_prefix_hit_tokens == 0
    assert output.num_scheduled_tokens == {"b": 41}


def test_first_lookup_counts_prefix_queries_and_hits() -> None:
    scheduler = make_scheduler()
    shared = list(range(32))
    scheduler.add_request(make_request("a", prompt=[*shared, *range(100, 110)]))
    output, _ = step(scheduler)
    assert (output.num_prefix_query_tokens, output.num_prefix_hit_tokens) == (42, 0)
    scheduler.add_request(make_request("b", prompt=[*shared, *range(200, 205)]))
    output, _ = step(scheduler)
    assert (output.num_prefix_query_tokens, output.num_prefix_hit_tokens) == (37, 32)
    assert output.num_scheduled_tokens == {"b": 5}


# -- update_from_output ---------------------------------------------------------------------------
def test_update_samples_only_at_the_end_of_a_prefill_then_finishes_and_frees() -> None:
    scheduler = make_scheduler(num_gpu_blocks=10, max_num_batched_tokens=16)
    planned = [7, 8]
    request = Request("r", list(range(40)), 2, block_size=16, output_token_ids=planned)
    scheduler.add_request(request)
    kv = scheduler.kv_cache_manager

    for expected_chunk in (16, 16):
        output, update = step(scheduler)
        assert output.num_scheduled_tokens == {"r": expected_chunk}
        assert (update.sampled, update.finished) == ([], [])
    output, update = step(scheduler)
    assert output.num_scheduled_tokens == {"r": 8}
    assert (ids(update.sampled), update.finished) == (["r"], [])
    assert request.output_token_ids == [7]
    assert kv.block_table("r") == [1, 2, 3]

    output, update = step(scheduler)
    assert output.num_scheduled_tokens == {"r": 1}
    assert (output.shape.num_decode_reqs, output.shape.decode_context_tokens) == (1, 40)
    assert (ids(update.sampled), ids(update.finished)) == (["r"], ["r"])
    assert request.output_token_ids == [7, 8]
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert scheduler.running == []
    assert scheduler.requests == {}
    assert not scheduler.has_unfinished_requests()
    assert kv.block_table("r") == []
    # Freed tail first: the partial block 3 to the front, hashed 2 and 1 to the tail.
    assert kv.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1]


def test_an_empty_step_schedules_nothing() -> None:
    scheduler = make_scheduler()
    output, update = step(scheduler)
    assert output.is_empty
    assert output.step == 1
    assert (update.sampled, update.finished) == ([], [])


# -- input checks ---------------------------------------------------------------------------------
def test_duplicate_request_id_raises() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 8))
    with pytest.raises(ValueError, match="duplicate request id 'r'"):
        scheduler.add_request(make_request("r", 8))


def test_prompt_plus_max_tokens_over_max_model_len_raises() -> None:
    scheduler = make_scheduler(max_model_len=64)
    scheduler.add_request(make_request("fits", 60, max_tokens=4))
    with pytest.raises(ValueError) as info:
        scheduler.add_request(make_request("long", 60, max_tokens=5))
    assert str(info.value) == (
        "request long: prompt 60 + max_tokens 5 tokens exceeds max_model_len=64"
    )
    assert ids(scheduler.waiting) == ["fits"]


def test_unknown_scheduling_policy_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        make_policy("lifo")
    assert str(info.value) == "scheduling_policy='lifo' is unknown; known policies: fcfs, priority"
    # The config rejects it too; a config built without validation fails in the scheduler.
    with pytest.raises(pydantic.ValidationError, match="'fcfs' or 'priority'"):
        EngineConfig(scheduling_policy="lifo")
    unchecked = EngineConfig.model_construct(**(DEFAULT_ENGINE | {"scheduling_policy": "lifo"}))
    with pytest.raises(ValueError, match="known policies: fcfs, priority"):
        Scheduler(unchecked, num_gpu_blocks=100)


# -- batch shape ----------------------------------------------------------------------------------
def test_batch_shape_counts_prefill_tokens_decode_reqs_and_decode_context() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=100)
    scheduler.add_request(make_request("d1", 10, max_tokens=5))
    scheduler.add_request(make_request("d2", 20, max_tokens=5))
    output, _ = step(scheduler)
    assert (output.shape.num_prefill_tokens, output.shape.num_prefill_reqs) == (30, 2)
    assert output.shape.num_decode_reqs == 0
    assert output.shape.prefill_attention_pairs == 10 * 5 + 20 * 10

    scheduler.add_request(make_request("p", 150, max_tokens=5))
    output, _ = step(scheduler)
    shape = output.shape
    assert output.num_scheduled_tokens == {"d1": 1, "d2": 1, "p": 98}
    assert (shape.num_prefill_tokens, shape.num_prefill_reqs) == (98, 1)
    assert (shape.num_decode_reqs, shape.decode_context_tokens) == (2, 10 + 20)
    assert shape.num_tokens == 100

    output, _ = step(scheduler)
    shape = output.shape
    assert output.num_scheduled_tokens == {"d1": 1, "d2": 1, "p": 52}
    assert (shape.num_prefill_tokens, shape.num_decode_reqs) == (52, 2)
    assert shape.decode_context_tokens == 11 + 21
    assert shape.prefill_attention_pairs == 52 * (98 + 26)


def test_the_batch_counts_the_blocks_requests_share_once_per_extra_holder() -> None:
    """Three requests hit a 2-block shared prefix (one registered it, two hit it): the
    batch re-reads those blocks twice each, shared_kv_tokens = 2 blocks x 2 extra holders."""
    scheduler = make_scheduler()
    prefix = list(range(1000, 1032))  # two full blocks
    scheduler.add_request(make_request("a", prompt=[*prefix, 1, 2, 3], max_tokens=4))
    output, _ = step(scheduler)
    assert output.shape.shared_kv_tokens == 0  # one holder
    scheduler.add_request(make_request("b", prompt=[*prefix, 4, 5], max_tokens=4))
    scheduler.add_request(make_request("c", prompt=[*prefix, 6], max_tokens=4))
    output, _ = step(scheduler)
    assert output.admitted_hit_tokens == [32, 32]
    assert output.shape.shared_kv_tokens == 2 * 2 * 16
    output, update = step(scheduler)  # all three decode: the same blocks, still shared
    assert output.shape.num_decode_reqs == 3
    assert output.shape.shared_kv_tokens == 2 * 2 * 16
    while not update.finished:
        output, update = step(scheduler)
    assert ids(update.finished) == ["a"]  # admitted a step before the others
    assert output.shape.shared_kv_tokens == 2 * 2 * 16  # its last step still held them
    output, update = step(scheduler)
    assert output.shape.shared_kv_tokens == 2 * 1 * 16  # b and c: one extra holder
    assert ids(update.finished) == ["b", "c"]
    assert scheduler.kv_cache_manager.num_shared_refs == 0
