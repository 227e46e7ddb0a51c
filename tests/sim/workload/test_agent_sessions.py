from collections import defaultdict
from itertools import pairwise

import pytest
from pydantic import ValidationError

from sim.request import Request
from sim.workload.agent_sessions import AgentSessionsWorkload, FanoutConfig
from sim.workload.distributions import (
    BurstArrivals,
    FixedLatency,
    FixedLength,
    PoissonArrivals,
    PriorityClass,
    UniformLength,
)
from tests.sim.workload.fake_sink import Submission, run_workload, stream

SHARED = 40 + 30  # system prompt + tool schemas


def make_sessions(**overrides) -> AgentSessionsWorkload:
    args = {
        "sessions": 4,
        "session_arrival": BurstArrivals(),
        "turns": FixedLength(value=3),
        "system_prompt_tokens": 40,
        "tool_schema_tokens": 30,
        "user_message_tokens": FixedLength(value=10),
        "tool_result_tokens": FixedLength(value=20),
        "output_tokens": FixedLength(value=5),
        "tool_latency": FixedLatency(value_s=2.0),
    }
    return AgentSessionsWorkload(**(args | overrides))


def by_session(submissions: list[Submission]) -> dict[int, list[Submission]]:
    sessions: dict[int, list[Submission]] = defaultdict(list)
    for s in sorted(submissions, key=lambda s: (s.meta.turn, s.meta.subcall or 0)):
        sessions[s.meta.session_id].append(s)
    return dict(sessions)


def prompt(s: Submission) -> list[int]:
    return s.request.token_ids[: s.request.num_prompt_tokens]


def test_turn_waits_for_previous_finish_plus_tool_latency():
    sink = run_workload(make_sessions(), s_per_token=0.001)
    assert len(sink.submissions) == 4 * 3
    for turns in by_session(sink.submissions).values():
        assert [s.request.request_id for s in turns] == [
            f"s{turns[0].meta.session_id}-t{k}" for k in range(3)
        ]
        for before, after in pairwise(turns):
            assert after.submit_s == before.finish_s + 2.0
    # Session 0 exactly: 80-token prompt + 5 outputs, then 105 + 5, then 130.
    s0 = by_session(sink.submissions)[0]
    assert [s.request.num_prompt_tokens for s in s0] == [80, 105, 130]
    assert [s.submit_s for s in s0] == pytest.approx([0.0, 2.085, 4.195])


def test_next_prompt_extends_previous_prompt_and_output_exactly():
    sink = run_workload(make_sessions(turns=FixedLength(value=5)))
    for turns in by_session(sink.submissions).values():
        for before, after in pairwise(turns):
            history = prompt(before) + before.request.output_token_ids
            assert prompt(after)[: len(history)] == history
            assert len(prompt(after)) == len(history) + 20


def test_shared_prefix_identical_across_sessions_and_the_rest_differs():
    sink = run_workload(make_sessions(sessions=6))
    first_turns = [turns[0] for turns in by_session(sink.submissions).values()]
    assert len({tuple(prompt(s)[:SHARED]) for s in first_turns}) == 1
    assert len({tuple(prompt(s)[SHARED:]) for s in first_turns}) == 6
    outputs = {tuple(s.request.output_token_ids) for s in sink.submissions}
    assert len(outputs) == len(sink.submissions)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prompt_block_hashes_equal_what_request_computes(block_size):
    workload = make_sessions(fanout=FanoutConfig(probability=0.5, width=2))
    sink = run_workload(workload, block_size=block_size)
    for s in sink.submissions:
        own = Request("x", prompt(s), 1, block_size=block_size, prompt_block_hashes=None)
        assert s.request.block_hashes[: len(own.block_hashes)] == own.block_hashes


