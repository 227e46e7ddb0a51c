"""`kvsim capacity`: bracket-and-bisect on the load knob, the curve, the knee, clear errors."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from sim import files
from sim.capacity import Knob, default_knob, find_capacity, knee, knob_for, load_point
from sim.cli import app
from sim.errors import KvsimConfigError
from sim.scenario import SCENARIO_DIR, Scenario, load_scenario
from tests.sim.test_files import half_written

runner = CliRunner()
BURST = SCENARIO_DIR / "agent-burst.yaml"
CODING = SCENARIO_DIR / "coding-agents-8b-h100.yaml"


def fake_summary(ttft_p99_s: float, finished: int = 10, requests: int = 10) -> dict[str, Any]:
    target = 1.0
    return {
        "num_requests": requests,
        "num_finished": finished,
        "slos": {
            "ttft_p99_s": {"target": target, "value": ttft_p99_s, "pass": ttft_p99_s <= target}
        },
        "metrics": {"vllm:time_to_first_token_seconds": {"p50": ttft_p99_s / 2, "p99": ttft_p99_s}},
    }


def loaded(field: str) -> Callable[[Scenario], dict[str, Any]]:
    """A deployment whose p99 TTFT is load / 100 s: it holds up to a load of 100."""

    def simulate_summary(spec: Scenario) -> dict[str, Any]:
        node: Any = spec
        for key in field.split("."):
            node = getattr(node, key)
        return fake_summary(float(node) / 100)

    return simulate_summary


def test_sessions_are_bisected_to_one_session() -> None:
    spec = load_scenario(BURST, ["workload.sessions=30"])
    seen: list[float] = []
    result = find_capacity(
        spec, loaded("workload.sessions"), on_point=lambda p: seen.append(p.load)
    )
    assert result.knob.field == "workload.sessions"
    assert (result.capacity, result.first_failing) == (100, 101)
    assert seen[:4] == [30, 60, 120, 90]  # doubling brackets, then bisection
    assert [p.load for p in result.curve] == sorted(seen) and len(seen) == len(set(seen))
    assert all(p.holds == (p.load <= 100) for p in result.curve)


def test_a_rate_is_bisected_to_two_percent_and_an_overload_halves_first() -> None:
    spec = load_scenario(CODING, ["workload.session_arrival.rate_per_s=500"])
    result = find_capacity(spec, loaded("workload.session_arrival.rate_per_s"))
    assert result.knob.unit == "sessions/s"
    assert result.curve[0].load < 100 < 500 and result.curve[-1].load == 500
    assert result.capacity <= 100 < result.first_failing
    assert result.first_failing / result.capacity - 1 <= 0.02


def test_unfinished_requests_mean_the_load_does_not_hold() -> None:
    point = load_point(5, fake_summary(0.1, finished=9))
    assert not point.holds and point.failed == ["1 of 10 requests unfinished at the limit"]


def test_an_slo_no_load_meets_names_the_bound_at_the_lightest_load() -> None:
    spec = load_scenario(BURST, ["workload.sessions=4"])
    with pytest.raises(KvsimConfigError) as err:
        find_capacity(spec, lambda s: fake_summary(3.0))
    message = str(err.value)
    assert "the SLOs hold at no load tried" in message
    assert "workload.sessions=1: ttft_p99_s 3 > 1" in message


def test_knee_is_where_p99_ttft_leaves_its_line() -> None:
    points = [load_point(x, fake_summary(y)) for x, y in [(1, 0.1), (2, 0.11), (3, 0.13), (4, 2.0)]]
    assert knee(points) == 3
    assert knee(points[:2]) is None


def test_default_knobs() -> None:
    assert default_knob(load_scenario(BURST)).field == "workload.sessions"
    assert default_knob(load_scenario(CODING)).field == "workload.session_arrival.rate_per_s"
    open_loop = load_scenario(SCENARIO_DIR / "chat-rag-baseline.yaml")
    assert default_knob(open_loop).field.startswith("workload.")
    with pytest.raises(KvsimConfigError, match="not a field of this scenario"):
        find_capacity(open_loop, loaded("x"), Knob("workload.nope", True, "", 1, 10))


def test_cli_finds_the_capacity_and_writes_the_curve(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    result = runner.invoke(
        app,
        ["capacity", str(BURST), "--set", "workload.sessions=4", "--set", "workload.turns.value=2",
         "--slo", "ttft_p99_s=0.25", "--out", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    document = json.loads((out / "capacity.json").read_text())
    assert document["slos"]["ttft_p99_s"] == 0.25
    capacity, failing = document["capacity"], document["first_failing"]
    assert failing == capacity + 1
    curve = {p["load"]: p for p in document["curve"]}
    assert curve[capacity]["holds"] and not curve[failing]["holds"]
    assert curve[capacity]["ttft_p99_s"] <= 0.25 < curve[failing]["ttft_p99_s"]
    assert f"capacity: {capacity:g} concurrent sessions" in " ".join(result.output.split())
    assert document["what_if"] == [] and "what-if" not in result.output


def small_capacity(*args: str) -> Any:
    """``kvsim capacity`` of 4 two-turn agent sessions at a 0.25 s p99 TTFT, and ``args``."""
    base = ["capacity", str(BURST), "--set", "workload.sessions=4", "--set",
            "workload.turns.value=2", "--slo", "ttft_p99_s=0.25"]  # fmt: skip
    return runner.invoke(app, [*base, *args])


def test_a_capacity_under_a_what_if_policy_says_so(tmp_path: Path) -> None:
    out = tmp_path / "cap"
    result = small_capacity("--set", "engine.kv_retention.policy=tool_latency", "--out", str(out))
    assert result.exit_code == 0, result.output
    (line,) = json.loads((out / "capacity.json").read_text())["what_if"]
    assert line.startswith("kv_retention: tool_latency")
    text = " ".join(result.output.split())
    assert "a what-if, not vLLM 0.32's own behaviour: kv_retention: tool_latency" in text


def test_cli_exports_the_deployment_it_sized(tmp_path: Path) -> None:
    serve = tmp_path / "serve.sh"
    result = small_capacity(
        "--set", "engine.max_num_seqs=64", "--export-format", "vllm-args", "--export-out",
        str(serve),
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "--max-num-seqs 64" in serve.read_text()


def test_an_export_inside_out_checks_its_folder_without_creating_it(tmp_path: Path) -> None:
    """The up-front check of --export-out's folder must not create --out, which the search's
    own results then find in their way."""
    out = tmp_path / "res" / "cap"
    result = small_capacity(
        "--out", str(out), "--export-format", "vllm-args", "--export-out", str(out / "serve.sh")
    )
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["capacity.json", "serve.sh"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slo", "ttft_p99_s=-1"], "slos.ttft_p99_s"),
        (["--slo", "ttft_p99_s=0.000001", "--set", "workload.sessions=2"],
         "the SLOs hold at no load tried"),
        (["--set", "slos.ttft_p99_s=null", "--set", "slos.e2e_p99_s=null"], "no SLO to hold"),
        (["--export-format", "helm", "--export-out", "x"], "--export-format 'helm': expected"),
        (["--export-out", "x"], "--export-format and --export-out go together"),
        (["--slo", "ttft_p99_s"], "--slo 'ttft_p99_s': expected NAME=SECONDS"),
    ],
)  # fmt: skip
def test_cli_errors_are_one_paragraph(args: list[str], message: str) -> None:
    result = runner.invoke(app, ["capacity", str(BURST), "--set", "workload.turns.value=2", *args])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()) and "Traceback" not in result.output


def test_requests_that_had_not_arrived_at_the_limit_mean_the_load_does_not_hold() -> None:
    point = load_point(3, {**fake_summary(0.1), "num_not_arrived": 2})
    assert not point.holds and point.failed == ["2 requests had not arrived at the limit"]


def test_an_slo_without_a_value_fails_the_load_with_a_message() -> None:
    summary = fake_summary(0.1)
    summary["slos"]["itl_p99_s"] = {"target": 0.1, "value": None, "pass": False}
    point = load_point(3, summary)
    assert not point.holds
    assert point.failed == ["itl_p99_s: no value (no request got that far)"]


def test_a_lower_rate_gets_a_longer_time_limit() -> None:
    spec = load_scenario(CODING, ["workload.session_arrival.rate_per_s=0.8"])
    limits: dict[float, float] = {}

    def summary(s: Scenario) -> dict[str, Any]:
        rate = s.workload.session_arrival.rate_per_s
        limits[rate] = s.limits.max_duration_s
        return fake_summary(rate * 10)  # holds up to a rate of 0.1

    result = find_capacity(spec, summary)
    assert result.capacity is not None and result.capacity <= 0.1 < result.first_failing
    base = spec.limits.max_duration_s
    for rate, limit in limits.items():
        assert limit == pytest.approx(base * max(1.0, 0.8 / rate))


def test_a_knob_named_by_hand_keeps_its_type() -> None:
    spec = load_scenario(BURST, ["workload.turns.value=4"])
    knob = knob_for(spec, "workload.turns.value")
    assert knob.integer and knob.field == "workload.turns.value"
    assert knob_for(spec, "workload.sessions") == default_knob(spec)
    assert not knob_for(spec, "workload.tool_latency.median_s").integer
    with pytest.raises(KvsimConfigError, match="not a number to search over"):
        knob_for(spec, "workload.session_arrival.kind")
    for not_a_load in ("seed", "limits.max_duration_s", "engine.gpu_memory_utilization"):
        with pytest.raises(KvsimConfigError, match=f"--knob {not_a_load}: not a load"):
            knob_for(spec, not_a_load)
    with pytest.raises(KvsimConfigError, match="not a field of this scenario"):
        knob_for(spec, "workload.nope")
    result = find_capacity(spec, loaded("workload.turns.value"), knob)
    assert (result.capacity, result.first_failing) == (100, 101)


def test_an_export_that_cannot_be_written_is_refused_before_the_search(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["capacity", str(BURST), "--slo", "ttft_p99_s=1", "--export-format", "vllm-args",
         "--export-out", "/proc/kvsim/serve.sh"],
    )  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "/proc/kvsim is not a writable folder" in " ".join(result.output.split())
    assert "searching" not in result.output


def replicas_needed(needed: int) -> Callable[[Scenario], dict[str, Any]]:
    """A fleet that holds with ``needed`` replicas or more; records the routers it saw."""

    def simulate_summary(spec: Scenario) -> dict[str, Any]:
        assert spec.fleet is not None
        simulate_summary.routers.append(spec.fleet.router.kind)  # type: ignore[attr-defined]
        return fake_summary(0.5 if spec.fleet.replicas >= needed else 2.0)

    simulate_summary.routers = []  # type: ignore[attr-defined]
    return simulate_summary


def test_the_fewest_replicas_are_found_by_doubling_then_bisection() -> None:
    from sim.capacity import find_min_replicas

    spec = load_scenario(BURST)  # no fleet section: starts from one replica, round robin
    seen: list[float] = []
    fake = replicas_needed(11)
    result = find_min_replicas(spec, fake, on_point=lambda p: seen.append(p.load))
    assert (result.router, result.fewest, result.most_failing) == ("round_robin", 11, 10)
    assert seen == [1, 2, 4, 8, 16, 12, 10, 11]
    assert set(fake.routers) == {"round_robin"}  # type: ignore[attr-defined]


def test_the_replica_search_halves_from_a_fleet_that_holds_and_takes_the_router_asked() -> None:
    from sim.capacity import find_min_replicas

    spec = load_scenario(BURST, ["fleet.replicas=16", "fleet.router.kind=least_loaded"])
    seen: list[float] = []
    fake = replicas_needed(3)
    result = find_min_replicas(spec, fake, "session_affinity", lambda p: seen.append(p.load))
    assert (result.router, result.fewest, result.most_failing) == ("session_affinity", 3, 2)
    assert seen == [16, 8, 4, 2, 3]
    assert set(fake.routers) == {"session_affinity"}  # type: ignore[attr-defined]
    # One replica that already holds: nothing below it to try.
    single = find_min_replicas(load_scenario(BURST), replicas_needed(1))
    assert (single.fewest, single.most_failing, len(single.curve)) == (1, None, 1)


def test_capacity_replicas_refuses_an_unknown_router_and_a_knob_with_it() -> None:
    result = runner.invoke(app, ["capacity", str(BURST), "--replicas", "--router", "random"])
    assert result.exit_code == 2
    assert "--router 'random': expected one of round_robin" in result.output
    result = runner.invoke(
        app, ["capacity", str(BURST), "--replicas", "--knob", "workload.sessions"]
    )
    assert result.exit_code == 2
    assert "give one search" in result.output
    result = runner.invoke(app, ["capacity", str(BURST), "--router", "round_robin"])
    assert result.exit_code == 2
    assert "--router and --max-replicas go with --replicas" in result.output


def test_capacity_replicas_checks_the_export_before_searching(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        ["capacity", str(BURST), "--replicas", "--export-format", "bogus",
         "--export-out", str(tmp_path / "x")],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "searching" not in result.output
    assert "bogus" in result.output


def test_the_replica_search_stops_at_the_request_count_and_keeps_the_view_delay() -> None:
    from sim.capacity import find_min_replicas

    spec = load_scenario(
        BURST, ["fleet.replicas=2", "fleet.router.kind=weighted", "fleet.router.view_delay_s=0.5"]
    )
    delays: list[float] = []

    def never(spec: Scenario) -> dict[str, Any]:
        assert spec.fleet is not None
        delays.append(spec.fleet.router.view_delay_s)
        return fake_summary(5.0, requests=6, finished=6)  # 6 requests; never within the SLO

    result = find_min_replicas(spec, never, "round_robin")
    # 2 and 4 replicas fail; 8 is beyond the 6 requests: no use going further.
    assert (result.fewest, result.most_failing) == (None, 8)
    assert [p.load for p in result.curve] == [2, 4, 8]
    assert set(delays) == {0.5}
    capped = find_min_replicas(spec, never, "round_robin", max_replicas=3)
    assert [p.load for p in capped.curve] == [2, 3]


def test_capacity_replicas_exports_the_fleet_it_found_and_fails_when_none_holds(
    tmp_path: Path,
) -> None:
    """48 agents need 3 replicas behind round robin and 4 behind session affinity for a
    0.3 s p99 TTFT (round robin, the fewest, is exported); no count up to 4 holds 0.15 s."""
    args = ["capacity", str(BURST), "--replicas", "--router", "round_robin", "--router",
            "session_affinity", "--max-replicas", "4", "--set", "workload.sessions=48",
            "--set", "workload.turns.value=2"]  # fmt: skip
    serve = tmp_path / "serve.sh"
    result = runner.invoke(
        app,
        [*args, "--slo", "ttft_p99_s=0.3", "--out", str(tmp_path / "ok"),
         "--export-format", "vllm-args", "--export-out", str(serve)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    found = {r["router"]: r["fewest_replicas"] for r in json.loads(
        (tmp_path / "ok" / "capacity.json").read_text())["replica_search"]}  # fmt: skip
    assert found == {"round_robin": 3, "session_affinity": 4}
    text = " ".join(serve.read_text().split())
    assert "3 replicas of this engine behind a round_robin router" in text
    result = runner.invoke(
        app,
        [*args, "--slo", "ttft_p99_s=0.15", "--out", str(tmp_path / "none"),
         "--export-format", "vllm-args", "--export-out", str(tmp_path / "none.sh")],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "no router tried holds the SLOs" in " ".join(result.output.split())
    assert (tmp_path / "none" / "capacity.json").is_file() and not (tmp_path / "none.sh").exists()


def test_an_out_nothing_can_be_written_in_is_refused_before_the_search(tmp_path: Path) -> None:
    """A real write, not os.access (which says yes to root, under /proc too); a missing
    folder is created, as for a run."""
    result = small_capacity("--out", "/proc/kvsim-capacity")
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "--out /proc/kvsim-capacity: /proc is not a writable folder" in text
    assert "searching" not in result.output
    (tmp_path / "file").write_text("")
    result = small_capacity("--out", str(tmp_path / "file" / "cap"))
    assert result.exit_code == 2 and "searching" not in result.output
    assert "is not a writable folder" in " ".join(result.output.split())


def test_a_capacity_json_that_cannot_be_written_leaves_nothing_to_block_the_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "new" / "cap"
    with monkeypatch.context() as patch:
        patch.setattr(files, "_write_all", half_written(errno.ENOSPC))
        result = small_capacity("--out", str(out))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert f"the search finished, but its results could not be written to {out}" in text
    assert "No space left on device" in text
    assert os.listdir(tmp_path / "new") == []  # no folder, no half capacity.json
    result = small_capacity("--out", str(out))
    assert result.exit_code == 0, result.output
    assert json.loads((out / "capacity.json").read_text())["capacity"] is not None
