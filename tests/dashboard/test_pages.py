"""Dashboard pages under streamlit.testing.v1.AppTest: renders, widgets, results (the run
explorer's own cases are in test_run_explorer_page.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from sim.cost_model import CostParams
from sim.scenario import SCENARIO_DIR
from tests.dashboard.apptest import TIMEOUT_S, charts, open_page, start_app, texts
from tests.profiles import profile_with


def test_what_if_renders_knobs(runs_env: Path) -> None:
    at = start_app()
    assert texts(at.title) == ["What-if"]
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
    assert "Result" not in texts(at.subheader)


@pytest.mark.parametrize("scenario", sorted(p.name for p in SCENARIO_DIR.glob("*.yaml")))
def test_what_if_knobs_of_every_shipped_scenario(runs_env: Path, scenario: str) -> None:
    at = start_app()
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
    at = start_app()
    at.number_input(key="wi-coding-agents-8b-h100-workload.sessions").set_value(10)
    at.button(key="wi-run").click().run()
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    assert "Result" in texts(at.subheader)
    labels = [m.label for m in at.metric]
    assert {"TTFT p99", "ITL p99", "E2E p99", "KV usage peak", "preemptions"} <= set(labels)
    assert any("--set workload.sessions=10" in c for c in texts(at.code))
    latency = at.dataframe[0].value
    assert list(latency["latency"]) == ["TTFT", "ITL", "TPOT", "E2E", "queue"]
    assert (latency["samples"].iloc[0]) == 100  # 10 sessions x 10 turns
    slos = [d.value for d in at.dataframe if "verdict" in d.value.columns]
    assert slos and set(slos[0]["verdict"]) <= {"PASS", "FAIL"}
    assert len(charts(at)) == 4  # timeline + 3 CDFs

    at.button(key="wi-save").click().run()
    assert not at.exception, at.exception
    saved = sorted(p.name for p in runs_env.iterdir())
    assert saved == ["coding-agents-8b-h100-1"]
    assert any("Saved to" in s for s in texts(at.success))
    assert at.button(key="wi-save").disabled
    summary = json.loads((runs_env / saved[-1] / "summary.json").read_text())
    assert summary["num_requests"] == 100


def jittery_profile() -> bytes:
    """A profile for the coding-agent scenario's model and GPU, with measured-run spread."""
    params = CostParams(mode="additive", compute_efficiency=0.5, bandwidth_efficiency=0.8)
    profile = profile_with(
        params,
        hardware="H100-SXM-80GB",
        model="Llama-3.1-8B",
        run_step_ratios=[0.9, 1.0, 1.2],
        step_residual_quantiles=[0.9] * 50 + [1.0] * 50 + [2.0],
    )
    return profile.model_dump_json().encode()


def test_what_if_draws_an_uncertainty_band_with_a_calibration_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs_env = tmp_path / "runs"
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(runs_env))
    at = start_app()
    at.number_input(key="wi-coding-agents-8b-h100-workload.sessions").set_value(4)
    at.number_input(key="wi-samples").set_value(2)
    at.button(key="wi-run").click().run()
    errors = texts(at.error)  # samples without a profile
    assert errors and "upload one" in errors[0] and "Result" not in texts(at.subheader)

    at.file_uploader(key="wi-profile").set_value(("bad.json", b"{}", "application/json"))
    at.button(key="wi-run").click().run()
    assert any("not a calibration profile" in e and "bad.json" in e for e in texts(at.error))
    assert "Result" not in texts(at.subheader)
    profile = ("cpu-fit.json", jittery_profile(), "application/json")
    at.file_uploader(key="wi-profile").set_value(profile)
    at.button(key="wi-run").click().run()
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    assert any("--calibration cpu-fit.json --samples 2" in c for c in texts(at.code))
    (band,) = [d.value for d in at.dataframe if "p10" in d.value.columns]
    assert list(band.columns) == ["metric", "this run", "median", "p10", "p90"]
    assert band["metric"].iloc[0] == "TTFT p50" and len(band) >= 10
    assert any("each step's own jitter" in c for c in texts(at.caption))

    at.button(key="wi-save").click().run()
    assert not at.exception, at.exception
    (saved,) = runs_env.iterdir()
    record = json.loads((saved / "samples.json").read_text())
    assert len(record["speed_factors"]) == 2 and record["step_jitter"] is True
    summary = json.loads((saved / "summary.json").read_text())
    assert summary["calibration"]["params"]["compute_efficiency"] == 0.5


