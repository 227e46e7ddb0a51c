"""Ctrl-C while waiting on workers becomes a KeyboardInterrupt at a safe point; the workers
themselves never see it, and die with this process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from sim.interrupts import (
    completed,
    result_of,
    sigint_blocked,
    sigint_deferred,
    stop_pool,
    submit,
    worker_pool,
)
from tests.dashboard.test_launch import default_sigint as terminal_sigint

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


def blocked_signals() -> set[int]:
    """The signals blocked in the calling thread (run in a worker process)."""
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, []))


def nap(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@pytest.mark.usefixtures("default_sigint")
def test_workers_start_with_ctrl_c_blocked_and_a_ctrl_c_meanwhile_is_not_lost() -> None:
    """A terminal's Ctrl-C reaches the whole process group: workers still importing would
    print tracebacks. They inherit SIGINT blocked from the submit that starts them; this
    process gets a Ctrl-C that arrived meanwhile as soon as the submit returns."""
    pool = worker_pool(1)
    try:
        assert signal.SIGINT in submit(pool, blocked_signals).result(timeout=120)
    finally:
        stop_pool(pool)
    assert signal.SIGINT not in blocked_signals()
    main = threading.main_thread().ident
    assert main is not None
    with pytest.raises(KeyboardInterrupt), sigint_deferred() as interrupt:
        with sigint_blocked():
            signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.05)
            assert not interrupt.requested  # held, not lost
        time.sleep(0.05)
        assert interrupt.requested
    assert signal.SIGINT not in blocked_signals()


def test_stop_pool_terminates_a_running_task_at_once() -> None:
    pool = worker_pool(1)
    future = submit(pool, nap, 60.0)
    deadline = time.monotonic() + 120
    while future.running() is False and time.monotonic() < deadline:
        time.sleep(0.05)
    processes = list(pool._processes.values())
    stop_pool(pool)  # the task naps for a minute: waiting for it would leave it alive here
    # The pool's manager thread may reap a terminated worker a moment after stop_pool's join
    # (is_alive reads True until its returncode is recorded): a few seconds of grace, far
    # short of the nap.
    grace = time.monotonic() + 5
    while any(p.is_alive() for p in processes) and time.monotonic() < grace:
        time.sleep(0.05)
    assert processes and not any(p.is_alive() for p in processes)


def test_a_worker_whose_parent_is_already_gone_exits() -> None:
    code = "from sim.interrupts import die_with_parent; die_with_parent({}); print('alive')"
    here = subprocess.run(
        [sys.executable, "-c", code.format(os.getpid())], capture_output=True, text=True
    )
    assert (here.returncode, here.stdout.strip()) == (0, "alive")
    orphan = subprocess.run(
        [sys.executable, "-c", code.format(dead_pid())], capture_output=True, text=True
    )
    assert (orphan.returncode, orphan.stdout) == (1, "")


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def start_kvsim(*args: str) -> subprocess.Popen[str]:
    """``kvsim ARGS`` in its own process group (a terminal's Ctrl-C reaches all of it), with
    Python's own Ctrl-C handler, from the checkout; output and errors in one pipe."""
    return subprocess.Popen(
        [sys.executable, "-c", "from sim.cli import app; app()", *args],
        start_new_session=True,
        preexec_fn=terminal_sigint,
        cwd=Path(__file__).parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def worker_pids(parent: int) -> list[int]:
    """The spawned worker processes of ``parent`` (not its resource tracker)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and b"spawn_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaps does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], within_s: float = 30.0) -> list[int]:
    """The pids still running after ``within_s``."""
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left
