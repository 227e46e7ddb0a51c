"""Print how many cases the input fuzzer (tests/sim/test_fuzz_inputs.py) ran."""

from __future__ import annotations

import sys


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
