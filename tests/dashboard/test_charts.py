"""Plotly figure builders: traces and axis titles (with units), no Streamlit involved."""

from __future__ import annotations

import numpy as np
import pandas as pd

from dashboard import charts
from dashboard.data import ALL_CLASSES, TIMELINE_COLUMNS
from dashboard.tables import fleet_frame
from tests.dashboard.synth import FLEET_SECTION


def _steps(n: int = 50) -> pd.DataFrame:
    frame = pd.DataFrame({c: np.zeros(n) for c in TIMELINE_COLUMNS})
    frame["start_s"] = np.arange(n) * 0.1
    frame["kv_cache_usage_perc"] = np.linspace(0, 1, n)
    frame["num_requests_running"] = np.arange(n)
    return frame


def _axis_titles(fig) -> set[str]:
    layout = fig.to_dict()["layout"]
    return {
        v["title"]["text"]
        for k, v in layout.items()
        if k.startswith(("xaxis", "yaxis")) and "title" in v
    }


def test_timeline_figure() -> None:
    steps = _steps()
    events = steps.iloc[[5, 9]].assign(num_preemptions=[1, 2])
    fig = charts.timeline_figure(steps, events)
    assert [t.name for t in fig.data] == ["KV cache usage", "preemption", "running", "waiting"]
    assert list(fig.data[0].y[:2]) == [0.0, 100 / 49]  # percent
    assert list(fig.data[1].customdata) == [1, 2]
    assert _axis_titles(fig) == {"KV cache usage (%)", "requests", "time (s)"}


def test_cdf_figure_in_ms_on_log_axis() -> None:
    cdfs = pd.DataFrame(
        {
            "metric": ["ttft", "ttft", "e2e"],
            "priority_class": [ALL_CLASSES, ALL_CLASSES, ALL_CLASSES],
            "value": [0.01, 0.02, 1.0],
            "fraction": [0.5, 1.0, 1.0],
        }
    )
    fig = charts.cdf_figure(cdfs, "ttft")
    assert len(fig.data) == 1 and list(fig.data[0].x) == [10.0, 20.0]
    assert fig.layout.xaxis.type == "log"
    assert _axis_titles(fig) == {"time to first token (ms)", "fraction of requests"}
    grouped = charts.cdf_figure(cdfs.assign(run=["r1", "r2", "r1"]), "ttft", group="run")
    assert [t.name for t in grouped.data] == ["r1", "r2"]


def test_overlay_timeline_figure() -> None:
    fig = charts.overlay_timeline_figure(
        {"a": _steps(), "b": _steps(10)}, "kv_cache_usage_perc", "KV cache usage (%)", scale=100
    )
    assert [t.name for t in fig.data] == ["a", "b"]
    assert fig.data[0].y[-1] == 100
    assert fig.data[0].line.shape == "linear"
    assert _axis_titles(fig) == {"KV cache usage (%)", "time (s)"}


def test_block_map_figure_downsamples_with_a_note() -> None:
    times = np.linspace(0, 10, 100)
    states = np.zeros((100, 2000), dtype=np.uint8)
    states[:, :500] = 2
    states[:, 500:600] = 1
    fig, note = charts.block_map_figure(times, states, ["a"], selected=50, max_times=50)
    z = np.asarray(fig.data[0].z)
    assert z.shape == (500, 50)  # blocks x snapshots: every 4th block, every 2nd snapshot
    assert note == "showing 50 of 100 snapshots (every 2nd) and 500 of 2,000 blocks (every 4th)"
    assert _axis_titles(fig) == {"time (s)", "block index"}
    assert list(fig.data[0].colorbar.ticktext) == [
        "free",
        "prefix-cached (free)",
        "running: a",
    ]
    assert fig.layout.shapes[0].x0 == times[50]
    _, none = charts.block_map_figure(times[:10], states[:10, :100], ["a"])
    assert none is None


