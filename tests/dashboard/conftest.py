"""Fixtures for the dashboard tests: a runs directory with two small simulated runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.results import write_run
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario

APP = Path(__file__).resolve().parents[2] / "dashboard" / "app.py"

# Small and fast (well under a second each): 10 coding agents; 16 priority-mix sessions on a
# pool small enough that a few requests are preempted.
SMALL_RUNS = {
    "coding-small": ("coding-agents-8b-h100.yaml", ["workload.sessions=10"]),
    "priority-small": (
        "priority-mix.yaml",
        ["workload.sessions=16", "engine.num_gpu_blocks_override=2100"],
    ),
}


@pytest.fixture(scope="session")
def small_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A runs directory: ``priority-small`` with its block map, ``coding-small`` without one
    (written as a measured run would be)."""
    base = tmp_path_factory.mktemp("runs")
    for name, (scenario, overrides) in SMALL_RUNS.items():
        result = simulate(load_scenario(SCENARIO_DIR / scenario, overrides))
        if name == "priority-small":
            result.write(base / name)
        else:
            write_run(
                base / name, result.summary, result.requests, result.steps, result.scenario_yaml
            )
    return base


@pytest.fixture
def runs_env(small_runs: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the dashboard at ``small_runs`` through $KVSIM_RUNS_DIR."""
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(small_runs))
    return small_runs


def one_priority_mix_run(factory: pytest.TempPathFactory, name: str, overrides: list[str]) -> Path:
    """A runs directory holding one simulated run ``name``: priority-mix's 32 sessions on
    ``priority-small``'s pool (2,100 blocks), with ``overrides``."""
    base = factory.mktemp(f"{name}-runs")
    scenario = load_scenario(
        SCENARIO_DIR / "priority-mix.yaml",
        ["workload.sessions=32", "engine.num_gpu_blocks_override=2100", *overrides],
    )
    simulate(scenario).write(base / name)
    return base


@pytest.fixture(scope="session")
def fleet_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``fleet-small``: on 2 replicas (that pool each) behind round robin, with a few
    preemptions on each and its block map (of replica 0)."""
    return one_priority_mix_run(tmp_path_factory, "fleet-small", ["fleet.replicas=2"])


@pytest.fixture(scope="session")
def swap_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``swap-small``: swap preemption (a what-if) into a 2 GiB CPU pool, which it fills at
    times, with its CPU swap pool map."""
    return one_priority_mix_run(
        tmp_path_factory,
        "swap-small",
        ["engine.preemption_mode=swap", "engine.swap_space_gib=2"],
    )


@pytest.fixture(scope="session")
def offload_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``offload-small``: a 2 GiB CPU offload tier (a what-if) that loads prefixes back,
    with its CPU store map."""
    return one_priority_mix_run(tmp_path_factory, "offload-small", ["engine.kv_offload_gib=2"])
