"""The Sweeps page on real small sweeps (AppTest) and its data shaping (sweep_data)."""

from __future__ import annotations

import base64
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.io as pio
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import sweep_charts, sweep_data
from sim.export import serve_command
from sim.scenario import load_scenario
from sim.sweep import ERROR_SUFFIX, POINTS_DIR, plan_sweep, run_sweep, write_results
from tests.dashboard.conftest import APP

SCENARIO = Path(__file__).resolve().parents[2] / "scenarios" / "agent-burst.yaml"
SMALL = ["workload.sessions=3", "workload.turns.value=2"]
# max_num_batched_tokens=8 < max_num_seqs=16: that point cannot load and is recorded failed.
GRID = ["engine.max_num_seqs=8,16", "engine.max_num_batched_tokens=8,2048"]
SEQS, BUDGET = "engine.max_num_seqs", "engine.max_num_batched_tokens"


def _sweep(base: Path, name: str, grid: list[str], sets: list[str]) -> pd.DataFrame:
    return run_sweep(plan_sweep(SCENARIO, grid, SMALL + sets, base / "sweeps" / name), 1)


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, pd.DataFrame]]:
    """``grid``: 2 x 2, one point failed, the scenario's SLOs (every ok point meets them);
    ``strict``: the same grid with a 1 s p99 TTFT bound, which p0000 misses."""
    base = tmp_path_factory.mktemp("runs")
    tables = {
        "grid": _sweep(base, "grid", GRID, []),
        "strict": _sweep(base, "strict", GRID, ["slos.ttft_p99_s=1.0"]),
    }
    return base, tables


def _page(base: Path, monkeypatch: pytest.MonkeyPatch, sweep: str | None = None) -> AppTest:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(base))
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.switch_page("views/sweeps.py").run()
    if sweep is not None:
        at.selectbox(key="sw-sweep").set_value(base / "sweeps" / sweep / "sweep.json").run()
    assert not at.exception, at.exception
    return at


def _figure(at: AppTest, key: str):
    (chart,) = [c for c in at.get("plotly_chart") if c.proto.id.endswith(key)]
    return pio.from_json(chart.proto.spec)


def _array(value) -> np.ndarray:
    """A figure's data array as sent to the browser (plotly packs numbers as base64)."""
    if isinstance(value, dict) and "bdata" in value:
        flat = np.frombuffer(base64.b64decode(value["bdata"]), dtype=value["dtype"])
        shape = [int(n) for n in str(value.get("shape", len(flat))).split(",")]
        return flat.reshape(shape)
    return np.asarray(value)


def _texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def _slo(table: pd.DataFrame) -> list[bool | None]:
    return [None if pd.isna(v) else bool(v) for v in table["slo_pass"]]


def test_the_grid_sweep_as_made(sweeps) -> None:
    _, tables = sweeps
    table = tables["grid"]
    assert list(table["status"]) == ["ok", "ok", "failed", "ok"]
    assert _slo(table) == [True, True, None, True]
    assert table.loc[1, "goodput_req_s"] == table.loc[3, "goodput_req_s"]  # a tie: p0001 first
    assert table.loc[0, "itl_p99_s"] < table.loc[1, "itl_p99_s"]  # p0000: lowest ITL only
    assert _slo(tables["strict"]) == [False, True, None, True]


