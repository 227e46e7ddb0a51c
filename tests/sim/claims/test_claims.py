"""`kvsim report claims`: the study's plan, the report's tables, the command end to end."""

from __future__ import annotations

import json
from concurrent.futures import Future, wait
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sim.capacity import find_capacity
from sim.claims import render
from sim.claims import study as study_module
from sim.claims.render import pressure_rows, render_markdown, sessions_rows
from sim.claims.study import (
    AMPLE_FACTOR,
    PRESSURE_LOAD,
    UTILIZATION_LOADS,
    Study,
    plan_first_phase,
    plan_second_phase,
)
from sim.claims.variants import ALLOCATOR_VARIANTS, SESSION_VARIANTS, Variant
from sim.cli import app
from sim.errors import KvsimConfigError
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario

runner = CliRunner()
TINY = Path(__file__).parent / "tiny-claims.yaml"
RATE = "workload.session_arrival.rate_per_s"


def tiny_study(base_rate: float = 2.0) -> Study:
    return Study(load_scenario(TINY, []), RATE, base_rate=base_rate)


def test_a_variant_needs_its_engine_field() -> None:
    assert Variant("x", "x", ()).available()
    missing = Variant("y", "y", ("engine.no_such=1",), requires="no_such_field", vllm_exact=False)
    assert not missing.available()
    assert missing.missing_reason() == "not simulated: this kvsim has no engine.no_such_field yet"
    # Only what exists is searched.
    keys = [t.key for t in plan_first_phase()]
    assert keys == [v.key for v in SESSION_VARIANTS if v.available()]
    assert "vllm" in keys and "vllm_priority" in keys


def test_second_phase_loads_are_relative_to_vllms_capacity() -> None:
    study = tiny_study(base_rate=2.0)  # the scenario's own rate is 1.0/s, limit 600 s
    tasks = {(t.group, t.key): t for t in plan_second_phase(study, ample_blocks=3200)}
    assert [k for g, k in tasks if g == "utilization"] == [f"{f:g}" for f in UTILIZATION_LOADS]
    # 0.25x would be below the scenario's rate: its time limit stretches in proportion.
    assert tasks[("utilization", "0.5")].overrides == (f"{RATE}=1", "limits.max_duration_s=600")
    assert tasks[("utilization", "1.5")].overrides == (f"{RATE}=3", "limits.max_duration_s=600")
    pressure = (f"{RATE}={2.0 * PRESSURE_LOAD:g}", "limits.max_duration_s=600")
    assert tasks[("pressure", "ample")].overrides == (
        "engine.num_gpu_blocks_override=3200",
        *pressure,
    )
    assert tasks[("pressure", "vllm_priority")].overrides == (
        "engine.scheduling_policy=priority",
        *pressure,
    )
    assert ("pressure", "static") not in tasks  # static allocation never preempts
    waste = [k for g, k in tasks if g == "waste"]
    assert waste == [v.key for v in ALLOCATOR_VARIANTS if v.available()]

    slow = plan_second_phase(tiny_study(base_rate=1.0), ample_blocks=3200)
    half = next(t for t in slow if (t.group, t.key) == ("utilization", "0.5"))
    assert half.overrides == (f"{RATE}=0.5", "limits.max_duration_s=1200")


def point(load: float, sessions: int, ttft: float) -> dict[str, Any]:
    return {
        "load": load,
        "peak_concurrent_sessions": sessions,
        "ttft_p99_s": ttft,
        "itl_p99_s": 0.05,
        "preemptions": 3,
    }


def run(prefill: int, busy: float, hit: float = 0.5, finished: int = 100) -> dict[str, Any]:
    metrics = {
        "vllm:time_to_first_token_seconds": {"p99": 1.5},
        "vllm:num_preemptions": {"total": 2},
        "vllm:kv_cache_usage_perc": {"mean": 0.9, "p95": 0.99},
        "prefix_cache_hit_rate": hit,
    }
    summary = {
        "metrics": metrics,
        "duration_s": 120.0,
        "num_finished": finished,
        "slos": {"ttft_p99_s": {"pass": False}},
    }
    return {"summary": summary, "busy_s": busy, "prefill_tokens": prefill, "num_steps": 10}


