"""The claims report as Markdown, with its plots written as PNG beside it.

Pure functions of a :class:`~sim.claims.study.Study`, except :func:`write_report`, which
writes the files. Numbers are rounded for reading; the raw results go to ``claims.json``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from sim import __version__
from sim.claims.study import AMPLE_FACTOR, PRESSURE_LOAD, UTILIZATION_LOADS, Study
from sim.claims.variants import ALLOCATOR_VARIANTS, SESSION_VARIANTS, Variant
from sim.errors import KvsimConfigError
from sim.files import write_new_folder

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"


def _fmt(value: float | None, spec: str = ".3g") -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _kind(variant: Variant) -> str:
    return "vLLM-exact" if variant.vllm_exact else "what-if"


def setup_section(study: Study) -> list[str]:
    s = study.scenario
    e = s.engine
    slos = ", ".join(f"{k} <= {v:g} s" for k, v in s.slos.model_dump(exclude_none=True).items())
    return [
        "## Setup",
        "",
        f"- Scenario: `{s.name}` (seed {s.seed}): {s.description}",
        f"- Model: {s.model.name}; GPU: {s.hardware.name}; tensor parallel "
        f"{e.tensor_parallel_size}.",
        f"- Engine: block_size {e.block_size}, gpu_memory_utilization {e.gpu_memory_utilization}, "
        f"max_num_batched_tokens {e.max_num_batched_tokens}, max_num_seqs {e.max_num_seqs}, "
        f"max_model_len {e.max_model_len}, prefix caching "
        f"{'on' if e.enable_prefix_caching else 'off'}.",
        f"- SLOs (every request): {slos}.",
        f"- Load knob: `{study.knob_field}`; vLLM's capacity, the base of the relative loads "
        f"below: {_fmt(study.base_rate, '.4g')}.",
        f"- kvsim {__version__}. Rows marked *vLLM-exact* are configurations vLLM 0.32 runs "
        "(kvsim reproduces its scheduler step for step); *what-if* rows are policies vLLM 0.32 "
        "does not run as configured, simulated on the same engine, and the CPU offload tier: "
        "vLLM 0.32's own, modelled from its source but not checked against it (its CPU build "
        "cannot run it).",
        "",
    ]


def missing(variant: Variant, result: dict[str, Any] | None, needs: str) -> str | None:
    """Why a variant has no result holding ``needs``: this kvsim lacks its engine field,
    its simulation failed (the error), or it did not run; None when it has one."""
    if not variant.available():
        return variant.missing_reason()
    if result is None or needs not in result:
        return (result or {}).get("error", "not run")
    return None


def sessions_rows(study: Study) -> list[dict[str, Any]]:
    """One row per policy: its capacity and the peak concurrent sessions at it."""
    rows = []
    for variant in SESSION_VARIANTS:
        result = study.capacity.get(variant.key)
        note = missing(variant, result, "capacity")
        row: dict[str, Any] = {"variant": variant, "note": note, "capacity": None, "point": None}
        if note is None:
            assert result is not None
            row["capacity"] = result["capacity"]
            row["simulations"] = result["simulations"]
            points = [p for p in result["curve"] if p["load"] == result["capacity"]]
            row["point"] = points[0] if points else None
        rows.append(row)
    return rows


def sessions_section(study: Study) -> list[str]:
    rows = []
    for r in sessions_rows(study):
        v, p = r["variant"], r["point"]
        if p is None:
            rows.append([v.label, _kind(v), *["-"] * 6, r["note"] or "holds no load tried"])
            continue
        rows.append(
            [
                v.label,
                _kind(v),
                _fmt(r["capacity"], ".4g"),
                str(p["peak_concurrent_sessions"]),
                _fmt(p["ttft_p99_s"]),
                _fmt(p["itl_p99_s"]),
                str(p["preemptions"]),
                str(r["simulations"]),
                "",
            ]
        )
    header = ["policy", "kind", "sessions/s", "agents at once (peak)", "TTFT p99 s",
              "ITL p99 s", "preemptions", "simulations", "note"]  # fmt: skip
    return [
        "## Agent sessions per GPU within the SLOs",
        "",
        "The highest session arrival rate at which every request finishes within the SLOs "
        "(bisection to 2%), and the agent sessions in flight at once at that rate. Vendor "
        "material claims 8-12 agents per GPU for naive serving, 40-60 for vLLM and 120+ for an "
        "optimized stack.",
        "",
        *_table(header, rows),
        "",
        "![agents per GPU](sessions.png)",
        "",
    ]


def utilization_section(study: Study) -> list[str]:
    rows = []
    for f in UTILIZATION_LOADS:
        result = study.runs.get(("utilization", f"{f:g}"), {})
        if "summary" not in result:
            rows.append([f"{f:g}x", *["-"] * 6, result.get("error", "not run")])
            continue
        summary = result["summary"]
        m = summary["metrics"]
        minutes = summary["duration_s"] / 60
        preempt = m[PREEMPTIONS]["total"]
        rows.append(
            [
                f"{f:g}x",
                _pct(m[KV_USAGE]["mean"]),
                _pct(m[KV_USAGE]["p95"]),
                str(preempt),
                _fmt(preempt / minutes if minutes else None, ".3g"),
                _fmt(m[TTFT]["p99"]),
                "yes" if all(v["pass"] for v in summary["slos"].values()) else "no",
                "",
            ]
        )
    header = ["load (x vLLM capacity)", "KV usage mean", "KV usage p95", "preemptions",
              "preemptions/min", "TTFT p99 s", "SLOs hold", "note"]  # fmt: skip
    return [
        "## Steady-state KV utilization and what it costs",
        "",
        "vLLM at loads around its capacity: the KV usage it runs at (time-weighted over its "
        "steps) and the preemptions that buys. Operators target 88-92% KV utilization.",
        "",
        *_table(header, rows),
        "",
        "![KV usage vs preemptions](utilization.png)",
        "",
    ]


def pressure_rows(study: Study) -> list[dict[str, Any]]:
    """Each policy under overload against the ample-KV run: the share of its prefill tokens
    that the ample run did not compute (context computed again), and of its busy time."""
    ample = study.runs.get(("pressure", "ample"), {})
    rows = []
    for variant in SESSION_VARIANTS:
        if variant.key == "static":
            continue
        result = study.runs.get(("pressure", variant.key))
        note = missing(variant, result, "summary")
        row: dict[str, Any] = {"variant": variant, "result": result, "note": note}
        row["recomputed"] = row["busy_gap"] = None
        if note is None and result is not None and "summary" in ample:
            done, reference = result["summary"]["num_finished"], ample["summary"]["num_finished"]
            if done != reference:
                row["note"] = (
                    f"finished {done:,} requests, the reference {reference:,}: not "
                    "comparable (time limit)"
                )
            else:
                if result["prefill_tokens"]:
                    extra = result["prefill_tokens"] - ample["prefill_tokens"]
                    row["recomputed"] = extra / result["prefill_tokens"]
                if result["busy_s"] > 0:
                    row["busy_gap"] = 1 - ample["busy_s"] / result["busy_s"]
        rows.append(row)
    return rows


def pressure_section(study: Study) -> list[str]:
    ample = study.runs.get(("pressure", "ample"), {})
    rows = []
    if "summary" in ample:
        m = ample["summary"]["metrics"]
        rows.append(
            [
                f"reference: KV cache x{AMPLE_FACTOR} (vLLM)",
                "vLLM-exact",
                f"{ample['prefill_tokens']:,}",
                "-",
                _fmt(ample["busy_s"], ".4g"),
                "-",
                _pct(m.get("prefix_cache_hit_rate")),
                str(m[PREEMPTIONS]["total"]),
                "-",
                _fmt(m[TTFT]["p99"]),
                "",
            ]
        )
    for r in pressure_rows(study):
        v, result = r["variant"], r["result"]
        if result is None or "summary" not in result:  # not available, failed or not run
            rows.append([v.label, _kind(v), *["-"] * 8, r["note"]])
            continue
        summary = result["summary"]
        m = summary["metrics"]
        moved = summary.get("swap") or summary.get("offload") or {}
        transfer = moved.get("transfer_time_s")
        note = r["note"] or ""
        if "offload" in summary:  # its hits are counted apart from HBM's
            note = "; ".join(
                filter(None, [note, f"CPU store hit rate {_pct(moved.get('hit_rate'))}"])
            )
        rows.append(
            [
                v.label,
                _kind(v),
                f"{result['prefill_tokens']:,}",
                _pct(r["recomputed"]),
                _fmt(result["busy_s"], ".4g"),
                _pct(r["busy_gap"]),
                _pct(m.get("prefix_cache_hit_rate")),
                str(m[PREEMPTIONS]["total"]),
                _fmt(transfer, ".3g"),
                _fmt(m[TTFT]["p99"]),
                note,
            ]
        )
    header = ["policy", "kind", "prefill tokens", "of them computed again", "busy s",
              "busy time beyond the reference", "prefix hit rate", "preemptions", "transfer s",
              "TTFT p99 s", "note"]  # fmt: skip
    return [
        f"## Recompute vs swap under KV pressure ({PRESSURE_LOAD:g}x vLLM capacity)",
        "",
        "Each policy at the same overload, against the same requests on a KV cache "
        f"{AMPLE_FACTOR}x larger, where nothing is preempted or evicted. Prefill tokens a "
        "policy computes beyond the reference's are context computed again: prefixes evicted "
        "while an agent waited for its tool, and recompute after preemption. The busy-time "
        "gap is an upper bound on what that costs: the reference also batches more requests "
        "per step. InferCept reports recompute at 37-40% of forward time for "
        "tool-interrupted agents.",
        "",
        *_table(header, rows),
        "",
    ]


def waste_section(study: Study) -> list[str]:
    rows = []
    for variant in ALLOCATOR_VARIANTS:
        result = study.runs.get(("waste", variant.key))
        note = missing(variant, result, "summary")
        if note is not None or result is None:
            rows.append([variant.label, _kind(variant), *["-"] * 9, note])
            continue
        waste = result["summary"].get("kv_waste_breakdown") or {}
        shares = waste.get("shares_of_capacity") or {}
        rows.append(
            [
                variant.label,
                _kind(variant),
                _pct(waste.get("effective_utilization")),
                _pct(waste.get("stored_share_of_allocated")),
                _pct(shares.get("reserved_unused")),
                _pct(shares.get("internal_fragmentation")),
                _pct(shares.get("external_fragmentation")),
                _pct(shares.get("free")),
                _fmt(waste.get("mean_live_requests"), ".3g"),
                str(waste.get("max_live_requests", "-")),
                _fmt(result["summary"]["metrics"][TTFT]["p99"]),
                "",
            ]
        )
    header = ["allocator", "kind", "effective KV utilization", "allocated KV holding tokens",
              "reserved, unused", "internal fragmentation", "external fragmentation", "free",
              "requests at once (mean)", "(max)", "TTFT p99 s", "note"]  # fmt: skip
    return [
        "## KV memory waste by allocator (at vLLM's capacity)",
        "",
        "Shares of the KV capacity, time-weighted over the run's steps (effective KV "
        "utilization: tokens stored / capacity; allocated KV holding tokens: the PagedAttention "
        "paper's measure, tokens stored / memory allocated to requests). Vendor material says "
        "static allocation wastes 60-80% of KV memory and paging under 4%; the PagedAttention "
        "paper measured 20.4-38.2% effective KV use for Orca-style reservation against 96.3% "
        "for vLLM (13B model, ShareGPT-like lengths).",
        "",
        *_table(header, rows),
        "",
    ]


def render_markdown(study: Study) -> str:
    lines = [
        f"# Claims about KV memory policies, measured: {study.scenario.name}",
        "",
        *setup_section(study),
        *waste_section(study),
        *sessions_section(study),
        *utilization_section(study),
        *pressure_section(study),
    ]
    return "\n".join(lines).rstrip() + "\n"


def sessions_figure(study: Study) -> go.Figure:
    rows = [r for r in sessions_rows(study) if r["point"] is not None]
    return go.Figure(
        go.Bar(
            x=[r["variant"].label for r in rows],
            y=[r["point"]["peak_concurrent_sessions"] for r in rows],
            marker_color=["#1f77b4" if r["variant"].vllm_exact else "#ff7f0e" for r in rows],
        ),
        layout={
            "title": "Agent sessions at once within the SLOs (blue: vLLM-exact, orange: what-if)",
            "yaxis_title": "agents at once (peak)",
            "width": 1000,
            "height": 500,
        },
    )


def utilization_figure(study: Study) -> go.Figure:
    xs, ys, labels = [], [], []
    for f in UTILIZATION_LOADS:
        summary = study.runs.get(("utilization", f"{f:g}"), {}).get("summary")
        if summary is None:
            continue
        m = summary["metrics"]
        xs.append(100 * m[KV_USAGE]["mean"])
        ys.append(m[PREEMPTIONS]["total"] / max(summary["duration_s"] / 60, 1e-9))
        labels.append(f"{f:g}x")
    return go.Figure(
        go.Scatter(x=xs, y=ys, text=labels, mode="lines+markers+text", textposition="top center"),
        layout={
            "title": "vLLM: steady-state KV usage vs preemptions (load x capacity)",
            "xaxis_title": "KV usage, time-weighted mean (%)",
            "yaxis_title": "preemptions per minute",
            "width": 800,
            "height": 500,
        },
    )


def write_png(figure: go.Figure, path: Path) -> None:
    """Plotly's static export (kaleido, the ``report`` extra, and a Chromium it finds)."""
    try:
        figure.write_image(path)
    except Exception as exc:  # kaleido missing, or no browser for it to drive
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvsimConfigError(
            f"cannot write the report's PNG plots ({reason}): they need kaleido, the report "
            "extra of kvsim (pip install 'kvsim[report]'), and a Chromium for it to drive "
            "(Debian: apt install chromium)"
        ) from None


