"""Run directories: ``summary.json``, ``requests.parquet``, ``steps.parquet``, ``scenario.yaml``.

Simulated and measured runs write the same files. A run directory appears only once all of
its files are written (they are written to a hidden sibling, then renamed into place), so a
crash never leaves a directory that looks complete, and an existing run is never overwritten.

Before a run simulates, it claims its directory (:func:`claim_run_dir`): the directory is
created atomically, holding only a ``.kvsim-claim`` file with the owner's pid, so two runs
started together with the same ``--out`` (or none) never pick the same directory, and the
second learns it before it simulates. What a killed run leaves (a claimed but empty
directory, a hidden ``.<name>.partial-<pid>`` sibling) is removed by the next run in the
same folder once its owner is gone, and :func:`list_runs` never lists it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from sim.errors import KvsimConfigError, short_repr

SUMMARY = "summary.json"
REQUESTS = "requests.parquet"
STEPS = "steps.parquet"
SCENARIO = "scenario.yaml"
CLAIM = ".kvsim-claim"
_PARTIAL = re.compile(r"^\..+\.partial-(\d+)$")


@dataclass
class RunData:
    """A loaded run directory."""

    path: Path
    summary: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame
    scenario_yaml: str

    @property
    def label(self) -> str:
        return f"{self.summary.get('source', '?')}:{self.path.name}"


def new_run_dir(base: Path, name: str) -> Path:
    """A fresh ``base/name-N`` path that does not exist yet (N counts up from 1).

    Only a name: two processes may get the same one. A run that will write there should
    claim it with :func:`claim_new_run_dir` instead.
    """
    n = 1
    while (base / f"{name}-{n}").exists():
        n += 1
    return base / f"{name}-{n}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid < (1 << 31)
    return True


def _claim_pid(path: Path) -> int | None:
    """The pid in ``path``'s claim file, or None if it is not a claimed directory."""
    try:
        return int((path / CLAIM).read_text().strip() or "0")
    except (OSError, ValueError):
        return None


def _owned_claim(path: Path) -> bool:
    """True if ``path`` is claimed by this process or its parent (a replay worker writes the
    run its parent claimed)."""
    return _claim_pid(path) in (os.getpid(), os.getppid())


def clean_stale(base: Path) -> list[Path]:
    """Remove what killed runs left in ``base``: hidden ``.<name>.partial-<pid>`` folders and
    claimed directories holding nothing but their claim, whose owner process is gone.
    Returns what was removed. Never raises."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
            path = Path(entry.path)
            match = _PARTIAL.match(entry.name)
            if match:
                if not _pid_alive(int(match.group(1))):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
                continue
            pid = _claim_pid(path)
            if pid is not None and not _pid_alive(pid) and os.listdir(path) == [CLAIM]:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        except OSError:
            continue
    return removed


def _create_parent(out_dir: Path, option: str, refuse_existing: bool = False) -> None:
    """Create ``out_dir``'s folder; KvsimConfigError naming ``option`` if it cannot be (or,
    with ``refuse_existing``, if ``out_dir`` itself exists)."""
    try:
        exists = refuse_existing and out_dir.exists()
    except (OSError, ValueError) as exc:  # e.g. a NUL byte in the path
        raise KvsimConfigError(f"{option} {out_dir}: cannot create it ({exc})") from None
    if exists:
        raise KvsimConfigError(f"{option} {out_dir}: already exists; kvsim never overwrites")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        if isinstance(exc, FileExistsError):
            reason = f"{out_dir.parent} is not a directory"
        raise KvsimConfigError(f"{option} {out_dir}: cannot create it ({reason})") from None


def claim_run_dir(out_dir: Path, option: str = "--out") -> Path:
    """Create ``out_dir`` atomically and mark it as this process's run in progress.

    Raises KvsimConfigError, naming ``option``, if it exists (kvsim never overwrites a run)
    or cannot be created or written (a read-only folder, a path under ``/proc``).
    """
    out_dir = Path(out_dir)
    _create_parent(out_dir, option)
    clean_stale(out_dir.parent)
    try:
        out_dir.mkdir()
    except FileExistsError:
        raise KvsimConfigError(
            f"{option} {out_dir}: already exists; kvsim never overwrites a run"
        ) from None
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise KvsimConfigError(f"{option} {out_dir}: cannot create it ({reason})") from None
    try:
        # Written aside and renamed in: another process's clean_stale must never read a
        # claim file still empty (pid 0, dead) and remove the run just claimed.
        pending = out_dir / f".{CLAIM}.{os.getpid()}"
        pending.write_text(f"{os.getpid()}\n")
        os.replace(pending, out_dir / CLAIM)
    except OSError as exc:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise KvsimConfigError(
            f"{option} {out_dir}: cannot write into it ({exc.strerror or exc})"
        ) from None
    return out_dir


def check_out_free(out_dir: Path, option: str = "--out") -> None:
    """KvsimConfigError unless ``out_dir`` does not exist and its folder can be created and
    written (for writers that create the directory themselves, later)."""
    out_dir = Path(out_dir)
    _create_parent(out_dir, option, refuse_existing=True)
    if not os.access(out_dir.parent, os.W_OK | os.X_OK):
        raise KvsimConfigError(f"{option} {out_dir}: its folder is not writable")


def claim_new_run_dir(base: Path, name: str) -> Path:
    """Claim the first free ``base/name-N`` (N counts up from 1), atomically."""
    n = 1
    while True:
        path = base / f"{name}-{n}"
        if not path.exists():
            try:
                return claim_run_dir(path)
            except KvsimConfigError:
                if not path.exists():
                    raise  # not a lost race: the folder cannot be created
        n += 1


def release_claim(out_dir: Path) -> None:
    """Remove ``out_dir`` if it is still only this process's claim (a run that failed)."""
    out_dir = Path(out_dir)
    with contextlib.suppress(OSError):
        if _owned_claim(out_dir) and os.listdir(out_dir) == [CLAIM]:
            shutil.rmtree(out_dir, ignore_errors=True)


