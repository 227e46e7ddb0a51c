"""Ctrl-C while waiting on workers becomes a KeyboardInterrupt at a safe point."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest

from sim.interrupts import completed, result_of, sigint_deferred


def ctrl_c_soon() -> threading.Timer:
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own Ctrl-C handler, as in a plain ``kvsim`` process."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("default_sigint")
@pytest.mark.parametrize("wait", ["completed", "result_of"])
def test_ctrl_c_during_a_wait_raises_keyboard_interrupt_and_restores_the_handler(
    wait: str,
) -> None:
    never: Future[None] = Future()
    with pytest.raises(KeyboardInterrupt), sigint_deferred() as interrupt:
        timer = ctrl_c_soon()  # armed inside the block: the signal lands in the wait
        try:
            if wait == "completed":
                list(completed([never], interrupt))
            else:
                result_of(never, interrupt)
        finally:
            timer.join()
    assert interrupt.requested
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("default_sigint")
def test_futures_come_back_as_they_finish_without_an_interrupt() -> None:
    first: Future[int] = Future()
    second: Future[int] = Future()
    with sigint_deferred() as interrupt:
        threading.Timer(0.15, first.set_result, (1,)).start()
        second.set_result(2)
        assert list(completed([first, second], interrupt)) == [second, first]
        assert result_of(first, interrupt) == 1
    assert not interrupt.requested


@pytest.mark.usefixtures("default_sigint")
def test_a_ctrl_c_at_the_end_of_the_block_is_not_lost() -> None:
    with pytest.raises(KeyboardInterrupt), sigint_deferred():
        os.kill(os.getpid(), signal.SIGINT)  # handled (flag set) before the block exits


def test_an_ignored_or_foreign_sigint_handler_is_left_alone() -> None:
    def foreign(signum: int, frame: object) -> None:
        pass

    for handler in (signal.SIG_IGN, foreign):
        previous = signal.signal(signal.SIGINT, handler)
        try:
            with sigint_deferred() as interrupt:
                assert signal.getsignal(signal.SIGINT) is handler
                os.kill(os.getpid(), signal.SIGINT)  # ignored, or the foreign handler's
            assert not interrupt.requested
            assert signal.getsignal(signal.SIGINT) is handler
        finally:
            signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("default_sigint")
def test_outside_the_main_thread_the_handler_is_left_alone() -> None:
    seen: list[object] = []

    def body() -> None:
        with sigint_deferred() as interrupt:
            seen.append(signal.getsignal(signal.SIGINT))
            seen.append(interrupt.requested)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [signal.default_int_handler, False]
