"""The Sweeps page's data: a ``kvsim sweep`` results table shaped for its views (no Streamlit).

``results.parquet`` (``sim/sweep.py``) has one row per point: ``point``, one typed column per
grid field, ``status`` (ok / failed / pending), ``error``, ``run_dir``, the metrics and the
SLO verdicts (``slo_<name>_pass``, ``slo_pass``; ``slo_pass`` is empty when the scenario sets
no SLOs). A point "passes" when it ran (``ok``), finished every request (``num_finished`` ==
``num_requests``) and every SLO held, or the scenario sets none: a run that hit
``limits.max_duration_s`` with requests unfinished has latencies over the finished ones only,
the slowest left out, so its SLO verdicts read better than the config is (the tuner and
``kvsim capacity`` count such a run as failing too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from sim.sweep import unfinished_points

REQUIRED = ("point", "status")
# The metrics a heatmap can show, with their labels (column: label with unit).
METRICS: dict[str, str] = {
    "goodput_req_s": "goodput (req/s)",
    "output_throughput_tok_s": "output throughput (tok/s)",
    "request_throughput_req_s": "request throughput (req/s)",
    "ttft_p50_s": "TTFT p50 (s)",
    "ttft_p99_s": "TTFT p99 (s)",
    "itl_p50_s": "ITL p50 (s)",
    "itl_p99_s": "ITL p99 (s)",
    "e2e_p50_s": "E2E p50 (s)",
    "e2e_p99_s": "E2E p99 (s)",
    "slo_attainment": "SLO attainment",
    "preemptions": "preemptions",
    "prefix_cache_hit_rate": "prefix-cache hit rate",
    "kv_usage_mean": "KV usage mean",
    "kv_usage_peak": "KV usage peak",
    "peak_concurrent_sessions": "peak concurrent sessions",
}
# The chosen config's objectives: label -> (column, True when higher is better).
OBJECTIVES: dict[str, tuple[str, bool]] = {
    "highest goodput": ("goodput_req_s", True),
    "highest output throughput": ("output_throughput_tok_s", True),
    "highest request throughput": ("request_throughput_req_s", True),
    "lowest TTFT p99": ("ttft_p99_s", False),
    "lowest ITL p99": ("itl_p99_s", False),
    "lowest E2E p99": ("e2e_p99_s", False),
    "lowest KV usage peak": ("kv_usage_peak", False),
    "fewest preemptions": ("preemptions", False),
}
THROUGHPUT = "output_throughput_tok_s"
# Aggregating the knobs not on the heatmap's axes: the mean over their ok points.
MEAN = "mean"


def read_results(path: Path) -> pd.DataFrame:
    """``results.parquet`` of a sweep; an unreadable file or one without the point and status
    columns raises one ValueError naming the file."""
    try:
        table = pd.read_parquet(path)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise ValueError(f"{path}: cannot read the sweep's results: {exc}") from None
    lacking = [c for c in REQUIRED if c not in table.columns]
    if lacking:
        raise ValueError(f"{path}: not a kvsim sweep results table (no column {lacking[0]!r})")
    return table


def knobs(grid: object, table: pd.DataFrame) -> list[str]:
    """The grid fields of ``sweep.json``'s ``grid`` that the table has, in grid order; a
    results table written without a grid falls back to the columns before ``status``."""
    if isinstance(grid, dict):
        found = [f for f in grid if f in table.columns]
        if found:
            return found
    columns = list(table.columns)
    end = columns.index("status") if "status" in columns else 0
    return [c for c in columns[:end] if c != "point"]


def passing(table: pd.DataFrame) -> pd.Series:
    """True for the ok points that finished every request and whose SLOs all held (or
    whose scenario sets none)."""
    ok = (table["status"] == "ok") & ~unfinished_points(table)
    if "slo_pass" not in table.columns:
        return ok
    slo = table["slo_pass"]
    return ok & (slo.isna() | (slo == True))  # noqa: E712 (object column: True/False/None)


def verdicts(table: pd.DataFrame) -> pd.Series:
    """Each point's verdict: ``PASS``, ``FAIL`` (an SLO missed), ``no SLOs``,
    ``UNFINISHED`` (its run hit the time limit with requests unfinished, whatever its SLOs
    read), ``failed`` (the point did not run: see its error) or ``pending``."""
    out = table["status"].map({"failed": "failed", "pending": "pending"}).fillna("PASS")
    if "slo_pass" in table.columns:
        ok = table["status"] == "ok"
        out[ok & table["slo_pass"].isna()] = "no SLOs"
        out[ok & (table["slo_pass"] == False)] = "FAIL"  # noqa: E712
    out[unfinished_points(table)] = "UNFINISHED"
    return out.rename("verdict")


def values(table: pd.DataFrame, knob: str) -> list[object]:
    """A knob's distinct values in order (by their text when they mix types)."""
    found = list(table[knob].dropna().unique())
    try:
        return sorted(found)
    except TypeError:
        return sorted(found, key=str)


