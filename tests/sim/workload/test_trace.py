import json

import pytest
from pydantic import ValidationError

from sim.errors import KvsimConfigError
from sim.workload.trace import TraceRecord, TraceWorkload, load_trace
from tests.sim.workload.fake_sink import run_workload, stream

HASH = 8  # tokens per hash id: small so the test prompts stay small


def write_jsonl(tmp_path, rows, name="trace.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_trace(path, **overrides) -> TraceWorkload:
    return TraceWorkload(**({"path": str(path), "hash_block_tokens": HASH} | overrides))


MOONCAKE_ROWS = [
    {"timestamp": 0, "input_length": 20, "output_length": 3, "hash_ids": [1, 2, 3]},
    {"timestamp": 1500, "input_length": 30, "output_length": 2, "hash_ids": [1, 2, 4, 5]},
    {"timestamp": 500, "input_length": 12, "output_length": 1, "hash_ids": [7, 2]},
]


def test_equal_hash_ids_give_identical_token_blocks(tmp_path):
    path = write_jsonl(tmp_path, MOONCAKE_ROWS)
    sink = run_workload(make_trace(path, timestamp_unit="ms"), block_size=4)
    first, third, second = (s.request.token_ids for s in sink.submissions)
    assert first[:16] == second[:16]  # hash ids 1, 2
    assert first[16:20] != second[16:20]  # 3 vs 4
    assert third[8:12] == first[8:12]  # hash id 2 in a different position: same tokens
    assert third[:8] != first[:8]
    # input_length past the hashed blocks is unique; short of them, the last block is cut.
    assert len(sink.submissions[0].request.token_ids) == 20 + 3
    assert [s.request.num_prompt_tokens for s in sink.submissions] == [20, 12, 30]


def test_arrival_times_follow_timestamps_unit_and_scale(tmp_path):
    path = write_jsonl(tmp_path, MOONCAKE_ROWS)
    sink = run_workload(make_trace(path, timestamp_unit="ms", time_scale=2.0))
    assert [s.submit_s for s in sink.submissions] == [0.0, 1.0, 3.0]
    assert [s.request.request_id for s in sink.submissions] == ["req-0", "req-1", "req-2"]
    assert [s.request.arrival_time_s for s in sink.submissions] == [0.0, 1.0, 3.0]


def test_until_s_replays_a_window_of_the_scaled_trace(tmp_path):
    path = write_jsonl(tmp_path, MOONCAKE_ROWS)
    # Scaled arrivals at 0, 1 and 3 s: a window before 3 s keeps the first two.
    workload = make_trace(path, timestamp_unit="ms", time_scale=2.0, until_s=3.0)
    assert workload.expected_num_requests() == 2
    sink = run_workload(workload)
    assert [s.submit_s for s in sink.submissions] == [0.0, 1.0]
    with pytest.raises(ValidationError, match="until_s"):
        make_trace(path, until_s=0)


def test_times_count_from_the_earliest_row(tmp_path):
    """A window cut from the middle of a recording, or Unix timestamps, replays from t = 0;
    only the span is bounded (a year), with a hint at the unit."""
    epoch_s = 1_733_000_000
    shifted = [dict(row, timestamp=row["timestamp"] + epoch_s) for row in MOONCAKE_ROWS]
    path = write_jsonl(tmp_path, shifted)
    as_recorded = run_workload(make_trace(write_jsonl(tmp_path, MOONCAKE_ROWS, "zero.jsonl")))
    rebased = run_workload(make_trace(path))
    assert [s.submit_s for s in rebased.submissions] == [
        s.submit_s for s in as_recorded.submissions
    ]
    assert rebased.submissions[0].submit_s == 0.0
    assert [r.timestamp_s for r in load_trace(path, timestamp_unit="ms")][:1] == [0.0]
    in_seconds = tmp_path / "seconds.jsonl"
    in_seconds.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
        '{"timestamp": 40000000, "input_length": 5, "output_length": 1}\n'
    )
    in_ms = [dict(row, timestamp=row["timestamp"] + 1000 * epoch_s) for row in MOONCAKE_ROWS]
    in_ms_path = write_jsonl(tmp_path, in_ms, "ms.jsonl")
    assert [r.timestamp_s for r in load_trace(in_ms_path, timestamp_unit="ms")] == [0, 1.5, 0.5]
    with pytest.raises(
        KvsimConfigError,
        match=r"ms.jsonl:2: field 'timestamp' = 1,733,000,001,500 is no time in seconds .* a "
        "Unix time in milliseconds needs timestamp_unit: ms",
    ):
        load_trace(in_ms_path)  # Unix milliseconds read as seconds
    with pytest.raises(
        KvsimConfigError,
        match=r"its rows span 40,000,000 s \(line 1 to line 2\), more than kvsim's limit of "
        r"31,536,000 s \(a year\); timestamps in ms need timestamp_unit: ms",
    ):
        load_trace(in_seconds)


