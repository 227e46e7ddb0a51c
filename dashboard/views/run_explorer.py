"""Run explorer: one run directory's summary, timelines, HBM block map, latency CDFs and the
per-turn waterfall of one agent session. A fleet run (``fleet`` in the scenario) also gets
the fleet view (per-replica figures, KV usage over time, load imbalance) and a replica picker
that narrows the timeline, CDFs and session list to one replica.

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
    from dashboard.data import (
        ALL_REPLICAS,
        PHASES,
        REPLICA,
        ordinal,
        replica_label,
        session_waterfall,
    )
    from dashboard.errors import guard, show_error
    from dashboard.loaders import BlockMap, RunView, load_block_map, load_view, read_band
    from dashboard.locations import runs_dir
    from dashboard.tables import IMBALANCES, fleet_frame, router_line

PCT_FORMAT = st.column_config.NumberColumn(format="%.1f")


def _fleet(view: RunView) -> None:
    fleet = view.fleet
    kind = (fleet.get("router") or {}).get("kind", "?")
    st.subheader(f"Fleet (what-if): {view.replicas} replicas, {kind} router")
    if not fleet:
        st.info("This run's summary.json has no `fleet` section: only the timelines below.")
    else:
        st.caption(router_line(fleet))
        imbalance = fleet.get("load_imbalance") or {}
        cols = st.columns(len(IMBALANCES))
        for col, (name, key) in zip(cols, IMBALANCES, strict=True):
            value = imbalance.get(key)
            col.metric(
                f"imbalance: {name}",
                "-" if value is None else f"{value:.2f}",
                help=f"max / mean over the replicas of their {name} (1.00 = even)",
            )
        table = fleet_frame(fleet)
        st.dataframe(
            table,
            hide_index=True,
            key="ex-fleet-table",
            column_config={c: PCT_FORMAT for c in table.columns if c.endswith(")")},
        )
        if not table.empty:
            st.plotly_chart(charts.replica_bars_figure(table), key="ex-fleet-bars")
    timelines = {replica_label(r): t.frame for r, t in enumerate(view.replica_timelines)}
    fig = charts.overlay_timeline_figure(
        timelines, "kv_cache_usage_perc", "KV cache usage (%)", scale=100, shape="hv"
    )
    st.plotly_chart(fig, key="ex-fleet-kv")
    st.caption("KV cache usage of each replica over time" + _points_note(view) + ".")


def _points_note(view: RunView) -> str:
    strides = sorted({t.stride for t in view.replica_timelines})
    if not strides or strides[-1] <= 1:
        return ""
    every = (
        ordinal(strides[-1])
        if len(strides) == 1
        else f"{ordinal(strides[0])} to {ordinal(strides[-1])}"
    )
    return f" (each replica's steps downsampled: every {every})"


def _pick_replica(view: RunView) -> int | None:
    """The replica the sections below show (None: all of them)."""
    choice = st.selectbox(
        "Replica",
        [-1, *range(view.replicas)],
        format_func=lambda r: ALL_REPLICAS if r < 0 else replica_label(r),
        key="ex-replica",
        help="Narrows the timeline, the latency CDFs and the session list below to one "
        "replica. The summary above is fleet-wide.",
    )
    return None if choice < 0 else int(choice)


def _fleet_timeline(view: RunView, replica: int | None) -> None:
    st.subheader("KV cache and requests over time")
    per_replica = view.fleet.get("per_replica") or [None] * view.replicas
    if replica is None:
        labels = [replica_label(r) for r in range(view.replicas)]
        fig = charts.fleet_timeline_figure(
            {k: t.frame for k, t in zip(labels, view.replica_timelines, strict=True)},
            {k: t.frame for k, t in zip(labels, view.replica_preemptions, strict=True)},
        )
        st.plotly_chart(fig, key="ex-timeline")
        events = sum(t.total for t in view.replica_preemptions)
        total = int(view.summary.get("metrics", {}).get("vllm:num_preemptions", {}).get("total", 0))
        st.caption(
            "One colour per replica: KV usage above, running (solid) and waiting (dotted) "
            "requests below"
            + _points_note(view)
            + "; "
            + (
                f"{events:,} steps with preemptions (x markers), {total:,} in all."
                if events
                else "no preemptions in this run."
            )
        )
        return
    timeline, preemptions = view.replica_timelines[replica], view.replica_preemptions[replica]
    st.plotly_chart(charts.timeline_figure(timeline.frame, preemptions.frame), key="ex-timeline")
    notes = [n for n in (timeline.note(), preemptions.note("preemption steps")) if n]
    own = per_replica[replica] if replica < len(per_replica) else None
    total = (own or {}).get("preemptions")
    notes.append(
        f"{preemptions.total:,} steps with preemptions (x markers)"
        + ("" if total is None else f", {int(total):,} in all")
        if preemptions.total
        else "no preemptions on this replica"
    )
    st.caption(f"{replica_label(replica)} only: " + "; ".join(notes) + ".")


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


def _block_map(path: Path, fleet: bool) -> None:
    st.subheader("HBM block map")
    if fleet:
        st.caption("A fleet run's block map shows replica 0 only, whichever replica is picked.")
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
    if st.session_state.get("ex-snapshot-of") != str(path):
        # Another run: start at its last snapshot, not at the last run's position.
        st.session_state.pop("ex-snapshot", None)
        st.session_state["ex-snapshot-of"] = str(path)
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
    codes, legend = charts.block_states(row, block_map.classes)
    counts = np.bincount(codes, minlength=2)
    names = [label for label, _ in legend]
    st.caption(
        f"t = {times[index]:,.2f} s: "
        + ", ".join(f"{names[k]} {int(c):,}" for k, c in enumerate(counts) if k < len(names))
        + f" of {row.size:,} blocks."
    )
    st.plotly_chart(
        charts.block_strip_figure(row, block_map.classes, float(times[index])), key="ex-strip"
    )
    if block_map.cpu_states is not None:
        _cpu_map(block_map, index)


# The CPU map of a what-if run, by kind: title, who holds a block, what state 1 means, what
# the held blocks are, and how they relate to the HBM map.
_CPU_MAPS = {
    "swap": (
        "CPU swap pool (what-if: swap preemption)",
        "swapped out",
        "(unused)",
        "hold swapped-out KV",
        "a swapped-out request's HBM blocks are freed, so the HBM map above does not show them",
    ),
    "offload": (
        "CPU offload store (what-if: vLLM's offloading connector)",
        "being loaded",
        "stored (prefix copy)",
        "hold stored prefix blocks",
        "a block stays in the store after HBM evicts it; a prefix lookup that misses in HBM "
        "loads it back",
    ),
}


def _cpu_map(block_map: BlockMap, index: int) -> None:
    """The CPU side of a swap or offload run (a what-if): KV per CPU block."""
    title, owner, cached, held_what, relation = _CPU_MAPS[block_map.cpu_kind or "swap"]
    cpu = block_map.cpu_states
    assert cpu is not None
    times = block_map.times_s
    st.subheader(title)
    if cpu.shape[1] == 0:
        st.info("The CPU pool has no blocks.")
        return
    fig, note = charts.block_map_figure(
        times, cpu, block_map.classes, index, owner=owner, pool="CPU block", cached=cached
    )
    st.plotly_chart(fig, key="ex-cpumap")
    held = int(np.count_nonzero(cpu[index]))
    st.caption(
        f"t = {times[index]:,.2f} s: {held:,} of {cpu.shape[1]:,} CPU blocks {held_what} "
        f"({relation})." + (f" {note[0].upper()}{note[1:]}." if note else "")
    )


def _band(path: Path) -> None:
    try:
        band = read_band(path)
    except ValueError as exc:  # an optional file: the rest of the run still shows
        st.warning(str(exc))
        return
    if band is None:
        return
    table, num_samples = band
    plural = "s" if num_samples != 1 else ""
    with st.expander(f"Uncertainty band ({num_samples} step-speed sample{plural})"):
        st.caption(
            "`kvsim run --samples`: the scenario again at the step speeds of the calibration's "
            "measured runs (and each step's own jitter, for profiles that record it; "
            "latencies and throughput times the fit's model error held out on the calibration "
            "scenarios, for profiles that record it); each metric at the profile as fitted, and "
            "the samples' median and p10-p90 (samples.json)."
        )
        st.dataframe(table, hide_index=True, key="ex-band")


def _cdfs(view: RunView, replica: int | None) -> None:
    st.subheader("Latency CDFs by priority class")
    cdfs = view.cdfs if replica is None else view.replica_cdfs[replica]
    if replica is not None:
        st.caption(f"Requests of {replica_label(replica)} only.")
    if cdfs.empty:
        st.info(
            "No latency samples in this run" + (" on this replica." if replica is not None else ".")
        )
        return
    cols = st.columns(3)
    for col, metric in zip(cols, ("ttft", "itl", "e2e"), strict=True):
        if (cdfs["metric"] == metric).any():
            col.plotly_chart(charts.cdf_figure(cdfs, metric), key=f"ex-cdf-{metric}")
        else:
            col.caption(f"No {metric.upper()} samples (no per-token times in this run).")


def _waterfall(view: RunView, replica: int | None) -> None:
    st.subheader("Agent session waterfall")
    requests = view.requests
    if replica is not None:
        requests = requests[requests[REPLICA] == replica]
    sessions = requests["session_id"]
    ids = np.unique(sessions[sessions >= 0].to_numpy())
    where = "this run" if replica is None else f"{replica_label(replica)}"
    if ids.size == 0:
        st.info(
            f"No agent sessions on {where} (open-loop or trace traffic without sessions)."
            if replica is not None
            else "No agent sessions in this run (open-loop or trace traffic without sessions)."
        )
        return
    session = st.selectbox(
        f"Session ({ids.size:,} in {where})"
        if replica is None
        else f"Session ({ids.size:,} with a request on {where})",
        ids.tolist(),
        index=0,
        key="ex-session" if replica is None else f"ex-session-r{replica}",
    )
    if view.replicas:
        st.caption("Every turn of the session is shown, each labelled with the replica it ran on.")
    cut_at_s = view.summary.get("duration_s") if view.summary.get("truncated_at_limit") else None
    segments = session_waterfall(view.requests, int(session), cut_at_s)
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
        _band(Path(view.path))
        replica = None
        if view.replicas:
            _fleet(view)
            replica = _pick_replica(view)
            _fleet_timeline(view, replica)
        else:
            _timeline(view)
        _block_map(Path(view.path), fleet=view.replicas > 0)
        _cdfs(view, replica)
        _waterfall(view, replica)
        with st.expander("Scenario as resolved"):
            st.code(view.scenario_yaml or "(no scenario.yaml)", language="yaml")
