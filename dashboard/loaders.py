"""Cached loaders of run directories, block maps and sweep results.

Everything is cached with ``st.cache_data`` keyed on the resolved path and the newest
modification time of the files read, so a rewritten file is read again. What is cached is
a compact :class:`RunView`: the per-token times of a run (tens of millions of floats at 100k
requests) are reduced to CDF points and the step table to a downsampled timeline at load
time, because ``st.cache_data`` hands out a pickled copy on every rerun.

``block_map.npz`` (optional; simulated runs write it, see ``sim/block_map.py``):

- ``times_s``: float64 ``[T]``, the snapshot times;
- ``states``: uint8 ``[T, num_blocks]``: 0 = free, 1 = cached but free (prefix cache),
  ``2 + k`` = owned by a running request of priority class ``k``;
- ``classes``: ``[K]`` strings, the names of the priority classes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import streamlit as st

from dashboard.data import (
    MAX_TIMELINE_POINTS,
    REPLICA,
    REQUEST_VIEW_COLUMNS,
    TIMELINE_COLUMNS,
    Sampled,
    by_replica,
    every_kth,
    fleet_totals,
    latency_cdfs,
    num_replicas,
    replica_points,
    take_token_times,
)
from sim.report import format_value
from sim.results import REQUESTS, SCENARIO, STEPS, SUMMARY, check_run_dir, check_summary
from sim.results import list_runs as complete_runs
from sim.uncertainty import SAMPLES

BLOCK_MAP = "block_map.npz"
_RUN_FILES = (SUMMARY, REQUESTS, STEPS, SCENARIO, BLOCK_MAP)
BAND_COLUMNS = ("metric", "this run", "median", "p10", "p90")


def list_runs(base: Path) -> list[Path]:
    """Run directories directly under ``base`` (those with a summary.json), newest first."""
    if not base.is_dir():
        return []
    # Hidden folders (a killed run's .partial-*) and claimed runs in progress are not runs.
    found = [p for p in complete_runs(base) if (p / SUMMARY).is_file()]
    return sorted(found, key=lambda p: (-(p / SUMMARY).stat().st_mtime_ns, p.name))


def mtime_key(path: Path) -> int:
    """Newest modification time (ns) of the run files present: the cache key's freshness."""
    times = [(path / name).stat().st_mtime_ns for name in _RUN_FILES if (path / name).exists()]
    return max(times, default=path.stat().st_mtime_ns if path.exists() else 0)


@dataclass(frozen=True)
class RunView:
    """What the pages show of one run directory (small enough to cache by value)."""

    path: str
    summary: dict[str, Any]
    scenario_yaml: str
    requests: pd.DataFrame  # requests.parquet without the per-token times
    timeline: Sampled  # every k-th step of TIMELINE_COLUMNS
    preemptions: Sampled  # steps with num_preemptions > 0
    cdfs: pd.DataFrame  # latency_cdfs(): metric, priority_class, value, fraction
    # A fleet run (a replica column in requests and steps): its number of replicas, and per
    # replica its own timeline, preemption steps and CDFs. 0 and empty for one engine, whose
    # timeline is its steps; a fleet's ``timeline`` is ``fleet_totals`` of all its steps.
    replicas: int = 0
    replica_timelines: tuple[Sampled, ...] = ()
    replica_preemptions: tuple[Sampled, ...] = ()
    replica_cdfs: tuple[pd.DataFrame, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.summary.get('source', '?')}:{Path(self.path).name}"

    @property
    def fleet(self) -> dict[str, Any]:
        """The summary's ``fleet`` section ({} when absent)."""
        fleet = self.summary.get("fleet")
        return fleet if isinstance(fleet, dict) else {}


def _read_files(path: Path) -> tuple[dict[str, Any], pa.Table, pd.DataFrame, str]:
    """summary, requests (Arrow), the timeline columns of steps, scenario text.

    The same checks and reasons as :func:`sim.results.load_run`, but only the step columns
    the timelines plot are read, and per-token times stay in Arrow's flat layout (pandas
    would make one array object per request).
    """
    check_run_dir(path)
    try:
        summary = json.loads((path / SUMMARY).read_text())
        requests = pq.read_table(path / REQUESTS)
        step_names = pq.read_schema(path / STEPS).names
        lacking = [c for c in TIMELINE_COLUMNS if c not in step_names]
        lacking += [c for c in REQUEST_VIEW_COLUMNS if c not in requests.column_names]
        if lacking:
            raise ValueError(f"run files lack columns {', '.join(lacking)}")
        fleet = [REPLICA in step_names, REPLICA in requests.column_names]
        if any(fleet) and not all(fleet):
            where = "steps.parquet" if fleet[0] else "requests.parquet"
            raise ValueError(f"only {where} has a {REPLICA} column (a fleet run has it in both)")
        columns = TIMELINE_COLUMNS + ([REPLICA] if all(fleet) else [])
        steps = pd.read_parquet(path / STEPS, columns=columns)
        if all(fleet) and not (
            pa.types.is_integer(requests.schema.field(REPLICA).type)
            and pd.api.types.is_integer_dtype(steps[REPLICA])
        ):
            raise ValueError(f"the {REPLICA} column must hold integers")
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise ValueError(f"{path}: cannot read run files: {exc}") from None
    try:
        check_summary(summary)
    except ValueError as exc:
        raise ValueError(f"{path}: cannot read run files: {exc}") from None
    scenario_yaml = (path / SCENARIO).read_text() if (path / SCENARIO).is_file() else ""
    return summary, requests, steps, scenario_yaml


def _token_times(requests: pa.Table) -> tuple[np.ndarray, np.ndarray] | None:
    if "token_times_s" not in requests.column_names:
        return None
    column = requests.column("token_times_s").combine_chunks()
    offsets = column.offsets.to_numpy()
    flat = column.values.to_numpy()[offsets[0] : offsets[-1]]
    return flat.astype(float, copy=False), offsets - offsets[0]