@dataclass(frozen=True)
class Heatmap:
    """``z``: the metric per (y value, x value), NaN where no ok point; ``labels``: what each
    cell says (the value, ``failed``, ``FAIL`` marks a missed SLO, ``UNFINISHED`` a run that
    hit its time limit with requests unfinished); ``points``: the point id of each cell
    (empty when aggregated)."""

    z: pd.DataFrame
    labels: pd.DataFrame
    points: pd.DataFrame


def _cell(values: pd.DataFrame, metric: str) -> str:
    ok = values[values["status"] == "ok"]
    if ok.empty:
        return "failed" if (values["status"] == "failed").any() else "pending"
    text = f"{ok[metric].mean():.4g}" if pd.notna(ok[metric].mean()) else "-"
    marks = verdicts(values)
    for mark in ("FAIL", "UNFINISHED"):
        count = int((marks == mark).sum())
        if count:
            text += f" {mark}" if len(values) == 1 else f" ({count} {mark})"
    failed = int((values["status"] == "failed").sum())
    if failed and len(values) > 1:
        text += f" ({failed} failed)"
    return text


def heatmap(
    table: pd.DataFrame, x: str, y: str, metric: str, fixed: dict[str, object] | str
) -> Heatmap:
    """``metric`` over knobs ``x`` (columns) and ``y`` (rows). The other knobs are either
    ``fixed`` at one value each ({field: value}), or ``MEAN``: each cell is the mean over
    the cell's ok points (the label counts its failed points and missed SLOs)."""
    rows = table
    if isinstance(fixed, dict):
        for field, value in fixed.items():
            rows = rows[rows[field] == value]
    xs, ys = values(table, x), values(table, y)
    z = pd.DataFrame(float("nan"), index=pd.Index(ys, name=y), columns=pd.Index(xs, name=x))
    labels = pd.DataFrame("", index=z.index, columns=z.columns)
    points = pd.DataFrame("", index=z.index, columns=z.columns)
    for (yv, xv), cell in rows.groupby([y, x], sort=False):
        ok = cell[cell["status"] == "ok"]
        if not ok.empty:
            z.loc[yv, xv] = float(ok[metric].mean())
        labels.loc[yv, xv] = _cell(cell, metric)
        if len(cell) == 1:
            points.loc[yv, xv] = str(cell["point"].iloc[0])
    return Heatmap(z, labels, points)


def pareto(table: pd.DataFrame, latency: str) -> list[str]:
    """The points of the front of output throughput (higher) vs ``latency`` (lower) among
    the passing points, by throughput (highest first); equal points are all on it."""
    cand = table[passing(table)].dropna(subset=[THROUGHPUT, latency])
    front = []
    for _, p in cand.iterrows():
        beaten = (
            (cand[THROUGHPUT] >= p[THROUGHPUT])
            & (cand[latency] <= p[latency])
            & ((cand[THROUGHPUT] > p[THROUGHPUT]) | (cand[latency] < p[latency]))
        )
        if not beaten.any():
            front.append(p)
    ordered = sorted(front, key=lambda p: (-p[THROUGHPUT], p[latency], str(p["point"])))
    return [str(p["point"]) for p in ordered]


def choose(table: pd.DataFrame, objective: str) -> pd.Series | None:
    """The passing point best by ``objective`` (an ``OBJECTIVES`` label); ties go to the
    first point in sweep order. None when no point passes."""
    column, higher = OBJECTIVES[objective]
    cand = table[passing(table)].dropna(subset=[column])
    if cand.empty:
        return None
    best = cand[column].max() if higher else cand[column].min()
    return cand[cand[column] == best].iloc[0]
