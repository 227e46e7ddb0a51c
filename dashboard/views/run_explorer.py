"""Run explorer: one run directory's summary, timelines, HBM block map, latency CDFs and the
per-turn waterfall of one agent session.

The title is drawn before pandas, pyarrow and plotly are imported. A run directory that
cannot be read, or whose files break a chart, is one ``st.error`` paragraph naming it.
"""

# ruff: noqa: E402 (imports after the title, on purpose)

from __future__ import annotations

import streamlit as st

st.title("Run explorer")

from pathlib import Path

with st.spinner("Loading..."):
    import numpy as np

    from dashboard import charts
    from dashboard.components import pick_run, show_summary
    from dashboard.data import PHASES, session_waterfall
    from dashboard.errors import guard, show_error
    from dashboard.loaders import RunView, load_block_map, load_view
    from dashboard.locations import runs_dir


def _timeline(view: RunView) -> None:
    st.subheader("KV cache and requests over time")
    fig = charts.timeline_figure(view.timeline.frame, view.preemptions.frame)
    st.plotly_chart(fig, key="ex-timeline")
    notes = [n for n in (view.timeline.note(), view.preemptions.note("preemption steps")) if n]
    total = int(view.summary.get("metrics", {}).get("vllm:num_preemptions", {}).get("total", 0))
    notes.append(
        f"{view.preemptions.total:,} steps with preemptions (x markers), {total:,} in all"
        if view.preemptions.total
        else "no preemptions in this run"
    )
    st.caption("; ".join(notes) + ".")


def _block_map(path: Path) -> None:
    st.subheader("HBM block map")
    try:
        block_map = load_block_map(path)
    except Exception as exc:
        show_error(exc, f"{path}: block map", str(path))
        return
    if block_map is None:
        st.info(
            "This run has no `block_map.npz` (measured runs never do, and simulated runs only "
            "when they record block snapshots), so there is no block map to show."
        )
        return
    times = block_map.times_s
    if times.size == 0:
        st.info("The block map has no snapshots (the run ended before the first one).")
        return
    index = st.select_slider(
        "Snapshot (simulated time)",
        options=range(len(times)),
        value=len(times) - 1,
        format_func=lambda i: f"{times[i]:,.1f} s",
        key="ex-snapshot",
        help="Highlights one snapshot on the map and shows every block of it below.",
    )
    fig, note = charts.block_map_figure(times, block_map.states, block_map.classes, index)
    st.plotly_chart(fig, key="ex-blockmap")
    if note:
        st.caption(note)
    row = block_map.states[index]
    counts = np.bincount(np.minimum(row, 1 + len(block_map.classes)), minlength=2)
    names = [label for label, _ in charts.state_legend(block_map.classes)]
    st.caption(
        f"t = {times[index]:,.2f} s: "
        + ", ".join(f"{names[k]} {int(c):,}" for k, c in enumerate(counts) if k < len(names))
        + f" of {row.size:,} blocks."
    )
    st.plotly_chart(
        charts.block_strip_figure(row, block_map.classes, float(times[index])), key="ex-strip"
    )


def _cdfs(view: RunView) -> None:
    st.subheader("Latency CDFs by priority class")
    if view.cdfs.empty:
        st.info("No latency samples in this run.")
        return
    cols = st.columns(3)
    for col, metric in zip(cols, ("ttft", "itl", "e2e"), strict=True):
        if (view.cdfs["metric"] == metric).any():
            col.plotly_chart(charts.cdf_figure(view.cdfs, metric), key=f"ex-cdf-{metric}")
        else:
            col.caption(f"No {metric.upper()} samples (no per-token times in this run).")


def _waterfall(view: RunView) -> None:
    st.subheader("Agent session waterfall")
    sessions = view.requests["session_id"]
    ids = np.unique(sessions[sessions >= 0].to_numpy())
    if ids.size == 0:
        st.info("No agent sessions in this run (open-loop or trace traffic without sessions).")
        return
    session = st.selectbox(
        f"Session ({ids.size:,} in this run)", ids.tolist(), index=0, key="ex-session"
    )
    segments = session_waterfall(view.requests, int(session))
    fig = charts.waterfall_figure(segments, title=f"session {session}")
    st.plotly_chart(fig, key="ex-waterfall")
    totals = segments.groupby("phase")["duration_s"].sum()
    st.caption(
        "Time per phase: "
        + ", ".join(f"{phase} {totals.get(phase, 0.0):,.2f} s" for phase in PHASES)
        + "."
    )


with guard("listing the runs"):
    path = pick_run(runs_dir(), key="ex")
if path is not None:
    with guard(f"run directory {path}", str(path)):
        view = load_view(path)
        with st.expander("Summary", expanded=True):
            show_summary(view.summary, key="ex")
        _timeline(view)
        _block_map(Path(view.path))
        _cdfs(view)
        _waterfall(view)
        with st.expander("Scenario as resolved"):
            st.code(view.scenario_yaml or "(no scenario.yaml)", language="yaml")
