"""Compare two runs metric by metric: the error table of ``kvsim validate`` and ``compare``.

Pure functions over ``summary.json`` contents, so simulated runs, measured runs and runs
imported from ``vllm bench serve`` compare alike. A reference measured several times (one
scenario replayed in several fresh processes) compares against the median of its runs, and
the rows keep every run's value so the table can show the measurement's own spread.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sim.metrics import E2E, ITL, KV_USAGE, PREEMPTIONS, QUEUE, TTFT

# (label, path into summary["metrics"], unit: "s", "tok/s", "frac" (a 0-1 share) or "" (count))
COMPARED_METRICS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("TTFT p50", (TTFT, "p50"), "s"),
    ("TTFT p90", (TTFT, "p90"), "s"),
    ("TTFT p99", (TTFT, "p99"), "s"),
    ("ITL p50", (ITL, "p50"), "s"),
    ("ITL p99", (ITL, "p99"), "s"),
    ("E2E p50", (E2E, "p50"), "s"),
    ("E2E p99", (E2E, "p99"), "s"),
    ("queue time p50", (QUEUE, "p50"), "s"),
    ("output throughput", ("output_throughput_tok_s",), "tok/s"),
    ("preemptions", (PREEMPTIONS, "total"), ""),
    ("prefix-cache hit rate", ("prefix_cache_hit_rate",), "frac"),
    ("KV usage mean", (KV_USAGE, "mean"), "frac"),
    ("KV usage peak", (KV_USAGE, "peak"), "frac"),
)


@dataclass(frozen=True)
class ComparisonRow:
    metric: str
    unit: str
    value: float | None  # the run under test (e.g. the simulation)
    reference: float | None  # the reference (e.g. the measurement; the median of its runs)
    reference_runs: tuple[float, ...] = ()  # each reference run's value, when repeated

    @property
    def relative_error(self) -> float | None:
        """(value - reference) / reference; None when either is missing or reference is 0."""
        if self.value is None or self.reference is None:
            return None
        if self.reference == 0:
            return 0.0 if self.value == 0 else math.inf
        return (self.value - self.reference) / abs(self.reference)

    @property
    def reference_spread(self) -> tuple[float, float] | None:
        """Lowest and highest reference run relative to the reference (the median); None
        for a single run or a zero reference."""
        if len(self.reference_runs) < 2 or not self.reference:
            return None
        ref = abs(self.reference)
        return (min(self.reference_runs) - self.reference) / ref, (
            max(self.reference_runs) - self.reference
        ) / ref


def metric_value(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    node: Any = summary.get("metrics", {})
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node is None else float(node)


def compare_summaries(value: dict[str, Any], reference: dict[str, Any]) -> list[ComparisonRow]:
    """One row per compared metric: value, reference and relative error."""
    return compare_to_runs(value, [reference])


def compare_to_runs(
    value: dict[str, Any], references: Sequence[dict[str, Any]]
) -> list[ComparisonRow]:
    """One row per compared metric against the median of several reference runs (the same
    scenario measured repeatedly); a metric missing from any run is missing."""
    if not references:
        raise ValueError("compare_to_runs needs at least one reference run")
    rows = []
    for label, path, unit in COMPARED_METRICS:
        runs = [metric_value(r, path) for r in references]
        present = tuple(v for v in runs if v is not None)
        reference = statistics.median(present) if len(present) == len(runs) else None
        kept = present if len(references) > 1 and reference is not None else ()
        rows.append(ComparisonRow(label, unit, metric_value(value, path), reference, kept))
    return rows


def rows_to_records(rows: list[ComparisonRow]) -> list[dict[str, Any]]:
    """JSON-ready rows (for report.json and the dashboard)."""
    return [
        {
            "metric": r.metric,
            "unit": r.unit,
            "value": r.value,
            "reference": r.reference,
            "relative_error": r.relative_error,
            "reference_runs": list(r.reference_runs),
        }
        for r in rows
    ]
