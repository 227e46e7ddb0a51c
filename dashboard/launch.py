"""Start the dashboard: ``python -m streamlit run dashboard/app.py``, bound to 127.0.0.1 by default.

kvsim owns the Streamlit process it starts:

- the options are checked first (port range, address, port free, runs directory), so a bad
  ``--port`` is one error line and nothing is started;
- Streamlit's first-run email prompt and its usage statistics are switched off on the child's
  command line (``--server.showEmailPrompt false``, ``--browser.gatherUsageStats false``),
  never in the user's ``~/.streamlit`` config; its stdin is /dev/null, so no prompt can wait;
- kvsim prints the URL once ``/_stcore/health`` answers;
- Ctrl-C, SIGTERM or SIGHUP to kvsim stops the child (SIGTERM, then SIGKILL after
  :data:`STOP_TIMEOUT_S`) and waits for it, so no Streamlit server is left serving.

Without ``--headless`` Streamlit decides by itself whether a browser can be opened (on Linux,
only when ``$DISPLAY`` or ``$WAYLAND_DISPLAY`` is set) and opens it on the served URL.
"""

from __future__ import annotations

import errno
import ipaddress
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from sim.errors import KvsimConfigError

APP = Path(__file__).resolve().parent / "app.py"
HEALTH_PATH = "/_stcore/health"
STOP_TIMEOUT_S = 10.0
POLL_S = 0.1
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def streamlit_command(
    host: str = "127.0.0.1",
    port: int = 8501,
    runs_dir: Path = Path("runs"),
    headless: bool = False,
) -> list[str]:
    """The ``python -m streamlit run`` command line the dashboard is started with.

    ``--server.headless true`` only with ``headless``; otherwise Streamlit's own default
    applies (a browser is opened where there is a display).
    """
    command = [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.showEmailPrompt",
        "false",  # no first-run "Email:" prompt: it blocks a terminal and kills a script
        "--browser.gatherUsageStats",
        "false",
        "--logger.hideWelcomeMessage",
        "true",  # kvsim prints the URL itself, once the server answers
        "--client.toolbarMode",
        "minimal",  # no Deploy button: this is a local tool
    ]
    if headless:
        command += ["--server.headless", "true"]
    return [*command, "--", "--runs-dir", str(Path(runs_dir).resolve())]


def _probe_host(host: str) -> str:
    """The address to reach the server at (a wildcard bind is reached on loopback)."""
    return WILDCARD_HOSTS.get(host, host)


def url_for(host: str, port: int) -> str:
    """``http://host:port`` as a browser takes it (IPv6 literals in brackets)."""
    shown = "localhost" if host in WILDCARD_HOSTS else host
    try:
        if ipaddress.ip_address(shown).version == 6:
            shown = f"[{shown}]"
    except ValueError:
        pass  # a host name
    return f"http://{shown}:{port}"


def check_options(host: str, port: int, runs_dir: Path) -> None:
    """Refuse what Streamlit could not serve, before anything starts (KvsimConfigError)."""
    if not 1 <= port <= 65535:
        raise KvsimConfigError(
            f"--port {port}: not a TCP port; use a number from 1 to 65535 (default 8501)"
        )
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise KvsimConfigError(
            f"--host {host!r}: not an address or a host name that resolves ({exc}); "
            "use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"
        ) from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Streamlit binds
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                reason = "the port is already in use; pick another with --port"
            elif exc.errno in (errno.EACCES, errno.EPERM):
                reason = "binding it needs privileges; use a port above 1023"
            elif exc.errno == errno.EADDRNOTAVAIL:
                reason = f"{host} is not an address of this machine"
            else:
                reason = exc.strerror or str(exc)
            raise KvsimConfigError(
                f"--host {host} --port {port}: cannot serve there: {reason}"
            ) from None
    runs = Path(runs_dir)
    if runs.exists() and not runs.is_dir():
        raise KvsimConfigError(f"--runs-dir {runs}: exists and is not a directory")


def is_up(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """Whether Streamlit's health endpoint answers ``ok``."""
    try:
        health = url_for(_probe_host(host), port) + HEALTH_PATH
        with urllib.request.urlopen(health, timeout=timeout_s) as response:
            return response.status == 200 and response.read().strip() == b"ok"
    except (OSError, ValueError):
        return False


class _Stop(Exception):
    """A stop signal arrived (SIGTERM or SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stop(signum: int, frame: FrameType | None) -> None:
    del frame
    raise _Stop(signum)


def stop(proc: subprocess.Popen, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM the child, SIGKILL it if it has not exited after ``timeout_s``; its status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()


def _let_pending_signals_run() -> None:
    """A Python-level call: Python runs signal handlers whose signal has arrived on entry."""


def launch(
    host: str = "127.0.0.1",
    port: int = 8501,
    runs_dir: Path = Path("runs"),
    headless: bool = False,
    announce: Callable[[str], None] | None = None,
) -> int:
    """Serve the dashboard until it is stopped; returns the exit status for kvsim.

    ``announce`` receives the line naming the URL once the server answers (default: stdout).
    Streamlit's status when it ends by itself; 130 after Ctrl-C, 128 + N after signal N.
    """
    say = announce or (lambda line: print(line, flush=True))
    command = streamlit_command(host, port, runs_dir, headless)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.getsignal(s) for s in (*STOP_SIGNALS, signal.SIGINT)}
    if main_thread:  # signal handlers can only be set from the main thread
        for s in STOP_SIGNALS:
            signal.signal(s, _raise_stop)
    proc: subprocess.Popen | None = None
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        while proc.poll() is None:
            if is_up(host, port):
                say(
                    f"kvsim dashboard: serving on {url_for(host, port)} (runs directory "
                    f"{Path(runs_dir).resolve()}); Ctrl-C stops it."
                )
                break
            time.sleep(POLL_S)
        status = proc.wait()
        # Ctrl-C reaches Streamlit too, which may exit 0 before this process has run its
        # KeyboardInterrupt: the signal is pending by the time wait() returns, and entering
        # a Python function raises it, here inside the try.
        _let_pending_signals_run()
        return status
    except KeyboardInterrupt:
        return 130
    except _Stop as exc:
        return 128 + exc.signum
    finally:
        if proc is not None and proc.poll() is None:
            if main_thread:  # a second signal while stopping kills the child at once
                for s in previous:
                    signal.signal(s, lambda *_: proc.kill())
            stop(proc)
        if main_thread:
            for s, handler in previous.items():
                signal.signal(s, signal.SIG_DFL if handler is None else handler)
