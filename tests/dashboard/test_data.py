"""Pure data shaping: downsampling, CDF points, ITL samples, waterfalls, knobs, tables."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from dashboard.data import (
    ALL_CLASSES,
    REPLICA,
    by_replica,
    cdf_points,
    every_kth,
    flatten_times,
    fleet_totals,
    itl_samples,
    latency_cdfs,
    num_replicas,
    ordinal,
    replica_label,
    replica_points,
    session_waterfall,
    take_token_times,
)
from dashboard.knobs import build_overrides, knobs_for, question, scenario_from, yaml_value
from dashboard.tables import (
    FLEET_COLUMNS,
    comparison_frame,
    engine_frame,
    fleet_frame,
    latency_frame,
    router_line,
    slo_frame,
)
from sim.errors import KvsimConfigError
from sim.scenario import SCENARIO_DIR
from tests.dashboard.synth import FLEET_SECTION
from validate.compare import ComparisonRow


def test_every_kth_keeps_short_frames_and_says_nothing() -> None:
    frame = pd.DataFrame({"x": range(10)})
    sampled = every_kth(frame, max_points=10)
    assert sampled.stride == 1 and len(sampled.frame) == 10 and sampled.note() is None


def test_every_kth_strides_and_keeps_the_last_row() -> None:
    frame = pd.DataFrame({"x": range(1001)})
    sampled = every_kth(frame, max_points=100)
    assert sampled.stride == 11
    assert list(sampled.frame["x"][:3]) == [0, 11, 22]
    assert sampled.frame["x"].iloc[-1] == 1000
    assert sampled.note() == f"showing {len(sampled.frame)} of 1,001 steps (every 11th)"


@pytest.mark.parametrize(("k", "text"), [(1, "1st"), (2, "2nd"), (3, "3rd"), (11, "11th")])
def test_ordinal(k: int, text: str) -> None:
    assert ordinal(k) == text


def test_cdf_points_small_is_exact_and_drops_nan() -> None:
    points = cdf_points(np.array([3.0, 1.0, np.nan, 2.0]))
    assert list(points["value"]) == [1.0, 2.0, 3.0]
    assert list(points["fraction"]) == pytest.approx([1 / 3, 2 / 3, 1.0])


def test_cdf_points_large_keeps_min_max_and_shape() -> None:
    values = np.arange(100_000, dtype=float)
    points = cdf_points(values, max_points=500)
    assert len(points) == 500
    assert points["value"].iloc[0] == 0 and points["value"].iloc[-1] == 99_999
    assert points["fraction"].iloc[-1] == 1.0
    # evenly spaced ranks of a uniform sample: value / n tracks the fraction
    assert np.allclose(points["value"] / 100_000, points["fraction"], atol=1e-4)


def test_itl_samples_skip_request_boundaries_and_empty_requests() -> None:
    times = pd.Series([[1.0, 1.5, 2.5], [], [10.0], [20.0, 20.25]])
    flat, offsets = flatten_times(times)
    assert list(offsets) == [0, 3, 3, 4, 6]
    gaps, owners = itl_samples(flat, offsets, np.array([0, 1, 2, 3]))
    assert list(gaps) == [0.5, 1.0, 0.25]
    assert list(owners) == [0, 0, 3]


def test_latency_cdfs_per_class_and_overall() -> None:
    requests = pd.DataFrame(
        {
            "priority_class": ["a", "b", "a"],
            "ttft_s": [0.1, 0.2, 0.3],
            "e2e_s": [1.0, 2.0, math.nan],
            "finish_s": [1.0, 2.0, math.nan],
        }
    )
    times = flatten_times(pd.Series([[0.1, 0.2], [0.3, 0.5, 0.6], [0.4]]))
    cdfs = latency_cdfs(requests, times)
    counts = cdfs.groupby(["metric", "priority_class"]).size().to_dict()
    assert counts == {
        ("e2e", ALL_CLASSES): 2, ("e2e", "a"): 1, ("e2e", "b"): 1,
        ("itl", ALL_CLASSES): 3, ("itl", "a"): 1, ("itl", "b"): 2,
        ("ttft", ALL_CLASSES): 3, ("ttft", "a"): 2, ("ttft", "b"): 1,
    }  # fmt: skip
    itl_b = cdfs[(cdfs.metric == "itl") & (cdfs.priority_class == "b")]["value"]
    assert list(itl_b) == pytest.approx([0.1, 0.2])


def test_latency_cdfs_single_class_has_only_the_overall_curve() -> None:
    requests = pd.DataFrame(
        {"priority_class": ["x"], "ttft_s": [0.1], "e2e_s": [1.0], "finish_s": [1.0]}
    )
    cdfs = latency_cdfs(requests, None)
    assert set(cdfs["priority_class"]) == {ALL_CLASSES}
    assert set(cdfs["metric"]) == {"ttft", "e2e"}


def _session_rows() -> pd.DataFrame:
    # turn 0: arrive 10, scheduled 11, first token 12, finish 15; tool wait to 18;
    # turn 1: fan-out of two sub-calls arriving at 18.
    return pd.DataFrame(
        {
            "session_id": [3, 3, 3, 4],
            "turn": [0, 1, 1, 0],
            "subcall": [-1, 0, 1, -1],
            "arrival_s": [10.0, 18.0, 18.0, 0.0],
            "first_scheduled_s": [11.0, 18.5, 19.0, 0.0],
            "first_token_s": [12.0, 19.0, 20.0, 1.0],
            "finish_s": [15.0, 21.0, math.nan, 2.0],
        }
    )


def test_session_waterfall_phases() -> None:
    seg = session_waterfall(_session_rows(), 3)
    rows = [tuple(r) for r in seg[["label", "phase", "start_s", "duration_s"]].to_numpy()]
    assert rows == [
        ("turn 0", "queueing", 0.0, 1.0),
        ("turn 0", "prefill", 1.0, 1.0),
        ("turn 0", "decode", 2.0, 3.0),
        ("turn 0", "tool wait", 5.0, 3.0),
        ("turn 1.0", "queueing", 8.0, 0.5),
        ("turn 1.0", "prefill", 8.5, 0.5),
        ("turn 1.0", "decode", 9.0, 2.0),
        ("turn 1.1", "queueing", 8.0, 1.0),
        ("turn 1.1", "prefill", 9.0, 1.0),
    ]  # unfinished sub-call: no decode bar; last turn: no tool wait


def test_session_waterfall_of_a_cut_run_shows_the_unfinished_phase_to_the_cut() -> None:
    seg = session_waterfall(_session_rows(), 3, cut_at_s=24.0)
    rows = [tuple(r) for r in seg[["label", "phase", "start_s", "duration_s"]].to_numpy()]
    # turn 1.1 had its first token at 20 s and was decoding when the run stopped at 24 s.
    assert rows[-3:] == [
        ("turn 1.1 (unfinished)", "queueing", 8.0, 1.0),
        ("turn 1.1 (unfinished)", "prefill", 9.0, 1.0),
        ("turn 1.1 (unfinished)", "decode", 10.0, 4.0),
    ]
    queued = _session_rows().assign(first_scheduled_s=[11.0, 18.5, math.nan, 0.0],
                                    first_token_s=[12.0, 19.0, math.nan, 1.0])  # fmt: skip
    last = session_waterfall(queued, 3, cut_at_s=24.0).iloc[-1]
    assert (last["label"], last["phase"], last["duration_s"]) == (
        "turn 1.1 (unfinished)", "queueing", 6.0,
    )  # fmt: skip


def test_session_waterfall_labels_preempted_requests() -> None:
    rows = _session_rows().assign(num_preemptions=[0, 2, 0, 0])
    labels = list(dict.fromkeys(session_waterfall(rows, 3)["label"]))
    assert labels == ["turn 0", "turn 1.0 (preempted 2x)", "turn 1.1"]


def test_session_waterfall_unknown_session_is_empty() -> None:
    assert session_waterfall(_session_rows(), 99).empty


def test_knobs_of_a_shipped_scenario_and_overrides() -> None:
    import yaml

    text = (SCENARIO_DIR / "coding-agents-8b-h100.yaml").read_text()
    document = yaml.safe_load(text)
    knobs = {k.path: k for k in knobs_for(document)}
    assert knobs["workload.sessions"].default == 500
    assert knobs["workload.session_arrival.rate_per_s"].default == 0.2
    assert knobs["engine.scheduling_policy"].default == "fcfs"  # engine default, not in file
    values = {path: k.default for path, k in knobs.items()}
    assert build_overrides(list(knobs.values()), values) == []
    values |= {
        "workload.sessions": 10,
        "engine.enable_prefix_caching": False,
        "model": "Qwen2.5-7B",
    }
    overrides = build_overrides(list(knobs.values()), values)
    assert overrides == [
        'model="Qwen2.5-7B"',
        "engine.enable_prefix_caching=false",
        "workload.sessions=10",
    ]
    scenario = scenario_from(document, overrides, "x.yaml", SCENARIO_DIR)
    assert scenario.workload.sessions == 10 and not scenario.engine.enable_prefix_caching
    assert document["workload"]["sessions"] == 500  # the raw document is left alone
    assert question(text).startswith("How does one H100")


def test_policy_knobs_write_the_swap_space_only_with_swap() -> None:
    import yaml

    document = yaml.safe_load((SCENARIO_DIR / "agent-burst.yaml").read_text())
    knobs = {k.path: k for k in knobs_for(document)}
    assert knobs["engine.allocator"].options == (
        "paged", "static", "orca_max", "orca_pow2", "orca_oracle",
    )  # fmt: skip
    values = {path: k.default for path, k in knobs.items()}
    assert build_overrides(list(knobs.values()), values) == []  # the swap space stays unset
    values["engine.preemption_mode"] = "swap"
    overrides = build_overrides(list(knobs.values()), values)
    assert overrides == ['engine.preemption_mode="swap"', "engine.swap_space_gib=4.0"]
    scenario = scenario_from(document, overrides, "x.yaml", SCENARIO_DIR)
    assert scenario.engine.swap_space_gib == 4.0
    assert scenario.engine.what_if_policies()

    # A file that swaps: back to recompute clears its swap space, or validation refuses it.
    swapping = scenario.model_dump(mode="json")
    knobs = {k.path: k for k in knobs_for(swapping)}
    values = {path: k.default for path, k in knobs.items()}
    assert build_overrides(list(knobs.values()), values) == []
    values["engine.preemption_mode"] = "recompute"
    overrides = build_overrides(list(knobs.values()), values)
    assert overrides == ['engine.preemption_mode="recompute"', "engine.swap_space_gib=null"]
    back = scenario_from(swapping, overrides, "x.yaml", SCENARIO_DIR)
    assert back.engine.swap_space_gib is None and not back.engine.what_if_policies()


def test_offload_knob_writes_the_tier_and_zero_removes_it() -> None:
    import yaml

    document = yaml.safe_load((SCENARIO_DIR / "agent-burst.yaml").read_text())
    knobs = {k.path: k for k in knobs_for(document)}
    assert knobs["engine.kv_offload_gib"].default == 0.0  # no tier: shown as 0
    values = {path: k.default for path, k in knobs.items()}
    assert build_overrides(list(knobs.values()), values) == []
    values["engine.kv_offload_gib"] = 32.0
    overrides = build_overrides(list(knobs.values()), values)
    assert overrides == ["engine.kv_offload_gib=32.0"]
    scenario = scenario_from(document, overrides, "x.yaml", SCENARIO_DIR)
    assert scenario.engine.kv_offload_gib == 32.0 and scenario.engine.what_if_policies()

    offloading = scenario.model_dump(mode="json")
    knobs = {k.path: k for k in knobs_for(offloading)}
    values = {path: k.default for path, k in knobs.items()}
    assert values["engine.kv_offload_gib"] == 32.0
    values["engine.kv_offload_gib"] = 0.0
    overrides = build_overrides(list(knobs.values()), values)
    assert overrides == ["engine.kv_offload_gib=null"]
    back = scenario_from(offloading, overrides, "x.yaml", SCENARIO_DIR)
    assert back.engine.kv_offload_gib is None and not back.engine.what_if_policies()


def test_retention_knobs_write_only_what_changed() -> None:
    import yaml

    document = yaml.safe_load((SCENARIO_DIR / "coding-agents-8b-h100.yaml").read_text())
    knobs = {k.path: k for k in knobs_for(document)}
    assert knobs["engine.kv_retention.policy"].default == "none"
    assert knobs["engine.kv_retention.ttl_s"].default == 30.0
    values = {path: k.default for path, k in knobs.items()}
    values |= {"engine.kv_retention.policy": "tool_latency", "engine.kv_retention.quantile": 0.8}
    overrides = build_overrides(list(knobs.values()), values)
    assert overrides == [
        'engine.kv_retention.policy="tool_latency"',
        "engine.kv_retention.quantile=0.8",
    ]
    scenario = scenario_from(document, overrides, "x.yaml", SCENARIO_DIR)
    assert scenario.engine.kv_retention.quantile == 0.8
    assert scenario.engine.what_if_policies() == [
        "kv_retention: tool_latency (quantile=0.8 of the session's tool latency); not in vLLM 0.32"
    ]


def test_switching_the_retention_policy_resets_what_the_new_one_does_not_read() -> None:
    import yaml

    document = yaml.safe_load((SCENARIO_DIR / "coding-agents-8b-h100.yaml").read_text())
    document["engine"]["kv_retention"] = {"policy": "ttl", "ttl_s": 60.0}
    knobs = {k.path: k for k in knobs_for(document)}
    values = {path: k.default for path, k in knobs.items()}
    assert build_overrides(list(knobs.values()), values) == []
    values["engine.kv_retention.policy"] = "tool_latency"
    overrides = build_overrides(list(knobs.values()), values)
    assert overrides == [
        'engine.kv_retention.policy="tool_latency"',
        "engine.kv_retention.ttl_s=30.0",
    ]
    scenario = scenario_from(document, overrides, "x.yaml", SCENARIO_DIR)
    assert scenario.engine.kv_retention.policy == "tool_latency"
    with pytest.raises(KvsimConfigError, match=r"engine\.kv_retention\.ttl_s is set"):
        scenario_from(document, ['engine.kv_retention.policy="tool_latency"'], "x.yaml", None)


def test_knobs_of_open_loop_and_burst() -> None:
    open_loop = {"workload": {"kind": "open_loop", "arrival": {"kind": "poisson"}}}
    assert {"workload.num_requests", "workload.arrival.rate_per_s"} <= {
        k.path for k in knobs_for(open_loop)
    }
    burst = {"workload": {"kind": "agent_sessions", "session_arrival": {"kind": "burst"}}}
    paths = {k.path for k in knobs_for(burst)}
    assert "workload.sessions" in paths
    assert not any("rate_per_s" in p for p in paths)


def test_knobs_skip_values_of_the_wrong_type() -> None:
    document = {"engine": {"block_size": "big", "max_num_seqs": "many", "watermark": 0.1}}
    paths = {k.path for k in knobs_for(document)}
    assert "engine.max_num_seqs" not in paths and "engine.block_size" in paths
    block_size = next(k for k in knobs_for(document) if k.path == "engine.block_size")
    assert block_size.options[0] == "big"  # kept as an option, so the file's value shows


def test_scenario_from_reports_validation_errors() -> None:
    with pytest.raises(KvsimConfigError, match=r"engine\.max_num_seqs"):
        scenario_from(
            {"name": "x", "model": "Llama-3.1-8B", "hardware": "H100-SXM-80GB"},
            ["engine.max_num_seqs=0"],
            "x.yaml",
            None,
        )


@pytest.mark.parametrize(
    ("value", "text"), [(True, "true"), (0.5, "0.5"), (7, "7"), ("a: b", '"a: b"')]
)
def test_yaml_value(value, text: str) -> None:
    assert yaml_value(value) == text


SUMMARY = {
    "metrics": {
        "vllm:time_to_first_token_seconds": {"p50": 0.1, "p90": 0.2, "p99": 0.5, "mean": 0.15},
        "vllm:kv_cache_usage_perc": {"mean": 0.5, "p95": 0.9, "peak": 1.0},
        "prefix_cache_hit_rate": 0.25,
        "by_priority_class": {
            "a": {"count": 3, "ttft_s": {"p50": 0.1, "p99": 0.2}},
            "b": {"count": 4, "ttft_s": {"p50": 0.3, "p99": 0.4}},
        },
    },
    "slos": {"ttft_p99_s": {"target": 0.4, "value": 0.5, "pass": False}},
}


def test_tables_from_a_partial_summary() -> None:
    latency = latency_frame(SUMMARY)
    assert latency.loc[0, "p99 (ms)"] == 500.0
    assert math.isnan(latency.loc[1, "p99 (ms)"])  # ITL absent
    engine = dict(engine_frame(SUMMARY).to_numpy())
    assert engine["KV cache usage mean / p95 / peak"] == "50.0% / 90.0% / 100.0%"
    assert engine["prefix cache hit rate"] == "25.0%"
    assert engine["TTFT p50 / p99 of b (4 requests)"] == "300.0 / 400.0 ms"
    slos = slo_frame(SUMMARY)
    assert slos.to_dict("records") == [
        {"SLO": "ttft_p99_s", "target (ms)": 400.0, "p99 (ms)": 500.0, "verdict": "FAIL"}
    ]


def test_comparison_frame_in_percent() -> None:
    frame = comparison_frame(
        [
            ComparisonRow("TTFT p50", "s", 1.1, 1.0),
            ComparisonRow("preemptions", "", 3.0, 0.0),
            ComparisonRow("ITL p50", "s", None, 1.0),
        ]
    )
    errors = list(frame["relative error (%)"])
    assert errors[0] == pytest.approx(10.0)
    assert errors[1] == math.inf
    assert errors[2] is None or math.isnan(errors[2])
    assert list(frame["unit"]) == ["s", "-", "s"]


# --- Fleet runs ------------------------------------------------------------------------------


def test_fleet_totals_count_each_replica_at_its_latest_step() -> None:
    steps = pd.DataFrame(
        {
            "start_s": [0.0, 0.5, 1.0, 1.2, 2.0],
            "duration_s": [0.1, 0.2, 0.3, 0.4, 0.5],
            "num_preemptions": [0, 1, 0, 0, 2],
            "kv_cache_usage_perc": [0.2, 0.6, 0.4, 0.0, 0.8],
            "num_requests_running": [2, 5, 3, 0, 7],
            "num_requests_waiting": [0, 1, 0, 0, 4],
            REPLICA: [0, 1, 0, 1, 2],
        }
    )
    totals = fleet_totals(steps, replicas=3)
    assert list(totals.columns) == [
        "start_s",
        "duration_s",
        "num_preemptions",
        "kv_cache_usage_perc",
        "num_requests_running",
        "num_requests_waiting",
    ]
    assert list(totals["start_s"]) == [0.0, 0.5, 1.0, 1.2, 2.0]
    assert list(totals["num_preemptions"]) == [0, 1, 0, 0, 2]  # the step's own
    # replica 0: 0.2 then 0.4; replica 1: 0.6 then 0.0; replica 2: 0.8 (0 before its step)
    assert list(totals["kv_cache_usage_perc"]) == pytest.approx(
        [0.2 / 3, 0.8 / 3, 1.0 / 3, 0.4 / 3, 1.2 / 3]
    )
    assert list(totals["num_requests_running"]) == [2, 7, 8, 3, 10]
    assert list(totals["num_requests_waiting"]) == [0, 1, 1, 0, 4]
    assert totals["num_requests_running"].dtype == np.int64


def test_by_replica_num_replicas_and_points() -> None:
    frame = pd.DataFrame({"x": [1, 2, 3, 4], REPLICA: [2, 0, 2, 0]})
    parts = by_replica(frame, 4)
    assert [list(p["x"]) for p in parts] == [[2, 4], [], [1, 3], []]
    assert all(list(p.columns) == ["x"] for p in parts)
    assert num_replicas(frame, frame.iloc[:0], {"replicas": 4}) == 4
    assert num_replicas(frame, frame.iloc[:0], None) == 3  # one past the highest seen
    assert num_replicas(frame.iloc[:0], frame.iloc[:0], {}) == 0
    assert replica_points(1) == 5000 and replica_points(4) == 1250
    assert replica_points(64) == 500  # the floor
    assert replica_label(3) == "replica 3"


def test_take_token_times_of_some_rows() -> None:
    flat, offsets = flatten_times(pd.Series([[1.0, 2.0], [], [3.0, 4.0, 5.0], [6.0]]))
    sub_flat, sub_offsets = take_token_times(flat, offsets, np.array([0, 2, 3]))
    assert list(sub_flat) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    assert list(sub_offsets) == [0, 2, 5, 6]
    sub_flat, sub_offsets = take_token_times(flat, offsets, np.array([3, 1]))
    assert list(sub_flat) == [6.0] and list(sub_offsets) == [0, 1, 1]
    sub_flat, sub_offsets = take_token_times(flat, offsets, np.array([], dtype=np.int64))
    assert sub_flat.size == 0 and list(sub_offsets) == [0]


def test_session_waterfall_names_the_replica_in_a_fleet_run() -> None:
    rows = _session_rows().assign(**{REPLICA: [0, 1, 1, 0]})
    labels = list(dict.fromkeys(session_waterfall(rows, 3)["label"]))
    assert labels == ["turn 0 [replica 0]", "turn 1.0 [replica 1]", "turn 1.1 [replica 1]"]


def test_fleet_frame_and_router_line() -> None:
    frame = fleet_frame(FLEET_SECTION)
    assert list(frame.columns) == FLEET_COLUMNS
    first = frame.iloc[0].to_dict()
    assert first == {
        "replica": 0,
        "requests": 12,
        "finished": 11,
        "output tokens": 3000,
        "busy (%)": 50.0,
        "KV mean (%)": 25.0,
        "KV peak (%)": 75.0,
        "prefix hit rate (%)": 80.0,
        "preemptions": 2,
        "TTFT p50 (ms)": 50.0,
        "TTFT p99 (ms)": 500.0,
    }
    second = frame.iloc[1]
    assert second["requests"] == 8
    assert all(pd.isna(second[c]) for c in FLEET_COLUMNS if c not in ("replica", "requests"))
    assert fleet_frame({}).empty and list(fleet_frame({}).columns) == FLEET_COLUMNS
    assert router_line(FLEET_SECTION) == (
        "What-if: 2 replicas behind a simulated `session_affinity` router (load_factor=1.25, "
        "view_delay_s=0.0); each replica is the vLLM-exact engine."
    )
    assert router_line({}) == (
        "What-if: ? replicas behind a simulated `?` router; each replica is the vLLM-exact engine."
    )