def test_what_if_invalid_override_shows_error(runs_env: Path) -> None:
    at = start_app()
    # Llama-3.1-8B has 8 KV heads: TP=3 neither divides nor is divisible by it.
    at.number_input(key="wi-coding-agents-8b-h100-engine.tensor_parallel_size").set_value(3)
    at.button(key="wi-run").click().run()
    assert not at.exception, at.exception
    errors = texts(at.error)
    assert errors and "tensor_parallel_size=3" in errors[0]
    assert "Result" not in texts(at.subheader)


def test_what_if_upload(runs_env: Path) -> None:
    at = start_app()
    at.radio(key="wi-source").set_value("upload YAML").run()
    assert at.file_uploader(key="wi-upload") is not None
    at.file_uploader(key="wi-upload").set_value(("bad.yaml", b"name: [unclosed", "text/yaml"))
    at.run()
    assert any("not valid YAML" in e for e in texts(at.error))
    at.file_uploader(key="wi-upload").set_value(
        ("x.yaml", b"name: x\nmodel: Llama-3.1-8B\n", "text/yaml")
    )
    at.run()
    assert not at.exception, at.exception
    at.button(key="wi-run").click().run()
    errors = texts(at.error)
    assert errors and "hardware" in errors[0] and "workload" in errors[0]


def test_compare(runs_env: Path) -> None:
    at = open_page(start_app(), "compare")
    assert texts(at.title) == ["Compare runs"]
    runs = at.multiselect(key="cmp-runs")
    runs.set_value([runs_env / "coding-small", runs_env / "priority-small"]).run()
    assert not at.exception, at.exception
    assert texts(at.subheader) == ["Error table", "Latency CDFs", "Timelines"]
    table = at.dataframe[0].value
    assert "relative error (%)" in table.columns
    row = table.set_index("metric").loc["TTFT p50"]
    assert row["relative error (%)"] == pytest.approx(
        (row["value"] - row["reference"]) / abs(row["reference"]) * 100
    )
    assert len(charts(at)) == 5  # 3 CDFs + KV usage + running


def test_compare_a_fleet_run_with_one_engine(
    small_runs: Path, fleet_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(fleet_run))
    at = open_page(start_app(), "compare")
    at.multiselect(key="cmp-runs").set_value([fleet_run / "fleet-small"]).run()
    at.text_input(key="cmp-paths").set_value(str(small_runs / "priority-small")).run()
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    assert texts(at.subheader) == ["Error table", "Latency CDFs", "Timelines"]
    assert len(charts(at)) == 5
    assert any(
        "sim:fleet-small is a fleet of 2 replicas: its KV usage is their mean and its running "
        "requests their sum" in c
        for c in texts(at.caption)
    )
    # The fleet is a what-if (its router is kvsim's); the one engine is not.
    assert texts(at.info) == [
        "**sim:fleet-small** is a what-if, not vLLM 0.32's own behaviour: fleet of 2 replicas "
        "behind a simulated round_robin router (vLLM 0.32 serves one engine; the routing is "
        "kvsim's model)."
    ]


def test_compare_says_which_runs_are_what_ifs_and_which_were_cut(
    small_runs: Path, swap_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cut = tmp_path / "cut"
    shutil.copytree(small_runs / "priority-small", cut)
    summary = json.loads((cut / "summary.json").read_text())
    summary.update(truncated_at_limit=True, num_unfinished=3)
    (cut / "summary.json").write_text(json.dumps(summary))
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(swap_run))
    at = open_page(start_app(), "compare")
    at.multiselect(key="cmp-runs").set_value([swap_run / "swap-small"]).run()
    at.text_input(key="cmp-paths").set_value(str(cut)).run()
    assert not at.exception, at.exception
    (info,) = texts(at.info)
    assert info.startswith("**sim:swap-small** is a what-if, not vLLM 0.32's own behaviour: swap")
    (warning,) = texts(at.warning)
    assert warning.startswith("**sim:cut** hit limits.max_duration_s") and "3 of its" in warning