def list_runs(base: Path) -> list[Path]:
    """The complete run directories directly under ``base``, sorted by name: hidden folders
    (a killed run's ``.partial-*``) and runs still in progress are left out."""
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except OSError:
        return []
    runs = []
    for entry in entries:
        if entry.name.startswith("."):
            continue
        path = Path(entry.path)
        with contextlib.suppress(OSError):
            if entry.is_dir() and not (path / CLAIM).exists() and (path / SUMMARY).is_file():
                runs.append(path)
    return runs


def write_run(
    out_dir: Path,
    summary: dict[str, Any],
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    scenario_yaml: str,
    extra_writers: Sequence[Callable[[Path], None]] = (),
) -> Path:
    """Write a run directory atomically. Raises FileExistsError if ``out_dir`` exists, unless
    it is this process's (or its parent's) claim from :func:`claim_run_dir`.

    ``extra_writers`` each write optional files (such as the block map) into the folder.
    """
    out_dir = Path(out_dir)
    claimed = out_dir.exists() and _owned_claim(out_dir)
    if out_dir.exists() and not claimed:
        raise FileExistsError(f"{out_dir} already exists; kvsim never overwrites a run")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        (tmp / SUMMARY).write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        requests.to_parquet(tmp / REQUESTS, index=False)
        steps.to_parquet(tmp / STEPS, index=False)
        (tmp / SCENARIO).write_text(scenario_yaml)
        for writer in extra_writers:
            writer(tmp)
        if claimed:
            # The claim is an empty directory but for its marker: rename(2) replaces an
            # empty directory atomically.
            (out_dir / CLAIM).unlink()
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def check_run_dir(path: Path) -> None:
    """Raise ValueError, with the reason, unless ``path`` holds a complete run's files."""
    if not path.is_dir():
        raise ValueError(f"{path} is not a run directory")
    missing = [f for f in (SUMMARY, REQUESTS, STEPS) if not (path / f).is_file()]
    if missing:
        raise ValueError(f"{path} is not a complete run directory: missing {', '.join(missing)}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_numbers(value: object, where: str) -> None:
    """Every leaf under ``value`` is a number or null (what kvsim writes under metrics)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_numbers(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_numbers(item, f"{where}[{i}]")
    elif value is not None and not _is_number(value):
        raise ValueError(f"summary.json: {where} = {short_repr(value)}: expected a number or null")


def check_summary(summary: object) -> None:
    """Raise ValueError naming the field and its value unless ``summary`` has the request
    count and the metrics, and the types kvsim writes where it has the field: request
    counts whole numbers >= 0, the duration a number, ``complete`` and
    ``truncated_at_limit`` booleans (a cut run with its counts), every figure under
    ``metrics`` a number or null, each SLO an object. A hand-edited or foreign
    summary.json is refused here, not deep inside a table."""
    if not isinstance(summary, dict):
        raise ValueError("summary.json is not a JSON object")
    lacking = [key for key in ("num_requests", "metrics") if key not in summary]
    if lacking:
        raise ValueError(f"summary.json has no {' or '.join(lacking)}: not a kvsim run summary")
    counts = ("num_requests", "num_finished", "num_unfinished", "num_not_arrived")
    for key in (*counts, "trace_rows_skipped", "requests_clipped"):
        value = summary.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"summary.json: {key} = {short_repr(value)}: expected a count")
    if not _is_number(summary.get("duration_s", 0.0)):
        duration = short_repr(summary["duration_s"])
        raise ValueError(f"summary.json: duration_s = {duration}: expected a number of seconds")
    for key in ("complete", "truncated_at_limit"):
        if not isinstance(summary.get(key, False), bool):
            raise ValueError(
                f"summary.json: {key} = {short_repr(summary[key])}: expected true/false"
            )
    if summary.get("truncated_at_limit") and "num_unfinished" not in summary:
        raise ValueError("summary.json: truncated_at_limit without num_unfinished")
    what_if = summary.get("what_if", [])
    if not isinstance(what_if, list) or not all(isinstance(line, str) for line in what_if):
        raise ValueError(f"summary.json: what_if = {short_repr(what_if)}: expected a list of text")
    fleet = summary.get("fleet", {})
    if not isinstance(fleet, dict) or not isinstance(fleet.get("replicas", 1), int):
        raise ValueError(f"summary.json: fleet = {short_repr(fleet)}: expected replicas, a count")
    if not isinstance(summary.get("metrics", {}), dict):
        raise ValueError(
            f"summary.json: metrics = {short_repr(summary['metrics'])}: expected an object"
        )
    _check_numbers(summary.get("metrics", {}), "metrics")
    slos = summary.get("slos", {})
    if not isinstance(slos, dict) or not all(isinstance(v, dict) for v in slos.values()):
        raise ValueError(f"summary.json: slos = {short_repr(slos)}: expected an object of SLOs")


def load_run(path: str | Path) -> RunData:
    """Read a run directory; a missing or unreadable file, or a summary.json without the
    types kvsim writes (:func:`check_summary`), raises ValueError with the reason."""
    path = Path(path)
    check_run_dir(path)
    try:
        summary = json.loads((path / SUMMARY).read_text())
        check_summary(summary)
        requests = pd.read_parquet(path / REQUESTS)
        steps = pd.read_parquet(path / STEPS)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read run files: {exc}") from None
    scenario_yaml = (path / SCENARIO).read_text() if (path / SCENARIO).is_file() else ""
    return RunData(path, summary, requests, steps, scenario_yaml)
