"""A fleet run's tables and its ``fleet`` section of ``summary.json``.

``requests.parquet`` keeps submit order across the fleet and gains a ``replica`` column;
``steps.parquet`` holds every replica's steps (each replica counts its own ``step`` from 1),
ordered by start time then replica, with a ``replica`` column. The run's ``metrics`` are
computed over these tables as for one engine: request metrics are fleet-wide, step metrics
(KV usage, running and waiting requests, KV waste) pool the steps of all replicas, i.e. they
describe the average and the worst replica. The ``fleet`` section has each replica's own
figures and the load imbalance (max / mean over replicas).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from sim.fleet.config import FleetConfig
from sim.metrics import kv_usage_stats, latency_stats

REPLICA = "replica"


def _labelled(frames: Sequence[pd.DataFrame]) -> pd.DataFrame:
    """The replicas' tables one after the other, each row with its replica's index."""
    return pd.concat(
        [
            frame.assign(**{REPLICA: np.full(len(frame), index, dtype=np.int64)})
            for index, frame in enumerate(frames)
        ],
        ignore_index=True,
    )


def fleet_requests(frames: Sequence[pd.DataFrame], assignments: Sequence[int]) -> pd.DataFrame:
    """Each replica's request table (its own submit order) merged in the fleet's submit
    order (``assignments[k]`` is the replica of the k-th request)."""
    order = np.asarray(assignments, dtype=np.int64)
    merged = _labelled(frames)
    # Row r of ``merged`` is the request at position grouped[r] of the submit order.
    grouped = np.argsort(order, kind="stable")
    rows = np.empty_like(grouped)
    rows[grouped] = np.arange(len(grouped))
    return merged.iloc[rows].reset_index(drop=True)


def fleet_steps(tables: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """Every replica's steps, by start time then replica (equal starts in replica order).

    ``tables``: each replica's step columns (a recorder's ``steps``: name -> int64 or
    float64 array, the same names in every replica). Built one column at a time, straight
    from those arrays: a large fleet's step table has millions of rows, and per-replica
    frames concatenated and sorted whole held it four or five times over."""
    lengths = [len(table["start_s"]) for table in tables]
    replica = np.repeat(np.arange(len(tables), dtype=np.int64), lengths)
    start_s = np.concatenate([np.asarray(table["start_s"], dtype=np.float64) for table in tables])
    # Rows are in replica order already: a stable sort on start time alone keeps that order
    # for equal starts (and each replica's own).
    order = np.argsort(start_s, kind="stable")
    del start_s
    columns = {
        name: np.concatenate([np.asarray(table[name]) for table in tables])[order]
        for name in tables[0]
    }
    columns[REPLICA] = replica[order]
    return pd.DataFrame(columns, copy=False)  # the sorted columns are this frame's own


def _imbalance(values: Sequence[float]) -> float | None:
    mean = float(np.mean(values)) if len(values) else 0.0
    return float(np.max(values)) / mean if mean > 0 else None


def fleet_section(
    config: FleetConfig,
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    duration_s: float,
    engine_what_if: bool = False,
) -> dict[str, Any]:
    """The ``fleet`` section: the router, each replica's figures, and the imbalance;
    ``engine_what_if``: the replicas run a what-if memory policy (the summary's ``what_if``)."""
    per_replica = []
    for index in range(config.replicas):
        reqs = requests[requests[REPLICA] == index]
        own = steps[steps[REPLICA] == index]
        queries = int(own["prefix_cache_queries"].sum())
        hits = int(own["prefix_cache_hits"].sum())
        busy_s = float(own["duration_s"].sum())
        per_replica.append(
            {
                "replica": index,
                "num_requests": len(reqs),
                "num_finished": int(reqs["finish_s"].notna().sum()),
                "output_tokens": int(reqs["output_tokens"].sum()),
                "num_steps": len(own),
                "busy_frac": busy_s / duration_s if duration_s > 0 else None,
                "kv_cache_usage": kv_usage_stats(own),
                "prefix_cache_hit_rate": hits / queries if queries else None,
                "preemptions": int(reqs["num_preemptions"].sum()),
                "ttft_s": latency_stats(reqs["ttft_s"]),
            }
        )
    return {
        "what_if": "replicas behind a simulated router; each replica is "
        + (
            "the engine with the what-if policies listed under the summary's what_if"
            if engine_what_if
            else "the vLLM-exact engine"
        ),
        "metrics_note": "request metrics are fleet-wide; step metrics (KV usage, running and "
        "waiting requests, KV waste) pool every replica's steps, so they describe one replica "
        "on average and at its worst; kv_cache is one replica's",
        "replicas": config.replicas,
        "router": config.router.model_dump(mode="json"),
        "load_imbalance": {
            "requests": _imbalance([r["num_requests"] for r in per_replica]),
            "output_tokens": _imbalance([r["output_tokens"] for r in per_replica]),
            "busy_time": _imbalance([r["busy_frac"] or 0.0 for r in per_replica]),
        },
        "per_replica": per_replica,
    }
