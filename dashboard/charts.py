"""Plotly figure builders: pure functions of DataFrames and arrays (no Streamlit).

Every axis is titled with its unit. Callers downsample long timelines first
(:func:`dashboard.data.every_kth`) and show the note it returns.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from dashboard.data import PHASES, ordinal, strided
from sim.block_map import RETAINED

PALETTE = qualitative.Plotly
METRIC_TITLES = {
    "ttft": ("TTFT", "time to first token (ms)", "fraction of requests"),
    "itl": ("ITL", "inter-token latency (ms)", "fraction of inter-token gaps"),
    "e2e": ("E2E", "end-to-end latency (ms)", "fraction of finished requests"),
}
PHASE_COLORS = {
    "queueing": "#9e9e9e",
    "prefill": "#ff7f0e",
    "decode": "#1f77b4",
    "tool wait": "#2ca02c",
}
FREE_COLOR = "#ececec"
CACHED_COLOR = "#9ecae1"
RETAINED_COLOR = "#6a3d9a"
CLASS_COLORS = ["#d62728", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#bcbd22"]
TIME_AXIS = "time (s)"


def _layout(fig: go.Figure, height: int, title: str | None = None) -> go.Figure:
    fig.update_layout(
        height=height,
        title=title,
        margin={"l": 70, "r": 40, "t": 60 if title else 30, "b": 50},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
        hovermode="x unified",
        # A vertical mode bar at the right edge stays clear of the title and the legend.
        modebar={"orientation": "v"},
    )
    return fig


def timeline_figure(
    steps: pd.DataFrame, preemptions: pd.DataFrame | None = None, title: str | None = None
) -> go.Figure:
    """KV usage (%) above running / waiting requests over time, preemption steps marked.

    ``steps`` holds (downsampled) rows of steps.parquet; ``preemptions`` the steps with
    ``num_preemptions > 0``.
    """
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06)
    t = steps["start_s"]
    fig.add_scatter(
        x=t,
        y=steps["kv_cache_usage_perc"] * 100,
        name="KV cache usage",
        row=1,
        col=1,
        line={"color": PALETTE[0], "width": 1},
    )
    if preemptions is not None and len(preemptions):
        fig.add_scatter(
            x=preemptions["start_s"],
            y=preemptions["kv_cache_usage_perc"] * 100,
            mode="markers",
            name="preemption",
            marker={"color": "#d62728", "symbol": "x", "size": 7},
            customdata=preemptions["num_preemptions"],
            hovertemplate="%{customdata} preempted<extra>preemption</extra>",
            row=1,
            col=1,
        )
    fig.add_scatter(
        x=t,
        y=steps["num_requests_running"],
        name="running",
        row=2,
        col=1,
        line={"color": PALETTE[2], "width": 1},
    )
    fig.add_scatter(
        x=t,
        y=steps["num_requests_waiting"],
        name="waiting",
        row=2,
        col=1,
        line={"color": PALETTE[1], "width": 1},
    )
    fig.update_yaxes(title_text="KV cache usage (%)", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text=TIME_AXIS, row=2, col=1)
    return _layout(fig, 420, title)


def fleet_timeline_figure(
    timelines: dict[str, pd.DataFrame], preemptions: dict[str, pd.DataFrame] | None = None
) -> go.Figure:
    """``timeline_figure`` with one line per replica: KV usage (%) above running (solid) and
    waiting (dotted) requests; a replica keeps one colour and one legend entry. Each value
    holds until the replica's next step (an idle replica's line stays flat, not a ramp).

    ``timelines`` maps a replica's label to its own (downsampled) steps; ``preemptions`` to
    its steps with ``num_preemptions > 0``.
    """
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.06)
    for i, (label, steps) in enumerate(timelines.items()):
        color = PALETTE[i % len(PALETTE)]
        common = {"legendgroup": label, "mode": "lines"}
        fig.add_scatter(
            x=steps["start_s"],
            y=steps["kv_cache_usage_perc"] * 100,
            name=label,
            line={"color": color, "width": 1, "shape": "hv"},
            row=1,
            col=1,
            **common,
        )
        events = (preemptions or {}).get(label)
        if events is not None and len(events):
            fig.add_scatter(
                x=events["start_s"],
                y=events["kv_cache_usage_perc"] * 100,
                mode="markers",
                name=f"{label}: preemption",
                legendgroup=label,
                showlegend=False,
                marker={"color": color, "symbol": "x", "size": 7},
                customdata=events["num_preemptions"],
                hovertemplate="%{customdata} preempted<extra>" + label + "</extra>",
                row=1,
                col=1,
            )
        for column, dash in (("num_requests_running", "solid"), ("num_requests_waiting", "dot")):
            fig.add_scatter(
                x=steps["start_s"],
                y=steps[column],
                name=f"{label}: {column.rsplit('_', 1)[-1]}",
                showlegend=False,
                line={"color": color, "width": 1, "dash": dash, "shape": "hv"},
                row=2,
                col=1,
                **common,
            )
    fig.update_yaxes(title_text="KV cache usage (%)", range=[0, 105], row=1, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=2, col=1)
    fig.update_xaxes(title_text=TIME_AXIS, row=2, col=1)
    return _layout(fig, 420)


def replica_bars_figure(per_replica: pd.DataFrame) -> go.Figure:
    """Bars per replica (``tables.fleet_frame``): requests, busy time and prefix hit rate."""
    panels = ("requests", "busy (%)", "prefix hit rate (%)")
    fig = make_subplots(rows=1, cols=3, subplot_titles=panels)
    x = [f"r{r}" for r in per_replica["replica"]]
    for col, column in enumerate(panels, start=1):
        fig.add_bar(
            x=x,
            y=per_replica[column],
            name=column,
            showlegend=False,
            marker={"color": PALETTE[col - 1]},
            hovertemplate="%{x}: %{y:,.1f}<extra>" + column + "</extra>",
            row=1,
            col=col,
        )
        fig.update_xaxes(title_text="replica", row=1, col=col)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="busy time (%)", range=[0, 105], row=1, col=2)
    fig.update_yaxes(title_text="prefix-cache hit rate (%)", range=[0, 105], row=1, col=3)
    fig = _layout(fig, 320)
    fig.update_layout(hovermode="closest")
    return fig


def cdf_figure(cdfs: pd.DataFrame, metric: str, group: str = "priority_class") -> go.Figure:
    """Overlaid CDF curves of one metric (``ttft`` / ``itl`` / ``e2e``), one per ``group``.

    ``cdfs`` has columns metric, ``group``, value (s), fraction (from ``latency_cdfs``).
    """
    name, x_title, y_title = METRIC_TITLES[metric]
    fig = go.Figure()
    sel = cdfs[cdfs["metric"] == metric] if len(cdfs) else cdfs
    for i, (label, part) in enumerate(sel.groupby(group, sort=False)):
        fig.add_scatter(
            x=part["value"] * 1e3,
            y=part["fraction"],
            name=str(label),
            mode="lines",
            line={"shape": "hv", "color": PALETTE[i % len(PALETTE)], "width": 2},
        )
    fig.update_xaxes(title_text=x_title, type="log")
    fig.update_yaxes(title_text=y_title, range=[0, 1.02])
    fig = _layout(fig, 400, f"{name} CDF")
    # Narrow charts: the legend goes under the x axis title, where it hides no curve.
    fig.update_layout(
        hovermode="closest",
        legend={"orientation": "h", "x": 0, "y": -0.22, "yanchor": "top"},
        margin={"b": 110},
    )
    return fig


def overlay_timeline_figure(
    timelines: dict[str, pd.DataFrame],
    column: str,
    y_title: str,
    scale: float = 1.0,
    shape: str = "linear",
) -> go.Figure:
    """One line per run (or replica) of ``column`` over time (already downsampled frames);
    ``shape="hv"`` holds each value until the next step."""
    fig = go.Figure()
    for i, (label, frame) in enumerate(timelines.items()):
        fig.add_scatter(
            x=frame["start_s"],
            y=frame[column] * scale,
            name=label,
            mode="lines",
            line={"color": PALETTE[i % len(PALETTE)], "width": 1, "shape": shape},
        )
    fig.update_xaxes(title_text=TIME_AXIS)
    fig.update_yaxes(title_text=y_title, rangemode="tozero")
    return _layout(fig, 320)


def state_legend(
    classes: list[str],
    retained: bool = False,
    owner: str = "running",
    cached: str = "prefix-cached (free)",
) -> list[tuple[str, str]]:
    """(label, colour) of each block state: free, cached-but-free (``cached`` names it: a
    CPU offload store's readable copies), one per class (``owner`` names who holds the
    block: a running request in HBM, a swapped-out one in the CPU swap pool, a load in the
    CPU offload store), and with ``retained`` the what-if KV retention's held blocks last."""
    out = [("free", FREE_COLOR), (cached, CACHED_COLOR)]
    for k, name in enumerate(classes):
        out.append((f"{owner}: {name}", CLASS_COLORS[k % len(CLASS_COLORS)]))
    if retained:
        out.append(("retained for a returning session (what-if)", RETAINED_COLOR))
    return out


