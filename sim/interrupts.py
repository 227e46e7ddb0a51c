"""Ctrl-C while the main thread waits on worker processes.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is running when
SIGINT arrives. While it waits on futures it sits inside ``threading.Condition.wait``; an
interrupt that lands between re-acquiring the condition's lock and the ``with`` block's exit
surfaces as ``RuntimeError: release unlocked lock`` instead of ``KeyboardInterrupt`` (a
traceback where the user should read "interrupted: run the same command again"). Inside
:func:`sigint_deferred` Ctrl-C only sets a flag, and :func:`wait_first` raises
``KeyboardInterrupt`` at a safe point between short waits.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Collection, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, wait
from contextlib import contextmanager
from types import FrameType
from typing import Any

POLL_S = 0.1  # how soon a deferred Ctrl-C is acted on


class Interrupt:
    """Whether Ctrl-C arrived inside :func:`sigint_deferred`."""

    def __init__(self) -> None:
        self.requested = False

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` here if Ctrl-C arrived."""
        if self.requested:
            raise KeyboardInterrupt

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


@contextmanager
def sigint_deferred() -> Iterator[Interrupt]:
    """Within the block, SIGINT sets the yielded flag instead of raising. Outside the main
    thread (where Python delivers no signals) the flag simply never rises."""
    interrupt = Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield interrupt
        return
    previous = signal.signal(signal.SIGINT, interrupt._note)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, previous)
    interrupt.check()  # a Ctrl-C during the block's last moments is not lost


def wait_first(futures: Collection[Future[Any]], interrupt: Interrupt) -> set[Future[Any]]:
    """The futures done once at least one is (``concurrent.futures.wait``'s
    FIRST_COMPLETED), raising ``KeyboardInterrupt`` as soon as Ctrl-C arrives."""
    while True:
        done, _ = wait(futures, timeout=POLL_S, return_when=FIRST_COMPLETED)
        interrupt.check()
        if done:
            return done
