"""The shipped fleet scenarios (scenarios/fleet/): golden summaries of a scaled-down copy of
the coding-agent fleet and of the Mooncake fleet on the first 300 rows of the real trace
(committed under tests/sim/fleet/data/). The full-size fleets take minutes each and are
left to benchmarks/bench_fleet.py.

Regenerate the goldens deliberately with
``KVSIM_UPDATE_GOLDEN=1 pytest tests/sim/fleet/test_fleet_scenarios.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from tests.sim.test_shipped_scenarios import rounded

FLEET_DIR = SCENARIO_DIR / "fleet"
GOLDEN_DIR = Path(__file__).parent / "golden"
MOONCAKE_SLICE = Path(__file__).parent / "data" / "mooncake_conversation_head300.jsonl"

CASES = {
    # Fewer sessions at the same arrival rate: the same load at any moment, a shorter run.
    "coding-agents-fleet-8b-h100-scaled": (
        "coding-agents-fleet-8b-h100",
        ("workload.sessions=40",),
    ),
    "mooncake-fleet-8b-h100-head300": (
        "mooncake-fleet-8b-h100",
        (f"workload.path={MOONCAKE_SLICE}",),
    ),
    "mooncake-fleet-8b-h100-head300-round-robin": (
        "mooncake-fleet-8b-h100",
        (f"workload.path={MOONCAKE_SLICE}", "fleet.router.kind=round_robin"),
    ),
}
SIZES = [
    *(pytest.param(case, id=case) for case in CASES),
    pytest.param(
        "coding-agents-fleet-8b-h100", id="coding-agents-fleet-full", marks=pytest.mark.slow
    ),
]


def test_every_fleet_scenario_opens_with_its_question_and_has_a_fleet() -> None:
    shipped = sorted(FLEET_DIR.glob("*.yaml"))
    assert len(shipped) >= 2
    for path in shipped:
        assert path.read_text().splitlines()[0].startswith("# Question:"), path
        assert load_scenario(path).fleet is not None, path


@pytest.mark.parametrize("case", sorted(CASES))
def test_fleet_summary_matches_golden(case: str) -> None:
    name, overrides = CASES[case]
    result = simulate(load_scenario(FLEET_DIR / f"{name}.yaml", list(overrides)))
    summary = rounded(result.summary)
    golden = GOLDEN_DIR / f"{case}.json"
    if os.environ.get("KVSIM_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    assert golden.is_file(), f"no golden summary for {case}; run with KVSIM_UPDATE_GOLDEN=1"
    assert summary == json.loads(golden.read_text())
    assert summary["num_finished"] == summary["num_requests"]
