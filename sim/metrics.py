"""Metrics: pure functions from a run's request and step tables to its summary.

Names follow vLLM's Prometheus metrics (``vllm:time_to_first_token_seconds`` ...) so one
dashboard reads simulated and measured runs alike. Latency stats are p50/p90/p99/mean
(numpy's linear interpolation, as ``vllm bench serve``); the mean of KV usage and of running
requests is time-weighted over steps (a long step counts for its duration), the p95 of KV
usage is over steps (one sample each). Throughputs and goodput are per second of the run's
``duration_s`` (from 0 to the end of its last step, or its time limit).
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

import numpy as np
import pandas as pd

TTFT = "vllm:time_to_first_token_seconds"
ITL = "vllm:inter_token_latency_seconds"
E2E = "vllm:e2e_request_latency_seconds"
QUEUE = "vllm:request_queue_time_seconds"
TPOT = "vllm:request_time_per_output_token_seconds"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREEMPTIONS = "vllm:num_preemptions"
PREFIX_HITS = "vllm:prefix_cache_hits"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"

# The latency rows of the console and dashboard tables: (label, key in summary["metrics"]).
LATENCIES = (("TTFT", TTFT), ("ITL", ITL), ("TPOT", TPOT), ("E2E", E2E), ("queue", QUEUE))


def _clean(x: float) -> float | None:
    """JSON-safe float: NaN (no sample) becomes None."""
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def latency_stats(values: np.ndarray | pd.Series) -> dict[str, float | None]:
    """p50/p90/p99/mean of the finite samples; None where there are none."""
    arr = np.asarray(values, dtype=float)
    finite = np.isfinite(arr)
    if not finite.all():
        arr = arr[finite]
    if arr.size == 0:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "count": 0}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "mean": float(arr.mean()),
        "count": int(arr.size),
    }


def itl_samples(requests: pd.DataFrame) -> np.ndarray:
    """Every inter-token gap of every request (vLLM's ITL histogram observes each one)."""
    # Written into one array (np.diff's values): a 100k-request run has millions of gaps,
    # and a list of per-request diffs concatenated would hold them twice.
    times = [np.asarray(t, dtype=float) for t in requests["token_times_s"] if len(t) > 1]
    gaps = np.empty(sum(len(t) - 1 for t in times))
    start = 0
    for t in times:
        end = start + len(t) - 1
        np.subtract(t[1:], t[:-1], out=gaps[start:end])
        start = end
    return gaps


def time_weighted(values: pd.Series, weights: pd.Series) -> float:
    total = float(weights.sum())
    if total <= 0:
        return float(values.mean()) if len(values) else math.nan
    return float((values * weights).sum() / total)


def kv_usage_stats(steps: pd.DataFrame) -> dict[str, float | None]:
    if steps.empty:
        return {"mean": None, "p95": None, "peak": None}
    usage = steps["kv_cache_usage_perc"]
    return {
        "mean": _clean(time_weighted(usage, steps["duration_s"])),
        "p95": float(np.percentile(usage, 95)),
        "peak": float(usage.max()),
    }


def kv_waste(steps: pd.DataFrame, num_usable_blocks: int, block_size: int) -> dict[str, Any]:
    """Slots in allocated blocks that hold no token (partial tail blocks, chunk look-ahead).

    Reported as a share of allocated slots (time-weighted) and as a mean slot count.
    """
    if steps.empty:
        return {"unused_slots_mean": None, "unused_slot_frac_of_allocated": None}
    used_blocks = num_usable_blocks * steps["kv_cache_usage_perc"]
    allocated = (used_blocks * block_size).where(lambda s: s > 0)
    frac = (steps["kv_unused_slots"] / allocated).fillna(0.0)
    return {
        "unused_slots_mean": _clean(time_weighted(steps["kv_unused_slots"], steps["duration_s"])),
        "unused_slot_frac_of_allocated": _clean(time_weighted(frac, steps["duration_s"])),
    }


def peak_concurrent_sessions(
    requests: pd.DataFrame, end_s: float, open_sessions: Collection[int] = ()
) -> int:
    """Most agent sessions alive at once: each from its first arrival to its last finish,
    or to ``end_s`` for the ``open_sessions`` a run cut at its time limit left mid-turn or
    in a tool wait."""
    sessions = requests[requests["session_id"] >= 0]
    if sessions.empty:
        return 0
    spans = sessions.groupby("session_id").agg(start=("arrival_s", "min"), end=("finish_s", "max"))
    ends = spans["end"].fillna(end_s)
    if open_sessions:
        ends[ends.index.isin(list(open_sessions))] = end_s
    ends = ends.to_numpy()
    events = np.concatenate(
        [
            np.stack([spans["start"].to_numpy(), np.ones(len(spans))], 1),
            np.stack([ends, -np.ones(len(spans))], 1),
        ]
    )
    # Ends sort before starts at the same instant: a session that ends as another starts
    # is not concurrent with it.
    order = np.lexsort((events[:, 1], events[:, 0]))
    return int(np.cumsum(events[order, 1]).max())


def slo_mask(requests: pd.DataFrame, slos: dict[str, float | None]) -> pd.Series:
    """Finished requests meeting every set SLO (per request: its TTFT, mean ITL, E2E)."""
    ok = requests["finish_s"].notna()
    if slos.get("ttft_p99_s") is not None:
        ok &= requests["ttft_s"] <= slos["ttft_p99_s"]
    if slos.get("itl_p99_s") is not None:
        ok &= requests["mean_itl_s"].fillna(0.0) <= slos["itl_p99_s"]
    if slos.get("e2e_p99_s") is not None:
        ok &= requests["e2e_s"] <= slos["e2e_p99_s"]
    return ok


def slo_report(latency: dict[str, dict[str, Any]], slos: dict[str, float | None]) -> dict[str, Any]:
    """Pass/fail of each set SLO against the run's p99."""
    report = {}
    for key, metric in (("ttft_p99_s", TTFT), ("itl_p99_s", ITL), ("e2e_p99_s", E2E)):
        target = slos.get(key)
        if target is None:
            continue
        value = latency[metric]["p99"]
        report[key] = {
            "target": target,
            "value": value,
            "pass": value is not None and value <= target,
        }
    return report


def by_priority_class(requests: pd.DataFrame) -> dict[str, dict[str, Any]]:
    """TTFT and E2E per priority class (interactive vs background agents...)."""
    out = {}
    for name, group in requests.groupby("priority_class", sort=True):
        out[str(name)] = {
            "count": len(group),
            "ttft_s": latency_stats(group["ttft_s"]),
            "e2e_s": latency_stats(group["e2e_s"]),
        }
    return out


def swap_summary(
    steps: pd.DataFrame, duration_s: float, *, cpu_blocks: int | None = None, replicas: int = 1
) -> dict[str, Any]:
    """The ``swap`` section of a swap-preemption run (its step table has the swap columns):
    the CPU pool's size in blocks (``cpu_blocks``, one engine's), blocks, bytes and requests
    moved each way, swap-outs per minute, seconds spent copying (and their share of the
    run), and victims that fell back to recompute. A fleet of ``replicas`` has a pool per
    replica: the share of time copying is their mean, the peak the most any replica held,
    the counts are summed (the section's ``note`` says so)."""
    minutes = duration_s / 60.0 if duration_s > 0 else math.nan

    def total(name: str) -> int:
        return int(steps[name].sum()) if not steps.empty else 0

    transfer_s = float(steps["swap_transfer_s"].sum()) if not steps.empty else 0.0
    num_swap_outs = total("num_swap_outs")
    fleet = (
        {
            "note": f"a fleet of {replicas} replicas, a CPU swap pool each: cpu_blocks is one "
            "replica's pool, peak_requests_swapped the most any replica held, "
            "transfer_time_frac their mean; the other counts are summed over the replicas"
        }
        if replicas > 1
        else {}
    )
    return {
        **fleet,
        **({"cpu_blocks": cpu_blocks} if cpu_blocks is not None else {}),
        "swap_out_blocks": total("swap_out_blocks"),
        "swap_in_blocks": total("swap_in_blocks"),
        "swap_in_reused_blocks": total("swap_in_reused_blocks"),
        "swap_out_bytes": total("swap_out_bytes"),
        "swap_in_bytes": total("swap_in_bytes"),
        "num_swap_outs": num_swap_outs,
        "num_swap_ins": total("num_swap_ins"),
        "swap_outs_per_minute": _clean(num_swap_outs / minutes),
        "swap_ins_per_minute": _clean(total("num_swap_ins") / minutes),
        "transfer_time_s": transfer_s,
        "transfer_time_frac": (
            _clean(transfer_s / (duration_s * max(1, replicas))) if duration_s > 0 else None
        ),
        "steps_with_transfers": int((steps["swap_transfer_s"] > 0).sum()) if not steps.empty else 0,
        "recompute_fallbacks": total("num_swap_fallbacks"),
        "peak_requests_swapped": _peak(steps, "num_requests_swapped"),
    }


def returning_turns(requests: pd.DataFrame) -> dict[str, Any]:
    """What returning turns (turn >= 1 of an agent session) got from the KV cache: prompt
    and cached tokens (prefix hits, and tokens loaded from a CPU offload tier), and how fast
    they started. A workload without sessions has none."""
    returning = requests[requests["turn"] >= 1] if "turn" in requests else requests.iloc[:0]
    prompt = int(returning["prompt_tokens"].sum())
    cached = int(returning["cached_tokens"].sum())
    ttft = returning["ttft_s"].dropna()
    return {
        "num_requests": len(returning),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefix_hit_rate": cached / prompt if prompt else None,
        "ttft_p50_s": float(ttft.quantile(0.5)) if len(ttft) else None,
        "ttft_p90_s": float(ttft.quantile(0.9)) if len(ttft) else None,
        "num_preemptions": int(returning["num_preemptions"].sum()),
    }


def _peak(steps: pd.DataFrame, name: str) -> int:
    """Largest value of a step column (0 for no steps)."""
    return int(steps[name].max()) if not steps.empty else 0


def summarize(
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    *,
    duration_s: float,
    num_usable_blocks: int,
    block_size: int,
    slos: dict[str, float | None],
    open_sessions: Collection[int] = (),
) -> dict[str, Any]:
    """The ``metrics`` and ``slos`` sections of summary.json. ``open_sessions``: the agent
    sessions still alive when a cut run stopped (:class:`sim.workload.base.WorkloadRun`)."""
    finished = requests[requests["finish_s"].notna()]
    # As vLLM's Prometheus histograms observe them: TTFT at each first token, ITL at each
    # later one; E2E, queue time and TPOT once a request finishes (TPOT is its mean ITL, 0
    # for a single output token), so a run cut at its limit leaves the unfinished out.
    latency = {
        TTFT: latency_stats(requests["ttft_s"]),
        ITL: latency_stats(itl_samples(requests)),
        TPOT: latency_stats(finished["mean_itl_s"].fillna(0.0)),
        E2E: latency_stats(finished["e2e_s"]),
        QUEUE: latency_stats(finished["queue_s"]),
    }
    span_s = duration_s if duration_s > 0 else math.nan
    output_tokens = int(requests["output_tokens"].sum())
    queries = int(steps["prefix_cache_queries"].sum()) if not steps.empty else 0
    hits = int(steps["prefix_cache_hits"].sum()) if not steps.empty else 0
    preempted = requests["num_preemptions"]
    good = slo_mask(requests, slos)
    metrics: dict[str, Any] = {
        **latency,
        KV_USAGE: kv_usage_stats(steps),
        PREEMPTIONS: {
            "total": int(preempted.sum()),
            "requests_preempted": int((preempted > 0).sum()),
            "per_request_mean": _clean(float(preempted.mean())) if len(preempted) else None,
            "per_request_max": int(preempted.max()) if len(preempted) else 0,
        },
        PREFIX_QUERIES: queries,
        PREFIX_HITS: hits,
        "prefix_cache_hit_rate": hits / queries if queries else None,
        RUNNING: {
            "mean": _clean(time_weighted(steps[RUNNING.split(":")[1]], steps["duration_s"]))
            if not steps.empty
            else None,
            "peak": int(steps["num_requests_running"].max()) if not steps.empty else 0,
        },
        WAITING: {"peak": int(steps["num_requests_waiting"].max()) if not steps.empty else 0},
        "output_throughput_tok_s": _clean(output_tokens / span_s),
        "request_throughput_req_s": _clean(len(finished) / span_s),
        "goodput_req_s": _clean(int(good.sum()) / span_s),
        "slo_attainment": _clean(float(good.mean())) if len(requests) else None,
        "kv_waste": kv_waste(steps, num_usable_blocks, block_size),
        "peak_concurrent_sessions": peak_concurrent_sessions(requests, duration_s, open_sessions),
        "by_priority_class": by_priority_class(requests),
        "num_steps": len(steps),
    }
    return {"metrics": metrics, "slos": slo_report(latency, slos)}


# The metrics kvsim validate, kvsim compare and kvsim run --samples report:
# (label, path into summary["metrics"], unit: "s", "tok/s", "frac" (a 0-1 share) or "" (count))
HEADLINE_METRICS: tuple[tuple[str, tuple[str, ...], str], ...] = (
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


def metric_value(summary: dict[str, Any], path: tuple[str, ...]) -> float | None:
    """The value at ``path`` in ``summary["metrics"]`` (see HEADLINE_METRICS); None if absent."""
    node: Any = summary.get("metrics", {})
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return None if node is None else float(node)
