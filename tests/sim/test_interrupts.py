"""Ctrl-C while waiting on workers becomes a KeyboardInterrupt at a safe point."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from sim.interrupts import completed, result_of, sigint_deferred

GIVE_UP_S = 30.0  # a Ctrl-C that has not arrived by then never will: fail, do not hang


def ctrl_c_soon() -> threading.Timer:
    """SIGINT to the main thread in 0.2 s, where a terminal's Ctrl-C lands (the thread that
    waits), whichever thread the kernel would pick for a signal to the process."""
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


def give_up_later(future: Future[None]) -> threading.Timer:
    """Finish ``future`` after :data:`GIVE_UP_S`, so a wait whose Ctrl-C never arrives
    ends and the test fails instead of hanging the suite."""
    timer = threading.Timer(GIVE_UP_S, future.set_result, (None,))
    timer.daemon = True
    timer.start()
    return timer


def signal_state() -> str:
    """What to read when SIGINT never arrived: this process's pending, blocked, ignored and
    caught signal masks, and the wakeup fd a signal handler writes to."""
    try:
        status = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        status = []
    masks = [
        line.replace("\t", " ")
        for line in status
        if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
    ]
    wakeup = signal.set_wakeup_fd(-1)
    if wakeup != -1:
        signal.set_wakeup_fd(wakeup)
    return ", ".join(
        [*masks, f"wakeup fd {wakeup}", f"handler {signal.getsignal(signal.SIGINT)!r}"]
    )


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
    watchdog = give_up_later(never)
    try:
        with sigint_deferred() as interrupt:
            timer = ctrl_c_soon()  # armed inside the block: the signal lands in the wait
            try:
                if wait == "completed":
                    list(completed([never], interrupt))
                else:
                    result_of(never, interrupt)
            finally:
                timer.join(GIVE_UP_S)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail(f"no KeyboardInterrupt within {GIVE_UP_S:.0f} s of SIGINT ({signal_state()})")
    finally:
        watchdog.cancel()
    assert not timer.is_alive(), f"the thread sending SIGINT is stuck ({signal_state()})"
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