def test_page_heatmap_table_and_verdicts(sweeps, monkeypatch: pytest.MonkeyPatch) -> None:
    base, tables = sweeps
    at = _page(base, monkeypatch, "strict")
    table = tables["strict"]
    shown = at.dataframe[0].value
    assert list(shown["point"]) == ["p0000", "p0001", "p0002", "p0003"]
    assert list(shown["verdict"]) == ["FAIL", "PASS", "failed", "PASS"]
    assert "4 points, 1 failed" in _texts(at.markdown)
    assert at.selectbox(key="sw-metric").value == "goodput_req_s"
    assert (at.selectbox(key="sw-x").value, at.selectbox(key="sw-y").value) == (SEQS, BUDGET)
    heat = _figure(at, "sw-heatmap").data[0]
    assert list(heat.x) == ["8", "16"] and list(heat.y) == ["8", "2048"]
    z = _array(heat.z)
    assert z[0, 0] == table.loc[0, "goodput_req_s"]  # seqs 8, budget 8
    assert math.isnan(z[0, 1])  # seqs 16, budget 8: failed
    assert z[1, 0] == table.loc[1, "goodput_req_s"]
    assert z[1, 1] == table.loc[3, "goodput_req_s"]
    text = np.asarray(heat.text)
    assert text[0, 0].endswith(" FAIL") and text[0, 1] == "failed"
    assert "FAIL" not in text[1, 0] + text[1, 1]
    # Another metric, the knobs swapped.
    at.selectbox(key="sw-metric").set_value("ttft_p99_s").run()
    at.selectbox(key="sw-x").set_value(BUDGET).run()
    assert not at.exception, at.exception
    heat = _figure(at, "sw-heatmap").data[0]
    assert list(heat.x) == ["8", "2048"] and list(heat.y) == ["8", "16"]
    z = _array(heat.z)
    assert [z[0, 0], z[0, 1], z[1, 1]] == list(table.loc[[0, 1, 3], "ttft_p99_s"])
    assert math.isnan(z[1, 0])


def test_page_pareto_fronts(sweeps, monkeypatch: pytest.MonkeyPatch) -> None:
    base, _ = sweeps
    at = _page(base, monkeypatch, "grid")
    ttft = _figure(at, "sw-pareto-ttft_p99_s")
    itl = _figure(at, "sw-pareto-itl_p99_s")
    assert [t.name for t in ttft.data] == ["other points", "Pareto front"]
    assert list(ttft.data[1].text) == ["p0001", "p0003"] and list(ttft.data[0].text) == ["p0000"]
    assert list(itl.data[1].text) == ["p0001", "p0003", "p0000"]
    assert "Throughput vs TTFT p99 (s): front p0001, p0003." in _texts(at.caption)
    # With the strict SLO, p0000 (the ITL front's low end) no longer counts.
    at = _page(base, monkeypatch, "strict")
    itl = _figure(at, "sw-pareto-itl_p99_s")
    assert list(itl.data[1].text) == ["p0001", "p0003"] and list(itl.data[0].text) == []


def test_page_chosen_config_export_and_run_explorer(
    sweeps, monkeypatch: pytest.MonkeyPatch
) -> None:
    base, tables = sweeps
    at = _page(base, monkeypatch, "grid")
    assert at.selectbox(key="sw-objective").value == "highest goodput"
    assert any(m.startswith("**p0001** (highest goodput") for m in _texts(at.markdown))
    run = base / "sweeps" / "grid" / "points" / "p0001"
    scenario = load_scenario(run / "scenario.yaml")
    assert _texts(at.code) == [serve_command(scenario)]
    assert "--max-num-seqs 8 --max-num-batched-tokens 2048" in at.code[0].value
    (download,) = at.get("download_button")
    assert download.proto.label.startswith("Download vllm-yaml")
    at.selectbox(key="sw-objective").set_value("lowest ITL p99").run()
    assert any(m.startswith("**p0000** (lowest ITL p99") for m in _texts(at.markdown))
    at.selectbox(key="sw-objective").set_value("highest goodput").run()
    at.button(key="sw-open").click().run()
    assert not at.exception, at.exception
    assert _texts(at.title) == ["Run explorer"]
    assert at.text_input(key="ex-path").value == str(run)
    assert not at.error, _texts(at.error)
    assert str(tables["grid"].loc[1, "run_dir"]) == str(run)


def test_strict_slo_chooses_among_passing_points(sweeps, monkeypatch) -> None:
    base, _ = sweeps
    at = _page(base, monkeypatch, "strict")
    at.selectbox(key="sw-objective").set_value("lowest ITL p99").run()
    # p0000 has the lowest p99 ITL but misses the TTFT SLO: p0001 (tied with p0003) wins.
    assert any(m.startswith("**p0001** (lowest ITL p99") for m in _texts(at.markdown))