def test_compare_needs_two_runs(runs_env: Path) -> None:
    at = open_page(start_app(), "compare")
    at.multiselect(key="cmp-runs").set_value([runs_env / "coding-small"]).run()
    assert any("at least two runs" in i for i in texts(at.info))


def test_sweeps_page_only_with_sweep_results(
    small_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = start_app()
    with pytest.raises(ValueError, match="Could not find a navigation page"):
        at.switch_page("views/sweeps.py")
    sweep = tmp_path / "sweeps" / "seqs"
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text(
        json.dumps({"parameter": "engine.max_num_seqs", "results": [{"value": 64, "ok": 1}]})
    )
    at = open_page(start_app(), "sweeps")
    assert texts(at.title) == ["Sweeps"]
    assert list(at.dataframe[0].value.columns) == ["value", "ok"]


def test_sweeps_page_shows_a_kvsim_sweeps_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sim.sweep import plan_sweep, run_sweep

    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    scenario = Path(__file__).resolve().parents[2] / "scenarios" / "agent-burst.yaml"
    plan = plan_sweep(
        scenario,
        ["engine.max_num_seqs=8,16"],
        ["workload.sessions=3", "workload.turns.value=2"],
        tmp_path / "sweeps" / "seqs",
    )
    table = run_sweep(plan, 1)
    at = open_page(start_app(), "sweeps")
    assert not at.exception, at.exception
    shown = at.dataframe[0].value
    assert list(shown["engine.max_num_seqs"]) == [8, 16]
    assert list(shown["ttft_p99_s"]) == list(table["ttft_p99_s"])
    assert "2 points, 0 failed" in " ".join(m.value for m in at.markdown)


# --- Every failure is one readable message, never a traceback --------------------------------

TINY_CONFIG = Path(__file__).resolve().parents[2] / "validate" / "models" / "tiny-llama"


def _one_error(at: AppTest) -> str:
    """The page's only error message; no exception reached the page."""
    assert not at.exception, at.exception
    errors = texts(at.error)
    assert len(errors) == 1, errors
    (error,) = errors
    assert "Traceback" not in error and "\n" not in error
    return error


def _upload_and_run(at: AppTest, text: str) -> AppTest:
    at.radio(key="wi-source").set_value("upload YAML").run()
    at.file_uploader(key="wi-upload").set_value(("up.yaml", text.encode(), "text/yaml"))
    at.run()
    assert not at.exception, at.exception
    at.button(key="wi-run").click().run()
    return at


def _scenario(model: str, workload: str) -> str:
    return (
        f"name: broken\nmodel: {model}\nhardware: H100-SXM-80GB\nengine: {{max_model_len: 4096}}\n"
        f"workload: {workload}\nlimits: {{max_duration_s: 60}}\n"
    )


OPEN_LOOP = (
    "{kind: open_loop, num_requests: 4, arrival: {kind: burst, at_s: 0.0}, "
    "prompt_tokens: {kind: fixed, value: 64}, output_tokens: {kind: fixed, value: 8}}"
)


def test_what_if_runs_an_uploaded_scenario_with_a_model_config(runs_env: Path) -> None:
    """The control case of the broken ones below: the same upload with a good config.json."""
    at = _upload_and_run(start_app(), _scenario(str(TINY_CONFIG / "config.json"), OPEN_LOOP))
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    assert "Result" in texts(at.subheader)


def test_what_if_runs_an_uploaded_fleet_scenario(runs_env: Path) -> None:
    text = _scenario("Llama-3.1-8B", OPEN_LOOP) + "fleet: {replicas: 2}\n"
    at = _upload_and_run(start_app(), text)
    assert not at.exception, at.exception
    assert not at.error, texts(at.error)
    assert "Result" in texts(at.subheader)
    assert (
        "a fleet of 2 replicas: KV usage is their mean and requests their sum (save the run "
        "and open it in the Run explorer for each replica's figures)." in texts(at.caption)
    )


@pytest.mark.parametrize(
    "content",
    [
        '{"num_attention_heads": 0}',
        '{"num_attention_heads": "many"}',
        '{"num_attention_heads": [8]}',
        '{"hidden_size": null}',
        "5",
        "[]",
        '{"num_attention_heads": ',
        b"\x89PNG\x00\xff\xfe binary",
    ],
    ids=["zero-heads", "heads-string", "heads-list", "null", "number", "list", "cut", "binary"],
)
def test_what_if_upload_with_a_broken_model_config(
    runs_env: Path, tmp_path: Path, content: str | bytes
) -> None:
    config = tmp_path / "config.json"
    if isinstance(content, bytes):
        config.write_bytes(content)
    else:
        good = json.loads((TINY_CONFIG / "config.json").read_text())
        try:  # the broken field inside an otherwise complete config
            patch = json.loads(content)
            config.write_text(json.dumps({**good, **patch}) if isinstance(patch, dict) else content)
        except json.JSONDecodeError:
            config.write_text(content)
    at = _upload_and_run(start_app(), _scenario(str(config), OPEN_LOOP))
    error = _one_error(at)
    assert error.startswith("up.yaml") or error.startswith(str(config)), error
    assert "Result" not in texts(at.subheader)


@pytest.mark.parametrize("trace", ["missing.jsonl", "folder.jsonl", "binary.jsonl", "bad.csv"])
def test_what_if_upload_with_a_broken_trace(runs_env: Path, tmp_path: Path, trace: str) -> None:
    path = tmp_path / trace
    if trace == "folder.jsonl":
        path.mkdir()
    elif trace == "binary.jsonl":
        path.write_bytes(b"\xff\xfe\x00\x01" * 50)
    elif trace == "bad.csv":
        path.write_text("timestamp,input_length,output_length\n0,abc,5\n")
    workload = f"{{kind: trace, path: {path}}}"
    at = _upload_and_run(start_app(), _scenario("Llama-3.1-8B", workload))
    error = _one_error(at)
    assert error.startswith("up.yaml") or error.startswith(f"trace {path}"), error
    assert "Result" not in texts(at.subheader)


@pytest.mark.parametrize(
    "text",
    [b"\x00\x01\x02\xff\xfe", b"[" * 5000, b"- a\n- b\n", b"name: [unclosed"],
    ids=["binary", "deep", "list", "bad-yaml"],
)
def test_what_if_upload_that_is_not_a_scenario(runs_env: Path, text: bytes) -> None:
    at = start_app()
    at.radio(key="wi-source").set_value("upload YAML").run()
    at.file_uploader(key="wi-upload").set_value(("up.yaml", text, "text/yaml")).run()
    assert _one_error(at).startswith("up.yaml: ")


def _broken_run(small_runs: Path, tmp_path: Path, how: str) -> Path:
    run = tmp_path / how
    shutil.copytree(small_runs / "priority-small", run)
    if how == "summary-metrics-wrong-type":
        summary = json.loads((run / "summary.json").read_text())
        summary["metrics"] = {key: "n/a" for key in summary["metrics"]}
        (run / "summary.json").write_text(json.dumps(summary))
    elif how == "summary-binary":
        (run / "summary.json").write_bytes(b"\xff\xfe\x00")
    elif how == "requests-garbage":
        (run / "requests.parquet").write_bytes(b"PAR1 not really")
    elif how == "steps-wrong-types":
        steps = pd.read_parquet(run / "steps.parquet")
        steps["kv_cache_usage_perc"] = "high"
        steps["num_preemptions"] = "some"
        steps.to_parquet(run / "steps.parquet")
    elif how == "requests-wrong-types":
        requests = pd.read_parquet(run / "requests.parquet")
        requests["session_id"] = "s"
        requests["arrival_s"] = None
        requests.to_parquet(run / "requests.parquet")
    elif how == "block-map-garbage":
        (run / "block_map.npz").write_bytes(b"PK garbage")
    elif how == "block-map-times-text":
        with np.load(run / "block_map.npz") as npz:
            states, classes = npz["states"], npz["classes"]
        times = np.array(["t"] * len(states))
        np.savez(run / "block_map.npz", times_s=times, states=states, classes=classes)
    return run


BROKEN_RUNS = [
    "summary-metrics-wrong-type",
    "summary-binary",
    "requests-garbage",
    "steps-wrong-types",
    "requests-wrong-types",
    "block-map-garbage",
    "block-map-times-text",
]


@pytest.mark.parametrize("how", BROKEN_RUNS)
def test_run_explorer_broken_run_directory(
    small_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    run = _broken_run(small_runs, tmp_path, how)
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = open_page(start_app(), "run_explorer")
    at.text_input(key="ex-path").set_value(str(run)).run()
    assert str(run) in _one_error(at)


@pytest.mark.parametrize("how", BROKEN_RUNS)
def test_compare_with_a_broken_run_directory(
    small_runs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    run = _broken_run(small_runs, tmp_path, how)
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = open_page(start_app(), "compare")
    at.multiselect(key="cmp-runs").set_value([]).run()
    at.text_input(key="cmp-paths").set_value(f"{small_runs / 'coding-small'}, {run}").run()
    assert not at.exception, at.exception
    errors = texts(at.error)
    assert len(errors) <= 1 and all("Traceback" not in e for e in errors), errors
    assert errors or "Error table" in texts(at.subheader)  # a run that still compares


@pytest.mark.parametrize("how", ["fleet-section-wrong-types", "replica-column-text"])
def test_run_explorer_broken_fleet_run(
    fleet_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    run = tmp_path / how
    shutil.copytree(fleet_run / "fleet-small", run)
    if how == "fleet-section-wrong-types":
        summary = json.loads((run / "summary.json").read_text())
        summary["fleet"] = {"replicas": 2, "router": "x", "per_replica": "n/a"}
        (run / "summary.json").write_text(json.dumps(summary))
    else:
        steps = pd.read_parquet(run / "steps.parquet")
        steps["replica"] = steps["replica"].astype(str)
        steps.to_parquet(run / "steps.parquet")
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(tmp_path))
    at = open_page(start_app(), "run_explorer")
    at.text_input(key="ex-path").set_value(str(run)).run()
    assert str(run) in _one_error(at)


def test_what_if_save_into_an_unwritable_runs_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("KVSIM_RUNS_DIR", str(blocker / "runs"))  # under a file: cannot exist
    at = start_app()
    at.number_input(key="wi-coding-agents-8b-h100-workload.sessions").set_value(2)
    at.button(key="wi-run").click().run()
    assert "Result" in texts(at.subheader)
    at.button(key="wi-save").click().run()
    assert _one_error(at).startswith(f"saving the run to {blocker / 'runs'}: ")
    assert not at.success


def test_warm_up_imports_the_heavy_modules_once() -> None:
    """In a fresh interpreter: none of them before, all of them after, one thread."""
    check = (
        "import sys, threading\n"
        "from dashboard.warmup import HEAVY_MODULES, warm_up\n"
        "assert not [m for m in HEAVY_MODULES if m in sys.modules]\n"
        "done = warm_up()\n"
        "assert warm_up() is done\n"
        "assert [t.name for t in threading.enumerate()].count('kvsim-warm-up') == 1\n"
        f"assert done.wait({TIMEOUT_S})\n"
        "print(sorted(m for m in HEAVY_MODULES if m in sys.modules))\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", check], cwd=root, capture_output=True, text=True, check=True
    )
    from dashboard.warmup import HEAVY_MODULES

    assert out.stdout.strip() == str(sorted(HEAVY_MODULES))