def test_tables_come_from_the_study() -> None:
    study = tiny_study(base_rate=2.0)
    study.capacity = {
        "vllm": {
            "capacity": 2.0,
            "simulations": 7,
            "curve": [point(1.0, 9, 0.1), point(2.0, 13, 0.4)],
        },
        "vllm_priority": {"error": "capacity: the SLOs hold at no load tried"},
    }
    study.runs = {
        ("pressure", "ample"): run(prefill=6_000, busy=40.0, hit=0.8),
        ("pressure", "vllm"): run(prefill=10_000, busy=50.0),
        ("pressure", "vllm_priority"): run(prefill=9_000, busy=45.0, finished=90),
        ("utilization", "1.5"): run(prefill=1, busy=1.0),
    }
    rows = {r["variant"].key: r for r in sessions_rows(study)}
    assert rows["vllm"]["point"]["peak_concurrent_sessions"] == 13
    assert rows["vllm_priority"]["note"] == "capacity: the SLOs hold at no load tried"
    pressure = {r["variant"].key: r for r in pressure_rows(study)}
    assert pressure["vllm"]["recomputed"] == pytest.approx(0.4)  # 4,000 of 10,000
    assert pressure["vllm"]["busy_gap"] == pytest.approx(0.2)  # 1 - 40 / 50
    assert pressure["vllm_priority"]["recomputed"] is None  # cut off by the time limit
    assert pressure["vllm_priority"]["note"] == (
        "finished 90 requests, the reference 100: not comparable (time limit)"
    )

    text = render_markdown(study)
    assert "| vLLM 0.32: paged, prefix caching, recompute | vLLM-exact | 2 | 13 | 0.4 |" in text
    assert f"| reference: KV cache x{AMPLE_FACTOR} (vLLM) | vLLM-exact | 6,000 |" in text
    assert "| 10,000 | 40.0% | 50 | 20.0% | 50.0% | 2 |" in text
    assert "| 1.5x | 90.0% | 99.0% | 2 | 1 | 1.5 | no |" in text
    assert "| 0.5x | - |" in text  # a load that did not run says so
    for variant in SESSION_VARIANTS:
        if not variant.available():
            assert variant.missing_reason() in text


