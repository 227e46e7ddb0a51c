"""Build and run one simulation from a scenario: sizing, scheduler, cost model, workload."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import simpy

from sim import __version__
from sim.block_map import BlockMapRecorder
from sim.config.calibration import CalibrationProfile, shipped_profile
from sim.config.sizing import KVSizing, size_kv_cache
from sim.cost_model import CostModel, CostParams
from sim.engine import Engine
from sim.errors import KvsimConfigError
from sim.fleet.dispatch import FleetDispatcher, Replica
from sim.fleet.outputs import fleet_requests, fleet_section, fleet_steps
from sim.fleet.routers import build_router
from sim.gc_pacing import paced_collection
from sim.kv.offload import offload_summary
from sim.kv.retention import retention_summary
from sim.kv.waste import WasteTrackingScheduler, wants_waste_tracking
from sim.kv.waste import summary_section as waste_section
from sim.recorder import Recorder
from sim.results import write_run
from sim.scenario import Scenario, scenario_to_yaml
from sim.scheduler.scheduler import Scheduler
from sim.step_jitter import JitterSpec
from sim.summary import build_summary
from sim.workload import build_workload

# Simulated seconds between progress callbacks (and chances to stop).
PROGRESS_INTERVAL_S = 5.0
# Profile fields describing the calibration runs, not the pricing: left out of a run's
# summary.json (shape_cells are hundreds; stalled_runs names runs the fit left out; the
# others are what --samples draws from).
MEASURED_SPREAD = frozenset(
    {
        "shape_cells",
        "shape_cells_by_budget",
        "run_step_ratios",
        "held_out_run_step_ratios",
        "step_residual_quantiles",
        "step_residual_persistence",
        "held_out_metric_ratios",
        "stalled_runs",
    }
)

ProgressFn = Callable[[float, int, int | None], None]


def priced_by(calibration: CalibrationProfile, budget: int) -> dict[str, Any]:
    """The profile that priced a run at token budget ``budget``, as its summary records it.

    Less what describes its calibration runs rather than the pricing
    (:data:`MEASURED_SPREAD`: the fitted shape cells, hundreds, where kvsim run prints the
    run's coverage instead; each run's and step's speed, what --samples draws from; the runs
    left out as stalled). For a profile fitted per budget, ``params`` is the fit that priced
    the run (``priced_at_budget``: the budget whose fit it is, or None for the fit over all
    budgets) instead of the per-budget table."""
    record = calibration.model_dump(mode="json", exclude=MEASURED_SPREAD | {"params_by_budget"})
    if calibration.params_by_budget:
        record["params"] = calibration.params_for(budget).model_dump(mode="json")
        record["priced_at_budget"] = budget if budget in calibration.params_by_budget else None
    return record


@dataclass
class SimulationResult:
    scenario: Scenario
    sizing: KVSizing
    summary: dict[str, Any]
    requests: pd.DataFrame
    steps: pd.DataFrame
    block_map: BlockMapRecorder

    @property
    def scenario_yaml(self) -> str:
        return scenario_to_yaml(self.scenario)

    def write(self, out_dir: Path, extra_writers: Sequence[Callable[[Path], None]] = ()) -> Path:
        """Write the run directory (with its block map, and what ``extra_writers`` write
        into it before it appears)."""
        return write_run(
            out_dir,
            self.summary,
            self.requests,
            self.steps,
            self.scenario_yaml,
            extra_writers=[self.block_map.save, *extra_writers],
        )


def size_for(scenario: Scenario) -> KVSizing:
    """KV sizing of the scenario; an impossible config raises KvsimConfigError."""
    try:
        return size_kv_cache(scenario.model, scenario.hardware, scenario.engine)
    except ValueError as exc:
        raise KvsimConfigError(f"scenario {scenario.name!r}: {exc}") from None


def _build_replica(
    index: int,
    env: simpy.Environment,
    scenario: Scenario,
    sizing: KVSizing,
    cost_model: CostModel,
    exact_reference: bool,
    block_map: BlockMapRecorder | None,
    kv_waste: bool = False,
    step_jitter: JitterSpec | None = None,
) -> Replica:
    """One engine on the run's clock (a fleet has several; they share the cost model, which
    holds no state)."""
    engine_cfg = scenario.engine
    waste = wants_waste_tracking(engine_cfg, kv_waste)
    scheduler = (WasteTrackingScheduler if waste else Scheduler)(
        engine_cfg, sizing.num_gpu_blocks, sizing.bytes_per_block
    )
    if engine_cfg.kv_retention.policy != "none":
        scheduler.kv_cache_manager.enable_retention(engine_cfg.kv_retention, lambda: env.now)
    recorder = Recorder(engine_cfg.block_size, block_map)
    # Waste is sampled in Scheduler.schedule, which stretches skip.
    jitter = step_jitter.for_engine(scenario.seed, index) if step_jitter is not None else None
    engine = Engine(
        env, scheduler, cost_model, recorder, fast=not exact_reference and not waste, jitter=jitter
    )
    return Replica(index, engine)


def simulate(
    scenario: Scenario,
    calibration: CalibrationProfile | None = None,
    progress: ProgressFn | None = None,
    exact_reference: bool = False,
    kv_waste: bool = False,
    step_time_scale: float = 1.0,
    step_jitter: JitterSpec | None = None,
) -> SimulationResult:
    """Run the scenario to completion (or to its time limit) and summarise it.

    ``progress(sim_time_s, num_finished, expected_num_requests)`` is called every
    ``PROGRESS_INTERVAL_S`` simulated seconds. ``exact_reference`` runs every step through
    the scheduler, without the engine's stretches (see ``sim.engine``): the
    reference the fast path is tested against; results are identical, only slower.
    ``kv_waste`` adds the KV waste breakdown of the paged allocator to the summary (always
    there for a contiguous one; see ``sim.kv.waste``). ``step_time_scale`` multiplies every
    step time (an engine process slower or faster than the profile: ``kvsim run --samples``);
    ``step_jitter`` also multiplies each step's by its own draw (sim/step_jitter.py).
    """
    sizing = size_for(scenario)
    engine_cfg = scenario.engine
    if calibration is None:
        calibration = shipped_profile(scenario.hardware, scenario.model)
    params = (
        calibration.params_for(engine_cfg.max_num_batched_tokens)
        if calibration is not None
        else CostParams()
    )
    cost_model = CostModel(
        scenario.model, scenario.hardware, engine_cfg.tensor_parallel_size, params, step_time_scale
    )
    env = simpy.Environment()
    fleet = scenario.fleet
    # A fleet's block map shows its first replica.
    block_map = BlockMapRecorder()
    replicas = [
        _build_replica(
            index,
            env,
            scenario,
            sizing,
            cost_model,
            exact_reference,
            None if index else block_map,
            kv_waste,
            step_jitter,
        )
        for index in range(fleet.replicas if fleet is not None else 1)
    ]
    dispatcher: FleetDispatcher | None = None
    if fleet is not None:
        router = build_router(fleet.router, fleet.replicas, sizing.num_gpu_blocks)
        dispatcher = FleetDispatcher(env, replicas, router, fleet.router.view_delay_s)
        for replica in replicas:
            # The clock's next event is mostly another replica's step (see sim.engine).
            replica.engine.cut_by_submits = True
    workload = build_workload(scenario.workload, scenario.seed)
    rng = np.random.default_rng(scenario.seed)
    workload_run = workload.start(dispatcher or replicas[0].engine, rng)
    expected = workload_run.planned_requests

    limit_s = scenario.limits.max_duration_s
    for replica in replicas:
        replica.engine.horizon_s = limit_s
    truncated = False
    next_report_s = PROGRESS_INTERVAL_S
    peek, step = env.peek, env.step
    with paced_collection():
        while True:
            next_event_s = peek()
            if math.isinf(next_event_s):
                break  # workload drained, engines idle
            if next_event_s > limit_s:
                truncated = True
                break
            step()
            if progress is not None and env.now >= next_report_s:
                next_report_s = env.now + PROGRESS_INTERVAL_S
                num_finished = sum(
                    len(r.recorder.requests) - r.scheduler.num_unfinished_requests for r in replicas
                )
                progress(env.now, num_finished, expected)
    for replica in replicas:
        replica.engine.settle()

    if dispatcher is None:
        recorder = replicas[0].recorder
        requests = recorder.requests_frame()
        steps = recorder.steps_frame()
        end_s = float(steps["start_s"].iat[-1] + steps["duration_s"].iat[-1]) if len(steps) else 0.0
    else:
        requests = fleet_requests(
            [r.recorder.requests_frame() for r in replicas], dispatcher.assignments
        )
        steps = fleet_steps([r.recorder.steps for r in replicas])
        end_s = float((steps["start_s"] + steps["duration_s"]).max()) if len(steps) else 0.0
    duration_s = limit_s if truncated else end_s
    provenance = {
        "source": "sim",
        "kvsim_version": __version__,
        "hardware": scenario.hardware.name,
        "calibration": None
        if calibration is None
        else priced_by(calibration, engine_cfg.max_num_batched_tokens),
    }
    summary = build_summary(
        provenance,
        scenario,
        requests,
        steps,
        workload_run=workload_run,
        complete=True,
        truncated_at_limit=truncated,
        duration_s=duration_s,
        kv_cache={
            "block_size": sizing.block_size,
            "num_gpu_blocks": sizing.num_gpu_blocks,
            "bytes_per_block": sizing.bytes_per_block,
            "max_tokens_in_kv": sizing.max_tokens_in_kv,
            "weight_bytes": sizing.weight_bytes,
            "kv_cache_bytes": sizing.kv_cache_bytes,
        },
        num_usable_blocks=sizing.num_usable_blocks,
    )
    waste = waste_section(
        engine_cfg,
        [r.scheduler for r in replicas],
        [r.recorder.steps["duration_s"] for r in replicas],
    )
    if waste is not None:
        summary["kv_waste_breakdown"] = waste
    if fleet is not None:
        summary["fleet"] = fleet_section(
            fleet, requests, steps, duration_s, bool(summary.get("what_if"))
        )
    if engine_cfg.kv_retention.policy != "none":
        summary["retention"] = retention_summary(
            engine_cfg.kv_retention,
            [r.scheduler.kv_cache_manager.retention for r in replicas],  # type: ignore[misc]
            requests,
            duration_s,
        )
    if engine_cfg.kv_offload_gib is not None:
        summary["offload"] = offload_summary(
            [r.scheduler.offloader for r in replicas],  # type: ignore[misc]
            requests,
            steps,
            duration_s,
            sizing.bytes_per_block,
        )
    return SimulationResult(scenario, sizing, summary, requests, steps, block_map)
