"""Build and run one simulation from a scenario: sizing, scheduler, cost model, workload."""

from __future__ import annotations

import math
from collections.abc import Callable
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
from sim.recorder import Recorder
from sim.results import write_run
from sim.scenario import Scenario, scenario_to_yaml
from sim.scheduler.scheduler import Scheduler
from sim.summary import build_summary
from sim.workload import build_workload

# Simulated seconds between progress callbacks (and chances to stop).
PROGRESS_INTERVAL_S = 5.0

ProgressFn = Callable[[float, int, int | None], None]


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

    def write(self, out_dir: Path) -> Path:
        """Write the run directory (with its block map)."""
        return write_run(
            out_dir,
            self.summary,
            self.requests,
            self.steps,
            self.scenario_yaml,
            extra_writers=[self.block_map.save],
        )


def size_for(scenario: Scenario) -> KVSizing:
    """KV sizing of the scenario; an impossible config raises KvsimConfigError."""
    try:
        return size_kv_cache(scenario.model, scenario.hardware, scenario.engine)
    except ValueError as exc:
        raise KvsimConfigError(f"scenario {scenario.name!r}: {exc}") from None


def simulate(
    scenario: Scenario,
    calibration: CalibrationProfile | None = None,
    progress: ProgressFn | None = None,
    exact_reference: bool = False,
) -> SimulationResult:
    """Run the scenario to completion (or to its time limit) and summarise it.

    ``progress(sim_time_s, num_finished, expected_num_requests)`` is called every
    ``PROGRESS_INTERVAL_S`` simulated seconds. ``exact_reference`` runs every step through
    the scheduler, without the engine's decode stretches (see ``sim.engine``): the
    reference the fast path is tested against; results are identical, only slower.
    """
    sizing = size_for(scenario)
    engine_cfg = scenario.engine
    if calibration is None:
        calibration = shipped_profile(scenario.hardware, scenario.model)
    params = calibration.params if calibration is not None else CostParams()
    cost_model = CostModel(
        scenario.model, scenario.hardware, engine_cfg.tensor_parallel_size, params
    )
    env = simpy.Environment()
    scheduler = Scheduler(engine_cfg, sizing.num_gpu_blocks)
    block_map = BlockMapRecorder()
    recorder = Recorder(engine_cfg.block_size, block_map)
    engine = Engine(env, scheduler, cost_model, recorder, fast=not exact_reference)
    workload = build_workload(scenario.workload, scenario.seed)
    rng = np.random.default_rng(scenario.seed)
    workload.start(engine, rng)
    expected = workload.expected_num_requests()

    limit_s = scenario.limits.max_duration_s
    engine.horizon_s = limit_s
    truncated = False
    next_report_s = PROGRESS_INTERVAL_S
    peek, step = env.peek, env.step
    while True:
        next_event_s = peek()
        if math.isinf(next_event_s):
            break  # workload drained, engine idle
        if next_event_s > limit_s:
            truncated = True
            break
        step()
        if progress is not None and env.now >= next_report_s:
            next_report_s = env.now + PROGRESS_INTERVAL_S
            num_finished = len(recorder.requests) - scheduler.num_unfinished_requests
            progress(env.now, num_finished, expected)

    requests = recorder.requests_frame()
    steps = recorder.steps_frame()
    end_s = float(steps["start_s"].iat[-1] + steps["duration_s"].iat[-1]) if len(steps) else 0.0
    duration_s = limit_s if truncated else end_s
    provenance = {
        "source": "sim",
        "kvsim_version": __version__,
        "hardware": scenario.hardware.name,
        "calibration": None if calibration is None else calibration.model_dump(mode="json"),
    }
    summary = build_summary(
        provenance,
        scenario,
        requests,
        steps,
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
    return SimulationResult(scenario, sizing, summary, requests, steps, block_map)
