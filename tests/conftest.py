"""Shared pytest hooks: the test lanes, and what the vLLM conformance suite and the validation
checked.

Lanes (markers declared in pyproject.toml):

- ``vllm``: the test drives the installed vLLM. ``pytest -m "not vllm"`` is the fast lane. When
  ``import vllm`` fails (missing or broken install), a ``vllm`` test fails if ``CI`` is set
  (CI must never go green without the conformance suite and the validation gate) and is
  skipped otherwise, saying how to install vLLM.
- ``slow``: minutes of simulation (the shipped scenarios at full size). Runs with ``--full``
  or when ``CI`` is set; skipped otherwise (the fast lane runs scaled-down copies instead).

``CI`` counts as set unless it is empty, ``0`` or ``false``; a CI run also lists its slowest
tests (``--durations``).
"""

from __future__ import annotations

import importlib
import os
import sys
from functools import cache

import pytest

INSTALL_VLLM = "bash .ci/setup.sh --with-vllm"
# Which of vLLM and torch were imported once every test module was: none, so the fast lane
# runs without vLLM installed (tests/test_conftest.py checks it).
IMPORTED_AT_COLLECTION = pytest.StashKey[list[str]]()


def in_ci() -> bool:
    """Whether this is a CI run (``CI`` set, as CI services set it and ``.ci/run`` does)."""
    return os.environ.get("CI", "").strip().lower() not in {"", "0", "false"}


@cache
def vllm_import_error() -> str | None:
    """Why ``import vllm`` fails here (None when it imports); a broken install counts."""
    try:
        importlib.import_module("vllm")
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked slow (the shipped scenarios at full size); "
        "on by default when CI is set",
    )


# CI's limit is 90 minutes on a 2-core machine: its log lists the slowest tests, so where the
# time goes is known before it runs out (unless --durations is given).
CI_DURATIONS = 25


def pytest_configure(config: pytest.Config) -> None:
    if in_ci() and config.option.durations is None:
        config.option.durations = CI_DURATIONS


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--full") or in_ci():
        return
    skip = pytest.mark.skip(reason="slow: runs with --full or in CI (CI=true)")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    imported = [name for name in ("vllm", "torch") if name in sys.modules]
    session.config.stash[IMPORTED_AT_COLLECTION] = imported


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("vllm") is None:
        return
    error = vllm_import_error()
    if error is None:
        return
    message = f"needs vLLM, but `import vllm` fails ({error}); install it with `{INSTALL_VLLM}`"
    if in_ci():
        pytest.fail(f"CI is set and this test {message}", pytrace=False)
    pytest.skip(f"this test {message}")


def _print_conformance(terminalreporter) -> None:
    module = sys.modules.get("tests.validate.test_conformance")
    stats = getattr(module, "STATS", None)
    if not stats or not stats["streams"]:
        return
    terminalreporter.write_line(
        f"vLLM conformance against vllm {stats['vllm']}: {stats['streams']} streams, "
        f"{stats['steps']} steps, {stats['preempting']} streams with preemption, "
        f"{stats['prefix_hits']} with prefix hits, {stats['fcfs']} fcfs / "
        f"{stats['priority']} priority, {stats['caching']} with prefix caching, "
        f"{stats['divergences']} divergences"
    )


def _print_validation(terminalreporter) -> None:
    module = sys.modules.get("tests.validate.test_validation_bound")
    report = getattr(module, "REPORT", None)
    if not report:
        return
    fit = report.get("fit", {})
    terminalreporter.write_line(
        f"kvsim vs vLLM {report['vllm_version']} on this machine, scenario {report['scenario']}, "
        f"median of {len(report['real_runs'])} replays "
        f"(profile fitted on the calibration scenarios only: r2 {fit.get('r2', float('nan')):.3f}, "
        f"{fit.get('outlier_frac', 0) * 100:.1f}% stalled steps dropped):"
    )
    bands = {b["metric"]: b for b in report.get("band") or []}
    for row in report["metrics"]:
        err = row["relative_error"]
        value, reference = row["value"], row["reference"]
        runs = ", ".join(f"{v:.6g}" for v in row["reference_runs"])
        b = bands.get(row["metric"])
        band = (
            f" kvsim p10-p90 [{b['low']:.6g}, {b['high']:.6g}]"
            if b and b["low"] is not None and b["high"] is not None
            else ""
        )
        terminalreporter.write_line(
            f"  {row['metric']:<24} kvsim {value if value is None else f'{value:.6g}':<12} "
            f"vLLM {reference if reference is None else f'{reference:.6g}':<12} "
            f"error {'-' if err is None else f'{err * 100:+.1f}%':<8} runs [{runs}]{band}"
        )
    ratios = report.get("step_time_vs_sim") or []
    shown = ", ".join("-" if r is None else f"{r:.3f}" for r in ratios)
    terminalreporter.write_line(f"  vLLM step time / kvsim's, per replay: [{shown}]")
    if bands:
        inside = [m for m, b in bands.items() if b["inside"]]
        outside = [m for m, b in bands.items() if b["inside"] is False]
        terminalreporter.write_line(
            f"  vLLM's median inside kvsim's p10-p90 band over step-speed samples: "
            f"{len(inside)} of {len(inside) + len(outside)} metrics"
            + (f" (outside: {', '.join(outside)})" if outside else "")
        )
    coverage = report.get("shape_coverage")
    if coverage is not None:
        terminalreporter.write_line(
            f"  shape coverage: {coverage * 100:.1f}% of the simulation's steps are batch shapes "
            "the profile was fitted on"
        )


def pytest_terminal_summary(terminalreporter) -> None:
    _print_conformance(terminalreporter)
    _print_validation(terminalreporter)