def check_png_export() -> None:
    """Fail before any simulation when the plots could not be written at the end (the
    probe is written in a temporary folder: where the report goes is checked apart)."""
    with tempfile.TemporaryDirectory(prefix="kvsim-png-") as scratch:
        write_png(go.Figure(go.Bar(x=[0], y=[1])), Path(scratch) / "probe.png")


def write_report(study: Study, out: Path) -> Path:
    """``claims.md``, its PNG plots and ``claims.json`` in the new directory ``out``, written
    in a hidden sibling of this process first and renamed into place, so an interrupted or
    failed report leaves nothing (:func:`sim.files.write_new_folder`)."""

    def plots(folder: Path) -> None:
        write_png(sessions_figure(study), folder / "sessions.png")
        write_png(utilization_figure(study), folder / "utilization.png")

    raw = {
        "scenario": study.scenario.model_dump(mode="json"),
        "knob": study.knob_field,
        "base_rate": study.base_rate,
        "capacity": study.capacity,
        "runs": {f"{group}/{key}": result for (group, key), result in study.runs.items()},
    }
    files = {
        "claims.json": json.dumps(raw, indent=1, default=str) + "\n",
        "claims.md": render_markdown(study),
    }
    write_new_folder(out, files, extra=plots)
    return out / "claims.md"
