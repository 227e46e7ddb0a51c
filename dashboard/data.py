"""Pure data shaping for the dashboard: downsampling, CDF points, ITL samples, waterfalls.

No Streamlit here: these functions take and return DataFrames / arrays, so they are tested
directly and reused by the cached loaders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from sim.recorder import REQUEST_COLUMNS

# Columns of steps.parquet the timelines plot.
TIMELINE_COLUMNS = [
    "start_s",
    "duration_s",
    "kv_cache_usage_perc",
    "num_requests_running",
    "num_requests_waiting",
    "num_free_blocks",
    "num_preemptions",
]
# Columns of requests.parquet kept in memory (everything but the per-token times).
REQUEST_VIEW_COLUMNS = [c for c in REQUEST_COLUMNS if c != "token_times_s"]
MAX_TIMELINE_POINTS = 5000
MAX_CDF_POINTS = 2000
ALL_CLASSES = "all requests"


@dataclass(frozen=True)
class Sampled:
    """Every ``stride``-th row of a table of ``total`` rows (plus its last row)."""

    frame: pd.DataFrame
    total: int
    stride: int

    def note(self, what: str = "steps") -> str | None:
        """The note to show next to a downsampled plot; None when nothing was dropped."""
        if self.stride <= 1:
            return None
        return (
            f"showing {len(self.frame):,} of {self.total:,} {what} (every {ordinal(self.stride)})"
        )


def ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k:,}{suffix}"


def every_kth(frame: pd.DataFrame, max_points: int = MAX_TIMELINE_POINTS) -> Sampled:
    """Keep every k-th row (k the smallest stride that fits ``max_points``) and the last row."""
    total = len(frame)
    if total <= max_points:
        return Sampled(frame.reset_index(drop=True), total, 1)
    stride = math.ceil(total / max_points)
    index = np.arange(0, total, stride)
    if index[-1] != total - 1:
        index = np.append(index, total - 1)
    return Sampled(frame.iloc[index].reset_index(drop=True), total, stride)


def cdf_points(values: np.ndarray, max_points: int = MAX_CDF_POINTS) -> pd.DataFrame:
    """Empirical CDF of the finite ``values`` as (value, fraction) points.

    With more samples than ``max_points`` the sorted samples are taken at evenly spaced ranks
    (always including the minimum and maximum), so the curve keeps its exact shape.
    """
    arr = np.asarray(values)
    finite = np.isfinite(arr)
    arr = arr.copy() if finite.all() else arr[finite]
    arr.sort()  # in place: no second copy of a 30M-sample array
    n = arr.size
    if n == 0:
        return pd.DataFrame({"value": [], "fraction": []})
    ranks = np.arange(n) if n <= max_points else np.unique(np.linspace(0, n - 1, max_points))
    ranks = ranks.astype(np.int64)
    return pd.DataFrame({"value": arr[ranks].astype(float), "fraction": (ranks + 1) / n})


def flatten_times(token_times: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Per-request token-time lists as one flat float64 array and row offsets ``[n + 1]``."""
    lengths = np.fromiter((len(t) for t in token_times), dtype=np.int64, count=len(token_times))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] == 0:
        return np.empty(0), offsets
    return np.concatenate(token_times.to_numpy(), dtype=float), offsets


