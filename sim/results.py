"""Run directories: ``summary.json``, ``requests.parquet``, ``steps.parquet``, ``scenario.yaml``.

Simulated and measured runs write the same files. A run directory appears only once all of
its files are written (they are written to a hidden sibling, flushed to the disk, then
renamed into place, the rename flushed too), so a crash never leaves a directory that looks
complete, and an existing run is never overwritten.

Before a run simulates, it claims its directory (:func:`claim_run_dir`): the directory is
created atomically, holding only a ``.kvsim-claim`` file with the owner's pid and host name,
so two runs started together with the same ``--out`` (or none) never pick the same
directory, and the second learns it before it simulates. What a killed run leaves (a claimed
but empty directory, a hidden ``.<name>.partial-<pid>@<host>`` sibling, ``<host>`` a digest
of the host name) is removed by the next run in the same folder on the same host once its
owner is gone, and :func:`list_runs` never lists it. A run on another host (shared storage:
NFS, a Ray cluster's sweep) is never judged by its pid here; leftovers of kvsim versions
that recorded no host are taken as this host's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from sim.errors import KvsimConfigError, short_repr
from sim.files import hidden_name, probe_folder, reason, sync_folder, sync_tree

SUMMARY = "summary.json"
REQUESTS = "requests.parquet"
STEPS = "steps.parquet"
SCENARIO = "scenario.yaml"
CLAIM = ".kvsim-claim"
# A writer's hidden run: .<name>.partial-<pid>, and @<host tag> since hosts are recorded.
_PARTIAL = re.compile(r"^\..+\.partial-(\d+)(?:@([0-9a-f]{8}))?$")


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


def this_host() -> str:
    """This machine's name, as recorded in a claim."""
    return socket.gethostname()


def _host_tag(host: str) -> str:
    """A short, file-name-safe digest of ``host`` (in a partial run's name)."""
    return hashlib.sha256(host.encode()).hexdigest()[:8]


def partial_dir(out_dir: Path, pid: int | None = None) -> Path:
    """The hidden sibling ``.<name>.partial-<pid>@<host tag>`` a run is written into before
    it is renamed into place (the name cut to fit a file name where it is long)."""
    pid = os.getpid() if pid is None else pid
    return out_dir.with_name(hidden_name(out_dir.name, f".partial-{pid}@{_host_tag(this_host())}"))


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


def _claim_owner(path: Path) -> tuple[int, str | None] | None:
    """The pid and host in ``path``'s claim file (host None: written before hosts were
    recorded), or None if it is not a claimed directory."""
    try:
        lines = (path / CLAIM).read_text().split("\n")
        pid = int(lines[0].strip() or "0")
    except (OSError, ValueError):
        return None
    host = lines[1].strip() if len(lines) > 1 and lines[1].strip() else None
    return pid, host


def _local(host: str | None) -> bool:
    """Whether a claim of ``host`` is this machine's (an old claim without one is taken as
    this machine's, as kvsim treated it when it wrote it)."""
    return host is None or host == this_host()


def _owned_claim(path: Path) -> bool:
    """True if ``path`` is claimed by this process or its parent (a replay worker writes the
    run its parent claimed), on this host."""
    owner = _claim_owner(path)
    return owner is not None and owner[0] in (os.getpid(), os.getppid()) and _local(owner[1])


def _dead_partial(match: re.Match[str]) -> bool:
    """Whether a partial run's writer (its name's pid and host) is gone from this host."""
    pid, tag = int(match.group(1)), match.group(2)
    return tag in (None, _host_tag(this_host())) and not _pid_alive(pid)


def _dead_claim(path: Path) -> int | None:
    """The pid of a claimed directory's owner if it is gone from this host and the
    directory holds nothing but its claim, else None."""
    owner = _claim_owner(path)
    if owner is None or not _local(owner[1]) or _pid_alive(owner[0]):
        return None
    return owner[0] if os.listdir(path) == [CLAIM] else None


