"""Compare: two or more runs side by side: overlaid CDFs and timelines, and the error table of
the first selected run against the second.

The title is drawn before pandas and plotly are imported. A run that cannot be read is one
``st.error`` paragraph naming it; the others are still compared.
"""

# ruff: noqa: E402 (imports after the title, on purpose)

from __future__ import annotations

import streamlit as st

st.title("Compare runs")

from pathlib import Path

with st.spinner("Loading..."):
    import pandas as pd

    from dashboard import charts
    from dashboard.data import ALL_CLASSES
    from dashboard.errors import guard, show_error
    from dashboard.loaders import RunView, list_runs, load_view
    from dashboard.locations import runs_dir
    from dashboard.tables import comparison_frame
    from sim.report import partial_lines, what_if_line
    from validate.compare import compare_summaries, slo_mismatch

base = runs_dir()
with guard(f"listing the runs in {base}"):
    available = list_runs(base)
chosen = st.multiselect(
    "Runs (the first is compared against the second)",
    available,
    default=available[:2],
    format_func=lambda p: p.name,
    key="cmp-runs",
)
extra = st.text_input(
    "... and run directories by path (comma-separated)",
    key="cmp-paths",
    placeholder="e.g. runs/measured-1, /data/runs/sim-3",
)
paths: list[Path] = list(chosen) + [Path(p.strip()) for p in extra.split(",") if p.strip()]

if len(paths) < 2:
    st.info(
        f"Pick at least two runs ({len(available)} found in `{base}`), e.g. a simulated and a "
        "measured run of the same scenario, or two configs of one scenario."
    )
    st.stop()

views: list[RunView] = []
for path in paths:
    try:
        views.append(load_view(path))
    except Exception as exc:
        show_error(exc, f"run directory {path}", str(path))
if len(views) < 2:
    st.stop()

with guard("comparing " + ", ".join(str(Path(v.path).name) for v in views)):
    # Labels must be unique: two runs with the same directory name get their parent's too.
    labels = [v.label for v in views]
    labels = [
        f"{label} ({Path(v.path).parent.name})" if labels.count(label) > 1 else label
        for label, v in zip(labels, views, strict=True)
    ]

    st.subheader("Error table")
    value, reference = views[0], views[1]
    st.caption(
        f"value: **{labels[0]}**, reference: **{labels[1]}**; relative error = "
        "(value - reference) / |reference|."
        + (" Further runs appear in the charts only." if len(views) > 2 else "")
    )
    for v, label in zip(views, labels, strict=True):
        for partial in partial_lines(v.summary, f"**{label}**"):
            st.warning(f"{partial}.")
        if what_if := what_if_line(v.summary, f"**{label}**"):
            st.info(f"{what_if}.")
    if mismatch := slo_mismatch(value.summary, reference.summary):
        st.info(f"{mismatch[0].upper()}{mismatch[1:]}.")
    table = comparison_frame(compare_summaries(value.summary, reference.summary))
    st.dataframe(
        table,
        hide_index=True,
        key="cmp-table",
        column_config={
            "value": st.column_config.NumberColumn(format="%.4g"),
            "reference": st.column_config.NumberColumn(format="%.4g"),
            "relative error (%)": st.column_config.NumberColumn(format="%+.1f %%"),
        },
    )

    st.subheader("Latency CDFs")
    overall = pd.concat(
        [
            v.cdfs[v.cdfs["priority_class"] == ALL_CLASSES].assign(run=label)
            for v, label in zip(views, labels, strict=True)
            if not v.cdfs.empty
        ]
    )
    cols = st.columns(3)
    for col, metric in zip(cols, ("ttft", "itl", "e2e"), strict=True):
        col.plotly_chart(charts.cdf_figure(overall, metric, group="run"), key=f"cmp-cdf-{metric}")

    st.subheader("Timelines")
    timelines = {label: v.timeline.frame for v, label in zip(views, labels, strict=True)}
    left, right = st.columns(2)
    left.plotly_chart(
        charts.overlay_timeline_figure(
            timelines, "kv_cache_usage_perc", "KV cache usage (%)", scale=100
        ),
        key="cmp-kv",
    )
    right.plotly_chart(
        charts.overlay_timeline_figure(timelines, "num_requests_running", "running requests"),
        key="cmp-running",
    )
    notes = [
        f"{label}: {n}" for v, label in zip(views, labels, strict=True) if (n := v.timeline.note())
    ]
    notes += [
        f"{label} is a fleet of {v.replicas} replicas: its KV usage is their mean and its "
        "running requests their sum"
        for v, label in zip(views, labels, strict=True)
        if v.replicas
    ]
    if notes:
        st.caption("; ".join(notes) + ".")
