"""End-to-end runs of the simulator: theory checks, determinism, limits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sim.config.calibration import shipped_profile
from sim.cost_model import CostModel, CostParams
from sim.report import too_long_line, truncation_line
from sim.results import load_run, write_run
from sim.runner import simulate
from sim.scenario import DEFAULT_SCENARIO, load_scenario, parse_scenario
from sim.scheduler.output import BatchShape
from tests.profiles import profile_with


def make_prefill(num_tokens: int) -> BatchShape:
    """One request prefilling ``num_tokens`` with nothing cached."""
    return BatchShape(num_tokens, 1, num_tokens * num_tokens / 2)


def open_loop_scenario(**workload: object) -> dict:
    return {
        "name": "theory",
        "seed": 1,
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "engine": {"max_model_len": 8192},
        "workload": {
            "kind": "open_loop",
            "num_requests": 20,
            "arrival": {"kind": "poisson", "rate_per_s": 0.01},
            "prompt_tokens": {"kind": "fixed", "value": 512},
            "output_tokens": {"kind": "fixed", "value": 16},
            **workload,
        },
    }


def test_lightly_loaded_engine_ttft_is_the_modelled_prefill_and_nothing_queues() -> None:
    scenario = parse_scenario(open_loop_scenario(), "theory")
    result = simulate(scenario)
    req = result.requests
    # An H100 run without --calibration prices steps with the shipped kernel fit.
    profile = shipped_profile(scenario.hardware)
    assert profile is not None and profile.source == "vidur-operator-tables"
    cost = CostModel(scenario.model, scenario.hardware, 1, profile.params)
    assert len(req) == 20 and req["finish_s"].notna().all()
    assert (req["queue_s"] == 0).all()
    assert req["ttft_s"].to_numpy() == pytest.approx(cost.prefill_time_s(512), rel=1e-12)
    # Each decode step of a lone request attends over its whole context so far.
    first_itl = req["token_times_s"].iloc[0][1] - req["token_times_s"].iloc[0][0]
    assert first_itl == pytest.approx(cost.decode_time_s(1, 512), rel=1e-12)
    assert result.summary["metrics"]["vllm:num_preemptions"]["total"] == 0


def test_only_the_step_that_wakes_an_idle_engine_pays_the_wake_up() -> None:
    scenario = parse_scenario(open_loop_scenario(), "theory")
    params = CostParams(idle_wakeup_s=2e-3, prefill_step_overhead_s=1e-3)
    profile = profile_with(params)
    req = simulate(scenario, profile).requests
    cost = CostModel(scenario.model, scenario.hardware, 1, params)
    # Every request arrives at an idle engine: its prefill step wakes it, its decodes do not.
    prefill_s = cost.prefill_time_s(512)
    assert prefill_s == pytest.approx(
        CostModel(scenario.model, scenario.hardware, 1).prefill_time_s(512) + 1e-3
    )
    assert req["ttft_s"].to_numpy() == pytest.approx(prefill_s + 2e-3, rel=1e-12)
    first_itl = req["token_times_s"].iloc[0][1] - req["token_times_s"].iloc[0][0]
    assert first_itl == pytest.approx(cost.decode_time_s(1, 512), rel=1e-12)


def test_a_wake_up_pays_for_how_long_the_engine_sat_idle() -> None:
    scenario = parse_scenario(open_loop_scenario(), "theory")
    params = CostParams(idle_wakeup_s=1e-3, idle_wakeup_log_s=2e-3)
    req = simulate(scenario, profile_with(params)).requests
    cost = CostModel(scenario.model, scenario.hardware, 1, params)
    # Requests ~100 s apart each find the engine idle since the last one finished (the
    # first since the run began), and their prefill step pays for that gap.
    idle_s = req["arrival_s"].to_numpy() - np.r_[0.0, req["finish_s"].to_numpy()[:-1]]
    assert (idle_s > 0).all()
    expected = [cost.step_time_s(make_prefill(512), True, 0, gap) for gap in idle_s]
    assert req["ttft_s"].to_numpy() == pytest.approx(expected, rel=1e-9)
    assert expected[0] > cost.prefill_time_s(512) + 1e-3


def test_decode_steps_after_a_prefill_pay_the_refill_one_over_n() -> None:
    scenario = parse_scenario(open_loop_scenario(), "theory")
    params = CostParams(post_prefill_decode_s=1e-3)
    req = simulate(scenario, profile_with(params)).requests
    cost = CostModel(scenario.model, scenario.hardware, 1, params)
    # A lone request: its n-th decode step (ITL n) is the n-th step after its prefill.
    itls = np.diff(req["token_times_s"].iloc[0])
    expected = [cost.decode_time_s(1, 512 + n - 1) + 1e-3 / n for n in range(1, 16)]
    assert itls == pytest.approx(expected, rel=1e-9)
    assert req["ttft_s"].to_numpy() == pytest.approx(cost.prefill_time_s(512), rel=1e-12)


def test_workload_that_always_fits_never_preempts() -> None:
    scenario = load_scenario(
        DEFAULT_SCENARIO,
        ["workload.sessions=30", "workload.session_arrival.rate_per_s=0.05"],
    )
    result = simulate(scenario)
    assert result.summary["metrics"]["vllm:kv_cache_usage_perc"]["peak"] < 0.5
    assert result.summary["metrics"]["vllm:num_preemptions"]["total"] == 0
    assert result.summary["num_unfinished"] == 0


def test_agent_sessions_hit_their_own_growing_context() -> None:
    scenario = load_scenario(DEFAULT_SCENARIO, ["workload.sessions=20"])
    result = simulate(scenario)
    later_turns = result.requests[result.requests["turn"] > 0]
    # Everything but the new tool result was sent before: most of each prompt is a hit.
    assert (later_turns["cached_tokens"] / later_turns["prompt_tokens"]).median() > 0.7


def test_time_limit_stops_the_run_and_says_so() -> None:
    scenario = load_scenario(DEFAULT_SCENARIO, ["limits.max_duration_s=60"])
    result = simulate(scenario)
    assert result.summary["truncated_at_limit"] is True
    assert result.summary["duration_s"] == 60
    assert result.summary["num_unfinished"] > 0
    assert result.requests["arrival_s"].max() <= 60
    unfinished, total = result.summary["num_unfinished"], result.summary["num_requests"]
    sessions = result.summary["sessions"]
    not_started = sessions["planned"] - sessions["started"]
    assert 0 < not_started < sessions["planned"] == 500
    assert truncation_line(result.summary) == (
        f"the run hit limits.max_duration_s (60 s) before its workload ended with {unfinished:,} "
        f"of its {total:,} requests unfinished ({not_started:,} of its 500 sessions not yet "
        "started): its latencies, throughput and SLO verdicts "
        "leave out what those had still to do (their ends, any first token yet to come), the "
        "slowest part of the run; raise limits.max_duration_s to see the whole workload"
    )
    # Cut with nothing in flight: what would have come after is still left out.
    idle = {**result.summary, "num_unfinished": 0}
    assert "workload ended: what would have arrived after it" in str(truncation_line(idle))
    whole = simulate(load_scenario(DEFAULT_SCENARIO, ["workload.sessions=4"]))
    assert not whole.summary["truncated_at_limit"] and truncation_line(whole.summary) is None
    assert "num_not_arrived" not in result.summary  # agents: not known in advance


def test_a_cut_open_loop_run_counts_the_requests_that_had_not_arrived() -> None:
    # 20 requests at 0.01/s: about 6 arrive in the first 600 s.
    spec = {**open_loop_scenario(), "limits": {"max_duration_s": 600}}
    result = simulate(parse_scenario(spec, "theory"))
    summary = result.summary
    arrived = summary["num_requests"]
    assert summary["truncated_at_limit"] and 0 < arrived < 20
    assert summary["num_not_arrived"] == 20 - arrived
    line = str(truncation_line(summary))
    assert "not yet arrived" in line and f"{20 - arrived:,}" in line
    whole = simulate(parse_scenario(open_loop_scenario(), "theory")).summary
    assert "num_not_arrived" not in whole
    # Prompts too long for max_model_len are cut as they are sent: only those counted.
    long = open_loop_scenario(prompt_tokens={"kind": "fixed", "value": 9000})
    cut = simulate(parse_scenario({**long, "limits": {"max_duration_s": 600}}, "t")).summary
    assert cut["requests_clipped"] == cut["num_requests"] < 20
    assert f"cut {cut['num_requests']} of its {cut['num_requests']} requests" in str(
        too_long_line(cut)
    )


def _run_cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sim.cli", *args], cwd=cwd, capture_output=True, text=True
    )


def test_same_seed_gives_byte_identical_summary_in_one_process_or_many(tmp_path: Path) -> None:
    overrides = ["workload.sessions=25"]
    scenario = load_scenario(DEFAULT_SCENARIO, overrides)
    paths = []
    for name in ("a", "b"):
        r = simulate(scenario)
        paths.append(write_run(tmp_path / name, r.summary, r.requests, r.steps, r.scenario_yaml))
    proc = _run_cli(
        [
            "run",
            str(DEFAULT_SCENARIO),
            "--set",
            overrides[0],
            "--out",
            str(tmp_path / "c"),
            "--quiet",
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    blobs = [(p / "summary.json").read_bytes() for p in (*paths, tmp_path / "c")]
    assert blobs[0] == blobs[1] == blobs[2]
    steps = [(tmp_path / n / "steps.parquet").read_bytes() for n in ("a", "b", "c")]
    assert steps[0] == steps[1] == steps[2]


def test_run_directory_schema_roundtrip(tmp_path: Path) -> None:
    r = simulate(parse_scenario(open_loop_scenario(), "theory"))
    run = load_run(write_run(tmp_path / "run", r.summary, r.requests, r.steps, r.scenario_yaml))
    assert run.summary == json.loads(json.dumps(r.summary))
    for column in ("request_id", "ttft_s", "e2e_s", "cached_tokens", "token_times_s"):
        assert column in run.requests.columns
    for column in ("duration_s", "kv_cache_usage_perc", "num_preemptions", "prefix_cache_hits"):
        assert column in run.steps.columns
    assert "kind: open_loop" in run.scenario_yaml
    with pytest.raises(FileExistsError):
        write_run(tmp_path / "run", r.summary, r.requests, r.steps, r.scenario_yaml)
