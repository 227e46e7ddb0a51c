"""Start the dashboard: ``streamlit run dashboard/app.py`` bound to 127.0.0.1 by default."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

APP = Path(__file__).resolve().parent / "app.py"


def streamlit_command(
    host: str = "127.0.0.1",
    port: int = 8501,
    runs_dir: Path = Path("runs"),
    headless: bool = False,
) -> list[str]:
    """The ``python -m streamlit run`` command line the dashboard is started with."""
    return [
        sys.executable,
        "-m",
        "streamlit",
        "run",
        str(APP),
        "--server.address",
        host,
        "--server.port",
        str(port),
        "--server.headless",
        "true" if headless else "false",
        "--browser.gatherUsageStats",
        "false",
        "--client.toolbarMode",
        "minimal",  # no Deploy button: this is a local tool
        "--",
        "--runs-dir",
        str(Path(runs_dir).resolve()),
    ]


def launch(
    host: str = "127.0.0.1",
    port: int = 8501,
    runs_dir: Path = Path("runs"),
    headless: bool = False,
) -> int:
    """Run the dashboard until it is stopped (Ctrl-C); returns streamlit's exit code."""
    command = streamlit_command(host, port, runs_dir, headless)
    try:
        return subprocess.call(command)
    except KeyboardInterrupt:
        return 130
