"""Ctrl-C while the main thread waits on worker processes.

Python raises ``KeyboardInterrupt`` at whatever bytecode the main thread is running when
SIGINT arrives. While it waits on futures it sits inside ``threading.Condition.wait``; an
interrupt that lands between re-acquiring the condition's lock and the ``with`` block's exit
surfaces as ``RuntimeError: release unlocked lock`` instead of ``KeyboardInterrupt`` (a
traceback where the user should read "interrupted: run the same command again"). Inside
:func:`sigint_deferred` Ctrl-C only sets a flag; :func:`completed` and :func:`result_of`
wait in short slices and raise ``KeyboardInterrupt`` between them, at a safe point.

The worker processes themselves (:func:`worker_pool`, :func:`submit`, :func:`stop_pool`, for
a sweep, ``--samples`` and the claims study) never see Ctrl-C: a terminal sends SIGINT to
the whole process group, and a worker still importing, or in the middle of a task, would
print a traceback or hand the interrupt back as its task's result. They start with SIGINT
blocked (inherited from the thread that starts them, across exec), and this process
terminates them when it is interrupted. They die with it too: the kernel kills them when
it dies (SIGTERM, SIGKILL, the OOM killer), so none is left running points or holding a
lock.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from multiprocessing import get_context
from types import FrameType
from typing import Any, TypeVar

POLL_S = 0.1  # how soon a deferred Ctrl-C is acted on
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_WAIT_S = 10.0  # how long a terminated worker is waited for

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


def die_with_parent(parent: int | None = None) -> None:
    """Worker initializer: on Linux the kernel kills this worker when the process that
    started it (pid ``parent``) dies, so a killed parent leaves no worker behind. The
    kernel's "parent" is the *thread* that started the worker (PR_SET_PDEATHSIG): a pool
    must be used and ended by the thread that submits to it first (every pool here lives
    inside one call), or its workers die with that thread."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux
        return
    if os.getppid() == 1 or (parent is not None and os.getppid() != parent):
        os._exit(1)  # the parent died before prctl took effect


def worker_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` spawned processes that die with this one (:func:`die_with_parent`).
    Spawned, not forked: the caller may run threads (a progress bar, the dashboard's server)
    whose locks a forked child would inherit held. Submit to it with :func:`submit`, and
    end it with :func:`stop_pool` on an error or interrupt."""
    return ProcessPoolExecutor(
        max_workers=workers,
        initializer=die_with_parent,
        initargs=(os.getpid(),),
        mp_context=get_context("spawn"),
    )


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread within the block: a process started in it inherits
    SIGINT blocked across exec (Python leaves the mask alone), so it never sees a Ctrl-C.
    A Ctrl-C that reaches this thread meanwhile is delivered when the block ends, not lost."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def submit(pool: ProcessPoolExecutor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """``pool.submit(fn, *args)`` with SIGINT blocked: a spawned pool starts its worker
    processes in ``submit``, and they inherit it (:func:`sigint_blocked`)."""
    with sigint_blocked():
        return pool.submit(fn, *args)


def stop_pool(pool: ProcessPoolExecutor) -> None:
    """Stop ``pool`` now (an error, Ctrl-C): drop the queued tasks and terminate the workers,
    rather than wait for the tasks they are running."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(timeout=STOP_WAIT_S)
