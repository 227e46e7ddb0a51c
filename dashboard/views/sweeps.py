"""Sweeps: the folders under ``<runs dir>/sweeps/`` that hold a ``sweep.json``.

For a ``kvsim sweep`` folder (``kvsim sweep ... --out <runs dir>/sweeps/NAME``): the results
table with each point's SLO verdict; a heatmap of any metric over two grid knobs (the other
knobs fixed at chosen values, or averaged; a line chart when the sweep has one knob); the
Pareto fronts of output throughput vs p99 TTFT and vs p99 ITL among the points that ran,
finished every request and met every SLO; and the chosen config (the best such point by an
objective) with a button that opens its run in the run explorer, its ``vllm serve`` line and
its vllm-yaml file.
Any other ``sweep.json`` is shown as written. The page only appears in the navigation once
such a folder exists.
"""

# ruff: noqa: E402 (imports after the title, on purpose)

from __future__ import annotations

import streamlit as st

st.title("Sweeps")

from pathlib import Path
from typing import Any

import pandas as pd

from dashboard import sweep_charts, sweep_data
from dashboard.errors import guard, show_error
from dashboard.loaders import load_json
from dashboard.locations import list_sweeps, runs_dir
from sim.sweep import RESULTS_FILE

RUN_EXPLORER = Path(__file__).resolve().parent / "run_explorer.py"
RUN_PATH_KEY = "ex-path"  # the run explorer's "path to a run directory" box (components.pick_run)


def _other(data: Any, file: Path) -> None:
    """A sweep.json that ``kvsim sweep`` did not write: its records as a table, raw JSON."""
    records = data if isinstance(data, list) else None
    if isinstance(data, dict):
        lists = (data[k] for k in ("results", "points", "runs") if isinstance(data.get(k), list))
        records = next(lists, None)
    if records and all(isinstance(r, dict) for r in records):
        st.dataframe(pd.json_normalize(records), hide_index=True, key="sw-records")
    with st.expander(f"{file} (raw)"):
        st.json(data, expanded=False)


def _heatmap(table: pd.DataFrame, knobs: list[str]) -> None:
    st.subheader("Metric over the grid")
    metrics = [m for m in sweep_data.METRICS if m in table.columns]
    metric = st.selectbox("Metric", metrics, format_func=sweep_data.METRICS.get, key="sw-metric")
    label = sweep_data.METRICS[metric]
    if len(knobs) == 1:
        st.plotly_chart(sweep_charts.line_figure(table, knobs[0], metric, label), key="sw-line")
        st.caption(
            f"One knob in this sweep (`{knobs[0]}`): a line chart of its ok points; `FAIL` marks "
            "a missed SLO, `UNFINISHED` a run that hit `limits.max_duration_s` with requests "
            "unfinished (its figures leave them out)."
        )
        return
    cols = st.columns(3)
    x = cols[0].selectbox("x knob", knobs, index=0, key="sw-x")
    y = cols[1].selectbox("y knob", [k for k in knobs if k != x], index=0, key="sw-y")
    others = [k for k in knobs if k not in (x, y)]
    fixed: dict[str, object] | str = {}
    how = "no other knobs"
    if others:
        mode = cols[2].radio("Other knobs", ["fixed", "mean"], horizontal=True, key="sw-others")
        if mode == "fixed":
            fixed = {
                k: st.selectbox(f"`{k}` at", sweep_data.values(table, k), key=f"sw-fix-{k}")
                for k in others
            }
            how = "other knobs fixed at " + ", ".join(f"`{k}`={v}" for k, v in fixed.items())
        else:
            fixed = sweep_data.MEAN
            how = "each cell the mean over its ok points of " + ", ".join(f"`{k}`" for k in others)
    hm = sweep_data.heatmap(table, x, y, metric, fixed)
    st.plotly_chart(sweep_charts.heatmap_figure(hm, label), key="sw-heatmap")
    st.caption(
        f"{label} by `{x}` and `{y}`; {how}. A `failed` cell did not run (its error is in the "
        "table), `FAIL` marks a missed SLO, `UNFINISHED` a run that hit "
        "`limits.max_duration_s` with requests unfinished (its figures leave them out), a "
        "blank cell has no point."
    )


