"""Ctrl-C while waiting on workers becomes a KeyboardInterrupt at a safe point."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import Future

import pytest

from sim.interrupts import sigint_deferred, wait_first


def ctrl_c_after(seconds: float) -> threading.Timer:
    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_during_a_wait_raises_keyboard_interrupt_and_restores_the_handler() -> None:
    before = signal.getsignal(signal.SIGINT)
    never: Future[None] = Future()
    timer = ctrl_c_after(0.2)
    with pytest.raises(KeyboardInterrupt), sigint_deferred() as interrupt:
        wait_first([never], interrupt)
    timer.join()
    assert interrupt.requested
    assert signal.getsignal(signal.SIGINT) is before


def test_finished_futures_come_back_without_an_interrupt() -> None:
    done: Future[int] = Future()
    done.set_result(3)
    pending: Future[int] = Future()
    with sigint_deferred() as interrupt:
        assert wait_first([done, pending], interrupt) == {done}
    assert not interrupt.requested


def test_a_ctrl_c_at_the_end_of_the_block_is_not_lost() -> None:
    with pytest.raises(KeyboardInterrupt), sigint_deferred():
        os.kill(os.getpid(), signal.SIGINT)  # handled (flag set) before the block exits


def test_outside_the_main_thread_the_handler_is_left_alone() -> None:
    before = signal.getsignal(signal.SIGINT)
    seen: list[object] = []

    def body() -> None:
        with sigint_deferred() as interrupt:
            seen.append(signal.getsignal(signal.SIGINT))
            seen.append(interrupt.requested)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [before, False]
