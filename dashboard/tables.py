"""Summary tables as DataFrames: pure functions of ``summary.json`` contents (no Streamlit)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from sim.metrics import KV_USAGE, LATENCIES, PREEMPTIONS
from validate.compare import ComparisonRow


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def headline(summary: dict[str, Any]) -> str:
    """One line: scenario, model on hardware, source, requests and simulated span."""
    return (
        f"{summary.get('scenario', '?')}: {summary.get('model', '?')} on "
        f"{summary.get('hardware', '?')} [{summary.get('source', '?')}] "
        f"{summary.get('num_finished', 0):,}/{summary.get('num_requests', 0):,} requests "
        f"in {summary.get('duration_s', 0.0):,.1f} s"
    )


def latency_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """p50/p90/p99/mean (ms) and sample count of TTFT, ITL, TPOT, E2E and queue time."""
    m = summary.get("metrics", {})
    rows = []
    for name, key in LATENCIES:
        s = m.get(key) or {}
        rows.append(
            {
                "latency": name,
                "p50 (ms)": _ms(s.get("p50")),
                "p90 (ms)": _ms(s.get("p90")),
                "p99 (ms)": _ms(s.get("p99")),
                "mean (ms)": _ms(s.get("mean")),
                "samples": s.get("count"),
            }
        )
    return pd.DataFrame(rows)


def engine_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """KV cache, preemption, prefix cache, throughput, goodput and per-class rows."""
    m = summary.get("metrics", {})
    kv = m.get(KV_USAGE) or {}
    p = m.get(PREEMPTIONS) or {}
    waste = (m.get("kv_waste") or {}).get("unused_slot_frac_of_allocated")
    rows = [
        (
            "KV cache usage mean / p95 / peak",
            f"{_pct(kv.get('mean'))} / {_pct(kv.get('p95'))} / {_pct(kv.get('peak'))}",
        ),
        ("KV slots allocated but empty", _pct(waste)),
        (
            "preemptions (requests hit, max per request)",
            f"{p.get('total', 0):,} ({p.get('requests_preempted', 0):,}, "
            f"{p.get('per_request_max', 0)})",
        ),
        ("prefix cache hit rate", _pct(m.get("prefix_cache_hit_rate"))),
        ("output throughput", f"{_num(m.get('output_throughput_tok_s'))} tok/s"),
        ("request throughput", f"{_num(m.get('request_throughput_req_s'), '.2f')} req/s"),
        (
            "goodput (finished within every SLO)",
            f"{_num(m.get('goodput_req_s'), '.2f')} req/s "
            f"({_pct(m.get('slo_attainment'))} of its requests)",
        ),
        ("peak concurrent sessions", f"{m.get('peak_concurrent_sessions', 0):,}"),
    ]
    kv_cache = summary.get("kv_cache") or {}
    if kv_cache.get("num_gpu_blocks"):
        # Usable blocks, as kvsim run prints them: vLLM's null block holds no KV.
        per_replica = " per replica" if isinstance(summary.get("fleet"), dict) else ""
        rows.append(
            (
                "KV blocks (block size)",
                f"{kv_cache['num_gpu_blocks'] - 1:,} usable{per_replica} "
                f"({kv_cache.get('block_size', '?')} tokens)",
            )
        )
    classes = m.get("by_priority_class") or {}
    if len(classes) > 1:
        for name, stats in classes.items():
            ttft = stats.get("ttft_s") or {}
            rows.append(
                (
                    f"TTFT p50 / p99 of {name} ({stats.get('count', 0):,} requests)",
                    f"{_num(_ms(ttft.get('p50')))} / {_num(_ms(ttft.get('p99')))} ms",
                )
            )
    return pd.DataFrame(rows, columns=["engine", "value"])


def slo_frame(summary: dict[str, Any]) -> pd.DataFrame:
    """One row per set SLO: target and measured p99 (ms) and PASS / FAIL."""
    rows = []
    for key, verdict in (summary.get("slos") or {}).items():
        rows.append(
            {
                "SLO": key,
                "target (ms)": _ms(verdict.get("target")),
                "p99 (ms)": _ms(verdict.get("value")),
                "verdict": "PASS" if verdict.get("pass") else "FAIL",
            }
        )
    return pd.DataFrame(rows, columns=["SLO", "target (ms)", "p99 (ms)", "verdict"])


def comparison_frame(rows: list[ComparisonRow]) -> pd.DataFrame:
    """The error table: value, reference and relative error in % (inf when reference is 0)."""
    records = []
    for r in rows:
        err = r.relative_error
        records.append(
            {
                "metric": r.metric,
                "unit": r.unit or "-",
                "value": r.value,
                "reference": r.reference,
                "relative error (%)": None if err is None else err * 100,
            }
        )
    return pd.DataFrame(records)


def fleet_frame(fleet: dict[str, Any]) -> pd.DataFrame:
    """One row per replica of a fleet run's ``per_replica`` figures (percentages and ms)."""
    rows = []
    for r in fleet.get("per_replica") or []:
        kv = r.get("kv_cache_usage") or {}
        ttft = r.get("ttft_s") or {}
        hit = r.get("prefix_cache_hit_rate")
        busy = r.get("busy_frac")
        rows.append(
            {
                "replica": r.get("replica"),
                "requests": r.get("num_requests"),
                "finished": r.get("num_finished"),
                "output tokens": r.get("output_tokens"),
                "busy (%)": None if busy is None else busy * 100,
                "KV mean (%)": None if kv.get("mean") is None else kv["mean"] * 100,
                "KV peak (%)": None if kv.get("peak") is None else kv["peak"] * 100,
                "prefix hit rate (%)": None if hit is None else hit * 100,
                "preemptions": r.get("preemptions"),
                "TTFT p50 (ms)": _ms(ttft.get("p50")),
                "TTFT p99 (ms)": _ms(ttft.get("p99")),
            }
        )
    return pd.DataFrame(rows, columns=FLEET_COLUMNS)


FLEET_COLUMNS = [
    "replica",
    "requests",
    "finished",
    "output tokens",
    "busy (%)",
    "KV mean (%)",
    "KV peak (%)",
    "prefix hit rate (%)",
    "preemptions",
    "TTFT p50 (ms)",
    "TTFT p99 (ms)",
]
IMBALANCES = (
    ("requests", "requests"),
    ("output tokens", "output_tokens"),
    ("busy time", "busy_time"),
)


def router_line(fleet: dict[str, Any]) -> str:
    """The fleet's what-if in one line: replicas, router kind and its settings."""
    router = dict(fleet.get("router") or {})
    kind = router.pop("kind", "?")
    settings = ", ".join(f"{k}={v}" for k, v in sorted(router.items()))
    return (
        f"What-if: {fleet.get('replicas', '?')} replicas behind a simulated `{kind}` router"
        + (f" ({settings})" if settings else "")
        + "; each replica is the vLLM-exact engine."
    )
