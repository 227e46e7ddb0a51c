"""Import the heavy modules in the background once the first page has been drawn.

The pages draw their title before importing pandas, pyarrow, plotly and the simulator, so the
first paint does not wait for them; this thread then imports them while the user reads the
page, so that opening another page or running a simulation does not wait either.
"""

from __future__ import annotations

import importlib
import logging
import threading

HEAVY_MODULES = (
    "dashboard.knobs",
    "dashboard.loaders",
    "dashboard.components",
    "dashboard.charts",
    "sim.runner",
    "validate.compare",
)
LOG = logging.getLogger("kvsim.dashboard")
_started = threading.Lock()
_done = threading.Event()


def _import_all() -> None:
    for name in HEAVY_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # the page that needs it will show the error
            LOG.warning("warm-up: cannot import %s", name, exc_info=True)
    _done.set()


def warm_up() -> threading.Event:
    """Start the import thread once per process; the event is set when it is done."""
    if _started.acquire(blocking=False):
        threading.Thread(target=_import_all, name="kvsim-warm-up", daemon=True).start()
    return _done