def _pareto(table: pd.DataFrame) -> None:
    st.subheader("Pareto front")
    shown = table[sweep_data.passing(table)]
    if shown.empty:
        st.info("No point ran, finished every request and met every SLO: there is no front.")
        return
    cols = st.columns(2)
    for col, (latency, label) in zip(
        cols, (("ttft_p99_s", "TTFT p99 (s)"), ("itl_p99_s", "ITL p99 (s)")), strict=True
    ):
        front = sweep_data.pareto(table, latency)
        fig = sweep_charts.pareto_figure(shown, latency, label, front)
        col.plotly_chart(fig, key=f"sw-pareto-{latency}")
        col.caption(f"Throughput vs {label}: front {', '.join(front)}.")
    st.caption(
        "Only the points that ran, finished every request and met every SLO (or whose "
        "scenario sets none)."
    )


def _chosen(table: pd.DataFrame, knobs: list[str]) -> None:
    from sim.export import serve_command, serve_yaml
    from sim.scenario import load_scenario

    st.subheader("Chosen config")
    objective = st.selectbox("Objective", list(sweep_data.OBJECTIVES), index=0, key="sw-objective")
    best = sweep_data.choose(table, objective)
    if best is None:
        st.warning(
            "No point ran, finished every request and met every SLO: there is no config to choose."
        )
        return
    st.markdown(
        f"**{best['point']}** ({objective} among the points that finished every request "
        "and met every SLO): " + ", ".join(f"`{k}={best[k]}`" for k in knobs)
    )
    if isinstance(what_if := best.get("what_if"), str) and what_if:
        st.warning(f"This config is a what-if, not vLLM 0.32's own behaviour: {what_if}")
    run_dir = Path(str(best["run_dir"]))
    if st.button("Open its run in the run explorer", key="sw-open"):
        st.session_state[RUN_PATH_KEY] = str(run_dir)
        st.switch_page(RUN_EXPLORER)
    try:
        scenario = load_scenario(run_dir / "scenario.yaml")
        command, config = serve_command(scenario), serve_yaml(scenario)
    except Exception as exc:
        show_error(exc, f"{run_dir}: export", str(run_dir))
        return
    st.code(command, language="bash")
    st.download_button(
        "Download vllm-yaml (for vllm serve --config)",
        config,
        file_name=f"{best['point']}-vllm.yaml",
        mime="application/yaml",
        key="sw-yaml",
    )


st.caption(
    "Sweeps under the runs directory's `sweeps/` folder: run one with "
    "`kvsim sweep SCENARIO --grid FIELD=V1,V2 --out <runs dir>/sweeps/NAME`."
)
files = list_sweeps(runs_dir())
if not files:
    st.info("No `sweeps/*/sweep.json` files under the runs directory.")
    st.stop()
file = st.selectbox("Sweep", files, format_func=lambda p: p.parent.name, key="sw-sweep")
with guard(str(file), str(file.resolve())):
    data = load_json(file)
results = file.parent / RESULTS_FILE
if not (isinstance(data, dict) and data.get("kind") == "kvsim sweep" and results.is_file()):
    _other(data, file)
    st.stop()

grid = data.get("grid") or {}
st.caption(f"`{data.get('scenario')}` over " + ", ".join(f"`{f}` in {v}" for f, v in grid.items()))
with guard(str(results), str(results)):
    table = sweep_data.read_results(results)
    knobs = sweep_data.knobs(grid, table)
failed = int((table["status"] == "failed").sum())
st.write(f"{len(table)} points, {failed} failed")
what_ifs = table["what_if"].dropna() if "what_if" in table.columns else pd.Series(dtype=str)
if not what_ifs.empty:
    st.info(
        f"{len(what_ifs)} of these points are what-ifs, not vLLM 0.32's own behaviour (the "
        f"`what_if` column), e.g. {what_ifs.iloc[0]}"
    )
shown = table.copy()
shown.insert(shown.columns.get_loc("status") + 1, "verdict", sweep_data.verdicts(table))
st.dataframe(shown, hide_index=True, key="sw-results")
if not (table["status"] == "ok").any():
    first = table["error"].dropna().astype(str)
    detail = f"; the first error: {first.iloc[0]}" if not first.empty else ""
    show_error(ValueError(f"no point of this sweep ran ({failed} failed){detail}"), str(results))
    st.stop()
if not knobs:
    show_error(ValueError("the results table has no grid knob columns"), str(results))
    st.stop()
with guard(f"{results}: charts", str(results)):
    _heatmap(table, knobs)
    _pareto(table)
    _chosen(table, knobs)
