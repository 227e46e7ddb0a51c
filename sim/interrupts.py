"""Ctrl-C while the main thread waits on worker processes.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is running when
SIGINT arrives. While it waits on futures it sits inside ``threading.Condition.wait``; an
interrupt that lands between re-acquiring the condition's lock and the ``with`` block's exit
surfaces as ``RuntimeError: release unlocked lock`` instead of ``KeyboardInterrupt`` (a
traceback where the user should read "interrupted: run the same command again"). Inside
:func:`sigint_deferred` Ctrl-C only sets a flag; :func:`completed` and :func:`result_of`
wait in short slices and raise ``KeyboardInterrupt`` between them, at a safe point.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from types import FrameType
from typing import TypeVar

POLL_S = 0.1  # how soon a deferred Ctrl-C is acted on

T = TypeVar("T")


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
    """Within the block, SIGINT sets the yielded flag instead of raising. Only Python's own
    Ctrl-C handler is replaced: outside the main thread (no signals there), or when SIGINT
    is ignored or handled by someone else, the flag never rises and SIGINT does what it
    did."""
    interrupt = Interrupt()
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield interrupt
        return
    signal.signal(signal.SIGINT, interrupt._note)
    try:
        yield interrupt
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupt.check()  # a Ctrl-C during the block's last moments is not lost


def completed(futures: Iterable[Future[T]], interrupt: Interrupt) -> Iterator[Future[T]]:
    """The futures as they finish (``concurrent.futures.as_completed``), raising
    ``KeyboardInterrupt`` as soon as Ctrl-C arrives. Each poll costs the same however many
    futures are pending (a sweep submits thousands at once)."""
    done: queue.SimpleQueue[Future[T]] = queue.SimpleQueue()
    pending = list(futures)
    for future in pending:
        future.add_done_callback(done.put)
    for _ in pending:
        while True:
            interrupt.check()
            try:
                future = done.get(timeout=POLL_S)
            except queue.Empty:
                continue
            break
        interrupt.check()
        yield future


def result_of(future: Future[T], interrupt: Interrupt) -> T:
    """``future.result()``, raising ``KeyboardInterrupt`` as soon as Ctrl-C arrives."""
    while True:
        interrupt.check()
        try:
            return future.result(timeout=POLL_S)
        except FutureTimeout:
            continue