def test_same_seed_same_stream(tmp_path):
    workload = make_trace(write_jsonl(tmp_path, MOONCAKE_ROWS))
    assert stream(run_workload(workload, seed=2)) == stream(run_workload(workload, seed=2))
    assert stream(run_workload(workload, seed=2)) != stream(run_workload(workload, seed=3))


def test_session_turn_priority_become_meta(tmp_path):
    rows = [
        {
            "timestamp": 0.5,
            "input_length": 4,
            "output_length": 1,
            "session_id": 3,
            "turn": 1,
            "priority": 2,
        },
        {"timestamp": 0.25, "input_length": 4, "output_length": 1, "extra": "ignored"},
    ]
    sink = run_workload(make_trace(write_jsonl(tmp_path, rows)))
    plain, tagged = sink.submissions
    assert (tagged.meta.session_id, tagged.meta.turn, tagged.meta.priority_class) == (3, 1, "p2")
    assert tagged.request.priority == 2
    assert (plain.meta.session_id, plain.meta.priority_class, plain.request.priority) == (
        None,
        "default",
        0,
    )


def test_csv_trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(
        'timestamp,input_length,output_length,hash_ids,session_id\n0,16,2,"[1, 2]",\n1,16,2,1 2,4\n'
    )
    records = load_trace(path)
    assert records == [
        TraceRecord(line=2, timestamp_s=0.0, input_length=16, output_length=2, hash_ids=(1, 2)),
        TraceRecord(
            line=3,
            timestamp_s=1.0,
            input_length=16,
            output_length=2,
            session_id=4,
            hash_ids=(1, 2),
        ),
    ]
    a, b = run_workload(make_trace(path)).submissions
    assert a.request.token_ids[:16] == b.request.token_ids[:16]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"timestamp": 1, "input_length": "ten", "output_length": 1}',
            r"trace.jsonl:2: field 'input_length' = 'ten' is not an integer >= 1",
        ),
        (
            '{"timestamp": 1, "input_length": 0, "output_length": 1}',
            r"trace.jsonl:2: field 'input_length' = 0 is not an integer >= 1",
        ),
        (
            '{"timestamp": -1, "input_length": 5, "output_length": 1}',
            r"trace.jsonl:2: field 'timestamp' = -1 is not a finite number >= 0",
        ),
        ('{"timestamp": 1, "input_length": 5}', r"trace.jsonl:2: missing field 'output_length'"),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}',
            r"trace.jsonl:2: field 'hash_ids' = -2 is not an integer >= 0",
        ),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": 3}',
            r"trace.jsonl:2: field 'hash_ids' = 3 is not a list of integers >= 0",
        ),
        (
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "session_id": 1.5}',
            r"trace.jsonl:2: field 'session_id' = 1.5 is not an integer >= 0",
        ),
        ('{"timestamp": 1, "input_length": 5', r"trace.jsonl:2: not valid JSON"),
        ("[1, 2]", r"trace.jsonl:2: expected a JSON object"),
    ],
)
def test_malformed_row_names_file_line_field_and_value(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_malformed_csv_row_names_line(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text("timestamp,input_length,output_length\n0,5,1\n\n1,5,x\n")
    with pytest.raises(ValueError, match=r"trace.csv:4: field 'output_length' = 'x'"):
        load_trace(path)


def test_format_from_suffix_or_field(tmp_path):
    with pytest.raises(ValidationError, match=r"cannot infer the format from suffix '\.txt'"):
        TraceWorkload(path="trace.txt")
    with pytest.raises(ValidationError, match="a folder, not a trace file"):
        TraceWorkload(path=str(tmp_path))
    path = write_jsonl(tmp_path, MOONCAKE_ROWS, name="trace.txt")
    assert len(run_workload(make_trace(path, format="jsonl")).submissions) == 3
    with pytest.raises(ValueError, match="no rows"):
        load_trace(write_jsonl(tmp_path, [], name="empty.jsonl"))


def test_rows_longer_than_max_model_len(tmp_path):
    path = write_jsonl(tmp_path, MOONCAKE_ROWS)
    with pytest.raises(
        ValueError,
        match=r"trace.jsonl:2: input_length 30 \+ output_length 2 "
        r"exceeds max_model_len=31 \(1 such rows",
    ):
        run_workload(make_trace(path), max_model_len=31)
    workload = make_trace(path, on_too_long="skip")
    sink = run_workload(workload, max_model_len=31)
    assert [s.request.num_prompt_tokens for s in sink.submissions] == [20, 12]
    assert sink.workload_run is not None
    assert (sink.workload_run.planned_requests, sink.workload_run.trace_rows_skipped) == (2, 1)
    # Per run, not on the config: the same config with room for every row skips none.
    again = run_workload(workload, max_model_len=64)
    assert again.workload_run is not None and again.workload_run.trace_rows_skipped == 0
    assert workload.expected_num_requests() == 3


# Session 7's turn 2 takes 0.2 s to serve (200 tokens at the fake's 1 ms), longer than the
# 0.1 s its trace waited before turn 3; session 8's turns are quick; the last row is no turn.
AGENT_ROWS = [
    {"timestamp": 0.0, "input_length": 8, "output_length": 2, "session_id": 7, "turn": 1},
    {"timestamp": 0.05, "input_length": 190, "output_length": 10, "session_id": 7, "turn": 2},
    {"timestamp": 0.15, "input_length": 8, "output_length": 2, "session_id": 7, "turn": 3},
    {"timestamp": 0.02, "input_length": 8, "output_length": 2, "session_id": 8, "turn": 1},
    {"timestamp": 0.5, "input_length": 8, "output_length": 2, "session_id": 8, "turn": 2},
    {"timestamp": 0.12, "input_length": 8, "output_length": 2},
]


def test_closed_loop_sends_a_turn_its_recorded_gap_after_the_last_once_it_is_answered(tmp_path):
    path = write_jsonl(tmp_path, AGENT_ROWS)
    open_loop = run_workload(make_trace(path)).by_id()
    closed = run_workload(make_trace(path, replay="closed_loop")).by_id()
    assert sorted(open_loop) == sorted(closed)  # ids follow the timestamp order either way
    sent = {i: round(s.submit_s, 9) for i, s in closed.items()}
    ids = {(s.meta.session_id, s.meta.turn): i for i, s in closed.items()}
    assert sent[ids[7, 1]] == 0.0 and sent[ids[8, 1]] == 0.02
    assert sent[ids[7, 2]] == 0.05  # turn 1 answered at 0.01, within the gap
    assert sent[ids[7, 3]] == round(closed[ids[7, 2]].finish_s, 9) == 0.25  # waited for it
    assert sent[ids[8, 2]] == 0.5  # recorded gap 0.48 after turn 1 was sent at 0.02
    assert sent[ids[None, None]] == 0.12  # no turn: at its time
    assert round(open_loop[ids[7, 3]].submit_s, 9) == 0.15  # open loop: never waits
    # Scaled, the gaps scale too.
    slow = run_workload(make_trace(path, replay="closed_loop", time_scale=2.0)).by_id()
    assert round(slow[ids[8, 2]].submit_s, 9) == 1.0
    assert round(slow[ids[7, 3]].submit_s, 9) == 0.3  # gap 0.2 after 0.1: answered at 0.3


def test_closed_loop_needs_rows_with_session_and_turn(tmp_path):
    path = write_jsonl(tmp_path, MOONCAKE_ROWS)
    with pytest.raises(
        KvsimConfigError,
        match=r"trace.jsonl: workload.replay = 'closed_loop', but no replayed row has both "
        "session_id and turn",
    ):
        run_workload(make_trace(path, replay="closed_loop"))
    with pytest.raises(ValidationError, match="replay"):
        make_trace(path, replay="closed")
