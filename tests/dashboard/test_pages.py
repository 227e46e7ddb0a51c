"""Every dashboard page under streamlit.testing.v1.AppTest: renders, widgets, results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from sim.scenario import SCENARIO_DIR
from tests.dashboard.conftest import APP

TIMEOUT_S = 120


def _app() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, at.exception
    return at


def _page(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, at.exception
    return at


def _texts(elements) -> list[str]:
    return [str(e.value) for e in elements]


def _charts(at: AppTest) -> list:
    return at.get("plotly_chart")


def test_what_if_renders_knobs(runs_env: Path) -> None:
    at = _app()
    assert _texts(at.title) == ["What-if"]
    assert at.radio(key="wi-source").value == "shipped scenario"
    assert at.selectbox(key="wi-file").value.name == "coding-agents-8b-h100.yaml"
    prefix = "wi-coding-agents-8b-h100"
    for path in (
        "model",
        "hardware",
        "engine.tensor_parallel_size",
        "engine.block_size",
        "engine.gpu_memory_utilization",
        "engine.max_num_batched_tokens",
        "engine.max_num_seqs",
        "engine.enable_prefix_caching",
        "engine.scheduling_policy",
        "workload.sessions",
        "workload.session_arrival.rate_per_s",
    ):
        assert at.get_by_key(f"{prefix}-{path}") is not None, path
    assert at.selectbox(key=f"{prefix}-model").value == "Llama-3.1-8B"
    assert at.number_input(key=f"{prefix}-workload.sessions").value == 500
    assert at.button(key="wi-run").label == "Run simulation"
    assert "Result" not in _texts(at.subheader)


@pytest.mark.parametrize("scenario", sorted(p.name for p in SCENARIO_DIR.glob("*.yaml")))
def test_what_if_knobs_of_every_shipped_scenario(runs_env: Path, scenario: str) -> None:
    at = _app()
    at.selectbox(key="wi-file").set_value(SCENARIO_DIR / scenario).run()
    assert not at.exception, at.exception
    prefix = f"wi-{Path(scenario).stem}"
    keys = {w.key for w in (*at.number_input, *at.selectbox) if w.key}
    assert f"{prefix}-engine.max_num_seqs" in keys
    assert f"{prefix}-workload.sessions" in keys or f"{prefix}-workload.num_requests" in keys
    assert at.info and at.info[0].value[:1].isupper()  # the scenario's question


def test_what_if_run_shows_summary_and_saves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs_env = tmp_path / "runs"  # saving writes here: keep the shared runs dir unchanged
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(runs_env))
    at = _app()
    at.number_input(key="wi-coding-agents-8b-h100-workload.sessions").set_value(10)
    at.button(key="wi-run").click().run()
    assert not at.exception, at.exception
    assert not at.error, _texts(at.error)
    assert "Result" in _texts(at.subheader)
    labels = [m.label for m in at.metric]
    assert {"TTFT p99", "ITL p99", "E2E p99", "KV usage peak", "preemptions"} <= set(labels)
    assert any("--set workload.sessions=10" in c for c in _texts(at.code))
    latency = at.dataframe[0].value
    assert list(latency["latency"]) == ["TTFT", "ITL", "E2E", "queue"]
    assert (latency["samples"].iloc[0]) == 100  # 10 sessions x 10 turns
    slos = [d.value for d in at.dataframe if "verdict" in d.value.columns]
    assert slos and set(slos[0]["verdict"]) <= {"PASS", "FAIL"}
    assert len(_charts(at)) == 4  # timeline + 3 CDFs

    at.button(key="wi-save").click().run()
    assert not at.exception, at.exception
    saved = sorted(p.name for p in runs_env.iterdir())
    assert saved == ["coding-agents-8b-h100-1"]
    assert any("Saved to" in s for s in _texts(at.success))
    assert at.button(key="wi-save").disabled
    summary = json.loads((runs_env / saved[-1] / "summary.json").read_text())
    assert summary["num_requests"] == 100


def test_what_if_invalid_override_shows_error(runs_env: Path) -> None:
    at = _app()
    # Llama-3.1-8B has 8 KV heads: TP=3 neither divides nor is divisible by it.
    at.number_input(key="wi-coding-agents-8b-h100-engine.tensor_parallel_size").set_value(3)
    at.button(key="wi-run").click().run()
    assert not at.exception, at.exception
    errors = _texts(at.error)
    assert errors and "tensor_parallel_size=3" in errors[0]
    assert "Result" not in _texts(at.subheader)


def test_what_if_upload(runs_env: Path) -> None:
    at = _app()
    at.radio(key="wi-source").set_value("upload YAML").run()
    assert at.file_uploader(key="wi-upload") is not None
    at.file_uploader(key="wi-upload").set_value(("bad.yaml", b"name: [unclosed", "text/yaml"))
    at.run()
    assert any("not valid YAML" in e for e in _texts(at.error))
    at.file_uploader(key="wi-upload").set_value(
        ("x.yaml", b"name: x\nmodel: Llama-3.1-8B\n", "text/yaml")
    )
    at.run()
    assert not at.exception, at.exception
    at.button(key="wi-run").click().run()
    errors = _texts(at.error)
    assert errors and "hardware" in errors[0] and "workload" in errors[0]


def test_run_explorer(runs_env: Path) -> None:
    at = _page(_app(), "run_explorer")
    assert _texts(at.title) == ["Run explorer"]
    select = at.selectbox(key="ex-select")
    assert set(select.options) >= {"coding-small", "priority-small"}
    select.set_value(runs_env / "priority-small").run()
    assert not at.exception, at.exception
    assert not at.error, _texts(at.error)
    heads = _texts(at.subheader)
    for head in (
        "KV cache and requests over time",
        "HBM block map",
        "Latency CDFs by priority class",
        "Agent session waterfall",
    ):
        assert head in heads
    snapshot = at.select_slider(key="ex-snapshot")
    assert snapshot.value == len(snapshot.options) - 1 > 10  # the last snapshot first
    assert len(_charts(at)) == 7  # timeline, map, strip, 3 CDFs, waterfall
    captions = " ".join(_texts(at.caption))
    assert "steps with preemptions" in captions
    assert "swap/offload" in captions
    at.select_slider(key="ex-snapshot").set_value(3).run()
    assert not at.exception, at.exception
    assert "t = " in " ".join(_texts(at.caption))
    at.selectbox(key="ex-session").set_value(5).run()
    assert not at.exception, at.exception
    assert "Time per phase" in " ".join(_texts(at.caption))


def test_run_explorer_without_block_map_and_bad_dir(runs_env: Path, tmp_path: Path) -> None:
    at = _page(_app(), "run_explorer")
    at.selectbox(key="ex-select").set_value(runs_env / "coding-small").run()
    assert any("no `block_map.npz`" in i for i in _texts(at.info))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{}")
    at.text_input(key="ex-path").set_value(str(tmp_path / "broken")).run()
    assert not at.exception, at.exception
    errors = _texts(at.error)
    assert errors and "missing requests.parquet, steps.parquet" in errors[0]


def test_run_explorer_empty_runs_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = _page(_app(), "run_explorer")
    assert any("No run directories" in i for i in _texts(at.info))


def test_compare(runs_env: Path) -> None:
    at = _page(_app(), "compare")
    assert _texts(at.title) == ["Compare runs"]
    runs = at.multiselect(key="cmp-runs")
    runs.set_value([runs_env / "coding-small", runs_env / "priority-small"]).run()
    assert not at.exception, at.exception
    assert _texts(at.subheader) == ["Error table", "Latency CDFs", "Timelines"]
    table = at.dataframe[0].value
    assert "relative error (%)" in table.columns
    row = table.set_index("metric").loc["TTFT p50"]
    assert row["relative error (%)"] == pytest.approx(
        (row["value"] - row["reference"]) / abs(row["reference"]) * 100
    )
    assert len(_charts(at)) == 5  # 3 CDFs + KV usage + running


def test_compare_needs_two_runs(runs_env: Path) -> None:
    at = _page(_app(), "compare")
    at.multiselect(key="cmp-runs").set_value([runs_env / "coding-small"]).run()
    assert any("at least two runs" in i for i in _texts(at.info))


def test_sweeps_page_only_with_sweep_results(
    small_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = _app()
    with pytest.raises(ValueError, match="Could not find a navigation page"):
        at.switch_page("views/sweeps.py")
    sweep = tmp_path / "sweeps" / "seqs"
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text(
        json.dumps({"parameter": "engine.max_num_seqs", "results": [{"value": 64, "ok": 1}]})
    )
    at = _page(_app(), "sweeps")
    assert _texts(at.title) == ["Sweeps"]
    assert list(at.dataframe[0].value.columns) == ["value", "ok"]
