"""The run explorer page under streamlit.testing.v1.AppTest: a run, a fleet run, a swap run,
and runs without a block map."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sim.report import truncation_line
from tests.dashboard.apptest import charts, open_page, start_app, texts, trace_names
from tests.dashboard.conftest import one_priority_mix_run


def test_run_explorer(runs_env: Path) -> None:
    at = open_page(start_app(), "run_explorer")
    assert texts(at.title) == ["Run explorer"]
    select = at.selectbox(key="ex-select")
    assert set(select.options) >= {"coding-small", "priority-small"}
    select.set_value(runs_env / "priority-small").run()
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    heads = texts(at.subheader)
    for head in (
        "KV cache and requests over time",
        "HBM block map",
        "Latency CDFs by priority class",
        "Agent session waterfall",
    ):
        assert head in heads
    snapshot = at.select_slider(key="ex-snapshot")
    assert snapshot.value == len(snapshot.options) - 1 > 10  # the last snapshot first
    assert len(charts(at)) == 7  # timeline, map, strip, 3 CDFs, waterfall
    # one engine: no replica picker and no fleet view
    assert "ex-replica" not in {w.key for w in at.selectbox}
    assert not [h for h in heads if h.startswith("Fleet")]
    assert not [c for c in texts(at.caption) if "replica" in c]
    captions = " ".join(texts(at.caption))
    assert "steps with preemptions" in captions
    at.select_slider(key="ex-snapshot").set_value(3).run()
    assert not at.exception, at.exception
    assert "t = " in " ".join(texts(at.caption))
    at.selectbox(key="ex-session").set_value(5).run()
    assert not at.exception, at.exception
    assert "Time per phase" in " ".join(texts(at.caption))


def test_run_explorer_fleet_run(fleet_run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(fleet_run))
    run = fleet_run / "fleet-small"
    fleet = json.loads((run / "summary.json").read_text())["fleet"]
    at = open_page(start_app(), "run_explorer")
    assert at.selectbox(key="ex-select").value == run
    assert not at.error, texts(at.error)
    assert texts(at.subheader) == [
        "Fleet (what-if): 2 replicas, round_robin router",
        "KV cache and requests over time",
        "HBM block map",
        "Latency CDFs by priority class",
        "Agent session waterfall",
    ]
    captions = texts(at.caption)
    assert captions[0] == (
        "What-if: 2 replicas behind a simulated `round_robin` router (view_delay_s=0.0); each "
        "replica is the vLLM-exact engine."
    )
    assert "A fleet run's block map shows replica 0 only, whichever replica is picked." in captions
    imbalance = {m.label: m.value for m in at.metric if m.label.startswith("imbalance")}
    assert imbalance == {
        f"imbalance: {name}": f"{fleet['load_imbalance'][key]:.2f}"
        for name, key in (
            ("requests", "requests"),
            ("output tokens", "output_tokens"),
            ("busy time", "busy_time"),
        )
    }
    table = next(d.value for d in at.dataframe if "busy (%)" in d.value.columns)
    assert list(table["requests"]) == [r["num_requests"] for r in fleet["per_replica"]]
    assert list(table["preemptions"]) == [r["preemptions"] for r in fleet["per_replica"]]
    # fleet bars, per-replica KV lines, per-replica timeline, block map and strip, 3 CDFs,
    # waterfall
    assert len(charts(at)) == 9
    assert trace_names(at, "ex-fleet-kv") == ["replica 0", "replica 1"]
    # all replicas: one line per replica (KV above; running and waiting below), no zig-zag
    names = trace_names(at, "ex-timeline")
    for r in (0, 1):
        assert [n for n in names if n.startswith(f"replica {r}") and ": p" not in n] == [
            f"replica {r}",
            f"replica {r}: running",
            f"replica {r}: waiting",
        ]
    picker = at.selectbox(key="ex-replica")
    assert picker.options == ["all replicas", "replica 0", "replica 1"]
    assert picker.value == -1
    assert at.selectbox(key="ex-session").label == "Session (32 in this run)"
    assert any(c.startswith("One colour per replica") for c in captions)

    picker.set_value(1).run()
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    captions = texts(at.caption)
    own = fleet["per_replica"][1]
    assert any(
        c.startswith("replica 1 only: ") and f", {own['preemptions']:,} in all" in c
        for c in captions
    ), captions
    assert "Requests of replica 1 only." in captions
    assert trace_names(at, "ex-timeline") == ["KV cache usage", "preemption", "running", "waiting"]
    sessions = at.selectbox(key="ex-session-r1")
    requests = pd.read_parquet(run / "requests.parquet")
    on_replica = sorted(set(requests.loc[requests["replica"] == 1, "session_id"]))
    assert sessions.options == [str(s) for s in on_replica]
    assert sessions.label == f"Session ({len(on_replica)} with a request on replica 1)"
    assert len(charts(at)) == 9
    sessions.set_value(on_replica[-1]).run()
    assert not at.exception, at.exception
    assert "Time per phase" in " ".join(texts(at.caption))


def test_run_explorer_swap_run_shows_the_cpu_swap_pool(
    swap_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(swap_run))
    at = open_page(start_app(), "run_explorer")
    assert not at.error, texts(at.error)
    heads = texts(at.subheader)
    cpu_head = "CPU swap pool (what-if: swap preemption)"
    assert heads.index(cpu_head) == heads.index("HBM block map") + 1
    assert len(charts(at)) == 8  # the single-engine run's 7 and the CPU map
    cpu = np.load(swap_run / "swap-small" / "block_map.npz")["cpu_states"]
    snapshot = at.select_slider(key="ex-snapshot")
    index = int(np.argmax(np.count_nonzero(cpu, axis=1)))  # the fullest CPU pool
    snapshot.set_value(index).run()
    assert not at.exception, at.exception
    held = int(np.count_nonzero(cpu[index]))
    assert held > 0
    expected = f"{held:,} of {cpu.shape[1]:,} CPU blocks hold swapped-out KV"
    assert any(c.startswith("t = ") and expected in c for c in texts(at.caption))
    (chart,) = [c for c in charts(at) if c.proto.id.endswith("-ex-cpumap")]
    ticks = json.loads(chart.proto.spec)["data"][0]["colorbar"]["ticktext"]
    assert [t for t in ticks if t.startswith("swapped out: ")]


def test_run_explorer_offload_run_shows_the_cpu_store(
    offload_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(offload_run))
    at = open_page(start_app(), "run_explorer")
    assert not at.error, texts(at.error)
    heads = texts(at.subheader)
    cpu_head = "CPU offload store (what-if: vLLM's offloading connector)"
    assert heads.index(cpu_head) == heads.index("HBM block map") + 1
    cpu = np.load(offload_run / "offload-small" / "block_map.npz")["cpu_states"]
    index = len(cpu) - 1  # the slider starts at the last snapshot
    held = int(np.count_nonzero(cpu[index]))
    assert held > 0
    expected = f"{held:,} of {cpu.shape[1]:,} CPU blocks hold stored prefix blocks"
    assert any(c.startswith("t = ") and expected in c for c in texts(at.caption))
    (chart,) = [c for c in charts(at) if c.proto.id.endswith("-ex-cpumap")]
    ticks = json.loads(chart.proto.spec)["data"][0]["colorbar"]["ticktext"]
    assert ticks[1] == "stored (prefix copy)"
    assert [t for t in ticks if t.startswith("being loaded: ")]


def test_run_explorer_says_what_a_run_cut_at_its_time_limit_leaves_out(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = one_priority_mix_run(tmp_path_factory, "cut-small", ["limits.max_duration_s=20"])
    summary = json.loads((base / "cut-small" / "summary.json").read_text())
    assert summary["truncated_at_limit"] and summary["num_unfinished"] > 0
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(base))
    at = open_page(start_app(), "run_explorer")
    assert not at.exception, at.exception
    assert f"{truncation_line(summary, 'The run')}." in texts(at.warning)


def test_run_explorer_without_block_map_and_bad_dir(runs_env: Path, tmp_path: Path) -> None:
    at = open_page(start_app(), "run_explorer")
    at.selectbox(key="ex-select").set_value(runs_env / "coding-small").run()
    assert any("no `block_map.npz`" in i for i in texts(at.info))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{}")
    at.text_input(key="ex-path").set_value(str(tmp_path / "broken")).run()
    assert not at.exception, at.exception
    errors = texts(at.error)
    assert errors and "missing requests.parquet, steps.parquet" in errors[0]


def test_run_explorer_empty_runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = open_page(start_app(), "run_explorer")
    assert any("No run directories" in i for i in texts(at.info))


def test_run_explorer_shows_the_uncertainty_band(runs_env: Path, tmp_path: Path) -> None:
    from sim.uncertainty import SAMPLES, band_records, band_rows

    run = tmp_path / "sampled"
    shutil.copytree(runs_env / "coding-small", run)
    summary = json.loads((run / "summary.json").read_text())
    three = [summary, summary, summary]
    record = band_records(band_rows(summary, three), [0.9, 1.0, 1.1], three)
    (run / SAMPLES).write_text(json.dumps(record))
    at = open_page(start_app(), "run_explorer")
    at.text_input(key="ex-path").set_value(str(run)).run()
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    (expander,) = [e for e in at.expander if e.label.startswith("Uncertainty band")]
    assert expander.label == "Uncertainty band (3 step-speed samples)"
    (band,) = expander.dataframe
    assert list(band.value["metric"])[:2] == ["TTFT p50", "TTFT p90"]
    assert list(band.value.columns) == ["metric", "this run", "median", "p10", "p90"]
    (run / SAMPLES).write_text("{not json")
    at.text_input(key="ex-path").set_value(str(run) + "/").run()
    assert any("cannot read the uncertainty band" in w for w in texts(at.warning))
    assert not at.error and "HBM block map" in texts(at.subheader)  # the rest still shows


def test_another_run_opens_at_its_last_snapshot(
    small_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("a", "b"):
        shutil.copytree(small_runs / "priority-small", tmp_path / name)
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = open_page(start_app(), "run_explorer")
    at.selectbox(key="ex-select").set_value(tmp_path / "a").run()
    at.select_slider(key="ex-snapshot").set_value(3).run()
    assert at.select_slider(key="ex-snapshot").value == 3
    at.selectbox(key="ex-select").set_value(tmp_path / "b").run()
    assert not at.exception, at.exception
    snapshot = at.select_slider(key="ex-snapshot")
    assert snapshot.value == len(snapshot.options) - 1  # not the other run's position
