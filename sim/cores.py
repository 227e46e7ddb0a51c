"""How many worker processes a parallel command (a sweep, ``--samples``, the claims study)
runs by default."""

from __future__ import annotations

import os


def default_workers() -> int:
    """Every core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
