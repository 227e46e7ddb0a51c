"""Streamlit pieces shared by the pages: the summary panel and the run picker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import streamlit as st

from dashboard.loaders import list_runs
from dashboard.tables import engine_frame, headline, latency_frame, slo_frame
from sim.metrics import E2E, ITL, KV_USAGE, PREEMPTIONS, TTFT
from sim.report import partial_lines, what_if_lines

MS_FORMAT = st.column_config.NumberColumn(format="%.1f")


def _latency(value: float | None) -> str:
    """Milliseconds below a second, seconds above (a metric tile is narrow)."""
    if value is None:
        return "-"
    return f"{value * 1e3:,.0f} ms" if value < 1.0 else f"{value:,.2f} s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def show_summary(summary: dict[str, Any], key: str) -> None:
    """Headline metrics, latency table, engine table and SLO verdicts of one run."""
    st.markdown(f"**{headline(summary)}**")
    for partial in partial_lines(summary, "The run"):
        st.warning(f"{partial}.")
    if what_if := what_if_lines(summary):
        st.info(
            "What-if: this run models what vLLM 0.32 does not run as configured; those parts "
            "of its results come from kvsim's model, not from vLLM's scheduler.\n\n"
            + "\n".join(f"- {line}" for line in what_if)
        )
    m = summary.get("metrics", {})
    cols = st.columns(6)
    cols[0].metric("TTFT p99", _latency((m.get(TTFT) or {}).get("p99")))
    cols[1].metric("ITL p99", _latency((m.get(ITL) or {}).get("p99")))
    cols[2].metric("E2E p99", _latency((m.get(E2E) or {}).get("p99")))
    cols[3].metric("KV usage peak", _pct((m.get(KV_USAGE) or {}).get("peak")))
    cols[4].metric("preemptions", f"{(m.get(PREEMPTIONS) or {}).get('total', 0):,}")
    cols[5].metric("prefix-cache hit rate", _pct(m.get("prefix_cache_hit_rate")))

    left, right = st.columns(2)
    with left:
        latency = latency_frame(summary)
        st.dataframe(
            latency,
            hide_index=True,
            key=f"{key}-latency",
            column_config={c: MS_FORMAT for c in latency.columns if c.endswith("(ms)")},
        )
        slos = slo_frame(summary)
        if slos.empty:
            st.caption("No SLOs set in the scenario.")
        else:
            st.dataframe(
                slos.style.map(
                    lambda v: (
                        "color: #1a7f37; font-weight: 600"
                        if v == "PASS"
                        else "color: #cf222e; font-weight: 600"
                    ),
                    subset=["verdict"],
                ),
                hide_index=True,
                key=f"{key}-slos",
                column_config={c: MS_FORMAT for c in slos.columns if c.endswith("(ms)")},
            )
    with right:
        st.dataframe(engine_frame(summary), hide_index=True, key=f"{key}-engine")


def pick_run(base: Path, key: str, label: str = "Run directory") -> Path | None:
    """A run under ``base`` (newest first) or any path typed in; None when there is none."""
    runs = list_runs(base)
    col1, col2 = st.columns([2, 3])
    chosen = col1.selectbox(
        label,
        runs,
        format_func=lambda p: p.name,
        key=f"{key}-select",
        placeholder=f"no runs in {base}",
        index=0 if runs else None,
    )
    typed = col2.text_input(
        "... or a path to a run directory",
        key=f"{key}-path",
        placeholder="e.g. runs/coding-agents-8b-h100-1",
    )
    if typed.strip():
        return Path(typed.strip())
    if chosen is None:
        st.info(
            f"No run directories in `{base}`. Simulate one with `kvsim run`, save one from the "
            "What-if page, or type a path."
        )
    return chosen
