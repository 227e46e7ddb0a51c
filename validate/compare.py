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

Metrics = Sequence[tuple[str, tuple[str, ...], str]]  # as HEADLINE_METRICS

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
# The figures the validation issue's bar names: these within BOUND, and the replays' median
# inside kvsim's band on each.
BAR_FIGURES = BOUNDED_METRICS[:4]
# What two runs' SLOs make of their requests: kvsim compare's and the dashboard's rows after
# the headline ones (validation leaves them out: replay and simulation share the scenario's
# SLOs, so they say nothing its latencies do not).
SLO_METRICS: Metrics = (
    ("goodput", ("goodput_req_s",), "req/s"),
    ("SLO attainment", ("slo_attainment",), "frac"),
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
        """(value - reference) / |reference|; None when either is missing, and infinite (of the
        value's sign) when only the reference is 0: :func:`rows_to_records` writes that as
        null, with the reason."""
        if self.value is None or self.reference is None:
            return None
        if self.reference == 0:
            return 0.0 if self.value == 0 else math.copysign(math.inf, self.value)
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
    """One row per headline metric and per :data:`SLO_METRICS` one: value, reference and
    relative error (:func:`slo_mismatch` says when the two runs' SLOs differ)."""
    return compare_to_runs(value, [reference], (*HEADLINE_METRICS, *SLO_METRICS))


def slo_mismatch(value: dict[str, Any], reference: dict[str, Any]) -> str | None:
    """Why the two runs' goodput and SLO attainment do not compare like with like (their
    summaries' SLO targets differ), or None when they share them."""
    a, b = (
        {key: verdict.get("target") for key, verdict in (s.get("slos") or {}).items()}
        for s in (value, reference)
    )
    differ = [key for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)]
    if not differ:
        return None

    def shown(target: float | None) -> str:
        return "none" if target is None else f"{target:g} s"

    pairs = "; ".join(f"{k} {shown(a.get(k))} against {shown(b.get(k))}" for k in differ)
    return (
        f"the runs' SLOs differ ({pairs}): their goodput and SLO attainment count requests "
        "against different bounds"
    )


def compare_to_runs(
    value: dict[str, Any],
    references: Sequence[dict[str, Any]],
    metrics: Metrics = HEADLINE_METRICS,
) -> list[ComparisonRow]:
    """One row per metric of ``metrics`` against the median of several reference runs (the
    same scenario measured repeatedly); a metric missing from any run is missing, and so is
    a value that is not finite (a NaN is a statistic without samples, as None is)."""
    if not references:
        raise ValueError("compare_to_runs needs at least one reference run")
    rows = []
    for label, path, unit in metrics:
        runs = [_finite(metric_value(r, path)) for r in references]
        present = tuple(v for v in runs if v is not None)
        reference = statistics.median(present) if len(present) == len(runs) else None
        kept = present if len(references) > 1 and reference is not None else ()
        rows.append(ComparisonRow(label, unit, _finite(metric_value(value, path)), reference, kept))
    return rows


def broken_bounds(rows: Sequence[ComparisonRow], bound: float = BOUND) -> list[str]:
    """The bounded metrics whose value is outside ``bound`` (see ComparisonRow.outside_bound)."""
    return [r.metric for r in rows if r.metric in BOUNDED_METRICS and r.outside_bound(bound)]


def _finite(x: float | None) -> float | None:
    """``x``, or None where it is missing or not finite (JSON has no NaN or infinity)."""
    return x if x is not None and math.isfinite(x) else None


def why_no_relative_error(row: ComparisonRow) -> str | None:
    """Why ``row`` has no finite relative error to write, or None when it has one."""
    if row.value is None:
        return "no value"
    if row.reference is None:
        return "no reference"
    if not (math.isfinite(row.value) and math.isfinite(row.reference)):
        return "not finite"
    if row.reference == 0 and row.value != 0:
        # A count of 0 measured against a few simulated: the record keeps both.
        return "reference is 0, value is not"
    if row.relative_error is None or not math.isfinite(row.relative_error):
        return "not finite"  # overflowed
    return None


def rows_to_records(rows: list[ComparisonRow]) -> list[dict[str, Any]]:
    """JSON-ready rows (for report.json, ``compare --out`` and the dashboard): strict JSON,
    so a relative error that is not finite (a count of 0 in the reference against a few in
    the value) is null, and ``relative_error_missing`` says why (None when there is one)."""
    return [
        {
            "metric": r.metric,
            "unit": r.unit,
            "value": _finite(r.value),
            "reference": _finite(r.reference),
            "relative_error": _finite(r.relative_error),
            "relative_error_missing": why_no_relative_error(r),
            "reference_runs": list(r.reference_runs),
        }
        for r in rows
    ]
