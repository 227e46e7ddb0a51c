"""Sweeps: the folders under ``<runs dir>/sweeps/`` that hold a ``sweep.json``.

For a ``kvsim sweep`` folder (``kvsim sweep ... --out <runs dir>/sweeps/NAME``) it shows the
grid and ``results.parquet``: one row per point, its overrides, metrics, SLO verdicts and
status. Any other ``sweep.json`` is shown as written. The page only appears in the
navigation once such a folder exists.
"""

# ruff: noqa: E402 (imports after the title, on purpose)

from __future__ import annotations

import streamlit as st

st.title("Sweeps")

import pandas as pd

from dashboard.errors import show_error
from dashboard.loaders import load_json
from dashboard.locations import list_sweeps, runs_dir
from sim.sweep import RESULTS_FILE

st.caption(
    "Sweeps under the runs directory's `sweeps/` folder: run one with "
    "`kvsim sweep SCENARIO --grid FIELD=V1,V2 --out <runs dir>/sweeps/NAME`."
)
files = list_sweeps(runs_dir())
if not files:
    st.info("No `sweeps/*/sweep.json` files under the runs directory.")
    st.stop()

for file in files:
    st.subheader(file.parent.name)
    try:
        data = load_json(file)
    except Exception as exc:
        show_error(exc, str(file), str(file.resolve()))
        continue
    results = file.parent / RESULTS_FILE
    if isinstance(data, dict) and data.get("kind") == "kvsim sweep" and results.is_file():
        st.caption(
            f"`{data.get('scenario')}` over "
            + ", ".join(f"`{f}` in {v}" for f, v in (data.get("grid") or {}).items())
        )
        try:
            table = pd.read_parquet(results)
        except Exception as exc:
            show_error(exc, str(results), str(results.resolve()))
            continue
        failed = int((table.get("status") == "failed").sum()) if "status" in table else 0
        st.write(f"{len(table)} points, {failed} failed")
        st.dataframe(table, hide_index=True, key=f"sweep-{file.parent.name}")
        continue
    records = None
    if isinstance(data, list):
        records = data
    elif isinstance(data, dict):
        records = next(
            (data[k] for k in ("results", "points", "runs") if isinstance(data.get(k), list)),
            None,
        )
    if records and all(isinstance(r, dict) for r in records):
        st.dataframe(pd.json_normalize(records), hide_index=True, key=f"sweep-{file.parent.name}")
    with st.expander(f"{file} (raw)"):
        st.json(data, expanded=False)
