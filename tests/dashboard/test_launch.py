"""`kvsim dashboard`: options checked before anything starts; Streamlit started without its
first-run prompt and usage statistics; the URL printed once it serves; stopped with kvsim."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dashboard import launch as launch_module
from dashboard.launch import APP, check_options, launch, streamlit_command, url_for
from sim.cli import app
from sim.errors import KvsimConfigError

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 90  # a failure guard only: how long a broken start may take to show itself


def _options(command: list[str]) -> dict[str, str]:
    end = command.index("--")
    return dict(zip(command[5:end:2], command[6:end:2], strict=True))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_streamlit_command_defaults() -> None:
    command = streamlit_command()
    assert command[:5] == [sys.executable, "-m", "streamlit", "run", str(APP)]
    assert _options(command) == {
        "--server.address": "127.0.0.1",
        "--server.port": "8501",
        "--server.showEmailPrompt": "false",
        "--browser.gatherUsageStats": "false",
        "--logger.hideWelcomeMessage": "true",
        "--client.toolbarMode": "minimal",
    }  # no --server.headless: Streamlit opens a browser where there is a display
    assert command[-3:] == ["--", "--runs-dir", str(Path("runs").resolve())]


def test_streamlit_command_headless(tmp_path: Path) -> None:
    command = streamlit_command("0.0.0.0", 9000, tmp_path, headless=True)
    options = _options(command)
    assert options["--server.address"] == "0.0.0.0"
    assert options["--server.port"] == "9000"
    assert options["--server.headless"] == "true"
    assert options["--server.showEmailPrompt"] == "false"
    assert command[-1] == str(tmp_path.resolve())


def test_url_for() -> None:
    assert url_for("127.0.0.1", 8501) == "http://127.0.0.1:8501"
    assert url_for("0.0.0.0", 8501) == "http://localhost:8501"
    assert url_for("::1", 8600) == "http://[::1]:8600"
    assert url_for("my-box", 80) == "http://my-box:80"


@pytest.mark.parametrize("port", [-1, 0, 65536, 70000])
def test_check_options_refuses_a_port_out_of_range(port: int, tmp_path: Path) -> None:
    with pytest.raises(KvsimConfigError) as err:
        check_options("127.0.0.1", port, tmp_path)
    assert str(err.value) == (
        f"--port {port}: not a TCP port; use a number from 1 to 65535 (default 8501)"
    )


def test_check_options_refuses_a_port_in_use(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(KvsimConfigError) as err:
            check_options("127.0.0.1", port, tmp_path)
    assert str(err.value) == (
        f"--host 127.0.0.1 --port {port}: cannot serve there: the port is already in use; "
        "pick another with --port"
    )


def test_check_options_refuses_bad_host_and_runs_dir(tmp_path: Path) -> None:
    with pytest.raises(KvsimConfigError, match=r"^--host 'no such host': not an address"):
        check_options("no such host", _free_port(), tmp_path)
    file = tmp_path / "runs"
    file.write_text("")
    with pytest.raises(KvsimConfigError) as err:
        check_options("127.0.0.1", _free_port(), file)
    assert str(err.value) == f"--runs-dir {file}: exists and is not a directory"
    check_options("127.0.0.1", _free_port(), tmp_path / "not-yet")  # created on first save


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_cli_refuses_a_bad_port_before_starting(port: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_popen(*args, **kwargs):
        raise AssertionError("nothing may start")

    monkeypatch.setattr(launch_module.subprocess, "Popen", no_popen)
    result = CliRunner().invoke(app, ["dashboard", "--port", port])
    assert result.exit_code == 2
    assert " ".join(result.output.split()) == (
        f"error: --port {port}: not a TCP port; use a number from 1 to 65535 (default 8501)"
    )


def test_launch_returns_streamlits_exit_code(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A Streamlit that ends before serving: its status, and no URL announced."""
    commands = []

    def failing_command(*args) -> list[str]:
        commands.append(args)
        return [sys.executable, "-c", "raise SystemExit(3)"]

    monkeypatch.setattr(launch_module, "streamlit_command", failing_command)
    announced: list[str] = []
    port = _free_port()
    assert launch("127.0.0.1", port, tmp_path, True, announce=announced.append) == 3
    assert commands == [("127.0.0.1", port, tmp_path, True)]
    assert announced == []


def _processes() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, parent pid, process group) of every process (Linux /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # ended meanwhile
            continue
        state, ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        found[int(entry.name)] = (state, int(ppid), int(pgrp))
    return found


def _descendants(pid: int) -> set[int]:
    table = _processes()
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (_, ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def _alive(pids: set[int], group: int) -> list[int]:
    """Processes of ``pids`` or of process group ``group`` still running (zombies are not)."""
    return sorted(
        p for p, (state, _, pgrp) in _processes().items() if (p in pids or pgrp == group)
        and state != "Z"
    )  # fmt: skip


def default_sigint() -> None:
    """In the child, Ctrl-C as in a terminal: a test run started in the background (a
    non-interactive shell's ``&``) inherits SIGINT ignored, and Python then never raises
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _wait_for(predicate, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            status = proc.poll()
            pytest.fail(f"{what}: not seen (kvsim status {status}); output:\n{log.read_text()}")
        time.sleep(0.2)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
@pytest.mark.parametrize(("how", "status"), [("SIGTERM", 143), ("Ctrl-C", 130)])
def test_kvsim_dashboard_serves_on_a_fresh_machine_and_stops(
    how: str, status: int, tmp_path: Path
) -> None:
    """No terminal, an empty HOME, a display: Streamlit would ask for an email and wait."""
    home = tmp_path / "home"
    home.mkdir()
    bin_dir = tmp_path / "bin"  # a stand-in browser: Streamlit opens xdg-open on Linux
    bin_dir.mkdir()
    opened = tmp_path / "opened.txt"
    browser = bin_dir / "xdg-open"
    browser.write_text(f'#!/bin/sh\necho "$1" >> "{opened}"\n')
    browser.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STREAMLIT_", "WAYLAND"))}
    env.update(
        HOME=str(home),
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
        DISPLAY=":0",  # Streamlit is not headless by default where there is a display
        BROWSER=str(browser),  # where Python's webbrowser module is used instead
        PYTHONPATH=str(ROOT),
    )
    port = _free_port()
    log = tmp_path / "kvsim.log"
    kvsim = [sys.executable, "-c", "from sim.cli import app; app()", "dashboard"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*kvsim, "--port", str(port), "--runs-dir", str(tmp_path / "runs")],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,  # its own process group, as a shell job has
            preexec_fn=default_sigint,
        )
    try:
        _wait_for(lambda: launch_module.is_up("127.0.0.1", port), "/_stcore/health", proc, log)
        url = f"http://127.0.0.1:{port}"
        _wait_for(lambda: f"serving on {url}" in log.read_text(), "the URL line", proc, log)
        _wait_for(lambda: opened.exists(), "the browser opening", proc, log)
        children = _descendants(proc.pid)
        assert children, "kvsim runs Streamlit as its child"
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:  # a terminal's Ctrl-C reaches the whole foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=WAIT_S) == status
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _alive(children | {proc.pid}, proc.pid) == []
    assert _port_is_free(port)
    assert opened.read_text().split() == [url]
    output = log.read_text()
    assert "Email" not in output and "Welcome to Streamlit" not in output
    assert not (home / ".streamlit").exists()  # the user's Streamlit config is not touched
