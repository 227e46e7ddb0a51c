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

from sim.metrics import HEADLINE_METRICS, metric_value

# How sure the interval around a repeated measurement's median must be (see median_interval).
MEDIAN_CONFIDENCE = 0.75
# The validation issue's bound: kvsim within 10% of real vLLM on these metrics.
BOUND = 0.10
BOUNDED_METRICS = (
    "TTFT p50",
    "ITL p50",
    "E2E p50",
    "output throughput",
    "preemptions",
    "prefix-cache hit rate",
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

    def outside_bound(self, bound: float) -> bool:
        """Whether the value is more than ``bound`` (relative) off every median the reference
        runs are consistent with (:func:`median_interval`); a single run is its own median and
        a missing value is outside.

        The test a bound on a noisy measurement can fail on: with six replays whose median
        moves by several percent from one session to the next, a point error of 10.1% is not
        evidence that the bound is broken, and one of 25% is.
        """
        if self.value is None or self.reference is None:
            return True
        low, high = (
            median_interval(self.reference_runs)
            if len(self.reference_runs) > 1
            else (self.reference, self.reference)
        )
        return not low - bound * abs(low) <= self.value <= high + bound * abs(high)

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


def median_interval(
    values: Sequence[float], confidence: float = MEDIAN_CONFIDENCE
) -> tuple[float, float]:
    """Distribution-free interval for the median of what ``values`` sample: the k-th lowest
    and k-th highest value, with the largest k whose interval covers the median with at least
    ``confidence`` (it does with probability 1 - 2 P(Binomial(n, 1/2) < k)). Three values give
    their range (75%), six the second lowest and second highest (78%), nine the third (82%).
    """
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    below = 1  # P(Binomial(n, 1/2) < k) * 2**n, for k = 1
    k = 1
    while k + 1 <= (n + 1) // 2:
        below_next = below + math.comb(n, k)
        if 1 - 2 * below_next / 2**n < confidence:
            break
        below, k = below_next, k + 1
    return xs[k - 1], xs[n - k]


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
    for label, path, unit in HEADLINE_METRICS:
        runs = [metric_value(r, path) for r in references]
        present = tuple(v for v in runs if v is not None)
        reference = statistics.median(present) if len(present) == len(runs) else None
        kept = present if len(references) > 1 and reference is not None else ()
        rows.append(ComparisonRow(label, unit, metric_value(value, path), reference, kept))
    return rows


def broken_bounds(rows: Sequence[ComparisonRow], bound: float = BOUND) -> list[str]:
    """The bounded metrics whose value is outside ``bound`` (see ComparisonRow.outside_bound)."""
    return [r.metric for r in rows if r.metric in BOUNDED_METRICS and r.outside_bound(bound)]


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