def test_fanout_submits_width_calls_at_once_sharing_the_context():
    fanout = FanoutConfig(
        probability=1.0,
        width=3,
        task_tokens=FixedLength(value=4),
        output_tokens=FixedLength(value=6),
    )
    workload = make_sessions(sessions=1, fanout=fanout)
    assert workload.expected_num_requests() is None
    sink = run_workload(workload)
    turns = by_session(sink.submissions)[0]
    assert [s.request.request_id for s in turns[:3]] == ["s0-t0-f0", "s0-t0-f1", "s0-t0-f2"]
    assert [s.meta.subcall for s in turns] == [0, 1, 2] * 3
    turn0, turn1 = turns[:3], turns[3:6]
    assert {s.submit_s for s in turn0} == {0.0}
    context = prompt(turn0[0])[:-4]
    assert len(context) == SHARED + 10
    assert all(prompt(s)[:-4] == context for s in turn0)
    assert len({tuple(prompt(s)[-4:]) for s in turn0}) == 3
    # The next turn waits for the slowest call, then has the context plus every call's output.
    assert {s.submit_s for s in turn1} == {max(s.finish_s for s in turn0) + 2.0}
    expected = context + [t for s in turn0 for t in s.request.output_token_ids]
    assert prompt(turn1[0])[: len(expected)] == expected
    assert len(prompt(turn1[0])) == len(expected) + 20 + 4


def test_max_context_tokens_ends_a_session():
    # Prompts grow 80, 105, 130 (+5 output each): a 120-token cap allows two turns.
    sink = run_workload(make_sessions(turns=FixedLength(value=5), max_context_tokens=120))
    assert {len(turns) for turns in by_session(sink.submissions).values()} == {2}


def test_engine_max_model_len_ends_a_session_too():
    sink = run_workload(make_sessions(turns=FixedLength(value=5)), max_model_len=135)
    assert {len(turns) for turns in by_session(sink.submissions).values()} == {3}
    assert all(s.request.num_prompt_tokens + s.request.max_tokens <= 135 for s in sink.submissions)


def test_max_context_tokens_must_leave_room_for_the_shared_prefix():
    with pytest.raises(ValidationError, match="= 70 leaves no room under max_context_tokens=70"):
        make_sessions(max_context_tokens=70)


def test_same_seed_same_stream():
    workload = make_sessions(
        session_arrival=PoissonArrivals(rate_per_s=2.0),
        turns=UniformLength(low=1, high=6),
        output_tokens=UniformLength(low=1, high=30),
        fanout=FanoutConfig(probability=0.3, width=2),
    )
    assert stream(run_workload(workload, seed=5)) == stream(run_workload(workload, seed=5))
    assert stream(run_workload(workload, seed=5)) != stream(run_workload(workload, seed=6))


def test_sessions_see_the_same_tokens_whatever_the_engine_speed():
    workload = make_sessions(output_tokens=UniformLength(low=1, high=30))
    fast = run_workload(workload, seed=5, s_per_token=0.0001).by_id()
    slow = run_workload(workload, seed=5, s_per_token=0.01).by_id()
    assert fast.keys() == slow.keys()
    for request_id, s in fast.items():
        assert s.request.token_ids == slow[request_id].request.token_ids


def test_priority_class_drawn_once_per_session():
    classes = [
        PriorityClass(name="interactive", priority=0, weight=1),
        PriorityClass(name="background", priority=10, weight=1),
    ]
    sink = run_workload(make_sessions(sessions=40, priority_classes=classes))
    seen = set()
    for turns in by_session(sink.submissions).values():
        assert len({(s.meta.priority_class, s.request.priority) for s in turns}) == 1
        seen.add(turns[0].meta.priority_class)
    assert seen == {"interactive", "background"}


def test_expected_num_requests_is_the_sum_of_sampled_turns():
    assert make_sessions(sessions=7).expected_num_requests() == 21
    workload = make_sessions(sessions=20, turns=UniformLength(low=1, high=9))
    assert workload.expected_num_requests() is None
    sink = run_workload(workload)
    assert workload.expected_num_requests() is None  # the run's count is the run's, below
    assert sink.workload_run is not None
    assert sink.workload_run.planned_requests == len(sink.submissions)


@pytest.mark.parametrize(
    "turns",
    [
        {"kind": "fixed", "value": 100_001},
        {"kind": "uniform", "low": 1, "high": 200_000},
        {"kind": "lognormal", "median": 40, "sigma": 1, "max": 150_000},
        {"kind": "empirical", "values": [3, 100_001]},
    ],
)
def test_turns_beyond_the_limit_are_refused_naming_the_field(turns: dict) -> None:
    with pytest.raises(ValidationError, match=r"turns: a session of up to .* turns is beyond"):
        AgentSessionsWorkload(sessions=1, turns=turns)
