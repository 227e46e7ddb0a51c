"""`launch()` runs `python -m streamlit run dashboard/app.py` bound to 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dashboard import launch as launch_module
from dashboard.launch import APP, launch, streamlit_command


def test_streamlit_command_defaults() -> None:
    command = streamlit_command()
    assert command[:5] == [sys.executable, "-m", "streamlit", "run", str(APP)]
    options = dict(zip(command[5:-3:2], command[6:-3:2], strict=True))
    assert options["--server.address"] == "127.0.0.1"
    assert options["--server.port"] == "8501"
    assert options["--server.headless"] == "false"
    assert command[-3:] == ["--", "--runs-dir", str(Path("runs").resolve())]


def test_launch_returns_the_exit_code(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls = []

    def fake_call(command: list[str]) -> int:
        calls.append(command)
        return 3

    monkeypatch.setattr(launch_module.subprocess, "call", fake_call)
    assert launch(host="0.0.0.0", port=9000, runs_dir=tmp_path, headless=True) == 3
    (command,) = calls
    assert command[command.index("--server.address") + 1] == "0.0.0.0"
    assert command[command.index("--server.port") + 1] == "9000"
    assert command[command.index("--server.headless") + 1] == "true"
    assert command[-1] == str(tmp_path.resolve())
