"""Sweeps: one scenario over the cross product of a grid of overrides, in parallel, resumable.

A sweep folder holds:

- ``sweep.json``: what the sweep is (scenario file and its SHA-256, ``--set`` overrides, the
  grid, every point's id and overrides). Re-running the same command on the same folder
  resumes; a different sweep is refused.
- ``points/<id>/``: each finished point's run directory (as ``kvsim run`` writes it),
  renamed into place by the worker once complete; ``points/<id>.error.json`` for a point
  whose scenario or simulation failed (its one-paragraph error). Either one marks the point
  done: a resumed sweep runs only the others, so a killed sweep (SIGINT or SIGKILL) loses no
  finished point and runs none twice. A point that could not be written (a full disk, a file
  size limit: OSError) or ran out of memory is no result of the point: it stops the sweep,
  and stays pending for the resumed sweep to run.
- ``results.parquet``: one row per point (its overrides, key metrics, SLO verdicts, status,
  error and run directory), rebuilt from ``points/`` whenever the sweep ends.

Points run in worker processes (all local cores by default); each point is deterministic
(the scenario's seed), so the table does not depend on the number of workers.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from sim.config.loading import load_yaml
from sim.errors import KvsimConfigError, short_repr
from sim.files import atomic_path, sync_folder, write_atomic
from sim.interrupts import completed, sigint_deferred, stop_pool, submit, worker_pool
from sim.report import what_if_lines
from sim.scenario import check_runnable, load_scenario

SWEEP_FILE = "sweep.json"
RESULTS_FILE = "results.parquet"
POINTS_DIR = "points"
LOCK_FILE = ".sweep.lock"
ERROR_SUFFIX = ".error.json"
MAX_POINTS = 10_000
RAY_CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"  # written by `ray start`
RAY_CONNECT_TIMEOUT_S = 5.0

# results.parquet's metric columns: (column, path in summary.json).
METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("num_requests", ("num_requests",)),
    ("num_finished", ("num_finished",)),
    ("num_not_arrived", ("num_not_arrived",)),  # a cut open-loop or trace run's; else none
    ("duration_s", ("duration_s",)),
    ("ttft_p50_s", ("metrics", "vllm:time_to_first_token_seconds", "p50")),
    ("ttft_p99_s", ("metrics", "vllm:time_to_first_token_seconds", "p99")),
    ("itl_p50_s", ("metrics", "vllm:inter_token_latency_seconds", "p50")),
    ("itl_p99_s", ("metrics", "vllm:inter_token_latency_seconds", "p99")),
    ("e2e_p50_s", ("metrics", "vllm:e2e_request_latency_seconds", "p50")),
    ("e2e_p99_s", ("metrics", "vllm:e2e_request_latency_seconds", "p99")),
    ("output_throughput_tok_s", ("metrics", "output_throughput_tok_s")),
    ("request_throughput_req_s", ("metrics", "request_throughput_req_s")),
    ("goodput_req_s", ("metrics", "goodput_req_s")),
    ("slo_attainment", ("metrics", "slo_attainment")),
    ("preemptions", ("metrics", "vllm:num_preemptions", "total")),
    ("prefix_cache_hit_rate", ("metrics", "prefix_cache_hit_rate")),
    ("kv_usage_mean", ("metrics", "vllm:kv_cache_usage_perc", "mean")),
    ("kv_usage_peak", ("metrics", "vllm:kv_cache_usage_perc", "peak")),
    ("peak_concurrent_sessions", ("metrics", "peak_concurrent_sessions")),
)


@dataclass(frozen=True)
class Point:
    id: str
    overrides: tuple[str, ...]  # "field=value", in grid order


@dataclass(frozen=True)
class SweepPlan:
    out: Path
    scenario: Path
    sets: tuple[str, ...]
    grid: tuple[tuple[str, tuple[str, ...]], ...]
    points: tuple[Point, ...]

    def pending(self) -> list[Point]:
        """Points with neither a run directory nor an error file."""
        return [p for p in self.points if not point_done(self.out, p.id)]


def parse_grid(specs: list[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``["engine.max_num_seqs=64,128", ...]`` as ((field, values), ...); refuses a grid
    without ``=``, an empty value, a repeated value or a field given twice."""
    axes: list[tuple[str, tuple[str, ...]]] = []
    for spec in specs:
        field, sep, raw = spec.partition("=")
        field = field.strip()
        if not sep or not field:
            raise KvsimConfigError(
                f"--grid {short_repr(spec)}: expected FIELD=V1,V2,..., e.g. "
                "engine.max_num_seqs=64,128,256"
            )
        values = tuple(v.strip() for v in raw.split(","))
        if not all(values):
            raise KvsimConfigError(f"--grid {short_repr(spec)}: an empty value in the list")
        if len(set(values)) != len(values):
            raise KvsimConfigError(f"--grid {short_repr(spec)}: a value is listed twice")
        if field in (f for f, _ in axes):
            raise KvsimConfigError(f"--grid {field}: given twice; list every value in one --grid")
        axes.append((field, values))
    if not axes:
        raise KvsimConfigError("no --grid given: a sweep needs at least one FIELD=V1,V2,...")
    return tuple(axes)


