"""The test lanes of tests/conftest.py, run on a tiny test file in a fresh pytest process.

vLLM's absence is simulated: ``-p novllm`` puts ``None`` in ``sys.modules["vllm"]`` (what
``import vllm`` then raises is a ModuleNotFoundError, as for a missing package), and a
``vllm.py`` next to the test file stands in for a broken or a working install.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from tests.conftest import IMPORTED_AT_COLLECTION, in_ci

pytest_plugins = ("pytester",)

CONFTEST = Path(__file__).with_name("conftest.py")
PYPROJECT = Path(__file__).parents[1] / "pyproject.toml"

TESTS = """
import pytest

@pytest.mark.vllm
def test_drives_vllm():
    import vllm

def test_plain():
    pass

@pytest.mark.slow
def test_full_size():
    pass
"""


@pytest.fixture
def lanes(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A project with this repository's conftest and markers, and the tiny test file."""
    monkeypatch.delenv("CI", raising=False)
    # Not the installed plugins (hypothesis alone takes seconds to import on a busy machine).
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    pytester.makeconftest(CONFTEST.read_text())
    options = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]
    markers = "".join(f"    {marker}\n" for marker in options["markers"])
    pytester.makeini(f"[pytest]\naddopts = {options['addopts']}\nmarkers =\n{markers}")
    pytester.makepyfile(test_lanes=TESTS, novllm="import sys\nsys.modules['vllm'] = None\n")
    return pytester


def test_without_ci_a_missing_vllm_skips_its_tests_and_says_how_to_install_it(
    lanes: pytest.Pytester,
) -> None:
    result = lanes.runpytest_subprocess("-p", "novllm")
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(
        [
            "SKIPPED [[]1[]] *: this test needs vLLM, but `import vllm` fails "
            "(ModuleNotFoundError: import of vllm halted; None in sys.modules); "
            "install it with `bash .ci/setup.sh --with-vllm`",
            "SKIPPED [[]1[]] *: slow: runs with --full or in CI (CI=true)",
        ]
    )


def test_in_ci_a_missing_vllm_fails_its_tests(
    lanes: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    result = lanes.runpytest_subprocess("-p", "novllm")
    # The slow test runs too: CI runs the shipped scenarios at full size.
    result.assert_outcomes(passed=2, errors=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "ERROR test_lanes.py::test_drives_vllm - Failed: CI is set and this test needs "
            "vLLM, but `import vllm` fails (ModuleNotFoundError: *); "
            "install it with `bash .ci/setup.sh --with-vllm`"
        ]
    )


def test_in_ci_a_broken_vllm_fails_its_tests_with_the_import_error(
    lanes: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    lanes.makepyfile(vllm="raise OSError('libtorch_cpu.so: cannot open shared object file')")
    result = lanes.runpytest_subprocess()
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "ERROR *test_drives_vllm - Failed: CI is set and this test needs vLLM, but "
            "`import vllm` fails (OSError: libtorch_cpu.so: cannot open shared object file); "
            "install it *"
        ]
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        ("", False),
        ("0", False),
        ("false", False),
        (" False ", False),
        ("true", True),
        ("1", True),
        ("yes", True),
    ],
)
def test_ci_is_set_unless_empty_zero_or_false(
    monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool
) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert in_ci() is expected


def test_an_importable_vllm_runs_its_tests_in_ci(
    lanes: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    lanes.makepyfile(vllm="__version__ = '0.32.0'")
    result = lanes.runpytest_subprocess("-m", "vllm")
    result.assert_outcomes(passed=1, deselected=2)


def test_the_fast_lane_never_imports_vllm_and_full_runs_the_slow_tests(
    lanes: pytest.Pytester,
) -> None:
    lanes.makepyfile(vllm="raise OSError('must not be imported')")
    result = lanes.runpytest_subprocess("-m", "not vllm", "--full")
    result.assert_outcomes(passed=2, deselected=1)


def test_collecting_the_tests_imports_neither_vllm_nor_torch(pytestconfig: pytest.Config) -> None:
    """Only the tests marked vllm import it, when they run: the fast lane needs no vLLM."""
    assert pytestconfig.stash[IMPORTED_AT_COLLECTION] == []
