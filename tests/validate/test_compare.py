"""The comparison table, and runs imported from `vllm bench serve --save-detailed`."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.report import truncation_line, what_if_line
from sim.runner import simulate
from sim.scenario import DEFAULT_SCENARIO, SCENARIO_DIR, load_scenario
from validate.commands import error_table, step_time_line
from validate.compare import (
    BOUNDED_METRICS,
    ComparisonRow,
    broken_bounds,
    compare_summaries,
    compare_to_runs,
    median_interval,
    rows_to_records,
    slo_mismatch,
)
from validate.vllm_bench import load_vllm_bench


def test_relative_error_against_the_reference() -> None:
    assert ComparisonRow("x", "s", 1.1, 1.0).relative_error == pytest.approx(0.1)
    assert ComparisonRow("x", "s", 0.9, 1.0).relative_error == pytest.approx(-0.1)
    assert ComparisonRow("x", "", 0.0, 0.0).relative_error == 0.0
    assert ComparisonRow("x", "", 3.0, 0.0).relative_error == math.inf
    assert ComparisonRow("x", "", -3.0, 0.0).relative_error == -math.inf
    assert ComparisonRow("x", "", None, 1.0).relative_error is None


def strict_loads(text: str):
    """json.loads that fails on the NaN/Infinity tokens Python writes and jq rejects."""

    def reject(token: str):
        raise AssertionError(f"not JSON: {token}")

    return json.loads(text, parse_constant=reject)


def test_records_hold_null_for_a_relative_error_that_is_not_finite() -> None:
    rows = [
        ComparisonRow("preemptions", "", 3.0, 0.0, (0.0, 0.0, 0.0)),  # vLLM 0, kvsim a few
        ComparisonRow("preemptions", "", 0.0, 0.0),
        ComparisonRow("TTFT p50", "s", 1.1, 1.0),
        ComparisonRow("TTFT p50", "s", None, 1.0),
        ComparisonRow("TTFT p50", "s", 1.0, None),
        ComparisonRow("TTFT p50", "s", math.nan, 1.0),
        ComparisonRow("TTFT p50", "s", 1.0, math.inf),
    ]
    records = strict_loads(json.dumps(rows_to_records(rows), allow_nan=False))
    got = [(r["value"], r["reference"], r["relative_error"]) for r in records]
    assert got == [
        (3.0, 0.0, None),  # both values kept: a reader sees 0 against 3
        (0.0, 0.0, 0.0),
        (1.1, 1.0, pytest.approx(0.1)),
        (None, 1.0, None),
        (1.0, None, None),
        (None, 1.0, None),
        (1.0, None, None),
    ]
    assert [r["relative_error_missing"] for r in records] == [
        "reference is 0, value is not",
        None,
        None,
        "no value",
        "no reference",
        "not finite",
        "not finite",
    ]
    assert records[0]["reference_runs"] == [0.0, 0.0, 0.0]


def test_a_metric_that_is_not_finite_compares_as_missing() -> None:
    rows = {
        r.metric: r
        for r in compare_to_runs(
            summary_with(math.nan, 2), [summary_with(0.01, 0), summary_with(math.inf, 0)]
        )
    }
    assert rows["TTFT p50"].value is None and rows["TTFT p50"].reference is None
    assert rows["TTFT p50"].reference_runs == ()
    assert rows["preemptions"].relative_error == math.inf


def test_a_run_compared_with_itself_has_zero_error() -> None:
    result = simulate(load_scenario(DEFAULT_SCENARIO, ["workload.sessions=8"]))
    rows = compare_summaries(result.summary, result.summary)
    # Every metric the validation bound names is compared (else the gate would skip it).
    assert {r.metric for r in rows} >= {*BOUNDED_METRICS, "KV usage peak"}
    assert all(r.relative_error in (0.0, None) for r in rows)


def summary_with(ttft_p50: float | None, preemptions: int) -> dict:
    ttft = {} if ttft_p50 is None else {"p50": ttft_p50}
    return {
        "metrics": {
            "vllm:time_to_first_token_seconds": ttft,
            "vllm:num_preemptions": {"total": preemptions},
        }
    }


def test_repeated_reference_compares_against_the_median_and_keeps_the_spread() -> None:
    runs = [summary_with(0.020, 4), summary_with(0.010, 6), summary_with(0.012, 5)]
    rows = {r.metric: r for r in compare_to_runs(summary_with(0.013, 5), runs)}
    ttft = rows["TTFT p50"]
    assert ttft.reference == pytest.approx(0.012)
    assert ttft.relative_error == pytest.approx(1 / 12)
    assert ttft.reference_runs == (0.020, 0.010, 0.012)
    low, high = ttft.reference_spread
    assert (low, high) == (pytest.approx(-1 / 6), pytest.approx(2 / 3))
    assert rows["preemptions"].reference == 5 and rows["preemptions"].relative_error == 0.0
    # A metric one run lacks has no median: missing, not the median of the others.
    rows = {
        r.metric: r for r in compare_to_runs(summary_with(0.013, 5), [*runs, summary_with(None, 5)])
    }
    assert rows["TTFT p50"].reference is None and rows["TTFT p50"].relative_error is None
    # One run: no spread column, the same rows as compare_summaries (which adds the SLO ones
    # after them).
    single = compare_to_runs(summary_with(0.013, 5), runs[:1])
    assert single == compare_summaries(summary_with(0.013, 5), runs[0])[: len(single)]
    assert all(r.reference_spread is None for r in single)
    with pytest.raises(ValueError, match="at least one reference run"):
        compare_to_runs(summary_with(0.013, 5), [])


def test_error_table_shows_the_spread_of_repeated_runs() -> None:
    runs = [summary_with(0.020, 4), summary_with(0.010, 6), summary_with(0.012, 5)]
    rows = compare_to_runs(summary_with(0.013, 5), runs)
    table = error_table(rows, "t", "kvsim", "vLLM (median of 3)")
    assert [c.header for c in table.columns][-1] == "runs spread"
    ttft_row = [r.metric for r in rows].index("TTFT p50")
    assert table.columns[-1]._cells[ttft_row] == "-16.7…+66.7%"
    assert rows_to_records(rows)[ttft_row]["reference_runs"] == [0.020, 0.010, 0.012]
    single = error_table(compare_to_runs(summary_with(0.013, 5), runs[:1]), "t", "a", "b")
    assert len(single.columns) == 4


def test_median_interval_widens_to_the_wanted_confidence() -> None:
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # 75%
    assert median_interval([6.0, 1.0, 5.0, 2.0, 4.0, 3.0]) == (2.0, 5.0)  # 78%
    assert median_interval([float(x) for x in range(9, 0, -1)]) == (3.0, 7.0)  # 82%
    assert median_interval([4.0]) == (4.0, 4.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], confidence=0.95) == (1.0, 6.0)
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_a_bound_is_broken_only_off_every_plausible_median() -> None:
    # ITL p50 of six agentic replays in one CI run (ms): the sample median is 2.1885.
    runs = (2.107, 2.245, 2.176, 2.200, 2.595, 2.177)
    row = ComparisonRow("ITL p50", "s", 2.407, statistics.median(runs), runs)
    assert row.relative_error == pytest.approx(0.0998, abs=1e-4)
    # Within 10% of the second highest replay (2.245 * 1.1 = 2.4695); from below, of the
    # second lowest (2.176 * 0.9 = 1.9584).
    assert not row.outside_bound(0.10)
    assert ComparisonRow("ITL p50", "s", 2.47, 2.1885, runs).outside_bound(0.10)
    assert not ComparisonRow("ITL p50", "s", 1.96, 2.1885, runs).outside_bound(0.10)
    assert ComparisonRow("ITL p50", "s", 1.95, 2.1885, runs).outside_bound(0.10)
    # One run is its own median; a count of 0 must be matched exactly; missing is outside.
    assert ComparisonRow("TTFT p50", "s", 1.09, 1.0).outside_bound(0.10) is False
    assert ComparisonRow("TTFT p50", "s", 1.11, 1.0).outside_bound(0.10) is True
    assert not ComparisonRow("preemptions", "", 0.0, 0.0, (0.0, 0.0, 0.0)).outside_bound(0.1)
    assert ComparisonRow("preemptions", "", 1.0, 0.0, (0.0, 0.0, 0.0)).outside_bound(0.1)
    assert ComparisonRow("TTFT p50", "s", None, 1.0).outside_bound(0.10)


def test_broken_bounds_names_only_bounded_metrics_outside_it() -> None:
    rows = [
        ComparisonRow("TTFT p50", "s", 1.25, 1.0, (0.9, 1.0, 1.1)),  # 1.1 * 1.1 = 1.21
        ComparisonRow("E2E p50", "s", 1.2, 1.0, (0.9, 1.0, 1.1)),
        ComparisonRow("ITL p99", "s", 9.0, 1.0, (0.9, 1.0, 1.1)),  # reported, not bounded
        ComparisonRow("preemptions", "", 43.0, 43.0, (43.0, 43.0, 43.0)),
    ]
    assert broken_bounds(rows) == ["TTFT p50"]
    assert broken_bounds(rows, bound=0.2) == []


def test_step_time_line_lists_every_replay() -> None:
    line = step_time_line([0.97, 1.104, None])
    assert "0.97, 1.10, -" in line and "above 1" in line


BENCH = {
    "duration": 10.0,
    "model_id": "tiny",
    "start_times": [100.0, 101.0, 102.5],
    "ttfts": [0.1, 0.2, 0.0],
    "itls": [[0.01, 0.02], [0.03], []],
    "latencies": [0.13, 0.23, 0.0],
    "input_lens": [10, 20, 30],
    "output_lens": [3, 2, 0],
    "errors": ["", "", "timeout"],
}


def write_bench(path: Path, **fields) -> Path:
    """A small detailed vllm bench result (the third request failed), ``fields`` replaced."""
    path.write_text(json.dumps({**BENCH, **fields}))
    return path


def test_vllm_bench_import_rebuilds_token_times(tmp_path: Path) -> None:
    run = load_vllm_bench(write_bench(tmp_path / "bench.json"))
    req = run.requests
    assert req["arrival_s"].tolist() == [0.0, 1.0, 2.5]
    assert req["token_times_s"].iloc[0] == pytest.approx([0.1, 0.11, 0.13])
    assert math.isnan(req["finish_s"].iloc[2])  # the failed request is not finished
    m = run.summary["metrics"]
    assert m["vllm:time_to_first_token_seconds"]["p50"] == pytest.approx(0.15)
    assert m["vllm:num_preemptions"] is None  # the client cannot see it
    assert run.summary["num_unfinished"] == 1


def test_vllm_bench_import_names_the_missing_field(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"duration": 1.0, "ttfts": []}))
    with pytest.raises(ValueError, match=r"start_times.*save-detailed"):
        load_vllm_bench(path)


def test_vllm_bench_import_keeps_the_nulls_of_a_failed_request(tmp_path: Path) -> None:
    # What the client leaves of a request that failed is not read: null (or 0) is fine there.
    nulls = {
        "ttfts": [0.1, 0.2, None],
        "itls": [[0.01, 0.02], [0.03], None],
        "latencies": [0.13, 0.23, None],
        "output_lens": [3, 2, None],
    }
    run = load_vllm_bench(write_bench(tmp_path / "bench.json", **nulls))
    whole = load_vllm_bench(write_bench(tmp_path / "whole.json"))
    assert run.summary == {**whole.summary, "scenario": "bench"}
    assert run.summary["num_unfinished"] == 1
    # A success with no itls (one output token) and a null error are read as before.
    run = load_vllm_bench(
        write_bench(tmp_path / "b.json", itls=[[0.01, 0.02], None, []], errors=["", None, "x"])
    )
    assert run.requests["token_times_s"].iloc[1] == pytest.approx([1.2])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"errors": ["", ""]}, "field 'errors' has 2 entries, expected 3"),
        ({"errors": []}, "field 'errors' has 0 entries, expected 3"),
        ({"errors": ["", 5, ""]}, "field 'errors' entry 1 is 5, expected a string"),
        ({"ttfts": [None, 0.2, 0.0]}, "field 'ttfts' entry 0 is null, expected a number"),
        ({"ttfts": [0.1, "0.2", 0.0]}, "field 'ttfts' entry 1 is \"0.2\", expected a number"),
        ({"ttfts": [0.1, True, 0.0]}, "field 'ttfts' entry 1 is true"),
        ({"latencies": [math.nan, 0.23, 0.0]}, "field 'latencies' entry 0 is NaN"),
        ({"start_times": [100.0, 101.0, None]}, "field 'start_times' entry 2 is null"),
        ({"itls": [0.01, [0.03], []]}, "field 'itls' entry 0 is 0.01, expected a list"),
        ({"itls": [[0.01, None], [0.03], []]}, "field 'itls' entry 0 item 1 is null"),
        ({"itls": [[0.01], [0.03], [], []]}, "field 'itls' has 4 entries, expected 3"),
        ({"input_lens": [10, None, 30]}, "field 'input_lens' entry 1 is null, expected a token"),
        ({"output_lens": [3, 2.5, 0]}, "field 'output_lens' entry 1 is 2.5, expected a token"),
        ({"output_lens": [-3, 2, 0]}, "field 'output_lens' entry 0 is -3"),
        ({"latencies": "fast"}, "field 'latencies' is \"fast\", expected a list"),
        ({"ttfts": None}, "field 'ttfts' is null, expected a list"),
        ({"input_lens": [10, 10**400, 30]}, "field 'input_lens' entry 1 is 1000"),
        ({"errors": {"0": ""}}, 'field \'errors\' is {"0": ""}, expected a list'),
        ({"duration": "long"}, "field 'duration' is \"long\", expected a number of seconds"),
    ],
)
def test_vllm_bench_import_names_the_bad_entry(tmp_path: Path, fields: dict, message: str) -> None:
    path = write_bench(tmp_path / "bench.json", **fields)
    with pytest.raises(ValueError) as info:
        load_vllm_bench(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_vllm_bench_import_needs_an_object(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="is a JSON object, not list"):
        load_vllm_bench(path)


def test_compare_command_prints_the_table(tmp_path: Path) -> None:
    result = simulate(load_scenario(DEFAULT_SCENARIO, ["workload.sessions=8"]))
    run_dir = result.write(tmp_path / "sim")
    out = tmp_path / "table.json"
    cli = CliRunner().invoke(
        app, ["compare", str(run_dir), str(write_bench(tmp_path / "b.json")), "--out", str(out)]
    )
    assert cli.exit_code == 0, cli.output
    assert "TTFT p50" in cli.output and "rel. error" in cli.output
    assert json.loads(out.read_text())[0]["metric"] == "TTFT p50"
    # The benchmark's failed request is said; the whole simulated run is not flagged.
    text = " ".join(cli.output.split())
    assert "1 of its 3 requests failed in the benchmark client" in text
    assert "cover the 2 that finished only" in text
    assert "hit limits.max_duration_s" not in text and "is incomplete" not in text
    bad = CliRunner().invoke(app, ["compare", str(tmp_path / "nope"), str(run_dir)])
    assert bad.exit_code == 2 and "not a run directory" in bad.output


def test_compare_writes_strict_json_when_the_reference_counts_zero(tmp_path: Path) -> None:
    result = simulate(load_scenario(DEFAULT_SCENARIO, ["workload.sessions=8"]))
    a, b = result.write(tmp_path / "a"), result.write(tmp_path / "b")
    for run, preemptions in ((a, 3), (b, 0)):  # vLLM measured 0, the simulation a few
        summary = json.loads((run / "summary.json").read_text())
        summary["metrics"]["vllm:num_preemptions"]["total"] = preemptions
        (run / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "table.json"
    cli = CliRunner().invoke(app, ["compare", str(a), str(b), "--out", str(out)])
    assert cli.exit_code == 0, cli.output
    assert "Infinity" not in out.read_text()
    row = {r["metric"]: r for r in strict_loads(out.read_text())}["preemptions"]
    assert (row["value"], row["reference"], row["relative_error"]) == (3.0, 0.0, None)
    assert row["relative_error_missing"] == "reference is 0, value is not"


def test_compare_says_when_a_run_was_cut_at_its_time_limit(tmp_path: Path) -> None:
    whole = simulate(load_scenario(DEFAULT_SCENARIO, ["workload.sessions=8"]))
    cut = simulate(
        load_scenario(DEFAULT_SCENARIO, ["workload.sessions=8", "limits.max_duration_s=20"])
    )
    assert cut.summary["truncated_at_limit"] and cut.summary["num_unfinished"] > 0
    a, b = cut.write(tmp_path / "cut"), whole.write(tmp_path / "whole")
    cli = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert cli.exit_code == 0, cli.output
    text = " ".join(cli.output.split())
    assert truncation_line(cut.summary, str(a)) in text
    assert f"{b} hit" not in text


def test_validate_needs_at_least_one_replay() -> None:
    scenario = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
    result = CliRunner().invoke(app, ["validate", str(scenario), "--repeats", "0"])
    assert result.exit_code == 2
    assert "repeats" in result.output


def test_compare_says_which_run_is_a_what_if(tmp_path: Path) -> None:
    sets = ["workload.sessions=8"]
    plain = simulate(load_scenario(DEFAULT_SCENARIO, sets))
    what_if = simulate(
        load_scenario(DEFAULT_SCENARIO, [*sets, "engine.kv_retention.policy=tool_latency"])
    )
    a, b = what_if.write(tmp_path / "ret"), plain.write(tmp_path / "plain")
    cli = CliRunner().invoke(app, ["compare", str(a), str(b)])
    assert cli.exit_code == 0, cli.output
    text = " ".join(cli.output.split())
    assert what_if_line(what_if.summary, str(a)) in text
    assert text.count("is a what-if") == 1  # the vLLM-exact run is not one


def test_compare_out_never_overwrites_and_names_an_unwritable_path(tmp_path: Path) -> None:
    run_dir = simulate(load_scenario(DEFAULT_SCENARIO, ["workload.sessions=2"])).write(
        tmp_path / "sim"
    )
    kept = tmp_path / "scenario.yaml"
    kept.write_text("mine")
    for out, message in (
        (kept, "already exists; kvsim never overwrites"),
        (tmp_path / "sim", "already exists; kvsim never overwrites"),
        (kept / "table.json", "cannot create it"),
    ):
        cli = CliRunner().invoke(app, ["compare", str(run_dir), str(run_dir), "--out", str(out)])
        assert cli.exit_code == 2 and message in " ".join(cli.output.split()), cli.output
        assert "Traceback" not in cli.output
    assert kept.read_text() == "mine"


def test_compare_adds_goodput_and_says_when_the_slos_differ(tmp_path: Path) -> None:
    sets = ["workload.sessions=8", "slos.ttft_p99_s=5"]
    loose = simulate(load_scenario(DEFAULT_SCENARIO, sets))
    tight = simulate(load_scenario(DEFAULT_SCENARIO, [*sets, "slos.ttft_p99_s=0.01"]))
    rows = {r.metric: r for r in compare_summaries(tight.summary, loose.summary)}
    goodput = rows["goodput"]
    assert (goodput.value, goodput.reference) == (
        tight.summary["metrics"]["goodput_req_s"],
        loose.summary["metrics"]["goodput_req_s"],
    )
    assert goodput.value < goodput.reference and goodput.unit == "req/s"
    assert rows["SLO attainment"].reference == loose.summary["metrics"]["slo_attainment"]
    # Validation compares one scenario's SLOs with themselves: no such rows there.
    assert "goodput" not in {r.metric for r in compare_to_runs(tight.summary, [loose.summary])}
    assert slo_mismatch(loose.summary, loose.summary) is None
    assert slo_mismatch(tight.summary, loose.summary) == (
        "the runs' SLOs differ (ttft_p99_s 0.01 s against 5 s): their goodput and SLO "
        "attainment count requests against different bounds"
    )
    a, b = tight.write(tmp_path / "tight"), loose.write(tmp_path / "loose")
    cli = CliRunner().invoke(app, ["compare", str(a), str(b)], env={"COLUMNS": "200"})
    assert cli.exit_code == 0, cli.output
    text = " ".join(cli.output.split())
    assert "goodput" in text and " req/s" in text and "the runs' SLOs differ" in text
    same = CliRunner().invoke(app, ["compare", str(b), str(b)], env={"COLUMNS": "200"})
    assert same.exit_code == 0 and "SLOs differ" not in same.output
    # A vllm bench import knows no SLOs: its goodput counts every finished request.
    bench = load_vllm_bench(write_bench(tmp_path / "b.json")).summary
    assert "ttft_p99_s 5 s against none" in (slo_mismatch(loose.summary, bench) or "")
