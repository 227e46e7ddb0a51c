"""Runs that look measured but were simulated with known step-time parameters, so the
calibration and the validation protocol can be checked exactly without vLLM."""

from __future__ import annotations

from pathlib import Path

from sim.cost_model import CostParams
from sim.results import RunData, load_run, write_run
from sim.runner import simulate
from sim.scenario import Scenario
from tests.profiles import profile_with

TRUTH = CostParams(
    mode="additive",
    compute_efficiency=3.0,
    attention_compute_efficiency=1.5,
    bandwidth_efficiency=1.2,
    step_overhead_s=9e-4,
    per_request_overhead_s=7e-5,
    prefill_step_overhead_s=4e-3,
    idle_wakeup_s=2.5e-3,
    idle_wakeup_log_s=1.2e-3,
    post_prefill_decode_s=9e-4,
    kernel_build_s=2e-3,
    kernel_build_per_token_s=1e-5,
)


def fake_replay(
    scenario: Scenario,
    out_dir: Path,
    source: str = "vllm",
    params: CostParams = TRUTH,
    step_time_scale: float = 1.0,
) -> RunData:
    """Simulate ``scenario`` priced by ``params`` (every step times ``step_time_scale``: a
    process that ran slower than the model) and write it as a run measured on vLLM-CPU."""
    profile = profile_with(params, hardware="cpu", model="tiny-llama", vllm_version="0.32.0")
    result = simulate(scenario, profile, step_time_scale=step_time_scale)
    summary = {**result.summary, "source": source, "device": "cpu", "vllm_version": "0.32.0"}
    write_run(out_dir, summary, result.requests, result.steps, result.scenario_yaml)
    return load_run(out_dir)