def test_retained_blocks_get_their_own_legend_entry() -> None:
    states = np.array([[0, 1, 2, 3, 255, 255]], dtype=np.uint8)
    z, legend = charts.block_states(states, ["interactive", "background"])
    assert [label for label, _ in legend] == [
        "free",
        "prefix-cached (free)",
        "running: interactive",
        "running: background",
        "retained for a returning session (what-if)",
    ]
    assert z.tolist() == [[0, 1, 2, 3, 4, 4]]
    # Without retained blocks the legend has no such entry and codes map to themselves.
    z, legend = charts.block_states(states[:, :4], ["interactive", "background"])
    assert len(legend) == 4 and z.tolist() == [[0, 1, 2, 3]]
    fig = charts.block_strip_figure(states[0], ["interactive", "background"], 0.0, width=4)
    assert np.asarray(fig.data[0].z, dtype=float)[1, :2].tolist() == [4.0, 4.0]


def test_block_strip_figure_wraps_every_block() -> None:
    row = np.arange(300) % 3
    fig = charts.block_strip_figure(row.astype(np.uint8), ["a"], 1.5, width=128)
    z = np.asarray(fig.data[0].z, dtype=float)
    assert z.shape == (3, 128)
    assert np.isnan(z[2, 300 - 256 :]).all()  # padding beyond block 299
    assert z[1, 0] == row[128]
    assert "every block at t = 1.50 s" in fig.layout.title.text


def test_waterfall_figure() -> None:
    segments = pd.DataFrame(
        {
            "label": ["turn 0", "turn 0", "turn 1"],
            "turn": [0, 0, 1],
            "phase": ["queueing", "decode", "prefill"],
            "start_s": [0.0, 1.0, 3.0],
            "duration_s": [1.0, 2.0, 0.5],
        }
    )
    fig = charts.waterfall_figure(segments)
    assert [t.name for t in fig.data] == ["queueing", "prefill", "decode", "tool wait"]
    decode = fig.data[2]
    assert list(decode.base) == [1.0] and list(decode.x) == [2.0]
    assert list(fig.layout.yaxis.categoryarray) == ["turn 0", "turn 1"]
    assert _axis_titles(fig) == {"time since the session's first arrival (s)", "turn"}


def test_fleet_timeline_figure_one_colour_and_legend_entry_per_replica() -> None:
    a, b = _steps(4), _steps(3).assign(kv_cache_usage_perc=[0.5, 0.25, 0.0])
    events = b.iloc[[1]].assign(num_preemptions=[3])
    fig = charts.fleet_timeline_figure({"replica 0": a, "replica 1": b}, {"replica 1": events})
    names = [t.name for t in fig.data]
    assert names == [
        "replica 0",
        "replica 0: running",
        "replica 0: waiting",
        "replica 1",
        "replica 1: preemption",
        "replica 1: running",
        "replica 1: waiting",
    ]
    assert [t.showlegend for t in fig.data] == [None, False, False, None, False, False, False]
    assert [t.legendgroup for t in fig.data] == ["replica 0"] * 3 + ["replica 1"] * 4
    colors = [t.line.color if t.mode == "lines" else t.marker.color for t in fig.data]
    assert colors == [charts.PALETTE[0]] * 3 + [charts.PALETTE[1]] * 4
    assert list(fig.data[3].y) == [50.0, 25.0, 0.0]  # percent
    assert {t.line.shape for t in fig.data if t.mode == "lines"} == {"hv"}  # held per step
    assert list(fig.data[4].customdata) == [3]
    assert [t.line.dash for t in fig.data if t.name.endswith(("running", "waiting"))] == [
        "solid",
        "dot",
    ] * 2
    assert _axis_titles(fig) == {"KV cache usage (%)", "requests", "time (s)"}


def test_replica_bars_figure() -> None:
    fig = charts.replica_bars_figure(fleet_frame(FLEET_SECTION))
    assert [t.name for t in fig.data] == ["requests", "busy (%)", "prefix hit rate (%)"]
    assert [list(t.x) for t in fig.data] == [["r0", "r1"]] * 3
    assert list(fig.data[0].y) == [12, 8]
    assert fig.data[1].y[0] == 50.0 and fig.data[2].y[0] == 80.0
    assert _axis_titles(fig) >= {"requests", "busy time (%)", "prefix-cache hit rate (%)"}
