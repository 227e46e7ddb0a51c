"""The step record layer: one classification of prefill vs decode, one step-table row."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.block_map import BlockMapRecorder
from sim.config.engine import EngineConfig
from sim.recorder import STEP_COLUMNS, Recorder, _drop_last
from sim.request import Request
from sim.scheduler.output import BatchShape
from sim.scheduler.scheduler import Scheduler
from sim.step_record import (
    STEP_RECORD_COLUMNS,
    StepRecord,
    batch_shape,
    is_decode,
    kv_unused_slots,
    shapes_of_steps,
    step_record,
)
from sim.workload.base import RequestMeta


@dataclass
class Counts:
    """A request's token counts, as vLLM's and kvsim's requests expose them."""

    num_computed_tokens: int
    num_tokens: int
    num_prompt_tokens: int


def test_add_record_appends_one_row_in_column_order():
    """What the replay of real vLLM writes: one StepRecord per step, its fields the columns."""
    record = StepRecord(
        step=3,
        start_s=1.5,
        duration_s=0.25,
        num_prefill_tokens=64,
        num_decode_tokens=7,
        num_prefill_reqs=2,
        decode_context_tokens=900,
        prefill_attention_pairs=2048.0,
        num_requests_running=9,
        num_requests_waiting=4,
        kv_cache_usage_perc=0.5,
        num_free_blocks=31,
        num_preemptions=1,
        prefix_cache_queries=128,
        prefix_cache_hits=32,
        resumed_prefix_cache_hits=16,
        kv_unused_slots=11,
        shared_kv_tokens=64,
    )
    recorder = Recorder(16)
    recorder.add_record(record)
    recorder.add_record(record._replace(step=4, kv_unused_slots=5))
    table = recorder.steps_frame()
    assert list(table.columns) == STEP_COLUMNS == list(STEP_RECORD_COLUMNS)
    assert table.to_dict("records") == [
        record.row(),
        {**record.row(), "step": 4, "kv_unused_slots": 5},
    ]
    assert [c for c in STEP_COLUMNS if "swap" in c] == []  # no swap in vLLM V1, no columns


@pytest.mark.parametrize(
    "new, context, tokens, prompt, decode",
    [
        (1, 100, 101, 100, True),  # the token sampled last step
        (1, 99, 100, 100, False),  # the last prompt token: a prefill chunk
        (2, 100, 102, 100, False),  # two tokens: recompute, not a decode
        (1, 50, 101, 100, False),  # a recompute chunk of a preempted request
        (16, 0, 16, 16, False),  # a whole prompt
    ],
)
def test_is_decode(new, context, tokens, prompt, decode):
    assert is_decode(new, context, tokens, prompt) is decode


def test_batch_shape_sums_decodes_and_prefill_chunks_either_way_round():
    scheduled = {"d1": 1, "d2": 1, "p": 64, "r": 1}
    before = {
        "d1": Counts(100, 101, 90),
        "d2": Counts(40, 41, 10),
        "p": Counts(32, 200, 200),  # a chunk after a 32-token prefix hit
        "r": Counts(10, 11, 11),  # last prompt token
    }
    expected = BatchShape(
        num_prefill_tokens=65,
        num_prefill_reqs=2,
        prefill_attention_pairs=64 * (32 + 32) + 1 * (10 + 0.5),
        num_decode_reqs=2,
        decode_context_tokens=140,
    )
    assert batch_shape(scheduled, before) == expected
    after = {
        rid: Counts(c.num_computed_tokens + scheduled[rid], c.num_tokens, c.num_prompt_tokens)
        for rid, c in before.items()
    }
    assert batch_shape(scheduled, after, computed_includes_scheduled=True) == expected
    assert batch_shape({}, {}) == BatchShape()


def test_kv_unused_slots():
    assert kv_unused_slots(num_held_blocks=5, block_size=16, num_computed_tokens=70) == 10


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int) -> Request:
    base = int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:6], "big")
    return Request(
        request_id, list(range(base, base + num_prompt_tokens)), max_tokens, block_size=16
    )


@settings(max_examples=40, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(1, 300), st.integers(1, 40)), min_size=1, max_size=8),
    num_gpu_blocks=st.integers(24, 80),
    budget=st.sampled_from([32, 64, 512]),
)
def test_the_scheduler_shape_and_recorder_row_come_from_the_record_layer(
    prompts, num_gpu_blocks, budget
):
    """Every step of kvsim's scheduler (chunked prefill, preemption by recompute included):
    its BatchShape is batch_shape() of what it scheduled, read after schedule() advanced the
    computed tokens as vLLM's does, the recorder's row is step_record()'s, and the step table
    gives the shapes back."""
    config = EngineConfig(
        block_size=16,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        max_model_len=352,
        long_prefill_token_threshold=0,
    )
    scheduler = Scheduler(config, num_gpu_blocks)
    recorder = Recorder(16, BlockMapRecorder())
    for i, (prompt, out) in enumerate(prompts):
        request = make_request(f"r{i}", prompt, out)
        scheduler.add_request(request)
        recorder.on_arrival(request, RequestMeta(), 0.0)
    now_s = 0.0
    expected_rows, shapes = [], []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        assert output.shape == batch_shape(
            output.num_scheduled_tokens, scheduler.requests, computed_includes_scheduled=True
        )
        shapes.append(output.shape)
        update = scheduler.update_from_output(output)
        recorder.on_step(output, update, now_s, now_s + 0.01, scheduler)
        # The simulator counts unused slots once the step's finished requests are freed.
        running = scheduler.running
        tables = scheduler.kv_cache_manager.req_to_blocks
        unused = kv_unused_slots(
            sum(len(tables[r.request_id]) for r in running),
            16,
            sum(r.num_computed_tokens for r in running),
        )
        expected_rows.append(step_record(output.step, output, now_s, now_s + 0.01, unused).row())
        now_s += 0.01
    table = recorder.steps_frame()
    assert table.to_dict("records") == expected_rows
    assert shapes_of_steps(table) == shapes


@given(st.integers(0, 200), st.integers(0, 200))
def test_dropping_a_cut_stretchs_values_keeps_the_rest_in_order(keep: int, drop: int) -> None:
    column = array("q", range(keep + drop))
    _drop_last(column, drop)
    assert column.tolist() == list(range(keep))