def block_states(
    states: np.ndarray,
    classes: list[str],
    owner: str = "running",
    cached: str = "prefix-cached (free)",
) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Block-map codes (``sim/block_map.py``) as indices into their legend: retained blocks
    (code 255) get the last entry, present only when the map has any."""
    retained = states == RETAINED
    legend = state_legend(classes, retained=bool(retained.any()), owner=owner, cached=cached)
    z = np.minimum(states, len(legend) - 1 - int(retained.any()))
    if retained.any():
        z = np.where(retained, len(legend) - 1, z)
    return z, legend


def _discrete_scale(colors: list[str]) -> list[list]:
    n = len(colors)
    scale = []
    for i, color in enumerate(colors):
        scale += [[i / n, color], [(i + 1) / n, color]]
    return scale


def _state_heatmap(
    z: np.ndarray, x, y, legend: list[tuple[str, str]], showscale: bool = True, **kwargs
) -> go.Heatmap:
    n = len(legend)
    return go.Heatmap(
        z=np.minimum(z, n - 1),
        x=x,
        y=y,
        zmin=-0.5,
        zmax=n - 0.5,
        colorscale=_discrete_scale([c for _, c in legend]),
        showscale=showscale,
        # Below the plot, across its width: the map keeps the full width and the state
        # names stay clear of the mode bar.
        colorbar={
            "tickvals": list(range(n)),
            "ticktext": [label for label, _ in legend],
            "title": {"text": "block state", "side": "top"},
            "orientation": "h",
            "x": 0,
            "xanchor": "left",
            "y": -0.28,
            "yanchor": "top",
            "len": 1,
            "thickness": 14,
        },
        **kwargs,
    )


def block_map_figure(
    times_s: np.ndarray,
    states: np.ndarray,
    classes: list[str],
    selected: int | None = None,
    max_times: int = 600,
    max_blocks: int = 512,
    owner: str = "running",
    pool: str = "block",
    cached: str = "prefix-cached (free)",
) -> tuple[go.Figure, str | None]:
    """HBM block map: block index (y) over time (x), coloured by block state (``owner`` and
    ``pool`` name the holders and the axis: "swapped out" and "CPU block" for the CPU swap
    pool's map).

    Large maps are shown every k-th snapshot / block; the returned note says so (None when
    every cell is shown). ``selected`` marks one snapshot with a vertical line.
    """
    t_idx, t_stride = strided(len(times_s), max_times)
    b_idx, b_stride = strided(states.shape[1], max_blocks)
    z, legend = block_states(states[np.ix_(t_idx, b_idx)].T, classes, owner, cached)
    fig = go.Figure(
        _state_heatmap(
            z,
            times_s[t_idx],
            b_idx,
            legend,
            hovertemplate=f"t=%{{x:.2f}} s<br>{pool} %{{y}}<br>state %{{z}}<extra></extra>",
        )
    )
    if selected is not None:
        fig.add_vline(x=float(times_s[selected]), line={"color": "black", "width": 2})
    fig.update_xaxes(title_text=TIME_AXIS)
    fig.update_yaxes(title_text=f"{pool} index")
    parts = [
        f"{len(idx):,} of {total:,} {what} (every {ordinal(stride)})"
        for idx, total, stride, what in (
            (t_idx, len(times_s), t_stride, "snapshots"),
            (b_idx, states.shape[1], b_stride, "blocks"),
        )
        if stride > 1
    ]
    note = f"showing {' and '.join(parts)}" if parts else None
    fig = _layout(fig, 500)
    fig.update_layout(hovermode="closest", margin={"b": 140})
    return fig, note


def block_strip_figure(
    state_row: np.ndarray, classes: list[str], time_s: float, width: int = 128
) -> go.Figure:
    """One snapshot, every block: block ids wrapped into rows of ``width`` blocks."""
    codes, legend = block_states(state_row, classes)
    n = state_row.size
    rows = -(-n // width)
    grid = np.full(rows * width, np.nan)
    grid[:n] = codes
    grid = grid.reshape(rows, width)
    ids = np.arange(rows * width).reshape(rows, width)
    fig = go.Figure(
        _state_heatmap(
            grid,
            None,
            np.arange(rows) * width,
            legend,
            showscale=False,  # the block map above carries the colour legend
            customdata=ids,
            hovertemplate="block %{customdata}<br>state %{z}<extra></extra>",
        )
    )
    fig.update_xaxes(title_text=f"block index mod {width}")
    fig.update_yaxes(title_text="block id (row start)", autorange="reversed")
    fig = _layout(fig, min(520, 140 + 6 * rows), f"every block at t = {time_s:,.2f} s")
    fig.update_layout(hovermode="closest")
    return fig


def waterfall_figure(segments: pd.DataFrame, title: str | None = None) -> go.Figure:
    """Horizontal bars per turn: queueing, prefill, decode, tool wait (``session_waterfall``)."""
    fig = go.Figure()
    labels = list(dict.fromkeys(segments["label"]))
    for phase in PHASES:
        part = segments[segments["phase"] == phase]
        fig.add_bar(
            y=part["label"],
            x=part["duration_s"],
            base=part["start_s"],
            orientation="h",
            name=phase,
            marker={"color": PHASE_COLORS[phase]},
            hovertemplate=f"{phase}: %{{x:.3f}} s (from %{{base:.2f}} s)<extra>%{{y}}</extra>",
        )
    fig.update_layout(barmode="overlay")
    fig.update_xaxes(title_text="time since the session's first arrival (s)")
    fig.update_yaxes(
        title_text="turn", categoryorder="array", categoryarray=labels, autorange="reversed"
    )
    fig = _layout(fig, max(260, 80 + 26 * len(labels)), title)
    fig.update_layout(hovermode="closest")
    return fig


__all__ = [
    "block_map_figure",
    "block_states",
    "block_strip_figure",
    "cdf_figure",
    "fleet_timeline_figure",
    "overlay_timeline_figure",
    "replica_bars_figure",
    "state_legend",
    "timeline_figure",
    "waterfall_figure",
]