def _file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def plan_sweep(scenario: Path, grid_specs: list[str], sets: list[str], out: Path) -> SweepPlan:
    """Check the grid against the scenario and write (or, resuming, check) ``sweep.json``.

    Every point's scenario is checked first. A grid value with which no point loads (an
    unknown field, a value of the wrong type, or one no combination makes possible) is
    refused here, naming it; a combination of otherwise good values that makes an
    impossible config (say a token budget below ``max_num_seqs``) is a failed point,
    recorded with its error.
    """
    grid = parse_grid(grid_specs)
    load_scenario(scenario, sets)  # the base scenario itself must load
    # Absolute paths: workers (Ray's included) may run in another working directory.
    scenario, out = scenario.resolve(), out.resolve()
    combos = list(itertools.product(*(values for _, values in grid)))
    if len(combos) > MAX_POINTS:
        raise KvsimConfigError(
            f"--grid: {len(combos):,} points, over the {MAX_POINTS:,} one sweep may have"
        )
    points = tuple(
        Point(f"p{i:04d}", tuple(f"{f}={v}" for (f, _), v in zip(grid, combo, strict=True)))
        for i, combo in enumerate(combos)
    )
    errors: dict[str, str] = {}
    for point in points:
        try:
            load_scenario(scenario, [*sets, *point.overrides])
        except KvsimConfigError as exc:
            errors[point.id] = str(exc)
    for axis, (field, values) in enumerate(grid):
        for value in values:
            with_value = [p for p in points if p.overrides[axis] == f"{field}={value}"]
            if all(p.id in errors for p in with_value):
                raise KvsimConfigError(
                    f"--grid {field}: value {short_repr(value)} makes every point it is in "
                    f"impossible: {errors[with_value[0].id]}"
                )
    plan = SweepPlan(out, scenario, tuple(sets), grid, points)
    document = {
        "kind": "kvsim sweep",
        "scenario": str(scenario),
        "scenario_sha256": _file_sha256(scenario),
        "sets": list(sets),
        "grid": {field: list(values) for field, values in grid},
        "points": [{"id": p.id, "overrides": list(p.overrides)} for p in points],
    }
    spec_file = out / SWEEP_FILE
    if spec_file.exists():
        try:
            existing = json.loads(spec_file.read_text())
        except (OSError, ValueError) as exc:
            raise KvsimConfigError(f"--out {out}: unreadable {SWEEP_FILE} ({exc})") from None
        if existing != document:
            raise KvsimConfigError(
                f"--out {out} holds another sweep (its scenario, --set or --grid differ, or "
                "the scenario file changed); resume it with its own command, or give a new --out"
            )
    elif out.exists() and any(out.iterdir()):
        raise KvsimConfigError(f"--out {out}: exists and is not a sweep folder")
    else:
        _create_sweep(out, json.dumps(document, indent=2) + "\n")
    return plan


def _create_sweep(out: Path, spec_text: str) -> None:
    """The new sweep folder: ``points/``, then ``sweep.json``; where that cannot be written,
    the folders just made are removed again (a folder without sweep.json would refuse the
    rerun as "not a sweep folder")."""
    made = [d for d in (out, out / POINTS_DIR) if not d.exists()]
    (out / POINTS_DIR).mkdir(parents=True, exist_ok=True)
    try:
        write_atomic(out / SWEEP_FILE, spec_text)
    except BaseException:
        for folder in reversed(made):
            with suppress(OSError):
                folder.rmdir()
        raise


def point_done(out: Path, point_id: str) -> bool:
    points = out / POINTS_DIR
    return (points / point_id).is_dir() or (points / f"{point_id}{ERROR_SUFFIX}").is_file()


