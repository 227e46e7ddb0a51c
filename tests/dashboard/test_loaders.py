"""Run-directory loaders: the runs dir, listing, RunView, bad files, block maps, sweeps."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dashboard.data import (
    ALL_CLASSES,
    MAX_TIMELINE_POINTS,
    REPLICA,
    TIMELINE_COLUMNS,
    fleet_totals,
    replica_points,
)
from dashboard.loaders import build_view, list_runs, mtime_key, read_block_map
from dashboard.locations import list_sweeps, runs_dir
from tests.dashboard.synth import synthesize_fleet_run, synthesize_run


def test_runs_dir_from_argv_env_or_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVSIM_RUNS_DIR", raising=False)
    assert runs_dir([]) == Path("runs")
    monkeypatch.setenv("KVSIM_RUNS_DIR", "/data/env-runs")
    assert runs_dir(["-q"]) == Path("/data/env-runs")
    assert runs_dir(["--runs-dir", "/data/a"]) == Path("/data/a")
    assert runs_dir(["--runs-dir=/data/b"]) == Path("/data/b")


def test_list_runs_newest_first(tmp_path: Path) -> None:
    assert list_runs(tmp_path / "absent") == []
    for i, name in enumerate(["old", "new"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text("{}")
        os.utime(tmp_path / name / "summary.json", (1000 + i, 1000 + i))
    (tmp_path / "not-a-run").mkdir()
    (tmp_path / "file.txt").write_text("")
    assert [p.name for p in list_runs(tmp_path)] == ["new", "old"]


def test_build_view_of_a_simulated_run(small_runs: Path) -> None:
    view = build_view(small_runs / "priority-small")
    assert view.label == "sim:priority-small"
    assert "token_times_s" not in view.requests
    assert view.timeline.total == view.summary["metrics"]["num_steps"]
    assert len(view.timeline.frame) <= MAX_TIMELINE_POINTS + 1
    steps = pd.read_parquet(small_runs / "priority-small" / "steps.parquet")
    preempting_steps = int((steps["num_preemptions"] > 0).sum())
    assert view.preemptions.total == preempting_steps >= 1  # one row per preempting step
    assert set(view.cdfs["metric"]) == {"ttft", "itl", "e2e"}
    assert set(view.cdfs["priority_class"]) == {ALL_CLASSES, "interactive", "background"}
    itl_all = view.cdfs[(view.cdfs.metric == "itl") & (view.cdfs.priority_class == ALL_CLASSES)]
    itl_p99 = view.summary["metrics"]["vllm:inter_token_latency_seconds"]["p99"]
    # the CDF and the summary describe the same samples
    assert np.interp(0.99, itl_all["fraction"], itl_all["value"]) == pytest.approx(
        itl_p99, rel=0.02
    )


def test_build_view_errors_name_the_reason(small_runs: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not a run directory"):
        build_view(tmp_path / "absent")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "summary.json").write_text("{}")
    with pytest.raises(ValueError, match=r"missing requests\.parquet, steps\.parquet"):
        build_view(partial)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(small_runs / "coding-small", corrupt)
    (corrupt / "steps.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match="cannot read run files"):
        build_view(corrupt)
    bad_json = tmp_path / "bad-json"
    shutil.copytree(small_runs / "coding-small", bad_json)
    (bad_json / "summary.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read run files"):
        build_view(bad_json)


def test_mtime_key_changes_when_a_file_is_rewritten(small_runs: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(small_runs / "coding-small", run)
    before = mtime_key(run)
    os.utime(run / "steps.parquet", ns=(before + 10**9, before + 10**9))
    assert mtime_key(run) == before + 10**9


def test_read_block_map(small_runs: Path, tmp_path: Path) -> None:
    assert read_block_map(small_runs / "coding-small") is None
    block_map = read_block_map(small_runs / "priority-small")
    assert block_map is not None
    assert block_map.states.shape == (block_map.times_s.size, 2100)
    assert set(block_map.classes) <= {"interactive", "background"}
    assert block_map.states.max() < 2 + len(block_map.classes)
    np.savez(tmp_path / "block_map.npz", times_s=np.zeros(3), states=np.zeros((2, 5)), classes=[])
    with pytest.raises(ValueError, match=r"states must be \[T, num_blocks\]"):
        read_block_map(tmp_path)
    (tmp_path / "block_map.npz").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read block map"):
        read_block_map(tmp_path)


def test_list_sweeps(tmp_path: Path) -> None:
    assert list_sweeps(tmp_path) == []
    (tmp_path / "sweeps" / "a").mkdir(parents=True)
    (tmp_path / "sweeps" / "a" / "sweep.json").write_text(json.dumps({"results": []}))
    (tmp_path / "sweeps" / "b").mkdir()
    assert list_sweeps(tmp_path) == [tmp_path / "sweeps" / "a" / "sweep.json"]


def test_synthetic_run_view_is_downsampled_and_complete(tmp_path: Path) -> None:
    run = synthesize_run(tmp_path / "synthetic", num_requests=5_000, steps_per_request=4)
    started = time.perf_counter()
    view = build_view(run)
    print(f"5k-request synthetic run: RunView in {time.perf_counter() - started:.2f} s")
    assert view.timeline.total == 20_000 and view.timeline.stride == 4
    assert view.timeline.note() == "showing 5,001 of 20,000 steps (every 4th)"
    assert len(view.requests) == 5_000
    # the ITL CDF covers every gap: output_tokens - 1 per request
    itl = view.cdfs[(view.cdfs.metric == "itl") & (view.cdfs.priority_class == ALL_CLASSES)]
    num_gaps = int((view.requests["output_tokens"] - 1).sum())
    assert itl["fraction"].iloc[0] == pytest.approx(1 / num_gaps)


# --- Fleet runs ------------------------------------------------------------------------------


def test_build_view_of_a_synthetic_fleet_run(tmp_path: Path) -> None:
    run = synthesize_fleet_run(tmp_path / "fleet", replicas=3, num_requests=600)
    view = build_view(run, max_points=1500)
    requests = pd.read_parquet(run / "requests.parquet")
    steps = pd.read_parquet(run / "steps.parquet")
    assert view.replicas == 3 and view.fleet["replicas"] == 3
    assert list(view.requests[REPLICA]) == list(requests[REPLICA])
    # 2,400 steps, 800 per replica: each replica's own timeline within its share of points
    assert replica_points(3, 1500) == 500
    for r, (timeline, events) in enumerate(
        zip(view.replica_timelines, view.replica_preemptions, strict=True)
    ):
        own = steps[steps[REPLICA] == r]
        assert (timeline.total, timeline.stride) == (800, 2)
        assert timeline.note() == "showing 401 of 800 steps (every 2nd)"  # and the last
        assert REPLICA not in timeline.frame.columns
        kept = [*range(0, 800, 2), 799]
        assert list(timeline.frame["start_s"]) == list(own["start_s"].iloc[kept])
        assert events.total == int((own["num_preemptions"] > 0).sum())
    # "all replicas" is the fleet as one engine: no zig-zag between the replicas' lines
    totals = fleet_totals(steps[[*TIMELINE_COLUMNS, REPLICA]], 3)
    assert view.timeline.total == 2400 and view.timeline.stride == 2
    assert list(view.timeline.frame["num_requests_running"]) == list(
        totals["num_requests_running"].iloc[[*range(0, 2400, 2), 2399]]
    )
    # each replica's CDFs are those of its own requests
    for r, cdfs in enumerate(view.replica_cdfs):
        own = requests[requests[REPLICA] == r]
        ttft = cdfs[(cdfs.metric == "ttft") & (cdfs.priority_class == ALL_CLASSES)]
        assert list(ttft["value"]) == sorted(own["ttft_s"])
        itl = cdfs[(cdfs.metric == "itl") & (cdfs.priority_class == ALL_CLASSES)]
        assert itl["fraction"].iloc[0] == pytest.approx(1 / int((own["output_tokens"] - 1).sum()))
        assert set(cdfs["priority_class"]) == {ALL_CLASSES, "interactive", "background"}


def test_build_view_of_a_single_engine_run_has_no_replicas(tmp_path: Path) -> None:
    run = synthesize_run(tmp_path / "one", num_requests=200, steps_per_request=2)
    view = build_view(run)
    assert view.replicas == 0 and view.fleet == {}
    assert view.replica_timelines == view.replica_preemptions == view.replica_cdfs == ()
    assert REPLICA not in view.requests.columns and REPLICA not in view.timeline.frame.columns
    steps = pd.read_parquet(run / "steps.parquet")
    assert list(view.timeline.frame["kv_cache_usage_perc"]) == list(steps["kv_cache_usage_perc"])


def test_build_view_of_a_simulated_fleet_run(fleet_run: Path) -> None:
    view = build_view(fleet_run / "fleet-small")
    per_replica = view.fleet["per_replica"]
    assert view.replicas == 2 and len(per_replica) == 2
    assert [t.total for t in view.replica_timelines] == [r["num_steps"] for r in per_replica]
    assert [int((view.requests[REPLICA] == r).sum()) for r in range(2)] == [
        r["num_requests"] for r in per_replica
    ]
    for r, cdfs in enumerate(view.replica_cdfs):
        ttft = cdfs[(cdfs.metric == "ttft") & (cdfs.priority_class == ALL_CLASSES)]
        own = view.requests[view.requests[REPLICA] == r]
        assert list(ttft["value"]) == sorted(own["ttft_s"])
        assert np.percentile(ttft["value"], 50) == pytest.approx(per_replica[r]["ttft_s"]["p50"])


@pytest.mark.parametrize("where", ["requests", "steps", "text"])
def test_build_view_of_a_broken_fleet_run(tmp_path: Path, where: str) -> None:
    run = synthesize_fleet_run(tmp_path / "fleet", replicas=2, num_requests=100)
    name = "steps" if where == "steps" else "requests"
    frame = pd.read_parquet(run / f"{name}.parquet")
    if where == "text":
        frame[REPLICA] = frame[REPLICA].astype(str)
        message = "the replica column must hold integers"
    else:
        frame = frame.drop(columns=REPLICA)
        other = "requests" if where == "steps" else "steps"
        message = f"only {other}.parquet has a replica column"
    frame.to_parquet(run / f"{name}.parquet")
    with pytest.raises(ValueError, match=f"cannot read run files: {message}"):
        build_view(run)
