"""Sweeps: a plain reader of ``<runs dir>/sweeps/*/sweep.json``.

kvsim has no sweep command yet; this page only appears in the navigation once such files
exist, and shows each one as written: its parameters and a table of its result records.
"""

# ruff: noqa: E402 (imports after the title, on purpose)

from __future__ import annotations

import streamlit as st

st.title("Sweeps")

import pandas as pd

from dashboard.errors import show_error
from dashboard.loaders import load_json
from dashboard.locations import list_sweeps, runs_dir

st.caption(
    "A simple reader of `sweeps/*/sweep.json` files under the runs directory. kvsim has no "
    "sweep command yet; this page shows whatever those files hold."
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