def run_point(scenario: Path, sets: tuple[str, ...], point: Point, out: Path) -> str | None:
    """Simulate one point and persist it; returns its error (None when it ran). Runs in a
    worker process: the run directory is written aside and renamed into place complete.

    Only the point's own failure (its scenario, its simulation) is its result. An OSError
    while writing the run or its error file, or a MemoryError (other workers may hold the
    memory), is raised, leaving the point pending: it says nothing about the point, and a
    resumed sweep runs it again."""
    from sim.runner import simulate

    try:
        spec = load_scenario(scenario, [*sets, *point.overrides])
        check_runnable(spec, str(scenario))
        result = simulate(spec)
        if result.summary["num_requests"] == 0:
            raise KvsimConfigError(
                f"no request arrived before limits.max_duration_s={spec.limits.max_duration_s:g} s"
            )
    except MemoryError:
        raise
    except Exception as exc:  # a failed point is recorded and the sweep goes on
        error = str(exc) if isinstance(exc, KvsimConfigError) else f"{type(exc).__name__}: {exc}"
        _record_error(out, point, error)
        return error
    points = out / POINTS_DIR
    tmp = points / f".tmp-{point.id}-{os.getpid()}"
    try:
        result.write(tmp)
        os.replace(tmp, points / point.id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync_folder(points)
    return None


def _record_error(out: Path, point: Point, error: str) -> None:
    write_atomic(
        out / POINTS_DIR / f"{point.id}{ERROR_SUFFIX}",
        json.dumps({"id": point.id, "overrides": list(point.overrides), "error": error}),
    )


@contextmanager
def sweep_lock(out: Path) -> Iterator[None]:
    """Hold the sweep folder: a second ``kvsim sweep`` on it is refused while this runs."""
    with (out / LOCK_FILE).open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise KvsimConfigError(
                f"--out {out}: another kvsim sweep (pid {holder}) is running on this folder"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield


def check_ray_address(address: str) -> str | None:
    """What ``ray.init`` gets for ``--ray ADDRESS``: None for ``local`` (a Ray instance
    started for this sweep), else the address, once something answers there. (``ray.init``
    itself waits for minutes on an address nobody serves.)"""
    if address == "local":
        return None
    if address == "auto":
        if not Path(RAY_CURRENT_CLUSTER).is_file():
            raise KvsimConfigError(
                "--ray auto: no Ray cluster runs on this machine (start one with "
                "`ray start --head`, or use --ray local)"
            )
        return address
    host_port = address.removeprefix("ray://")
    host, sep, port = host_port.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise KvsimConfigError(
            f"--ray {short_repr(address)}: expected local, auto, HOST:PORT or ray://HOST:PORT"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=RAY_CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise KvsimConfigError(
            f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc})"
        ) from None
    return address


def check_runner(workers: int | None, ray_address: str | None) -> None:
    """``--workers`` and ``--ray`` before a sweep creates its folder: a count of at least 1,
    Ray installed and something answering at the address (KvsimConfigError otherwise)."""
    if workers is not None and workers < 1:
        raise KvsimConfigError(f"--workers {workers}: must be at least 1")
    if ray_address is not None:
        _import_ray()
        check_ray_address(ray_address)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise KvsimConfigError(
            "--ray needs Ray, an optional extra: pip install 'kvsim[ray]'"
        ) from None
    return ray


def _run_on_ray(
    plan: SweepPlan,
    pending: list[Point],
    address: str,
    on_point: Callable[[Point, str | None], None] | None,
) -> None:
    ray = _import_ray()
    target = check_ray_address(address)
    try:
        ray.init(
            address=target, logging_level="ERROR", log_to_driver=False, include_dashboard=False
        )
    except Exception as exc:  # Ray raises ConnectionError, RuntimeError, ValueError...
        raise KvsimConfigError(f"--ray {address}: cannot join the Ray cluster ({exc})") from None
    refs: dict[Any, Point] = {}
    try:
        remote = ray.remote(num_cpus=1)(run_point)
        refs.update({remote.remote(plan.scenario, plan.sets, p, plan.out): p for p in pending})
        while refs:
            done, _ = ray.wait(list(refs), num_returns=1)
            for ref in done:
                point = refs.pop(ref)
                try:
                    error = ray.get(ref)
                except Exception as exc:
                    raise ray_failure(exc, plan.out) from None
                if on_point is not None:
                    on_point(point, error)
    finally:
        for ref in refs:  # interrupted: what has not finished is cancelled
            ray.cancel(ref, force=True)
        ray.shutdown()


def ray_failure(exc: BaseException, out: Path) -> BaseException:
    """What stops the sweep when a Ray task failed: the point's own OSError or MemoryError
    (Ray's error keeps it as ``cause``), else a one-paragraph error (its worker died: Ray's
    OOM killer, a lost node). Either way the point stays pending for a resume."""
    for candidate in (getattr(exc, "cause", None), exc):
        if isinstance(candidate, OSError | MemoryError):
            return candidate
    what = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return KvsimConfigError(
        f"a Ray task failed ({what}); the finished points are kept in {out}: re-run the "
        "same command to resume"
    )


def _run_locally(
    plan: SweepPlan,
    pending: list[Point],
    workers: int,
    on_point: Callable[[Point, str | None], None] | None,
) -> None:
    pool = worker_pool(min(workers, len(pending)))
    try:
        with sigint_deferred() as interrupt:
            futures: dict[Future[str | None], Point] = {
                submit(pool, run_point, plan.scenario, plan.sets, p, plan.out): p for p in pending
            }
            for future in completed(futures, interrupt):
                error = future.result()  # a point's OSError or MemoryError: raised here
                if on_point is not None:
                    on_point(futures[future], error)
    except BrokenProcessPool:
        stop_pool(pool)
        raise KvsimConfigError(
            f"a worker process died (out of memory?); the finished points are kept in "
            f"{plan.out}: re-run the same command to resume, with fewer --workers"
        ) from None
    except BaseException:  # Ctrl-C, a point that could not be written: stop now
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)


