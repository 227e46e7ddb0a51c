"""Where the dashboard reads from: the runs directory and its sweep results.

Only the standard library: ``app.py`` imports this before the first element is drawn, so the
page can paint while pandas, pyarrow, plotly and the simulator load.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RUNS_DIR_ENV = "KVSIM_RUNS_DIR"
SWEEPS = "sweeps"
SWEEP_FILE = "sweep.json"


def runs_dir(argv: list[str] | None = None) -> Path:
    """The runs directory: ``--runs-dir DIR`` after ``--`` on the streamlit command line,
    else ``$KVSIM_RUNS_DIR``, else ``./runs``."""
    argv = sys.argv[1:] if argv is None else argv
    for i, arg in enumerate(argv):
        if arg == "--runs-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--runs-dir="):
            return Path(arg.split("=", 1)[1])
    env = os.environ.get(RUNS_DIR_ENV)
    return Path(env) if env else Path("runs")


def list_sweeps(base: Path) -> list[Path]:
    """``sweep.json`` files under ``base/sweeps/*/`` (there is no sweep command yet)."""
    root = base / SWEEPS
    return sorted(root.glob(f"*/{SWEEP_FILE}")) if root.is_dir() else []
