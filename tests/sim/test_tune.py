"""`kvsim tune`: Optuna over vLLM's engine knobs, with the SLOs as its constraint."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sim import files
from sim.cli import app
from sim.errors import KvsimConfigError
from sim.scenario import SCENARIO_DIR, Scenario, load_scenario, parse_scenario
from sim.tune import (
    MEMORY_POLICIES,
    OFFLOAD_GIB,
    SPACE,
    Trial,
    baseline_params,
    overrides,
    pareto_front,
    startup_trials,
    trial_engine,
    tune,
)
from tests.sim.test_files import half_written

runner = CliRunner()
BURST = SCENARIO_DIR / "agent-burst.yaml"
FLEET = SCENARIO_DIR / "fleet-70b-tp4-h200.yaml"
SMALL = ["workload.sessions=12", "workload.turns.value=2"]


def fake_summary(spec: Scenario) -> dict[str, Any]:
    """A deployment whose goodput grows with max_num_seqs and whose p99 TTFT meets the 1 s
    SLO only with prefix caching on."""
    e = spec.engine
    ttft = 0.5 if e.enable_prefix_caching else 2.0
    return {
        "num_requests": 10,
        "num_finished": 10,
        "slos": {"ttft_p99_s": {"target": 1.0, "value": ttft, "pass": ttft <= 1.0}},
        "metrics": {
            "goodput_req_s": e.max_num_seqs / 100 + e.gpu_memory_utilization,
            "output_throughput_tok_s": 1000.0 * e.tensor_parallel_size,
            "vllm:time_to_first_token_seconds": {"p99": ttft},
            "vllm:inter_token_latency_seconds": {"p99": 0.05},
            "vllm:e2e_request_latency_seconds": {"p99": 9.0},
            "vllm:num_preemptions": {"total": 0},
        },
    }


def test_the_best_trial_is_the_best_feasible_one_and_the_search_is_seeded() -> None:
    spec = load_scenario(BURST, [*SMALL, "slos.ttft_p99_s=1"])
    result = tune(spec, "goodput", 25, fake_summary)
    assert len(result.trials) == 25 and result.simulations <= 25
    feasible = [t for t in result.trials if t.state == "ok"]
    assert feasible and all(t.params["enable_prefix_caching"] for t in feasible)
    assert all(not t.params["enable_prefix_caching"] for t in result.trials
               if t.state == "infeasible")  # fmt: skip
    assert result.best is not None
    assert result.best.objective == max(t.objective for t in feasible)
    # Tensor parallelism stays the scenario's except for the cost objective.
    assert {t.params["tensor_parallel_size"] for t in result.trials} == {1}
    again = tune(spec, "goodput", 25, fake_summary)
    assert [t.params for t in again.trials] == [t.params for t in result.trials]
    for t in result.trials:
        for name, values in SPACE.items():
            assert t.params[name] in values


def test_the_first_trial_is_the_scenarios_own_config() -> None:
    # A deployment whose goodput peaks at the scenario's own (unusual) config: the search
    # starts there, so it never reports a config worse than what the user runs.
    sets = [
        *SMALL,
        "slos.ttft_p99_s=1",
        "engine.max_num_seqs=100",
        "engine.gpu_memory_utilization=0.925",
        "engine.long_prefill_token_threshold=512",
    ]
    spec = load_scenario(BURST, sets)

    def peaked(s: Scenario) -> dict[str, Any]:
        summary = fake_summary(s)
        own = s.engine.max_num_seqs == 100 and s.engine.gpu_memory_utilization == 0.925
        summary["metrics"]["goodput_req_s"] = 100.0 if own else 1.0
        return summary

    result = tune(spec, "goodput", 6, peaked)
    first = result.trials[0]
    assert first.baseline and not any(t.baseline for t in result.trials[1:])
    assert first.params == baseline_params(spec)
    assert first.params["max_num_seqs"] == 100 and first.params["gpu_memory_utilization"] == 0.925
    assert trial_engine(spec.engine.model_dump(mode="json"), first) == spec.engine.model_dump(
        mode="json"
    )
    assert result.best is first and first.objective == 100.0
    assert first.baseline == "the scenario's own config"
    # The other trials draw from the space with the scenario's values added to it, and
    # utilizations on the 0.01 grid.
    for t in result.trials[1:]:
        assert t.params["max_num_seqs"] in (64, 100, 128, 256, 512)
        assert t.params["long_prefill_token_threshold"] in (0, 512, 1024, 4096)
        assert 0.80 <= t.params["gpu_memory_utilization"] <= 0.95
        assert round(t.params["gpu_memory_utilization"], 2) == t.params["gpu_memory_utilization"]


@pytest.mark.parametrize(
    ("sets", "which", "policy", "size", "own"),
    [
        (["engine.kv_offload_gib=48"], "exportable", "offload", ("kv_offload_gib", 48), True),
        (
            ["engine.preemption_mode=swap", "engine.swap_space_gib=8"],
            "all",
            "swap",
            ("swap_space_gib", 8),
            True,
        ),
        (["engine.kv_retention.policy=tool_latency"], "all", "retention", None, True),
        # Swap is not searched for exportable configs: the knobs, on vLLM's own engine.
        (
            ["engine.preemption_mode=swap", "engine.swap_space_gib=8"],
            "exportable",
            "vllm",
            None,
            False,
        ),
        ([], "exportable", "vllm", None, True),
    ],
)
def test_trial_0_keeps_the_scenarios_memory_policy_when_it_is_searched(
    sets: list[str], which: str, policy: str, size: tuple[str, float] | None, own: bool
) -> None:
    spec = load_scenario(BURST, [*SMALL, "slos.ttft_p99_s=1", *sets])
    first = tune(spec, "goodput", 1, fake_summary, memory_policies=which).trials[0]
    assert first.policy == policy and first.state == "ok", first.error
    if size is not None:
        assert first.params[size[0]] == size[1]
    document = spec.model_dump(mode="json")
    engine = trial_engine(document["engine"], first)
    assert (parse_scenario({**document, "engine": engine}, "t").engine == spec.engine) is own
    assert (first.baseline == "the scenario's own config") is own
    assert own or "vLLM's own engine" in (first.baseline or "")


def test_tpe_samples_at_random_for_a_third_of_the_budget_at_most_ten() -> None:
    assert [startup_trials(b) for b in (1, 2, 3, 15, 30, 31, 100)] == [1, 1, 1, 5, 10, 10, 10]


def test_configs_vllm_refuses_or_that_do_not_fit_are_not_simulated() -> None:
    spec = load_scenario(FLEET, ["workload.sessions=4", "slos.ttft_p99_s=1"])
    simulated: list[int] = []

    def counting(s: Scenario) -> dict[str, Any]:
        simulated.append(s.engine.tensor_parallel_size)
        return fake_summary(s)

    result = tune(spec, "cost-per-million-tokens", 30, counting)
    invalid = [t for t in result.trials if t.state == "invalid"]
    assert invalid and all(t.simulations == 0 and t.error for t in invalid)
    # 70B in bf16 does not fit on one 141 GB H200 at these utilizations, nor does a block
    # size of 64 with the model's 64k context at TP1.
    assert all(t.params["tensor_parallel_size"] > 1 for t in result.trials if t.state == "ok")
    assert len(simulated) == result.simulations == len(result.trials) - len(invalid)
    best = result.best
    assert best is not None and best.objective == min(
        t.objective for t in result.trials if t.state == "ok"
    )
    assert best.metrics["cost_per_million_tokens"] == pytest.approx(
        best.params["tensor_parallel_size"]
        / (1000.0 * best.params["tensor_parallel_size"] * 3600)
        * 1e6
    )


def test_the_cost_of_a_fleet_counts_every_replicas_gpus() -> None:
    """The fleet's throughput is all its replicas' together: 3 replicas of TP t cost 3t
    GPU-hours an hour, against the same throughput."""
    sets = ["workload.sessions=4", "slos.ttft_p99_s=1"]
    one = tune(load_scenario(FLEET, sets), "cost-per-million-tokens", 3, fake_summary)
    fleet = tune(
        load_scenario(FLEET, [*sets, "fleet.replicas=3"]), "cost-per-million-tokens", 3,
        fake_summary,
    )  # fmt: skip
    assert [t.params for t in fleet.trials] == [t.params for t in one.trials]  # seeded alike
    pairs = [(a, b) for a, b in zip(one.trials, fleet.trials, strict=True) if a.state == "ok"]
    assert pairs and all(b.objective == pytest.approx(3 * a.objective) for a, b in pairs)


def trial(n: int, tps: float, ttft: float, itl: float) -> Trial:
    metrics = {"output_throughput_tok_s": tps, "ttft_p99_s": ttft, "itl_p99_s": itl}
    return Trial(n, {}, "ok", tps, metrics=metrics)


def test_pareto_front_keeps_only_undominated_feasible_trials() -> None:
    trials = [
        trial(0, 100, 1.0, 0.05),
        trial(1, 90, 1.2, 0.06),  # dominated by 0
        trial(2, 120, 2.0, 0.05),  # more throughput, worse TTFT
        trial(3, 80, 0.5, 0.09),  # best TTFT
        Trial(4, {}, "infeasible", 500, metrics={"output_throughput_tok_s": 500,
                                                  "ttft_p99_s": 0.1, "itl_p99_s": 0.01}),
    ]  # fmt: skip
    assert [t.number for t in pareto_front(trials)] == [2, 0, 3]


def test_cli_reports_the_best_config_and_exports_it(tmp_path: Path) -> None:
    out, serve = tmp_path / "tune", tmp_path / "serve.yaml"
    args = ["tune", str(BURST), "--budget", "4", "--slo", "ttft_p99_s=5", "--out", str(out)]
    args += ["--export-format", "vllm-yaml", "--export-out", str(serve)]
    for assignment in SMALL:
        args += ["--set", assignment]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads((out / "tune.json").read_text())
    best = document["best"]
    assert len(document["trials"]) == 4 and document["simulations"] >= 1
    assert f"best: trial {best['number']}" in result.output
    assert f"max-num-seqs: {best['params']['max_num_seqs']}" in serve.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--objective", "speed"], "--objective 'speed': expected one of goodput"),
        (["--budget", "0"], "--budget 0: must be at least 1"),
        (["--export-format", "vllm-args"], "--export-format and --export-out go together"),
        (["--set", "slos.ttft_p99_s=null", "--set", "slos.e2e_p99_s=null"], "no SLO to tune"),
        (["--gpu-hour-usd", "nan"], "--gpu-hour-usd nan: must be a positive number"),
        (["--gpu-hour-usd", "inf"], "--gpu-hour-usd inf: must be a positive number"),
        (["--gpu-hour-usd", "0"], "--gpu-hour-usd 0.0: must be a positive number"),
    ],
)
def test_cli_errors_are_one_paragraph(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["tune", str(BURST), *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_unknown_objective_in_the_api() -> None:
    with pytest.raises(KvsimConfigError, match="--objective"):
        tune(load_scenario(BURST), "fast", 1, fake_summary)


def test_max_sessions_runs_a_capacity_search_per_trial() -> None:
    spec = load_scenario(BURST, [*SMALL, "slos.ttft_p99_s=1"])

    def by_sessions(s: Scenario) -> dict[str, Any]:
        summary = fake_summary(s)
        ttft = s.workload.sessions / (10.0 * s.engine.max_num_seqs / 64)  # more seqs, more room
        summary["slos"]["ttft_p99_s"] = {"target": 1.0, "value": ttft, "pass": ttft <= 1.0}
        summary["metrics"]["vllm:time_to_first_token_seconds"] = {"p99": ttft}
        return summary

    result = tune(spec, "max-sessions", 4, by_sessions)
    ran = [t for t in result.trials if t.state == "ok"]
    assert ran and all(t.simulations > 1 for t in ran)  # a whole search each
    for t in ran:
        assert t.objective == 10 * t.params["max_num_seqs"] // 64
    assert result.best is not None and result.best.objective == max(t.objective for t in ran)
    assert all(t.metrics["capacity_unit"] == "concurrent sessions" for t in ran)
    assert not any(t.metrics["capacity_at_ceiling"] for t in ran)


class FakeRun:
    def __init__(self, spec: Scenario) -> None:
        self.summary = fake_summary(spec)


def test_max_sessions_says_when_every_load_held_up_to_the_searchs_ceiling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every load holds (prefix caching on): each capacity search doubles up to the knob's
    # ceiling, where every trial ties; the CLI must say that is the search's bound.
    monkeypatch.setattr("sim.runner.simulate", FakeRun)
    args = ["tune", str(BURST), "--objective", "max-sessions", "--budget", "2"]
    result = runner.invoke(app, [*args, "--set", "engine.enable_prefix_caching=true"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "max-sessions = 1e+05 concurrent sessions" in text
    assert "every load the capacity search tried held, up to its ceiling" in text


def test_memory_policies_are_searched_as_a_policy_with_its_size() -> None:
    spec = load_scenario(
        BURST,
        [*SMALL, "slos.ttft_p99_s=1", "engine.preemption_mode=swap", "engine.swap_space_gib=8"],
    )
    seen: list[Scenario] = []

    def offload_wins(s: Scenario) -> dict[str, Any]:
        seen.append(s)
        summary = fake_summary(s)
        bonus = (s.engine.kv_offload_gib or 0) / 10  # a larger store holds more
        summary["metrics"]["goodput_req_s"] += bonus
        return summary

    result = tune(spec, "goodput", 30, offload_wins, memory_policies="exportable")
    assert {t.policy for t in result.trials} == {"vllm", "offload"}
    for t in result.trials:
        assert ("kv_offload_gib" in t.params) == (t.policy == "offload")
        assert t.params.get("kv_offload_gib", 32) in OFFLOAD_GIB
    # A picked policy replaces the scenario's (swap): vLLM's engine, or offload alone.
    assert all(s.engine.preemption_mode == "recompute" for s in seen)
    assert result.best is not None and result.best.policy == "offload"
    base = spec.engine.model_dump(mode="json")
    sets = overrides(base, result.best)
    assert f"engine.kv_offload_gib={result.best.params['kv_offload_gib']}" in sets
    assert 'engine.preemption_mode="recompute"' in sets and "engine.swap_space_gib=null" in sets
    # The overrides rebuild the trial's engine.
    rebuilt = load_scenario(BURST, [*SMALL, *sets])
    assert rebuilt.engine.model_dump(mode="json") == trial_engine(base, result.best)

    every = tune(spec, "goodput", 30, offload_wins, memory_policies="all")
    assert {t.policy for t in every.trials} == set(MEMORY_POLICIES)
    for t in every.trials:
        if t.policy == "retention" and t.state != "invalid":
            assert t.params["kv_retention"] == {"policy": "tool_latency"}
    # Without policies the scenario's own (swap) stays, as before.
    plain = tune(spec, "goodput", 3, fake_summary)
    assert all(t.policy is None and "kv_offload_gib" not in t.params for t in plain.trials)
    with pytest.raises(KvsimConfigError, match="--memory-policies 'some'"):
        tune(spec, "goodput", 1, fake_summary, memory_policies="some")


def test_an_offload_larger_than_host_memory_is_not_simulated() -> None:
    # An A100 has 128 GiB of host RAM per GPU: a 192 GiB store does not fit at TP1.
    spec = load_scenario(BURST, [*SMALL, "slos.ttft_p99_s=1", "hardware=A100-80GB"])
    result = tune(spec, "goodput", 40, fake_summary, memory_policies="exportable")
    too_big = [t for t in result.trials if t.params.get("kv_offload_gib") == 192]
    assert too_big and all(t.state == "invalid" for t in too_big)
    assert any("more host memory" in (t.error or "") for t in too_big)


def test_cli_memory_policies(tmp_path: Path) -> None:
    args = ["tune", str(BURST), "--budget", "3", "--slo", "ttft_p99_s=30"]
    for assignment in SMALL:
        args += ["--set", assignment]
    bad = runner.invoke(app, [*args, "--memory-policies", "all", "--export-format",
                              "vllm-args", "--export-out", str(tmp_path / "x.sh")])  # fmt: skip
    assert bad.exit_code == 2 and "use --memory-policies exportable" in " ".join(bad.output.split())
    bad = runner.invoke(app, [*args, "--memory-policies", "some"])
    assert bad.exit_code == 2 and "expected exportable or all" in bad.output
    out = tmp_path / "tune"
    result = runner.invoke(app, [*args, "--memory-policies", "exportable", "--out", str(out)])
    assert result.exit_code == 0, result.output
    trials = json.loads((out / "tune.json").read_text())["trials"]
    assert all(t["policy"] in ("vllm", "offload") for t in trials)
    assert "(memory policy: " in result.output


def test_cli_a_what_if_scenario_tuned_over_exportable_policies(tmp_path: Path) -> None:
    """The scenario's retention is replaced by each trial's policy, so the best config
    exports; tune.json and the output say which is a what-if; the best line pastes into a
    shell (a policy reset is JSON, quoted)."""
    out, serve = tmp_path / "tune", tmp_path / "serve.sh"
    args = ["tune", str(BURST), "--budget", "2", "--slo", "ttft_p99_s=30", "--out", str(out)]
    args += ["--memory-policies", "exportable", "--export-format", "vllm-args"]
    args += ["--export-out", str(serve), "--set", "engine.kv_retention.policy=tool_latency"]
    for assignment in SMALL:
        args += ["--set", assignment]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads((out / "tune.json").read_text())
    (own,) = document["what_if"]
    assert own.startswith("kv_retention: tool_latency")
    assert not any("retention" in line for line in document["best_what_if"])
    assert "vllm serve" in serve.read_text()
    text = " ".join(result.output.split())
    assert """--set 'engine.kv_retention={"policy": "none"}'""" in text


def test_a_search_for_export_leaves_out_configs_vllm_could_not_start() -> None:
    """20,000 pinned blocks take 39 GiB of KV at block size 16 on the H100, 78 GiB at 32:
    exported, only the 16-token trials may run."""
    spec = load_scenario(BURST, [*SMALL, "engine.num_gpu_blocks_override=20000"])
    free = tune(spec, "goodput", 8, fake_summary)
    assert any(t.state != "invalid" and t.params["block_size"] > 16 for t in free.trials)
    export = tune(spec, "goodput", 8, fake_summary, deployable=True)
    ran = [t for t in export.trials if t.state != "invalid"]
    assert ran and all(t.params["block_size"] == 16 for t in ran)
    refused = [t for t in export.trials if t.params["block_size"] > 16]
    assert refused and all("num_gpu_blocks_override=20000" in (t.error or "") for t in refused)


def small_tune(*args: str) -> Any:
    """``kvsim tune`` of 12 two-turn agent sessions, 2 trials, and ``args``."""
    base = ["tune", str(BURST), "--budget", "2", "--slo", "ttft_p99_s=5"]
    for assignment in SMALL:
        base += ["--set", assignment]
    return runner.invoke(app, [*base, *args])


def test_an_out_nothing_can_be_written_in_is_refused_before_the_search() -> None:
    """A real write, not os.access (which says yes to root, under /proc too)."""
    result = small_tune("--out", "/proc/kvsim-tune")
    assert result.exit_code == 2, result.output
    assert "--out /proc/kvsim-tune: /proc is not a writable folder" in " ".join(
        result.output.split()
    )
    assert "trial" not in result.output


def test_a_tune_json_that_cannot_be_written_leaves_nothing_to_block_the_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "tune"
    with monkeypatch.context() as patch:
        patch.setattr(files, "_write_all", half_written(errno.EFBIG))
        result = small_tune("--out", str(out))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"the search finished, but tune.json could not be written to {out}" in text
    assert os.listdir(tmp_path) == []  # no folder, no half tune.json, no temporary
    result = small_tune("--out", str(out))
    assert result.exit_code == 0, result.output
    assert len(json.loads((out / "tune.json").read_text())["trials"]) == 2
