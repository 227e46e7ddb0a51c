"""`kvsim` on bad input: one clear paragraph, a non-zero exit, no run directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.config.calibration import save_profile
from sim.cost_model import CostParams
from sim.scenario import DEFAULT_SCENARIO
from tests.profiles import profile_with

runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["engine.max_num_seqs=-3"], "engine.max_num_seqs = -3"),
        (["engine.scheduling_policy=lifo"], "engine.scheduling_policy = 'lifo'"),
        (["engine.bogus=1"], "engine.bogus"),
        (["model=Llama-9-1T"], "Llama-9-1T"),
        (["hardware=TPU-v9"], "TPU-v9"),
        (["model=Llama-3.1-70B"], "tensor_parallel_size"),
        (["engine.max_model_len=10000000"], "max_model_len"),
        (["workload.turns.kind=sometimes"], "workload"),
        (["nonsense"], "KEY=VALUE"),
    ],
)
def test_bad_input_is_one_paragraph_and_leaves_no_run(
    tmp_path: Path, overrides: list[str], expected: str
) -> None:
    out = tmp_path / "run"
    args = ["run", str(DEFAULT_SCENARIO), "--out", str(out), "--quiet"]
    for o in overrides:
        args += ["--set", o]
    code, output = run(*args)
    assert code == 2
    assert output.startswith("error:")
    assert expected in output
    assert "Traceback" not in output
    assert not out.exists()
    assert not list(tmp_path.iterdir())


def test_malformed_yaml_and_missing_file(tmp_path: Path) -> None:
    code, output = run("run", str(write(tmp_path, "name: [unclosed\n")), "--quiet")
    assert code == 2 and "not valid YAML" in output
    code, output = run("run", str(tmp_path / "nope.yaml"), "--quiet")
    assert code == 2 and "coding-agents-8b-h100.yaml" in output  # lists the shipped ones


def test_unknown_top_level_key_names_its_path(tmp_path: Path) -> None:
    text = DEFAULT_SCENARIO.read_text() + "\nturbo: true\n"
    code, output = run("run", str(write(tmp_path, text)), "--quiet")
    assert code == 2 and "turbo" in output and "Extra inputs" in output


def test_existing_out_dir_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, output = run("run", "--out", str(out), "--quiet")
    assert code == 2 and "already exists" in output
    assert (out / "keep.txt").read_text() == "mine"


def test_run_prints_summary_and_writes_run_dir(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, output = run(
        "run", str(DEFAULT_SCENARIO), "--set", "workload.sessions=10", "--out", str(out)
    )
    assert code == 0, output
    assert "TTFT" in output and "SLO ttft_p99_s" in output and "run written to" in output
    assert sorted(p.name for p in out.iterdir()) == [
        "block_map.npz",
        "requests.parquet",
        "scenario.yaml",
        "steps.parquet",
        "summary.json",
    ]


def test_run_warns_when_the_profile_was_fitted_at_another_token_budget(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    save_profile(profile_with(CostParams(mode="additive"), max_num_batched_tokens=[512]), profile)
    outputs = {}
    for budget in (512, 384):
        code, outputs[budget] = run(
            *("run", str(DEFAULT_SCENARIO), "--set", "workload.sessions=4", "--quiet"),
            *("--set", f"engine.max_num_batched_tokens={budget}", "--calibration", str(profile)),
            *("--out", str(tmp_path / str(budget))),
        )
        assert code == 0, outputs[budget]
    assert "was not calibrated" not in outputs[512]
    assert "engine.max_num_batched_tokens=384 was not calibrated" in outputs[384]
    assert "used 512" in outputs[384] and "run written to" in outputs[384]
