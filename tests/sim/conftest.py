"""Print how many cases the input fuzzer (tests/sim/test_fuzz_inputs.py) ran; the
``engines`` fixture."""

from __future__ import annotations

import sys
from typing import Any

import pytest

import sim.engine


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> list[sim.engine.Engine]:
    """The engines the test's simulations build."""
    built: list[sim.engine.Engine] = []
    init = sim.engine.Engine.__init__

    def keep(self: sim.engine.Engine, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        built.append(self)

    monkeypatch.setattr(sim.engine.Engine, "__init__", keep)
    return built


def pytest_terminal_summary(terminalreporter) -> None:
    module = sys.modules.get("tests.sim.test_fuzz_inputs")
    stats = getattr(module, "STATS", None)
    if not stats or not stats["cases"]:
        return
    terminalreporter.write_line(
        f"kvsim input fuzzing: {stats['cases']} cases, {stats['complete']} complete runs, "
        f"{stats['refused']} refused with one paragraph (exit 2), {stats['broken']} broke the "
        "rules (a traceback, a hang, an unclear message or a leftover; shrinking repeats them)"
    )