def test_three_knobs_fixed_or_mean(tmp_path: Path, monkeypatch) -> None:
    turns = "workload.turns.value"
    plan = plan_sweep(
        SCENARIO, [*GRID, f"{turns}=1,2"], ["workload.sessions=2"], tmp_path / "sweeps" / "three"
    )
    table = run_sweep(plan, 1).set_index("point")
    assert list(table["status"]) == ["ok"] * 4 + ["failed"] * 2 + ["ok"] * 2
    at = _page(tmp_path, monkeypatch)
    assert at.radio(key="sw-others").value == "fixed"
    assert at.selectbox(key=f"sw-fix-{turns}").value == 1
    z = _array(_figure(at, "sw-heatmap").data[0].z)  # rows: budget 8, 2048; columns: seqs 8, 16
    good = table["goodput_req_s"]
    assert [z[0, 0], z[1, 0], z[1, 1]] == [good["p0000"], good["p0002"], good["p0006"]]
    assert math.isnan(z[0, 1])
    assert any(f"other knobs fixed at `{turns}`=1." in c for c in _texts(at.caption))
    at.selectbox(key=f"sw-fix-{turns}").set_value(2).run()
    z = _array(_figure(at, "sw-heatmap").data[0].z)
    assert [z[0, 0], z[1, 0], z[1, 1]] == [good["p0001"], good["p0003"], good["p0007"]]
    at.radio(key="sw-others").set_value("mean").run()
    assert not at.exception, at.exception
    heat = _figure(at, "sw-heatmap").data[0]
    z = _array(heat.z)
    assert z[0, 0] == pytest.approx((good["p0000"] + good["p0001"]) / 2, rel=1e-12)
    assert z[1, 1] == pytest.approx((good["p0006"] + good["p0007"]) / 2, rel=1e-12)
    assert math.isnan(z[0, 1]) and np.asarray(heat.text)[0, 1] == "failed"
    assert any(f"the mean over its ok points of `{turns}`" in c for c in _texts(at.caption))


def test_one_knob_sweep_is_a_line_chart(tmp_path: Path, monkeypatch) -> None:
    table = _sweep(tmp_path, "one", ["engine.max_num_seqs=8,16"], [])
    at = _page(tmp_path, monkeypatch)
    assert "sw-x" not in {w.key for w in at.selectbox}
    line = _figure(at, "sw-line").data[0]
    assert list(line.x) == ["8", "16"]
    assert list(_array(line.y)) == list(table["goodput_req_s"])
    assert any("One knob in this sweep" in c for c in _texts(at.caption))
    assert not at.error


def test_what_if_points_are_said_and_a_chosen_what_if_is_flagged(tmp_path: Path, monkeypatch):
    # Ample HBM, no prefix caching: the static allocator serves as paged does, both points
    # pass with the same figures; the page must say which is a what-if, and flag it when it
    # is chosen.
    grid = ["engine.allocator=static,paged"]
    table = _sweep(tmp_path, "alloc", grid, ["engine.enable_prefix_caching=false"])
    assert table["what_if"].notna().tolist() == [True, False]
    at = _page(tmp_path, monkeypatch)
    assert any("1 of these points are what-ifs" in i for i in _texts(at.info))
    # Same goodput: the tie goes to the first point, the what-if.
    chosen = sweep_data.choose(table, next(iter(sweep_data.OBJECTIVES)))  # the default
    assert chosen is not None and chosen["point"] == "p0000"
    assert any("This config is a what-if" in w for w in _texts(at.warning))


def test_one_knob_line_marks_missed_slos_and_unfinished_runs() -> None:
    t = pd.DataFrame(
        {
            "point": ["p0", "p1", "p2", "p3"], "n": [4, 1, 3, 2],
            "status": ["ok", "ok", "ok", "failed"], "goodput_req_s": [1.0, 2.0, 3.0, None],
            "slo_pass": [True, False, True, None],  # p2's SLOs hold over its finished requests
            "num_requests": [10, 10, 10, None], "num_finished": [10, 10, 9, None],
        }
    )  # fmt: skip
    line = sweep_charts.line_figure(t, "n", "goodput_req_s", "goodput (req/s)").data[0]
    assert list(line.x) == ["1", "3", "4"]  # the failed point has no value to draw
    assert list(line.text) == ["FAIL", "UNFINISHED", ""]
    marks = sweep_charts.MARK_COLORS
    assert list(line.marker.color) == [marks["FAIL"], marks["UNFINISHED"], sweep_charts.LINE_COLOR]
    assert [row[1] for row in line.customdata] == ["FAIL", "UNFINISHED", "PASS"]


