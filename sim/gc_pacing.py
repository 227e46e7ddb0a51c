"""Python's cyclic garbage collector, paced for a simulation's event loop.

A run allocates millions of small containers (token lists, step outputs, SimPy events) that
reference counting frees; almost none of them form cycles. At the collector's default pace (a
young collection every 700 net allocations of containers) the young generation is scanned
over and over while the live requests' objects pass through it: 7-12% of the 100k-request
benchmark's time, for next to no garbage (the same peak RSS with the collector off). Inside
:func:`paced_collection` the young generation is collected every ``YOUNG_THRESHOLD`` net
allocations, the middle one every ``MIDDLE_EVERY`` young collections and the whole heap after
``OLD_EVERY`` middle ones (and, as always, only once it has grown by a quarter): cycles are
still collected, only less often. Figures, and the variants not taken, in
benchmarks/performance-log.md ("The garbage collector").

Collection never changes a result (nothing in kvsim has a finalizer or a weak reference).
Reentrant and thread-safe (the dashboard and sweeps run simulations in threads): the first
run in sets the pace, the last one out restores the caller's thresholds.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 100_000
MIDDLE_EVERY = 50
OLD_EVERY = 1_000

_lock = threading.Lock()
_depth = 0
_saved: tuple[int, int, int] | None = None


@contextmanager
def paced_collection() -> Iterator[None]:
    """Run the body with the collector paced for a simulation (see the module docstring)."""
    global _depth, _saved
    with _lock:
        if _depth == 0:
            _saved = gc.get_threshold()
            gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_EVERY, OLD_EVERY)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                assert _saved is not None
                gc.set_threshold(*_saved)
                _saved = None
