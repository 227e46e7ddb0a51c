"""The run summary's metrics against hand-built request and step tables: which requests each
latency covers (as vLLM's Prometheus histograms observe them), and sessions alive at a cut."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from sim.metrics import E2E, ITL, QUEUE, TPOT, TTFT, peak_concurrent_sessions, summarize
from sim.report import context_cap_line, truncation_line
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario

NAN = math.nan


def _requests() -> pd.DataFrame:
    """Three requests of two sessions: finished (3 tokens), finished (1 token), unfinished
    (first token only, admitted after a long wait)."""
    token_times = [np.array([1.0, 1.5, 2.5]), np.array([2.0]), np.array([9.0])]
    return pd.DataFrame(
        {
            "session_id": [0, 0, 1],
            "turn": [0, 1, 0],
            "priority_class": ["default"] * 3,
            "arrival_s": [0.0, 1.8, 3.0],
            "finish_s": [2.5, 2.0, NAN],
            "ttft_s": [1.0, 0.2, 6.0],
            "e2e_s": [2.5, 0.2, NAN],
            "queue_s": [0.5, 0.1, 5.0],
            "mean_itl_s": [0.75, NAN, NAN],
            "token_times_s": token_times,
            "output_tokens": [3, 1, 1],
            "num_preemptions": [0, 0, 0],
        }
    )


def _steps() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "duration_s": [1.0, 3.0],
            "kv_cache_usage_perc": [0.2, 0.6],
            "kv_unused_slots": [0, 0],
            "num_requests_running": [1, 2],
            "num_requests_waiting": [0, 1],
            "prefix_cache_queries": [10, 0],
            "prefix_cache_hits": [4, 0],
        }
    )


def test_each_latency_covers_what_vllms_histogram_observes() -> None:
    metrics = summarize(
        _requests(), _steps(), duration_s=10.0, num_usable_blocks=100, block_size=16, slos={}
    )["metrics"]
    assert metrics[TTFT]["count"] == 3  # every first token, finished or not
    assert metrics[ITL]["count"] == 2  # every gap
    # Once a request finishes: its E2E, queue time and mean ITL (0 for one output token).
    assert metrics[E2E]["count"] == metrics[QUEUE]["count"] == metrics[TPOT]["count"] == 2
    assert metrics[QUEUE]["mean"] == pytest.approx(0.3)
    assert metrics[TPOT]["mean"] == pytest.approx(0.375)
    assert metrics["output_throughput_tok_s"] == pytest.approx(0.5)  # every generated token
    assert metrics["request_throughput_req_s"] == pytest.approx(0.2)
    assert metrics["vllm:kv_cache_usage_perc"]["mean"] == pytest.approx(0.5)  # time-weighted


def test_sessions_open_at_the_cut_are_alive_until_it() -> None:
    requests = _requests()
    # Session 0 ended at 2.5 s, before session 1 arrived at 3.0 s: never two at once, unless
    # session 0 was only in a tool wait at its last finish.
    assert peak_concurrent_sessions(requests, 10.0) == 1
    assert peak_concurrent_sessions(requests, 10.0, open_sessions={0}) == 2


def test_sessions_cut_by_the_context_cap_are_counted_and_said() -> None:
    scenario = load_scenario(
        SCENARIO_DIR / "agent-burst.yaml",
        ["workload.sessions=12", "workload.turns.value=6", "workload.max_context_tokens=5000"],
    )
    result = simulate(scenario)
    sessions = result.summary["sessions"]
    assert sessions["planned"] == sessions["started"] == sessions["ended"] == 12
    assert sessions["context_cap_tokens"] == 5000
    assert sessions["cut_by_context"] > 0
    assert len(result.requests) == 12 * 6 - sessions["turns_not_sent"]
    assert context_cap_line(result.summary) == (
        f"the run: {sessions['cut_by_context']} of its 12 agent sessions ended before their "
        "last turn, the next one past the context cap of 5,000 tokens (engine.max_model_len "
        f"or workload.max_context_tokens), {sessions['turns_not_sent']} turns not sent: its "
        "figures leave out those longest contexts"
    )
    assert truncation_line(result.summary) is None


def test_a_cut_run_counts_sessions_in_a_tool_wait_as_alive() -> None:
    """30 sessions, a second apart, wait 30 s for each tool: all are alive at the 40 s cut,
    most of them between turns (their last request finished)."""
    scenario = load_scenario(
        SCENARIO_DIR / "agent-burst.yaml",
        [
            "workload.sessions=30",
            "workload.session_arrival={kind: poisson, rate_per_s: 1.0}",
            "workload.turns.value=3",
            "workload.tool_latency={kind: fixed, value_s: 30}",
            "limits.max_duration_s=40",
        ],
    )
    result = simulate(scenario)
    summary = result.summary
    assert summary["truncated_at_limit"]
    assert summary["sessions"] == {
        "planned": 30,
        "started": 30,
        "ended": 0,
        "cut_by_context": 0,
        "turns_not_sent": 0,
        "context_cap_tokens": 32768,
    }
    assert summary["metrics"]["peak_concurrent_sessions"] == 30
    # Ended at their last finish, as before: far fewer at once.
    assert peak_concurrent_sessions(result.requests, 40.0) < 30