def test_all_points_failed_is_one_message(tmp_path: Path, monkeypatch) -> None:
    """The planner refuses a grid whose every point is impossible, so the points of a real
    sweep are turned into failed ones (an error file each, as a worker writes it)."""
    plan = plan_sweep(SCENARIO, GRID, SMALL, tmp_path / "sweeps" / "bad")
    run_sweep(plan, 1)
    for point in ("p0000", "p0001", "p0003"):
        shutil.rmtree(plan.out / POINTS_DIR / point)
        (plan.out / POINTS_DIR / f"{point}{ERROR_SUFFIX}").write_text(
            json.dumps({"error": f"{point}: the simulation ran out of memory"})
        )
    assert set(write_results(plan)["status"]) == {"failed"}
    at = _page(tmp_path, monkeypatch)
    (error,) = _texts(at.error)
    assert error.endswith(
        "results.parquet: no point of this sweep ran (4 failed); the first error: "
        "p0000: the simulation ran out of memory"
    )
    assert not at.get("plotly_chart")


def test_unreadable_results_is_one_message(sweeps, tmp_path: Path, monkeypatch) -> None:
    base, _ = sweeps
    folder = tmp_path / "sweeps" / "broken"
    shutil.copytree(base / "sweeps" / "grid", folder)
    (folder / "results.parquet").write_bytes(b"not parquet")
    at = _page(tmp_path, monkeypatch)
    (error,) = _texts(at.error)
    assert error.startswith(f"{folder / 'results.parquet'}: cannot read the sweep's results")
    assert "Traceback" not in error and "\n" not in error


