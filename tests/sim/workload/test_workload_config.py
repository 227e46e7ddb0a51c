import pytest
from pydantic import TypeAdapter, ValidationError

from sim.workload import (
    AgentSessionsWorkload,
    OpenLoopWorkload,
    TraceWorkload,
    WorkloadConfig,
    build_workload,
)
from sim.workload.distributions import BurstArrivals, LogNormalLatency, LogNormalLength
from tests.sim.workload.fake_sink import run_workload

ADAPTER = TypeAdapter(WorkloadConfig)


def test_scenario_sections_parse_to_the_right_workload():
    open_loop = ADAPTER.validate_python(
        {
            "kind": "open_loop",
            "num_requests": 10,
            "arrival": {"kind": "gamma", "rate_per_s": 5, "cv": 2},
            "prompt_tokens": {"kind": "lognormal", "median": 800, "sigma": 0.5},
        }
    )
    assert isinstance(open_loop, OpenLoopWorkload)
    sessions = ADAPTER.validate_python(
        {
            "kind": "agent_sessions",
            "sessions": 500,
            "session_arrival": {"kind": "burst"},
            "tool_latency": {"kind": "lognormal", "median_s": 1, "p95_s": 30},
            "fanout": {"probability": 0.4, "width": 3},
            "priority_classes": [
                {"name": "interactive", "priority": 0, "weight": 3},
                {"name": "background", "priority": 1},
            ],
        }
    )
    assert isinstance(sessions, AgentSessionsWorkload)
    assert sessions.session_arrival == BurstArrivals()
    assert sessions.tool_latency == LogNormalLatency(median_s=1, p95_s=30)
    trace = ADAPTER.validate_python({"kind": "trace", "path": "mooncake.jsonl"})
    assert isinstance(trace, TraceWorkload)


def test_defaults_match_the_documented_agent_traffic():
    sessions = AgentSessionsWorkload(sessions=1)
    assert (sessions.system_prompt_tokens, sessions.tool_schema_tokens) == (2000, 1500)
    assert sessions.tool_latency == LogNormalLatency(median_s=1.5, p95_s=20.0)
    assert sessions.expected_num_requests() == 10
    assert isinstance(sessions.output_tokens, LogNormalLength)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"kind": "closed_loop"}, "does not match any of the expected tags"),
        ({"kind": "open_loop", "num_requests": 1, "rate": 3}, "Extra inputs are not permitted"),
        ({"kind": "agent_sessions", "sessions": 0}, "greater than 0"),
    ],
)
def test_bad_sections_are_errors(section, message):
    with pytest.raises(ValidationError, match=message):
        ADAPTER.validate_python(section)


def test_configs_compare_equal_after_running(tmp_path):
    # A run caches what it derived (file contents, planned turns) on the frozen config; that
    # must not change equality, dumps, or make == raise on cached numpy arrays.
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1}\n')
    sessions = {
        "kind": "agent_sessions",
        "sessions": 3,
        "turns": {"kind": "empirical", "values": [1, 2, 3]},
    }
    for section in (sessions, {"kind": "trace", "path": str(trace)}):
        ran, fresh = ADAPTER.validate_python(section), ADAPTER.validate_python(section)
        run_workload(ran)
        other = ADAPTER.validate_python(section)
        run_workload(other, seed=9)
        assert ran == fresh == other
        assert ran.model_dump() == fresh.model_dump()


def test_build_workload_returns_a_startable_workload():
    config = ADAPTER.validate_python({"kind": "open_loop", "num_requests": 3})
    workload = build_workload(config, seed=1)
    assert workload is config
    assert len(run_workload(workload).submissions) == 3


def test_a_first_turn_that_can_never_fit_is_refused_fan_out_included() -> None:
    from sim.errors import KvsimConfigError
    from sim.scenario import SCENARIO_DIR, check_runnable, load_scenario

    cap = ["engine.max_model_len=4096", "workload.max_context_tokens=4096"]
    fanout = "workload.fanout={probability: %s, width: 2, task_tokens: {kind: fixed, value: 64}, output_tokens: {kind: fixed, value: 256}}"  # noqa: E501
    big_output = "workload.output_tokens={kind: fixed, value: 3000}"
    path = SCENARIO_DIR / "agent-burst.yaml"  # prefix 3,500 tokens, messages >= 32
    # A plain turn cannot fit, but a fan-out turn can: some sessions run.
    check_runnable(load_scenario(path, [*cap, big_output, fanout % 0.5]))
    with pytest.raises(KvsimConfigError, match=r"\+ output_tokens = 3,500 \+ 32 \+ 3,000"):
        check_runnable(load_scenario(path, [*cap, big_output]))
    # Every turn fans out: its sub-calls, not the plain output, must fit.
    with pytest.raises(
        KvsimConfigError,
        match=r"fanout.task_tokens \+ fanout.output_tokens = 3,500 \+ 32 \+ 576 = 4,108 tokens "
        r"do not fit the context cap of 4,096",
    ):
        check_runnable(load_scenario(path, [*cap, fanout.replace("256", "512") % 1.0, big_output]))