def run_sweep(
    plan: SweepPlan,
    workers: int,
    on_point: Callable[[Point, str | None], None] | None = None,
    ray_address: str | None = None,
) -> pd.DataFrame:
    """Run the plan's pending points on ``workers`` local processes, or on a Ray cluster
    (``ray_address``: local, auto, HOST:PORT), then write and return the results table.
    ``on_point(point, error)`` runs in this process as each point finishes. On Ray the sweep
    folder must be on storage every node sees (one machine, or a shared filesystem), and
    kvsim installed on every node."""
    check_runner(workers, None)
    with sweep_lock(plan.out):
        _remove_leftovers(plan.out)
        pending = plan.pending()
        try:
            if pending and ray_address is not None:
                _run_on_ray(plan, pending, ray_address, on_point)
            elif pending:
                _run_locally(plan, pending, workers, on_point)
        except BaseException:
            with suppress(OSError):  # the error to report is the one that stopped the sweep
                write_results(plan)  # what finished, the rest pending
            raise
        return write_results(plan)


def _remove_leftovers(out: Path) -> None:
    """What killed workers and writers left (the sweep's lock is held): points written
    aside (``.tmp-*``, their ``.partial-*``) and hidden temporary files (``.*.tmp``)."""
    points = out / POINTS_DIR
    hidden = (".tmp-*", ".*.partial-*", ".*.tmp")
    for stale in [*(s for pattern in hidden for s in points.glob(pattern)), *out.glob(".*.tmp")]:
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            with suppress(OSError):
                stale.unlink()


def _dig(document: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(document, dict):
            return None
        document = document.get(key)
    return document


def point_record(plan: SweepPlan, point: Point) -> dict[str, Any]:
    """One results row: the point's overrides (typed), status, error, metrics, SLOs."""
    row: dict[str, Any] = {"point": point.id}
    for assignment in point.overrides:
        field, _, raw = assignment.partition("=")
        row[field] = load_yaml(raw, f"--grid {field}")
    points = plan.out / POINTS_DIR
    run_dir = points / point.id
    error_file = points / f"{point.id}{ERROR_SUFFIX}"
    if run_dir.is_dir():
        summary = json.loads((run_dir / "summary.json").read_text())
        row.update(status="ok", error=None, run_dir=str(run_dir))
        row.update({column: _dig(summary, path) for column, path in METRICS})
        # What the point modelled that vLLM 0.32 does not run (memory policies, a fleet's
        # router), one "; "-joined text; none for the vLLM-exact engine.
        row["what_if"] = "; ".join(what_if_lines(summary)) or None
        slos = summary.get("slos") or {}
        for name, verdict in slos.items():
            row[f"slo_{name}_pass"] = bool(verdict.get("pass"))
        row["slo_pass"] = all(v.get("pass") for v in slos.values()) if slos else None
    elif error_file.is_file():
        row.update(status="failed", error=json.loads(error_file.read_text())["error"])
        row["run_dir"] = None
    else:
        row.update(status="pending", error=None, run_dir=None)
    return row


def unfinished_points(table: pd.DataFrame) -> pd.Series:
    """True for the ok points of a results table whose run hit ``limits.max_duration_s``
    with requests unfinished or, for open-loop traffic or a trace, not yet arrived (their
    latencies and SLO verdicts leave those out); False everywhere for a table without the
    request counts."""
    ok = table["status"] == "ok"
    if not {"num_requests", "num_finished"} <= set(table.columns):
        return ok & False
    unfinished = table["num_finished"] < table["num_requests"]
    if "num_not_arrived" in table.columns:  # tables written before it had none
        unfinished |= pd.to_numeric(table["num_not_arrived"]).fillna(0) > 0
    return ok & unfinished


def write_results(plan: SweepPlan) -> pd.DataFrame:
    """Build ``results.parquet`` from the points folder (atomically) and return it."""
    table = pd.DataFrame([point_record(plan, p) for p in plan.points])
    for field, _ in plan.grid:  # a grid of mixed YAML types (true, 0) is stored as text
        kinds = {type(v) for v in table[field] if v is not None}
        if len(kinds) > 1:
            table[field] = [None if v is None else str(v) for v in table[field]]
    with atomic_path(plan.out / RESULTS_FILE) as tmp:
        table.to_parquet(tmp, index=False)
    return table