def _discard(path: Path, pid: int) -> bool:
    """Remove the claimed folder ``path`` so that its name is either free or left as it
    was, marker included: it is renamed to a hidden partial name (``pid``'s, which
    :func:`clean_stale` removes once that process is gone) before anything in it is
    removed. A claim whose parent cannot be written (made read-only mid-run) thus keeps its
    marker, instead of becoming an empty unmarked folder that blocks a rerun. Returns
    whether the name was freed."""
    hidden = partial_dir(path, pid)
    try:
        os.rename(path, hidden)
    except OSError:
        return False
    shutil.rmtree(hidden, ignore_errors=True)
    return True


def clean_stale(base: Path) -> list[Path]:
    """Remove what killed runs on this host left in ``base``: hidden ``.<name>.partial-*``
    folders and claimed directories holding nothing but their claim, whose owner process is
    gone. Returns what was removed. Never raises."""
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
                if _dead_partial(match):
                    shutil.rmtree(path, ignore_errors=True)
                    removed.append(path)
            elif (pid := _dead_claim(path)) is not None and _discard(path, pid):
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
        why = reason(exc)
        if isinstance(exc, FileExistsError):
            why = f"{out_dir.parent} is not a directory"
        raise KvsimConfigError(f"{option} {out_dir}: cannot create it ({why})") from None


def _taken(out_dir: Path, option: str) -> KvsimConfigError:
    """The refusal of an ``out_dir`` that exists, saying whose claim it is if it is one."""
    owner = _claim_owner(out_dir)
    if owner is None:
        return KvsimConfigError(f"{option} {out_dir}: already exists; kvsim never overwrites a run")
    pid, host = owner
    where = f"pid {pid}" + ("" if _local(host) else f" on host {host}")
    return KvsimConfigError(
        f"{option} {out_dir}: already exists, claimed by a kvsim run in progress ({where}); "
        "kvsim never overwrites a run (if that run is gone, delete the folder)"
    )


def _write_claim(out_dir: Path, text: str) -> None:
    """Write ``out_dir``'s claim file aside and rename it in: another process's clean_stale
    must never read a claim file still empty (pid 0, dead) and remove the run just claimed."""
    pending = out_dir / f".{CLAIM}.{os.getpid()}"
    pending.write_text(text)
    os.replace(pending, out_dir / CLAIM)


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
        raise _taken(out_dir, option) from None
    except (OSError, ValueError) as exc:
        raise KvsimConfigError(f"{option} {out_dir}: cannot create it ({reason(exc)})") from None
    try:
        _write_claim(out_dir, f"{os.getpid()}\n{this_host()}\n")
    except OSError as exc:
        shutil.rmtree(out_dir, ignore_errors=True)
        raise KvsimConfigError(
            f"{option} {out_dir}: cannot write into it ({reason(exc)})"
        ) from None
    return out_dir


def check_out_free(out_dir: Path, option: str = "--out") -> None:
    """KvsimConfigError unless ``out_dir`` does not exist and its folder can be created and
    written (for writers that create the directory themselves, later): a real write, as
    ``os.access`` says yes to root even where nothing can be written (``/proc``)."""
    out_dir = Path(out_dir)
    _create_parent(out_dir, option, refuse_existing=True)
    try:
        probe_folder(out_dir.parent)
    except (OSError, ValueError) as exc:
        raise KvsimConfigError(
            f"{option} {out_dir}: its folder {out_dir.parent} is not writable ({reason(exc)})"
        ) from None


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
    """Remove ``out_dir`` if it is still only this process's claim (a run that failed).
    Where the folder cannot be removed (its parent made read-only) it keeps its claim,
    which a later run removes once this process is gone."""
    out_dir = Path(out_dir)
    with contextlib.suppress(OSError):
        if _owned_claim(out_dir) and os.listdir(out_dir) == [CLAIM]:
            _discard(out_dir, os.getpid())


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
    tmp = partial_dir(out_dir)
    marker: str | None = None
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
        sync_tree(tmp)
        if claimed:
            # The claim is an empty directory but for its marker: rename(2) replaces an
            # empty directory atomically.
            marker = (out_dir / CLAIM).read_text()
            (out_dir / CLAIM).unlink()
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if claimed and marker is not None and not (out_dir / CLAIM).exists():
            # The rename failed (the folder made read-only): the claim keeps its marker,
            # or it would be an empty folder no run may remove.
            with contextlib.suppress(OSError):
                _write_claim(out_dir, marker)
        raise
    sync_folder(out_dir.parent)
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
