"""A replay's progress, from the replay process to the command that waits for it.

The replay process (validate/replay_worker.py) rewrites a small JSON file now and then: its
phase, the scenario's clock against ``limits.max_duration_s``, requests arrived and done.
The command polls the file while it waits and shows it: a progress bar on a terminal, a line
a minute elsewhere (CI logs). A replay takes as long as its scenario, up to hours on a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

STARTING = "starting vLLM"
WARMING_UP = "warming up"
REPLAYING = "replaying"

# The replay process rewrites the file at most this often (wall-clock seconds): a write
# between two engine steps costs microseconds, and never lands inside a timed step.
WRITE_EVERY_S = 2.0
# Without a terminal, one progress line this often (and at every change of phase).
LINE_EVERY_S = 60.0


@dataclass(frozen=True)
class ReplayProgress:
    phase: str  # STARTING, WARMING_UP or REPLAYING
    now_s: float = 0.0  # the scenario's clock (seconds since the replay started)
    limit_s: float = 0.0  # limits.max_duration_s, where the replay stops
    arrived: int = 0  # requests sent to vLLM so far
    finished: int = 0  # of them, finished

    def status(self) -> str:
        if self.phase != REPLAYING:
            return self.phase
        return (
            f"t={self.now_s:,.0f} s of at most {self.limit_s:,.0f} s, "
            f"{self.finished:,}/{self.arrived:,} requests done"
        )


def write_progress(path: Path, progress: ReplayProgress) -> None:
    """Replace the progress file at once (a reader never sees half of it)."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(asdict(progress)))
    os.replace(partial, path)


def read_progress(path: Path) -> ReplayProgress | None:
    """The last progress written, or None before the first (or if unreadable)."""
    try:
        return ReplayProgress(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


class ProgressFile:
    """The replay process's side: ``report(now_s, arrived, finished)`` on every event of
    the replay loop writes the file at most every ``every_s`` seconds of wall time."""

    def __init__(
        self,
        path: Path,
        limit_s: float,
        every_s: float = WRITE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path, self.limit_s, self.every_s, self.clock = path, limit_s, every_s, clock
        self._last_s = -float("inf")

    def phase(self, phase: str) -> None:
        self._write(ReplayProgress(phase, limit_s=self.limit_s))

    def report(self, now_s: float, arrived: int, finished: int) -> None:
        wall_s = self.clock()
        if wall_s - self._last_s < self.every_s:
            return
        self._last_s = wall_s
        self._write(ReplayProgress(REPLAYING, now_s, self.limit_s, arrived, finished))

    def _write(self, progress: ReplayProgress) -> None:
        # Best effort: a full disk or a removed folder costs the display, never the replay.
        with contextlib.suppress(OSError):
            write_progress(self.path, progress)


def wait_relaying_progress(
    proc: subprocess.Popen[bytes],
    path: Path,
    on_progress: Callable[[ReplayProgress], None] | None,
    poll_s: float = 1.0,
) -> int:
    """Wait for the replay process; hand each new progress it wrote to ``on_progress``.
    Returns its exit status."""
    last: ReplayProgress | None = None
    while True:
        try:
            return proc.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            pass
        progress = read_progress(path)
        if on_progress is not None and progress is not None and progress != last:
            on_progress(progress)
            last = progress


class ProgressDisplay:
    """The command's side: a transient bar of the scenario's clock against its limit on a
    terminal; elsewhere a line every ``every_s`` seconds and at each change of phase. Use it
    as a context manager and pass it as ``on_progress``."""

    def __init__(
        self,
        console: Console,
        description: str,
        every_s: float = LINE_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.console = console
        self.description = description
        self.every_s = every_s
        self.clock = clock
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._started_s = clock()
        self._line_s = -float("inf")
        self._phase: str | None = None

    def __enter__(self) -> ProgressDisplay:
        self._started_s = self.clock()
        if self.console.is_terminal:
            self._bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                console=self.console,
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=None, status=STARTING)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._bar is not None:
            self._bar.stop()

    def restart(self, description: str) -> None:
        """A new replay begins (``kvsim validate --repeats``): its own description and clock."""
        self.description, self._started_s, self._phase = description, self.clock(), None
        if self._bar is not None and self._task is not None:
            self._bar.reset(self._task, total=None, description=description, status=STARTING)

    def __call__(self, progress: ReplayProgress) -> None:
        if self._bar is not None and self._task is not None:
            replaying = progress.phase == REPLAYING
            self._bar.update(
                self._task,
                total=progress.limit_s if replaying else None,
                completed=min(progress.now_s, progress.limit_s),
                status=progress.status(),
            )
            return
        now_s = self.clock()
        if progress.phase == self._phase and now_s - self._line_s < self.every_s:
            return
        self._phase, self._line_s = progress.phase, now_s
        elapsed_s = now_s - self._started_s
        self.console.print(
            f"  {self.description}: {progress.status()} ({elapsed_s:,.0f} s elapsed)",
            highlight=False,
        )
