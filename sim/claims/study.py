"""The simulations behind ``kvsim report claims``, run in parallel worker processes.

Two phases. First, one capacity search per memory policy (:data:`SESSION_VARIANTS`): the
highest session arrival rate whose every request finishes within the SLOs, and the agent
sessions in flight at once at that rate. Then, at loads relative to vLLM's own capacity:

- *utilization*: vLLM at 0.5x-1.5x its capacity, for the steady-state KV usage each load
  reaches and the preemptions it costs;
- *pressure*: every policy at 1.5x vLLM's capacity, plus the same load on a KV cache
  :data:`AMPLE_FACTOR` times larger (nothing is ever evicted or preempted): the prefill
  tokens a policy computes beyond the ample run's are context computed again (prefixes
  evicted during tool waits, recompute after preemption);
- *waste*: each allocator (:data:`ALLOCATOR_VARIANTS`) at vLLM's capacity, for the KV
  memory waste breakdown.

Every simulation is the shipped scenario plus ``--set`` overrides, deterministic in its
seed, so the report does not depend on the number of workers.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.capacity import default_knob, find_capacity, get_field
from sim.claims.variants import ALLOCATOR_VARIANTS, SESSION_VARIANTS, Variant
from sim.config.limits import MAX_NUM_GPU_BLOCKS, MAX_SECONDS
from sim.errors import KvsimConfigError
from sim.interrupts import completed, sigint_deferred, stop_pool, submit, worker_pool
from sim.scenario import Scenario, check_runnable, load_scenario
from sim.workload import AgentSessionsWorkload

UTILIZATION_LOADS = (0.5, 0.75, 1.0, 1.25, 1.5)
PRESSURE_LOAD = 1.5
AMPLE_FACTOR = 8


@dataclass
class Task:
    """One unit of work for a worker: a capacity search or one simulation."""

    kind: str  # capacity | run
    group: str  # sessions | utilization | pressure | waste
    key: str
    overrides: tuple[str, ...]


@dataclass
class Study:
    scenario: Scenario
    knob_field: str
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)  # variant -> result
    runs: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (group, key)
    base_rate: float | None = None  # vLLM's capacity, the loads of phase two are relative to


def capacity_task(path: str, overrides: tuple[str, ...]) -> dict[str, Any]:
    """A capacity search of the scenario with ``overrides`` (worker side)."""
    from sim.runner import simulate

    try:
        spec = load_scenario(Path(path), list(overrides))
        check_runnable(spec, path)
        result = find_capacity(spec, lambda s: simulate(s).summary)
    except KvsimConfigError as exc:
        return {"error": str(exc)}
    return result.to_json()


def run_task(path: str, overrides: tuple[str, ...], kv_waste: bool = False) -> dict[str, Any]:
    """One simulation (worker side): its summary and the engine's busy time; ``kv_waste``
    adds the KV waste breakdown (for the paged allocator too)."""
    from sim.runner import simulate

    try:
        spec = load_scenario(Path(path), list(overrides))
        check_runnable(spec, path)
        result = simulate(spec, kv_waste=kv_waste)
    except KvsimConfigError as exc:
        return {"error": str(exc)}
    steps = result.steps
    return {
        "summary": result.summary,
        "busy_s": float(steps["duration_s"].sum()) if len(steps) else 0.0,
        "prefill_tokens": int(steps["num_prefill_tokens"].sum()) if len(steps) else 0,
        "num_steps": len(steps),
    }


def _run_tasks(
    path: Path,
    tasks: list[Task],
    workers: int,
    on_done: Callable[[Task, dict[str, Any]], None],
) -> dict[tuple[str, str], dict[str, Any]]:
    results: dict[tuple[str, str], dict[str, Any]] = {}
    # Workers that die with this process and never see Ctrl-C (sim.interrupts).
    pool = worker_pool(max(1, min(workers, len(tasks))))
    futures: dict[Future[dict[str, Any]], Task] = {}
    try:
        with sigint_deferred() as interrupt:
            for task in tasks:
                if task.kind == "capacity":
                    future = submit(pool, capacity_task, str(path), task.overrides)
                else:
                    future = submit(
                        pool, run_task, str(path), task.overrides, task.group == "waste"
                    )
                futures[future] = task
            for future in completed(futures, interrupt):
                task = futures[future]
                results[(task.group, task.key)] = future.result()
                on_done(task, results[(task.group, task.key)])
    except BaseException:  # Ctrl-C: terminate the workers rather than wait for their tasks
        stop_pool(pool)
        raise
    pool.shutdown(wait=True)
    # In task order, not the order the workers finished in: claims.json is the same for
    # any --workers.
    return {(t.group, t.key): results[(t.group, t.key)] for t in tasks}


def _at(study: Study, factor: float) -> tuple[str, ...]:
    """Overrides for ``factor`` x vLLM's capacity; a rate below the scenario's own gets the
    time limit stretched in proportion, as the capacity search does (the same sessions take
    longer to arrive)."""
    assert study.base_rate is not None
    rate = study.base_rate * factor
    own = float(get_field(study.scenario.model_dump(mode="json"), study.knob_field))
    limit_s = study.scenario.limits.max_duration_s
    if rate < own:
        limit_s = min(limit_s * own / rate, MAX_SECONDS)
    return (f"{study.knob_field}={rate:.6g}", f"limits.max_duration_s={limit_s:.6g}")


def plan_first_phase(variants: tuple[Variant, ...] = SESSION_VARIANTS) -> list[Task]:
    return [Task("capacity", "sessions", v.key, v.overrides) for v in variants if v.available()]


def plan_second_phase(study: Study, ample_blocks: int) -> list[Task]:
    """The utilization, pressure and waste runs, at loads relative to ``study.base_rate``."""
    tasks = [Task("run", "utilization", f"{f:g}", _at(study, f)) for f in UTILIZATION_LOADS]
    pressure = _at(study, PRESSURE_LOAD)
    tasks += [
        Task("run", "pressure", v.key, (*v.overrides, *pressure))
        for v in SESSION_VARIANTS
        if v.available() and v.key != "static"
    ]
    tasks.append(
        Task(
            "run",
            "pressure",
            "ample",
            (f"engine.num_gpu_blocks_override={ample_blocks}", *pressure),
        )
    )
    tasks += [
        Task("run", "waste", v.key, (*v.overrides, *_at(study, 1.0)))
        for v in ALLOCATOR_VARIANTS
        if v.available()
    ]
    return tasks


def run_study(
    path: Path,
    workers: int,
    on_done: Callable[[Task, dict[str, Any]], None] | None = None,
    on_phase: Callable[[str, int], None] | None = None,
) -> Study:
    """Both phases on the scenario at ``path``; raises KvsimConfigError when the scenario
    cannot be searched (no SLO, no load knob) or vLLM holds no load at all. ``on_done``
    runs as each task finishes; ``on_phase(name, num_tasks)`` before each phase."""
    scenario = load_scenario(path, [])
    if not isinstance(scenario.workload, AgentSessionsWorkload):
        raise KvsimConfigError(
            f"{path}: workload.kind={scenario.workload.kind}: the claims report measures "
            "agents (how many sessions a GPU holds); give an agent_sessions scenario"
        )
    sizing = check_runnable(scenario, str(path))
    if not scenario.slos.model_dump(exclude_none=True):
        raise KvsimConfigError(f"{path}: the claims report needs SLOs (slos: ttft_p99_s, ...)")
    knob = default_knob(scenario)
    study = Study(scenario, knob.field)
    report = on_done or (lambda task, result: None)
    phase = on_phase or (lambda name, num_tasks: None)
    searches = plan_first_phase()
    phase("capacity searches", len(searches))
    first = _run_tasks(path, searches, workers, report)
    study.capacity = {key: result for (_, key), result in first.items()}
    vllm = study.capacity["vllm"]
    if "error" in vllm or vllm.get("capacity") is None:
        raise KvsimConfigError(
            f"{path}: vLLM holds no load of this scenario within its SLOs "
            f"({vllm.get('error', 'no capacity')}); lighten the scenario or relax the SLOs"
        )
    study.base_rate = float(vllm["capacity"])
    ample = min(sizing.num_gpu_blocks * AMPLE_FACTOR, MAX_NUM_GPU_BLOCKS)
    runs = plan_second_phase(study, ample)
    phase("runs", len(runs))
    study.runs = _run_tasks(path, runs, workers, report)
    return study
