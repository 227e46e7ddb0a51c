"""Run directories: ``summary.json``, ``requests.parquet``, ``steps.parquet``, ``scenario.yaml``.

Simulated and measured runs write the same files. A run directory appears only once all of
its files are written (they are written to a hidden sibling, then renamed into place), so a
crash never leaves a directory that looks complete, and an existing run is never overwritten.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

SUMMARY = "summary.json"
REQUESTS = "requests.parquet"
STEPS = "steps.parquet"
SCENARIO = "scenario.yaml"


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
    """A fresh ``base/name-N`` path that does not exist yet (N counts up from 1)."""
    n = 1
    while (base / f"{name}-{n}").exists():
        n += 1
    return base / f"{name}-{n}"


def write_run(
    out_dir: Path,
    summary: dict[str, Any],
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    scenario_yaml: str,
    extra_writers: Sequence[Callable[[Path], None]] = (),
) -> Path:
    """Write a run directory atomically. Raises FileExistsError if ``out_dir`` exists.

    ``extra_writers`` each write optional files (such as the block map) into the folder.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
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


def load_run(path: str | Path) -> RunData:
    """Read a run directory; a missing or unreadable file raises ValueError with the reason."""
    path = Path(path)
    check_run_dir(path)
    try:
        summary = json.loads((path / SUMMARY).read_text())
        requests = pd.read_parquet(path / REQUESTS)
        steps = pd.read_parquet(path / STEPS)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read run files: {exc}") from None
    scenario_yaml = (path / SCENARIO).read_text() if (path / SCENARIO).is_file() else ""
    return RunData(path, summary, requests, steps, scenario_yaml)