def itl_samples(
    flat: np.ndarray, offsets: np.ndarray, row_codes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Every inter-token gap of every request (float32 seconds) and its row's code.

    ``flat`` / ``offsets`` are the flattened per-token times (``flatten_times`` or Arrow's
    list layout); vectorized because a 100k-request run has tens of millions of tokens.
    """
    if flat.size < 2:
        return np.empty(0, dtype=np.float32), np.empty(0, dtype=row_codes.dtype)
    # float32 halves the memory and sort time; gaps are milliseconds, far above its resolution.
    gaps = np.empty(flat.size - 1, dtype=np.float32)
    np.subtract(flat[1:], flat[:-1], out=gaps, casting="same_kind")
    keep = np.ones(gaps.size, dtype=bool)
    bounds = offsets[1:-1] - 1  # the gap from a request's last token to the next one's first
    keep[bounds[(bounds >= 0) & (bounds < gaps.size)]] = False
    per_row = np.maximum(np.diff(offsets) - 1, 0)
    return gaps[keep], np.repeat(row_codes, per_row)


def latency_cdfs(
    requests: pd.DataFrame, token_times: tuple[np.ndarray, np.ndarray] | None
) -> pd.DataFrame:
    """CDF points of TTFT, E2E and ITL, overall and per priority class.

    ``token_times`` is ``(flat, offsets)`` of the requests' per-token times, None if absent.
    Columns: metric (``ttft`` / ``e2e`` / ``itl``), priority_class, value (s), fraction.
    """
    codes, names = pd.factorize(requests["priority_class"].astype(str), sort=True)
    codes = codes.astype(np.int16)
    finished = requests["finish_s"].notna().to_numpy()
    series: dict[str, tuple[np.ndarray, np.ndarray]] = {
        "ttft": (requests["ttft_s"].to_numpy(dtype=float), codes),
        "e2e": (requests["e2e_s"].to_numpy(dtype=float)[finished], codes[finished]),
    }
    if token_times is not None:
        series["itl"] = itl_samples(*token_times, codes)
    parts = []
    for metric, (values, owners) in series.items():
        groups = [(ALL_CLASSES, values)]
        if len(names) > 1:  # integer codes: comparing 30M strings would take seconds
            groups += [(str(name), values[owners == k]) for k, name in enumerate(names)]
        for name, vals in groups:
            points = cdf_points(vals)
            points.insert(0, "priority_class", name)
            points.insert(0, "metric", metric)
            parts.append(points)
    return pd.concat(parts, ignore_index=True)


PHASES = ("queueing", "prefill", "decode", "tool wait")


def session_waterfall(
    requests: pd.DataFrame, session_id: int, cut_at_s: float | None = None
) -> pd.DataFrame:
    """One bar segment per phase of each request of a session, times relative to its start.

    queueing: arrival -> first scheduled; prefill: first scheduled -> first token; decode:
    first token -> finish; tool wait: the turn's last finish -> the next turn's arrival.
    A preempted request's label says so (its decode bar then includes the recompute); in a
    fleet run (a ``replica`` column) it names the request's replica.
    Columns: label, turn, phase, start_s, duration_s. Missing times drop their segment,
    except in a run cut at ``cut_at_s`` (its time limit): there a request still unfinished
    shows the phase it was in up to the cut, and its label says "unfinished".
    """
    rows = requests[requests["session_id"] == session_id].sort_values(
        ["turn", "subcall", "arrival_s"]
    )
    if rows.empty:
        return pd.DataFrame(columns=["label", "turn", "phase", "start_s", "duration_s"])
    t0 = float(rows["arrival_s"].min())
    fleet = "replica" in rows.columns
    next_arrival = rows.groupby("turn")["arrival_s"].min().shift(-1)
    turn_finish = rows.groupby("turn")["finish_s"].max()
    last_of_turn = ~rows["turn"].duplicated(keep="last")
    segments = []
    for rec, is_last in zip(rows.itertuples(index=False), last_of_turn, strict=True):
        label = f"turn {rec.turn}" if rec.subcall < 0 else f"turn {rec.turn}.{rec.subcall}"
        if fleet:  # a fleet run: where the router placed it
            label += f" [replica {rec.replica}]"
        if getattr(rec, "num_preemptions", 0):  # its decode bar includes the recompute
            label += f" (preempted {rec.num_preemptions}x)"
        bounds = [
            ("queueing", rec.arrival_s, rec.first_scheduled_s),
            ("prefill", rec.first_scheduled_s, rec.first_token_s),
            ("decode", rec.first_token_s, rec.finish_s),
        ]
        if cut_at_s is not None and not np.isfinite(rec.finish_s):
            label += " (unfinished)"
            # The phase it was in when the run stopped: the first one with no end.
            for i, (phase, start, end) in enumerate(bounds):
                if np.isfinite(start) and not np.isfinite(end):
                    bounds[i] = (phase, start, cut_at_s)
                    break
        if is_last:
            bounds.append(("tool wait", turn_finish[rec.turn], next_arrival[rec.turn]))
        for phase, start, end in bounds:
            if np.isfinite(start) and np.isfinite(end) and end >= start:
                segments.append((label, rec.turn, phase, start - t0, end - start))
    return pd.DataFrame(segments, columns=["label", "turn", "phase", "start_s", "duration_s"])


def strided(n: int, max_n: int) -> tuple[np.ndarray, int]:
    """Indices of every k-th of ``n`` items so at most ``max_n`` remain, and k."""
    stride = max(1, math.ceil(n / max_n))
    return np.arange(0, n, stride), stride


# --- Fleet runs (a ``replica`` column in requests.parquet and steps.parquet) -----------------

REPLICA = "replica"
ALL_REPLICAS = "all replicas"
# A fleet's timelines share the point budget of one timeline, but no replica gets fewer.
MIN_REPLICA_POINTS = 500


def replica_points(num_replicas: int, max_points: int = MAX_TIMELINE_POINTS) -> int:
    """Points per replica's timeline: an equal share of ``max_points``, at least
    ``MIN_REPLICA_POINTS``."""
    return max(max_points // max(num_replicas, 1), MIN_REPLICA_POINTS)


def num_replicas(requests: pd.DataFrame, steps: pd.DataFrame, fleet: dict | None) -> int:
    """Replicas of a fleet run: the summary's count, else one past the highest index seen."""
    if isinstance(fleet, dict) and isinstance(fleet.get("replicas"), int):
        return int(fleet["replicas"])
    seen = [int(f[REPLICA].max()) for f in (requests, steps) if len(f)]
    return max(seen, default=-1) + 1


def by_replica(frame: pd.DataFrame, replicas: int) -> list[pd.DataFrame]:
    """The rows of each replica ``0 .. replicas - 1`` in their order (empty frames for a
    replica with none), without the replica column."""
    groups = dict(iter(frame.groupby(REPLICA, sort=True)))
    empty = frame.iloc[:0]
    return [groups.get(r, empty).drop(columns=REPLICA) for r in range(replicas)]


def take_token_times(
    flat: np.ndarray, offsets: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The per-token times of ``rows`` only, as ``(flat, offsets)`` like ``flatten_times``."""
    rows = np.asarray(rows, dtype=np.int64)
    starts = offsets[rows]
    lengths = offsets[rows + 1] - starts
    new_offsets = np.zeros(rows.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    index = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    return flat[index], new_offsets


def fleet_totals(steps: pd.DataFrame, replicas: int) -> pd.DataFrame:
    """The fleet as one engine, one row per step of any replica (no zig-zag between them).

    After each step: KV cache usage is the mean over the replicas and running / waiting
    requests the sums, each replica counted at its latest step (0 before its first);
    ``num_preemptions`` and ``duration_s`` stay the step's own.
    """
    out = steps[["start_s", "duration_s", "num_preemptions"]].copy()
    groups = steps.groupby(REPLICA, sort=False)
    for column in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting"):
        values = steps[column].astype(float)
        previous = groups[column].shift(1).astype(float).fillna(0.0)
        total = (values - previous).cumsum().to_numpy()
        if column == "kv_cache_usage_perc":
            out[column] = total / replicas
        else:
            out[column] = np.rint(total).astype(np.int64)
    return out.reset_index(drop=True)


def replica_label(replica: int) -> str:
    return f"replica {replica}"
