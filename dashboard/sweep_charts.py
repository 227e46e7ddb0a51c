"""Plotly figures of the Sweeps page: pure functions of the shaped tables (no Streamlit)."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from dashboard.sweep_data import THROUGHPUT, Heatmap, verdicts

FRONT_COLOR = "#d62728"
OTHER_COLOR = "#9e9e9e"
LINE_COLOR = "#1f77b4"
# The verdicts a one-knob line marks on its points, and their colors.
MARK_COLORS = {"FAIL": "#d62728", "UNFINISHED": "#ff7f0e"}


def _axis(values: pd.Index) -> list[str]:
    return [str(v) for v in values]  # categorical: grid values are not evenly spaced


def heatmap_figure(hm: Heatmap, metric_label: str) -> go.Figure:
    """The metric per cell, each cell labelled (value, ``FAIL``, ``UNFINISHED``,
    ``failed``); a cell with no ok point is blank."""
    fig = go.Figure(
        go.Heatmap(
            z=hm.z.to_numpy(),
            x=_axis(hm.z.columns),
            y=_axis(hm.z.index),
            text=hm.labels.to_numpy(),
            texttemplate="%{text}",
            colorscale="Viridis",
            colorbar={"title": metric_label},
            hovertemplate=f"{hm.z.columns.name}=%{{x}}<br>{hm.z.index.name}=%{{y}}<br>"
            f"{metric_label}: %{{text}}<extra></extra>",
        )
    )
    fig.update_layout(height=420, margin={"l": 70, "r": 40, "t": 30, "b": 50})
    fig.update_xaxes(title=hm.z.columns.name, type="category")
    fig.update_yaxes(title=hm.z.index.name, type="category")
    return fig


def line_figure(points: pd.DataFrame, knob: str, metric: str, metric_label: str) -> go.Figure:
    """One knob's sweep: the metric of its ok points against the knob's values, a point that
    missed an SLO or hit its time limit unfinished marked (``FAIL``, ``UNFINISHED``) as on
    the heatmap."""
    ok = points[points["status"] == "ok"].sort_values(knob)
    verdict = verdicts(ok)
    marks = verdict.where(verdict.isin(MARK_COLORS), "")
    fig = go.Figure(
        go.Scatter(
            x=ok[knob].astype(str), y=ok[metric], mode="lines+markers+text",
            text=marks, textposition="top center", customdata=ok[["point"]].assign(v=verdict),
            marker={"size": 9, "color": [MARK_COLORS.get(m, LINE_COLOR) for m in marks]},
            line={"color": LINE_COLOR},
            hovertemplate="%{customdata[0]}: %{y} (%{customdata[1]})<extra></extra>",
        )
    )  # fmt: skip
    fig.update_layout(height=380, margin={"l": 70, "r": 40, "t": 30, "b": 50})
    fig.update_xaxes(title=knob, type="category")
    fig.update_yaxes(title=metric_label)
    return fig


def pareto_figure(points: pd.DataFrame, latency: str, label: str, front: list[str]) -> go.Figure:
    """Output throughput vs a p99 latency of the passing points; the front highlighted."""
    on = points["point"].isin(front)
    fig = go.Figure()
    for mask, name, color in (
        (~on, "other points", OTHER_COLOR),
        (on, "Pareto front", FRONT_COLOR),
    ):
        part = points[mask]
        if name == "Pareto front":
            part = part.set_index("point").loc[front].reset_index()
        fig.add_trace(
            go.Scatter(
                x=part[latency], y=part[THROUGHPUT], text=part["point"], name=name,
                mode="lines+markers" if name == "Pareto front" else "markers",
                marker={"color": color, "size": 10}, line={"shape": "hv"},
                hovertemplate="%{text}: %{x:.4g} s, %{y:.4g} tok/s<extra></extra>",
            )
        )  # fmt: skip
    fig.update_layout(
        height=380, margin={"l": 70, "r": 40, "t": 30, "b": 50},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0},
    )  # fmt: skip
    fig.update_xaxes(title=label)
    fig.update_yaxes(title="output throughput (tok/s)")
    return fig