def build_view(path: Path, max_points: int = MAX_TIMELINE_POINTS) -> RunView:
    """Read a run directory into a RunView (no caching). Bad files raise ValueError."""
    summary, table, steps, scenario_yaml = _read_files(Path(path))
    is_fleet = REPLICA in steps.columns
    columns = REQUEST_VIEW_COLUMNS + ([REPLICA] if is_fleet else [])
    requests = table.select(columns).to_pandas()
    requests["priority_class"] = requests["priority_class"].astype("category")
    events = steps[steps["num_preemptions"] > 0]
    token_times = _token_times(table)
    view = RunView(
        path=str(path),
        summary=summary,
        scenario_yaml=scenario_yaml,
        requests=requests,
        timeline=every_kth(steps, max_points),
        preemptions=every_kth(events, max_points),
        cdfs=latency_cdfs(requests, token_times),
    )
    if not is_fleet:
        return view
    replicas = num_replicas(requests, steps, summary.get("fleet"))
    points = replica_points(replicas, max_points)
    order = np.argsort(requests[REPLICA].to_numpy(), kind="stable")  # rows by replica
    bounds = np.searchsorted(requests[REPLICA].to_numpy()[order], np.arange(replicas + 1))
    cdfs = []
    for r in range(replicas):
        rows = order[bounds[r] : bounds[r + 1]]
        own = None if token_times is None else take_token_times(*token_times, rows)
        cdfs.append(latency_cdfs(requests.iloc[rows], own))
    return replace(
        view,
        timeline=every_kth(fleet_totals(steps, replicas), max_points),
        replicas=replicas,
        replica_timelines=tuple(every_kth(f, points) for f in by_replica(steps, replicas)),
        replica_preemptions=tuple(every_kth(f, points) for f in by_replica(events, replicas)),
        replica_cdfs=tuple(cdfs),
    )


@st.cache_data(max_entries=8, show_spinner="Loading run...")
def _cached_view(path: str, mtime_ns: int, max_points: int) -> RunView:
    del mtime_ns  # part of the cache key only
    return build_view(Path(path), max_points)


def load_view(path: str | Path, max_points: int = MAX_TIMELINE_POINTS) -> RunView:
    """The cached RunView of a run directory; a bad directory raises ValueError."""
    resolved = Path(path).expanduser().resolve()
    return _cached_view(str(resolved), mtime_key(resolved), max_points)


@dataclass(frozen=True)
class BlockMap:
    times_s: np.ndarray
    states: np.ndarray
    classes: list[str]
    # The CPU map's blocks per snapshot (swap-preemption and CPU offload runs only), else
    # None, and which of the two it is ("swap" or "offload").
    cpu_states: np.ndarray | None = None
    cpu_kind: str | None = None


def read_block_map(path: Path) -> BlockMap | None:
    """The run's block_map.npz, None when absent; a malformed file raises ValueError."""
    file = path / BLOCK_MAP
    if not file.is_file():
        return None
    try:
        with np.load(file, allow_pickle=False) as npz:
            times, states, classes = npz["times_s"], npz["states"], npz["classes"]
            cpu = npz["cpu_states"] if "cpu_states" in npz.files else None
            # Swap runs written before offload existed carry no kind.
            cpu_kind = str(npz["cpu_kind"]) if "cpu_kind" in npz.files else "swap"
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{file}: cannot read block map: {exc}") from None
    for name, array in (("states", states), ("cpu_states", cpu)):
        if array is not None and (
            times.ndim != 1 or array.ndim != 2 or array.shape[0] != times.shape[0]
        ):
            raise ValueError(
                f"{file}: {name} must be [T, num_blocks] with T = len(times_s); got "
                f"times_s {times.shape}, {name} {array.shape}"
            )
    return BlockMap(
        times.astype(float),
        states.astype(np.uint8),
        [str(c) for c in classes],
        None if cpu is None else cpu.astype(np.uint8),
        None if cpu is None else cpu_kind,
    )


@st.cache_data(max_entries=4, show_spinner="Loading block map...")
def _cached_block_map(path: str, mtime_ns: int) -> BlockMap | None:
    del mtime_ns
    return read_block_map(Path(path))


def load_block_map(path: str | Path) -> BlockMap | None:
    resolved = Path(path).expanduser().resolve()
    return _cached_block_map(str(resolved), mtime_key(resolved))


@st.cache_data(max_entries=16, show_spinner=False)
def _cached_json(path: str, mtime_ns: int) -> Any:
    del mtime_ns
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read: {exc}") from None


def load_json(path: Path) -> Any:
    return _cached_json(str(path.resolve()), path.stat().st_mtime_ns)


def read_band(path: Path) -> tuple[pd.DataFrame, int] | None:
    """The run's uncertainty band (``samples.json`` of ``kvsim run --samples``) as a table
    of formatted values, and its number of samples; None when the run has none. A malformed
    file raises ValueError naming it."""
    file = Path(path) / SAMPLES
    if not file.is_file():
        return None
    try:
        return band_frame(json.loads(file.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{file}: cannot read the uncertainty band ({exc})") from None


def band_frame(record: dict[str, Any]) -> tuple[pd.DataFrame, int]:
    """A band record (``sim.uncertainty.band_records``, what ``samples.json`` holds) as a
    table of formatted values, and its number of samples."""
    rows = [
        (m["metric"], *(format_value(m[k], m["unit"]) for k in ("point", "median", "low", "high")))
        for m in record["metrics"]
    ]
    return pd.DataFrame(rows, columns=list(BAND_COLUMNS)), len(record["speed_factors"])
