"""validate/gpu_power.py: the power-cap probe, run on a CPU with a tiny GEMM.

Marked ``vllm`` because it needs torch, which only the vLLM environment has.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.validate.standalone import run_alone

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[2] / "validate" / "gpu_power.py"


def test_the_probe_runs_alone_and_writes_its_measurements(tmp_path: Path) -> None:
    """Copied alone into an empty folder (what goes onto a GPU box), on a CPU: imports nothing
    of kvsim and writes a sag chain per --sag item and a point per shape and token count."""
    out = tmp_path / "power.json"
    argv = ["--out", str(out), "--device", "cpu", "--shapes", "test-tiny", "--tokens", "4,8"]
    argv += ["--sag", "test-tiny:8:5", "--cool-s", "0", "--trials", "2", "--sustain-s", "0.001"]
    last, stderr = run_alone(tmp_path, ("gpu_power.py",), argv)
    assert last == "exit 0 kvsim []", stderr
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and data["trials"] == 2
    [chain] = data["sag"]
    assert (chain["shape"], chain["m"], chain["k"], chain["n"]) == ("test-tiny", 8, 64, 128)
    assert len(chain["times_s"]) == 5 and min(chain["times_s"]) > 0
    assert len(chain["started"]) == 2
    points = data["length"]
    assert [p["m"] for p in points] == [4, 8]
    assert all(p["cool_s"] > 0 and p["sustained_s"] > 0 for p in points)
    assert points[1]["flops"] == 2.0 * 8 * 64 * 128
    assert points[0]["clock_mhz"] is None  # no NVML reading on a CPU


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "--device 'tpu' must be 'cuda' or 'cpu'"),
        (["--tokens", "1,x"], "--tokens '1,x': a comma list of whole numbers"),
        (["--tokens", "0"], "--tokens '0': each must be 1 or more"),
        (["--shapes", "nope"], "--shapes: unknown ['nope']"),
        (["--sag", "test-tiny:8"], "--sag 'test-tiny:8': shape:tokens:count"),
        (["--sag", "test-tiny:8:0"], "--sag 'test-tiny:8:0': tokens and count must be"),
        (["--trials", "0"], "--trials 0"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    out = tmp_path / "power.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu", *argv],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert message in done.stderr.strip().splitlines()[-1]
    assert not out.exists()