def test_other_sweep_json_is_shown_as_written(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "sweeps" / "other"
    folder.mkdir(parents=True)
    (folder / "sweep.json").write_text(json.dumps({"runs": [{"a": 1}, {"a": 2}]}))
    at = _page(tmp_path, monkeypatch)
    assert list(at.dataframe[0].value["a"]) == [1, 2]
    assert not at.error


# --- sweep_data on hand-made tables -------------------------------------------------------


def _table() -> pd.DataFrame:
    """3 knobs (a, b, c); point 5 failed, point 6 missed an SLO."""
    rows = []
    for i, (a, b, c) in enumerate((a, b, c) for a in (1, 2) for b in (10, 20) for c in ("x", "y")):
        rows.append(
            {
                "point": f"p{i}", "a": a, "b": b, "c": c,
                "status": "failed" if i == 5 else "ok",
                "output_throughput_tok_s": None if i == 5 else float(i),
                "ttft_p99_s": None if i == 5 else float(8 - i),
                "itl_p99_s": None if i == 5 else 1.0,
                "goodput_req_s": None if i == 5 else float(i % 4),
                "slo_pass": None if i == 5 else i != 6,
            }
        )  # fmt: skip
    return pd.DataFrame(rows)


def test_heatmap_fixed() -> None:
    t = _table()
    hm = sweep_data.heatmap(t, "a", "b", "goodput_req_s", {"c": "y"})  # p1, p3, p5, p7
    assert hm.z.loc[10, 1] == 1.0 and hm.z.loc[20, 1] == 3.0 and hm.z.loc[20, 2] == 3.0
    assert math.isnan(hm.z.loc[10, 2]) and hm.labels.loc[10, 2] == "failed"
    assert hm.points.to_dict() == {1: {10: "p1", 20: "p3"}, 2: {10: "p5", 20: "p7"}}
    assert hm.labels.loc[20, 2] == "3" and hm.labels.loc[10, 1] == "1"
    hm = sweep_data.heatmap(t, "a", "b", "goodput_req_s", {"c": "x"})  # p6 missed an SLO
    assert hm.labels.loc[20, 2] == "2 FAIL" and hm.z.loc[20, 2] == 2.0


def test_heatmap_mean_and_labels() -> None:
    t = _table()
    hm = sweep_data.heatmap(t, "a", "b", "goodput_req_s", sweep_data.MEAN)
    # (a=2, b=10): p4 (c=x, 0.0) ok, p5 failed -> mean 0.0, "(1 failed)".
    assert hm.z.loc[10, 2] == 0.0 and hm.labels.loc[10, 2] == "0 (1 failed)"
    # (a=2, b=20): p6 (2.0, SLO missed), p7 (3.0) -> 2.5, "(1 FAIL)".
    assert hm.z.loc[20, 2] == 2.5 and hm.labels.loc[20, 2] == "2.5 (1 FAIL)"
    assert hm.z.loc[10, 1] == 0.5 and hm.labels.loc[10, 1] == "0.5"
    assert (hm.points == "").all().all()


def test_verdicts_passing_pareto_choose() -> None:
    t = _table()
    assert list(sweep_data.verdicts(t)) == ["PASS"] * 5 + ["failed", "FAIL", "PASS"]
    assert list(t["point"][sweep_data.passing(t)]) == ["p0", "p1", "p2", "p3", "p4", "p7"]
    # throughput i, p99 TTFT 8 - i: the higher i the better on both; p7 beats every other.
    assert sweep_data.pareto(t, "ttft_p99_s") == ["p7"]
    # equal ITL: the highest throughput alone.
    assert sweep_data.pareto(t, "itl_p99_s") == ["p7"]
    assert sweep_data.choose(t, "highest goodput")["point"] == "p3"  # p3 and p7 tie at 3
    assert sweep_data.choose(t, "lowest TTFT p99")["point"] == "p7"
    none = t.assign(slo_pass=False)
    assert sweep_data.choose(none, "highest goodput") is None
    assert sweep_data.pareto(none, "ttft_p99_s") == []
    no_slos = t.drop(columns="slo_pass")
    assert sweep_data.verdicts(no_slos)[6] == "PASS"
    assert sweep_data.passing(no_slos).sum() == 7


def test_a_point_that_left_requests_unfinished_is_never_chosen() -> None:
    # p7 is the best point on every axis, but its run hit the time limit with a request left.
    t = _table().assign(num_requests=10, num_finished=[10] * 7 + [9])
    assert list(sweep_data.verdicts(t)) == ["PASS"] * 5 + ["failed", "FAIL", "UNFINISHED"]
    assert list(t["point"][sweep_data.passing(t)]) == ["p0", "p1", "p2", "p3", "p4"]
    assert sweep_data.pareto(t, "ttft_p99_s") == ["p4"]
    assert sweep_data.choose(t, "lowest TTFT p99")["point"] == "p4"
    assert sweep_data.heatmap(t, "a", "b", "goodput_req_s", {"c": "y"}).labels.loc[20, 2] == (
        "3 UNFINISHED"
    )
    mean = sweep_data.heatmap(t, "a", "b", "goodput_req_s", sweep_data.MEAN)
    assert mean.labels.loc[20, 2] == "2.5 (1 FAIL) (1 UNFINISHED)"
    # A failed point has no request counts; it stays "failed".
    assert sweep_data.verdicts(t.assign(num_finished=[10] * 5 + [None, 10, 10]))[5] == "failed"


def test_front_keeps_tradeoffs() -> None:
    t = pd.DataFrame(
        {
            "point": ["a", "b", "c", "d"],
            "status": ["ok"] * 4,
            "output_throughput_tok_s": [100.0, 200.0, 150.0, 200.0],
            "itl_p99_s": [0.01, 0.05, 0.06, 0.05],
            "slo_pass": [None] * 4,
        }
    )
    assert sweep_data.pareto(t, "itl_p99_s") == ["b", "d", "a"]  # c: beaten by b
    assert list(sweep_data.verdicts(t)) == ["no SLOs"] * 4


def test_read_results_and_knobs(tmp_path: Path) -> None:
    bad = tmp_path / "results.parquet"
    bad.write_text("x")
    with pytest.raises(ValueError, match="cannot read the sweep's results"):
        sweep_data.read_results(bad)
    pd.DataFrame({"x": [1]}).to_parquet(bad)
    with pytest.raises(ValueError, match="no column 'point'"):
        sweep_data.read_results(bad)
    t = _table()
    assert sweep_data.knobs({"b": ["10"], "a": ["1"], "zz": ["1"]}, t) == ["b", "a"]
    assert sweep_data.knobs(None, t) == ["a", "b", "c"]
    mixed = pd.DataFrame({"k": [8, "auto", 2, None]}, dtype=object)
    assert sweep_data.values(mixed, "k") == [2, 8, "auto"]
