"""The shipped scenarios: golden summaries, and more HBM never means more preemptions.

Golden files pin each shipped scenario's summary (numbers rounded to 6 significant
digits), so a behaviour change shows up in review as a diff of ``tests/sim/golden/``.
Each scenario runs twice over: at full size (marked ``slow``: minutes in all, so only with
``--full`` or in CI, golden ``golden/<name>.json``) and as a scaled-down copy (seconds, in
the fast lane, golden ``golden/scaled/<name>.json``). Regenerate them deliberately with
``KVSIM_UPDATE_GOLDEN=1 pytest --full tests/sim/test_shipped_scenarios.py``.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from sim.runner import SimulationResult, simulate
from sim.scenario import SCENARIO_DIR, load_scenario

GOLDEN_DIR = Path(__file__).parent / "golden"
SHIPPED = sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))

# The scaled-down copies: fewer sessions or requests at the same arrival rate, so the load at
# any moment stays alike and only the run is shorter. agent-burst starts every session at
# once and priority-mix preempts in its arrival bursts: both also get less KV
# (gpu_memory_utilization 0.5, the least at which the monotonicity check's 0.3 still holds a
# 32k request), so that they still preempt, as at full size.
SCALED: dict[str, tuple[str, ...]] = {
    "agent-burst": (
        "workload.sessions=75",
        "workload.turns.value=6",
        "engine.gpu_memory_utilization=0.5",
    ),
    "chat-rag-baseline": ("workload.num_requests=400",),
    "coding-agents-8b-h100": ("workload.sessions=25",),
    "fleet-70b-tp4-h200": ("workload.sessions=12",),
    "priority-mix": ("workload.sessions=50", "engine.gpu_memory_utilization=0.5"),
}
SIZES = [
    size
    for name in SHIPPED
    for size in (
        pytest.param(name, False, id=name, marks=pytest.mark.slow),
        *([pytest.param(name, True, id=f"{name}-scaled")] if name in SCALED else []),
    )
]


def overrides(name: str, scaled: bool) -> tuple[str, ...]:
    return SCALED[name] if scaled else ()


@cache
def run_shipped(name: str, *overrides: str) -> SimulationResult:
    return simulate(load_scenario(SCENARIO_DIR / f"{name}.yaml", list(overrides)))


def rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def test_there_are_at_least_five_shipped_scenarios_each_opening_with_its_question() -> None:
    assert len(SHIPPED) >= 5
    for name in SHIPPED:
        first = (SCENARIO_DIR / f"{name}.yaml").read_text().splitlines()[0]
        assert first.startswith("# Question:"), name


def test_every_shipped_scenario_has_a_scaled_copy() -> None:
    assert sorted(SCALED) == SHIPPED


@pytest.mark.parametrize(("name", "scaled"), SIZES)
def test_summary_matches_golden(name: str, scaled: bool) -> None:
    summary = rounded(run_shipped(name, *overrides(name, scaled)).summary)
    golden = GOLDEN_DIR / ("scaled" if scaled else "") / f"{name}.json"
    if os.environ.get("KVSIM_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    assert golden.is_file(), f"no golden summary for {name}; run with KVSIM_UPDATE_GOLDEN=1"
    assert summary == json.loads(golden.read_text())


# Shipped cases where a fifth more HBM preempts more, marked strict xfail (it fails once the
# check holds again). Under the H100 kernel fit without its power cap there were none (and
# under the fit before that, scaled priority-mix (50 sessions) preempted 11 times at
# gpu_memory_utilization 0.5 and 10 at 0.3); under the fit with it, since 2026-12-07:
NOT_MONOTONE: dict[str, str] = {
    "coding-agents-8b-h100": "the full scenario preempts 89 times at gpu_memory_utilization "
    "0.92 and 88 at 0.72 (110 at 0.82, 114 at 0.62, 131 at 0.52): an overloaded engine",
}
MONOTONE_SIZES = [
    pytest.param(
        *size.values,
        id=size.id,
        marks=[
            *size.marks,
            *(
                [pytest.mark.xfail(strict=True, reason=NOT_MONOTONE[size.id])]
                if size.id in NOT_MONOTONE
                else []
            ),
        ],
    )
    for size in SIZES
]


@pytest.mark.parametrize(("name", "scaled"), MONOTONE_SIZES)
def test_more_hbm_never_means_more_preemptions(name: str, scaled: bool) -> None:
    """A fifth more HBM for KV never preempts more.

    Small steps are not monotone in an overloaded engine (priority-mix preempted 47 times at
    gpu_memory_utilization 0.86 and 51 at 0.90 under the roofline: admission order shifts,
    and recompute from evicted prefixes is not counted as preemption; the full
    coding-agents-8b-h100 preempts 89, 110, 88, 114 and 131 times at 0.92, 0.82, 0.72, 0.62
    and 0.52 under the H100 kernel fit), so the check compares a real step.
    """
    base = run_shipped(name, *overrides(name, scaled))
    util = base.scenario.engine.gpu_memory_utilization
    smaller = run_shipped(
        name, *overrides(name, scaled), f"engine.gpu_memory_utilization={util - 0.2:.2f}"
    )
    assert smaller.sizing.num_gpu_blocks < base.sizing.num_gpu_blocks
    preempted = "vllm:num_preemptions"
    assert (
        smaller.summary["metrics"][preempted]["total"]
        >= base.summary["metrics"][preempted]["total"]
    )