def test_the_report_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The progress bar's phases: each announces its task count, and that many finish in it.
    phases: list[list[Any]] = []
    run_study = study_module.run_study

    def watched(path: Path, workers: int, on_done: Any, on_phase: Any) -> Study:
        def phase(name: str, num_tasks: int) -> None:
            phases.append([name, num_tasks, 0])
            on_phase(name, num_tasks)

        def done(task: Any, result: dict[str, Any]) -> None:
            phases[-1][2] += 1
            on_done(task, result)

        return run_study(path, workers, done, phase)

    monkeypatch.setattr(study_module, "run_study", watched)
    out = tmp_path / "claims"
    result = runner.invoke(
        app, ["report", "claims", "--scenario", str(TINY), "--out", str(out), "--workers", "2"]
    )
    assert result.exit_code == 0, result.output
    assert [name for name, _, _ in phases] == ["capacity searches", "runs"]
    assert all(total == finished > 0 for _, total, finished in phases)
    assert sorted(p.name for p in out.iterdir()) == [
        "claims.json",
        "claims.md",
        "sessions.png",
        "utilization.png",
    ]
    for png in ("sessions.png", "utilization.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # vLLM's row is what a capacity search of the same scenario finds on its own.
    direct = find_capacity(load_scenario(TINY, []), lambda s: simulate(s).summary)
    raw = json.loads((out / "claims.json").read_text())
    assert raw["base_rate"] == direct.capacity
    assert raw["capacity"]["vllm"] == json.loads(json.dumps(direct.to_json()))
    at_capacity = next(p for p in direct.curve if p.load == direct.capacity)
    text = (out / "claims.md").read_text()
    assert (
        f"| vLLM 0.32: paged, prefix caching, recompute | vLLM-exact | {direct.capacity:.4g} | "
        f"{at_capacity.peak_concurrent_sessions} |"
    ) in text
    # Every allocator's waste row comes from its own run at vLLM's capacity.
    for key, label in (("paged", "paged (vLLM)"), ("static", "static: max_model_len per request")):
        waste = raw["runs"][f"waste/{key}"]["summary"]["kv_waste_breakdown"]
        assert waste["allocator"] == key
        assert f"| {label} | " in text
        assert f"{100 * waste['effective_utilization']:.1f}%" in text
    paged = raw["runs"]["waste/paged"]["summary"]["kv_waste_breakdown"]
    static = raw["runs"]["waste/static"]["summary"]["kv_waste_breakdown"]
    assert paged["effective_utilization"] > static["effective_utilization"]
    assert "what_if" in raw["runs"]["pressure/swap"]["summary"]
    assert "what_if" not in raw["runs"]["pressure/vllm"]["summary"]
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # nothing staged is left


def test_bad_invocations_fail_before_simulating(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    result = runner.invoke(app, ["report", "claims", "--scenario", str(TINY), "--out", str(taken)])
    assert result.exit_code == 2
    assert "already exists" in result.output
    nowhere = tmp_path / "no" / "such"
    result = runner.invoke(
        app, ["report", "claims", "--scenario", str(TINY), "--out", str(nowhere)]
    )
    assert result.exit_code == 2
    assert "does not exist" in result.output
    no_slos = tmp_path / "no-slos.yaml"
    no_slos.write_text(TINY.read_text().split("slos:")[0])
    result = runner.invoke(
        app, ["report", "claims", "--scenario", str(no_slos), "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 2
    assert "needs SLOs" in result.output
    assert not (tmp_path / "r").exists()


def test_an_open_loop_scenario_and_an_unwritable_out_are_refused_up_front(tmp_path: Path) -> None:
    chat = SCENARIO_DIR / "chat-rag-baseline.yaml"
    result = runner.invoke(
        app, ["report", "claims", "--scenario", str(chat), "--out", str(tmp_path / "r")]
    )
    assert result.exit_code == 2, result.output
    assert "workload.kind=open_loop: the claims report measures agents" in " ".join(
        result.output.split()
    )
    assert not (tmp_path / "r").exists()
    result = runner.invoke(app, ["report", "claims", "--out", "/proc/claims"])
    assert result.exit_code == 2 and "the folder /proc is not writable" in result.output


def test_a_png_that_cannot_be_written_is_one_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_export(self: object, path: object) -> None:
        raise ValueError("Image export requires the Kaleido package")

    monkeypatch.setattr(render.go.Figure, "write_image", no_export)
    with pytest.raises(KvsimConfigError, match="need kaleido, the report extra"):
        render.check_png_export()


def test_the_shipped_claims_scenario_searches_the_session_rate() -> None:
    from sim.capacity import default_knob
    from sim.scenario import check_runnable

    spec = load_scenario(SCENARIO_DIR / "claims" / "agents-8b-h100.yaml", ["workload.sessions=20"])
    check_runnable(spec)
    assert default_knob(spec).field == RATE
    assert spec.slos.ttft_p99_s == 2.0 and spec.slos.itl_p99_s == 0.15
    summary = simulate(spec).summary
    assert summary["num_finished"] == summary["num_requests"] > 0


def test_results_come_back_in_task_order_whatever_order_workers_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # claims.json must not depend on --workers: hand the results over last-submitted first.
    def backwards(futures: dict[Future[Any], Any], interrupt: Any) -> Any:
        wait(list(futures))
        yield from reversed(list(futures))

    monkeypatch.setattr(study_module, "completed", backwards)
    tasks = [
        study_module.Task("run", "utilization", key, (f"{RATE}={rate}",))
        for key, rate in (("a", 1.0), ("b", 2.0), ("c", 3.0))
    ]
    seen: list[str] = []
    results = study_module._run_tasks(TINY, tasks, 2, lambda task, _: seen.append(task.key))
    assert seen == ["c", "b", "a"]
    assert list(results) == [("utilization", "a"), ("utilization", "b"), ("utilization", "c")]


def test_a_report_that_cannot_be_written_says_so_after_the_study(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(render, "check_png_export", lambda: None)
    monkeypatch.setattr(study_module, "run_study", lambda *args: tiny_study())
    out = tmp_path / "claims"

    def full_disk(figure: object, path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(render, "write_png", full_disk)
    result = runner.invoke(app, ["report", "claims", "--scenario", str(TINY), "--out", str(out)])
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"the study finished, but the report could not be written to {out}: " in text
    assert "Traceback" not in text
    assert list(tmp_path.iterdir()) == []  # the report's hidden folder is gone too
