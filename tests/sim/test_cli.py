"""`kvsim` on bad input: one clear paragraph, a non-zero exit, no run directory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim.cli import app
from sim.config.calibration import save_profile
from sim.cost_model import CostParams
from sim.report import too_long_line, truncation_line, what_if_line
from sim.scenario import DEFAULT_SCENARIO, SCENARIO_DIR
from tests.profiles import profile_with

runner = CliRunner()


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "scenario.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["engine.max_num_seqs=-3"], "engine.max_num_seqs = -3"),
        (["engine.scheduling_policy=lifo"], "engine.scheduling_policy = 'lifo'"),
        (["engine.bogus=1"], "engine.bogus"),
        (["model=Llama-9-1T"], "Llama-9-1T"),
        (["hardware=TPU-v9"], "TPU-v9"),
        (["model=Llama-3.1-70B"], "tensor_parallel_size"),
        (["engine.max_model_len=10000000"], "max_model_len"),
        (["workload.turns.kind=sometimes"], "workload"),
        (["nonsense"], "KEY=VALUE"),
    ],
)
def test_bad_input_is_one_paragraph_and_leaves_no_run(
    tmp_path: Path, overrides: list[str], expected: str
) -> None:
    out = tmp_path / "run"
    args = ["run", str(DEFAULT_SCENARIO), "--out", str(out), "--quiet"]
    for o in overrides:
        args += ["--set", o]
    code, output = run(*args)
    assert code == 2
    assert output.startswith("error:")
    assert expected in output
    assert "Traceback" not in output
    assert not out.exists()
    assert not list(tmp_path.iterdir())


def test_malformed_yaml_and_missing_file(tmp_path: Path) -> None:
    code, output = run("run", str(write(tmp_path, "name: [unclosed\n")), "--quiet")
    assert code == 2 and "not valid YAML" in output
    code, output = run("run", str(tmp_path / "nope.yaml"), "--quiet")
    assert code == 2 and "coding-agents-8b-h100.yaml" in output  # lists the shipped ones


def test_unknown_top_level_key_names_its_path(tmp_path: Path) -> None:
    text = DEFAULT_SCENARIO.read_text() + "\nturbo: true\n"
    code, output = run("run", str(write(tmp_path, text)), "--quiet")
    assert code == 2 and "turbo" in output and "Extra inputs" in output


def test_existing_out_dir_is_never_overwritten(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, output = run("run", "--out", str(out), "--quiet")
    assert code == 2 and "already exists" in output
    assert (out / "keep.txt").read_text() == "mine"


def test_run_prints_summary_and_writes_run_dir(tmp_path: Path) -> None:
    out = tmp_path / "run"
    code, output = run(
        "run", str(DEFAULT_SCENARIO), "--set", "workload.sessions=10", "--out", str(out)
    )
    assert code == 0, output
    assert "TTFT" in output and "SLO ttft_p99_s" in output and "run written to" in output
    assert "on H100-SXM-80GB [sim] " in " ".join(output.split())  # text, not rich markup
    assert sorted(p.name for p in out.iterdir()) == [
        "block_map.npz",
        "requests.parquet",
        "scenario.yaml",
        "steps.parquet",
        "summary.json",
    ]


def test_run_warns_when_the_profile_was_fitted_at_another_token_budget(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    save_profile(profile_with(CostParams(mode="additive"), max_num_batched_tokens=[512]), profile)
    outputs = {}
    for budget in (512, 384):
        code, outputs[budget] = run(
            *("run", str(DEFAULT_SCENARIO), "--set", "workload.sessions=4", "--quiet"),
            *("--set", f"engine.max_num_batched_tokens={budget}", "--calibration", str(profile)),
            *("--out", str(tmp_path / str(budget))),
        )
        assert code == 0, outputs[budget]
    assert "was not calibrated" not in outputs[512]
    assert "engine.max_num_batched_tokens=384 was not calibrated" in outputs[384]
    assert "used 512" in outputs[384] and "run written to" in outputs[384]


def test_run_reports_the_share_of_steps_the_profile_was_fitted_on(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    # Fitted on decode-only steps of 1 request at 1,024-2,047 tokens of context, nothing else.
    save_profile(profile_with(CostParams(mode="additive"), shape_cells=[(0, 1, 11, 0)]), profile)
    code, output = run(
        *("run", str(DEFAULT_SCENARIO), "--set", "workload.sessions=4", "--quiet"),
        *("--calibration", str(profile), "--out", str(tmp_path / "run")),
    )
    assert code == 0, output
    text = " ".join(output.split())
    assert (
        "shape coverage:" in text and "batch shapes the calibration profile was fitted on" in text
    )
    assert "the cost model extrapolates the step times of the others" in text


# -- hardening: every class of bad input is one paragraph, exit 2, no run directory ------------
# A small, fast scenario whose pieces the tests below break one at a time.
TINY = """\
name: tiny
seed: 3
model: {model}
hardware: {{name: small-gpu, hbm_bytes: 4294967296, hbm_bandwidth_bytes_per_s: 2.0e12,
           bf16_flops_per_s: 3.0e14, pcie_bandwidth_bytes_per_s: 3.2e10,
           nvlink_bandwidth_bytes_per_s: 0}}
engine: {{block_size: 16, max_model_len: 4096, max_num_seqs: 8, max_num_batched_tokens: 512}}
workload: {workload}
limits: {{max_duration_s: 120}}
"""
TINY_SESSIONS = (
    "{kind: agent_sessions, sessions: 2, turns: {kind: fixed, value: 2}, "
    "system_prompt_tokens: 64, tool_schema_tokens: 32, "
    "user_message_tokens: {kind: fixed, value: 16}, tool_result_tokens: {kind: fixed, value: 16}, "
    "output_tokens: {kind: fixed, value: 8}, tool_latency: {kind: fixed, value_s: 0.5}}"
)
TINY_MODEL = str(Path(__file__).resolve().parents[2] / "validate/models/tiny-llama/config.json")
TRACE_ROWS = "timestamp,input_length,output_length\n0,40,4\n0.5,60,3\n"


def tiny(tmp_path: Path, model: str = TINY_MODEL, workload: str = TINY_SESSIONS) -> Path:
    return write(tmp_path, TINY.format(model=model, workload=workload))


def trace_scenario(tmp_path: Path, data: bytes | str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return tiny(tmp_path, workload=f"{{kind: trace, path: {name}}}")


def refused(tmp_path: Path, *args: str) -> str:
    """Run ``kvsim run ARGS --out tmp/run``; assert one paragraph, exit 2, nothing written."""
    before = sorted(p.name for p in tmp_path.iterdir())
    out = tmp_path / "run"
    code, output = run("run", *args, "--out", str(out), "--quiet")
    assert code == 2, output
    assert output.startswith("error:") and "Traceback" not in output
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no .partial-*, no claim
    return output


def test_tiny_scenarios_run(tmp_path: Path) -> None:
    code, output = run("run", str(tiny(tmp_path)), "--out", str(tmp_path / "a"), "--quiet")
    assert code == 0, output
    code, output = run(
        "run", str(trace_scenario(tmp_path, TRACE_ROWS)), "--out", str(tmp_path / "b"), "--quiet"
    )
    assert code == 0 and "2/2 requests" in output, output


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads = 0: Input should be greater than 0"),
        (
            {"num_attention_heads": "8"},
            "num_attention_heads = '8': Input should be a valid integer",
        ),
        (
            {"num_attention_heads": [8]},
            "num_attention_heads = [8]: Input should be a valid integer",
        ),
        ({"hidden_size": 1.5}, "hidden_size = 1.5: Input should be a valid integer"),
        ({"num_key_value_heads": 3}, "not divisible by num_key_value_heads=3"),
        ({"vocab_size": None}, "vocab_size = None"),
        ({"torch_dtype": "int4"}, "dtype = 'int4'"),
    ],
)
def test_model_config_with_wrong_types_names_file_and_field(
    tmp_path: Path, change: dict, expected: str
) -> None:
    config = json.loads(Path(TINY_MODEL).read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(config))
    output = refused(tmp_path, str(tiny(tmp_path, model="config.json")))
    assert "config.json" in output and expected in output


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("42", "expected a JSON object {...}, got int 42"),
        ("[1, 2]", "expected a JSON object {...}, got list"),
        ('{"num_hidden_layers": NaN}', "NaN is not a number JSON allows"),
        ('{"num_hidden_layers": 4', "not valid JSON"),
    ],
)
def test_model_config_that_is_not_an_object_names_the_file(
    tmp_path: Path, text: str, expected: str
) -> None:
    (tmp_path / "config.json").write_text(text)
    output = refused(tmp_path, str(tiny(tmp_path, model="config.json")))
    assert "config.json" in output and expected in output


def test_trace_path_missing_or_a_directory(tmp_path: Path) -> None:
    output = refused(tmp_path, str(tiny(tmp_path, workload="{kind: trace, path: gone.csv}")))
    assert "gone.csv" in output and "no such file" in output
    (tmp_path / "dir.csv").mkdir()
    output = refused(tmp_path, str(tiny(tmp_path, workload="{kind: trace, path: dir.csv}")))
    assert "dir.csv: is a directory" in output


def test_out_that_cannot_be_created_is_refused_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sim.runner

    calls = []
    monkeypatch.setattr(sim.runner, "simulate", lambda *a, **k: calls.append(a))
    for out in ("/proc/kvsim/run", str(tmp_path / "scenario.yaml" / "run")):
        code, output = run("run", str(tiny(tmp_path)), "--out", out, "--quiet")
        assert code == 2 and f"--out {out}: cannot create it" in output, output
    assert calls == []


@pytest.mark.parametrize("command", ["replay", "validate"])
def test_replay_and_validate_without_vllm_say_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now fails, as if missing
    monkeypatch.chdir(tmp_path)
    code, output = run(command, str(tmp_path / "no-such-scenario.yaml"))
    assert code == 2 and "Traceback" not in output
    assert output.startswith("error: kvsim " + command + " runs real vLLM")
    assert "install it with `.ci/setup.sh --with-vllm`" in output
    assert list(tmp_path.iterdir()) == []  # checked before the scenario, before any work


def test_alias_bomb_is_refused_without_expanding(tmp_path: Path) -> None:
    bomb = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
    for i in range(1, 9):
        prev = chr(ord("a") + i - 1)
        bomb += f"{chr(ord('a') + i)}: &{chr(ord('a') + i)} [{', '.join(['*' + prev] * 9)}]\n"
    output = refused(tmp_path, str(write(tmp_path, bomb)))
    assert "aliases (*name) would expand the document beyond 100,000 nodes" in output
    # The same bomb in a --set value, and a bomb just under the limit: no repr of it either.
    code, output = run("run", "--set", "workload=" + bomb.replace("\n", ", "), "--quiet")
    assert code == 2 and len(output) < 2000


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("workload.sessions=1000000000", "sessions = 1000000000: Input should be less than or "),
        ("engine.num_gpu_blocks_override=1000000000", "num_gpu_blocks_override = 1000000000"),
        ("engine.max_model_len=100000000", "max_model_len = 100000000"),
        ("workload.turns.value=10000000000", "turns.fixed.value = 10000000000"),
        ("seed=-1", "seed = -1: Input should be greater than or equal to 0"),
        ("name=../../etc", "name = '../../etc': String should match pattern"),
    ],
)
def test_sizes_beyond_the_documented_bounds_are_refused(
    tmp_path: Path, override: str, expected: str
) -> None:
    output = refused(tmp_path, str(DEFAULT_SCENARIO), "--set", override)
    assert expected in output


def test_duplicate_yaml_key_is_an_error(tmp_path: Path) -> None:
    text = tiny(tmp_path).read_text() + "seed: 4\n"
    output = refused(tmp_path, str(write(tmp_path, text)))
    assert "duplicate key 'seed' (line 10; first at line 2)" in output


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("engine.block_size=8", "multiples of 16 tokens"),
        ("engine.block_size=24", "No common block size for 24"),
        (
            "engine.max_num_seqs=1024",
            "max_num_batched_tokens (512) must be greater than or equal to engine.max_num_seqs",
        ),
        ("engine.long_prefill_token_threshold=5000", "cannot be greater than engine.max_model_len"),
        ("engine.max_model_len=16384", "max_position_embeddings=8192"),
        ("workload.tool_latency.value_s=.inf", "value_s = inf: Input should be a finite number"),
        ("workload.session_arrival={kind: poisson, rate_per_s: .nan}", "should be a finite number"),
        ("slos.ttft_p99_s=.inf", "ttft_p99_s = inf"),
        ("engine.max_model_len=true", "engine: max_model_len = True: a number is needed, not"),
        ("workload.output_tokens={kind: empirical, values: [4, true]}", "values = [4, True]"),
    ],
)
def test_what_vllm_refuses_and_non_finite_numbers_are_refused(
    tmp_path: Path, override: str, expected: str
) -> None:
    output = refused(tmp_path, str(tiny(tmp_path)), "--set", override)
    assert expected in output


def test_preset_max_model_len_beyond_the_model_is_refused(tmp_path: Path) -> None:
    output = refused(tmp_path, str(DEFAULT_SCENARIO), "--set", "model=Llama-2-13B")
    assert "engine.max_model_len (32768) is greater than the derived max_model_len" in output


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (
            "timestamp,input_length,output_length,session_id,turn\n0,40,4,1,0\n1,50,4,1,0\n",
            "trace.csv:3: session_id=1 turn=0 is also on line 2",
        ),
        (
            "timestamp,input_length,output_length,session_id,turn\n5,40,4,1,0\n1,50,4,1,1\n",
            "session_id=1 turn=1 has timestamp before turn=0",
        ),
        (
            "timestamp,input_length,output_length,hash_ids\n0,40,4,1 2\n",
            "2 hash_ids describe more than input_length=40 tokens hold (1 blocks",
        ),
        (
            "timestamp,input_length,output_length\n0,40,4\n40000000,40,4\n",
            "its rows span 40,000,000 s",
        ),
        ("timestamp,input_length,output_length\n0,4000,400\n", "exceeds engine.max_model_len"),
        ("timestamp,input_length,output_length\ninf,40,4\n", "'timestamp' = 'inf' is not a finite"),
        ("timestamp,input_length,output_length\n", "no rows"),
    ],
)
def test_contradicting_or_unreachable_trace_rows_are_refused(
    tmp_path: Path, rows: str, expected: str
) -> None:
    output = refused(tmp_path, str(trace_scenario(tmp_path, rows)))
    assert "trace.csv" in output and expected in output


def test_a_run_cut_at_its_time_limit_says_what_its_figures_leave_out(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["run", str(DEFAULT_SCENARIO), "--out", str(out), "--quiet"]
    code, output = run(*args, "--set", "limits.max_duration_s=60")
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert truncation_line(summary) in output  # after the tables, in yellow on stderr
    whole = ["run", str(DEFAULT_SCENARIO), "--out", str(tmp_path / "whole"), "--quiet"]
    code, output = run(*whole, "--set", "workload.sessions=4")
    assert code == 0 and "hit limits.max_duration_s" not in output


def test_run_where_no_request_arrives_in_time_is_refused(tmp_path: Path) -> None:
    output = refused(
        tmp_path,
        str(tiny(tmp_path)),
        "--set",
        "workload.session_arrival={kind: poisson, rate_per_s: 0.00001}",
    )
    assert "no request arrived before limits.max_duration_s=120 s" in output


def test_a_shared_prefix_longer_than_max_model_len_is_refused_as_such(tmp_path: Path) -> None:
    output = refused(tmp_path, str(tiny(tmp_path)), "--set", "workload.system_prompt_tokens=4090")
    assert "system_prompt_tokens + tool_schema_tokens + the shortest user_message_tokens" in output
    assert "do not fit the context cap of 4,096 (engine.max_model_len=4096" in output
    assert "every session would end before its first turn" in output


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"name: x\x00\x01\x02", "is a binary file (it holds NUL bytes)"),
        ("name: caf\u00e9\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 at offset 9)"),
        ("name: x\n".encode("utf-16"), "is UTF-16 text, not UTF-8; save it as UTF-8"),
    ],
)
def test_binary_or_non_utf8_scenario_names_the_file(
    tmp_path: Path, data: bytes, expected: str
) -> None:
    path = tmp_path / "scenario.yaml"
    path.write_bytes(data)
    output = refused(tmp_path, str(path))
    assert f"scenario {path}: {expected}" in output


def test_binary_trace_names_the_file(tmp_path: Path) -> None:
    output = refused(tmp_path, str(trace_scenario(tmp_path, b"\x89PNG\r\n\x1a\n\x00\x00")))
    assert "trace.csv: is a binary file" in output


def test_csv_trace_with_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    scenario = trace_scenario(tmp_path, "\ufeff" + TRACE_ROWS)
    code, output = run("run", str(scenario), "--out", str(tmp_path / "run"), "--quiet")
    assert code == 0 and "2/2 requests" in output, output
    scenario = tmp_path / "bom.yaml"
    scenario.write_text("\ufeff" + tiny(tmp_path).read_text())
    code, output = run("run", str(scenario), "--out", str(tmp_path / "run2"), "--quiet")
    assert code == 0, output


def test_errors_name_the_file_and_field(tmp_path: Path) -> None:
    output = refused(tmp_path, str(tiny(tmp_path)), "--set", "workload.sessions=-1")
    assert f"{tmp_path / 'scenario.yaml'}: workload.agent_sessions.sessions = -1" in output
    output = refused(tmp_path, str(tiny(tmp_path)), "--set", "workload.priority_classes.x=1")
    assert "'priority_classes'" in output or "priority_classes" in output


# -- concurrency and kills ----------------------------------------------------------------------
def test_a_claimed_out_is_refused_before_simulating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sim.runner
    from sim.results import claim_run_dir

    out = claim_run_dir(tmp_path / "run")  # another run (this process) holds it
    calls = []
    monkeypatch.setattr(sim.runner, "simulate", lambda *a, **k: calls.append(a))
    code, output = run("run", str(tiny(tmp_path)), "--out", str(out), "--quiet")
    assert code == 2 and "already exists" in output and calls == []


def _cli(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    root = Path(__file__).resolve().parents[2]
    env = os.environ | {"PYTHONPATH": str(root)}
    return subprocess.Popen(
        [sys.executable, "-c", "from sim.cli import app; app()", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_concurrent_runs_keep_both_results_or_refuse_the_second(tmp_path: Path) -> None:
    scenario = str(tiny(tmp_path))
    # Same --out: exactly one writes it, the other is refused (it never overwrites).
    procs = [_cli(["run", scenario, "--out", "same", "--quiet"], tmp_path) for _ in range(2)]
    results = [(p.wait(timeout=300), p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    assert sorted(code for code, _ in results) == [0, 2], results
    assert any("already exists" in out for code, out in results if code == 2)
    assert sorted(p.name for p in (tmp_path / "same").iterdir()) == [
        "block_map.npz",
        "requests.parquet",
        "scenario.yaml",
        "steps.parquet",
        "summary.json",
    ]
    # No --out: both get their own directory.
    procs = [_cli(["run", scenario, "--quiet"], tmp_path) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny-1", "tiny-2"]


def test_leftovers_of_a_killed_run_are_cleaned_and_never_listed(tmp_path: Path) -> None:
    from sim.results import list_runs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    runs = tmp_path / "runs"
    partial = runs / f".tiny-1.partial-{dead.pid}"
    partial.mkdir(parents=True)
    (partial / "summary.json").write_text("{}")  # SIGKILL after the first file
    claimed = runs / "tiny-1"
    claimed.mkdir()
    (claimed / ".kvsim-claim").write_text(f"{dead.pid}\n")  # SIGKILL while simulating
    assert list_runs(runs) == []
    code, output = run("run", str(tiny(tmp_path)), "--out", str(runs / "tiny-2"), "--quiet")
    assert code == 0, output
    assert sorted(p.name for p in runs.iterdir()) == ["tiny-2"]
    assert list_runs(runs) == [runs / "tiny-2"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["engine.kv_retention.policy=tool_latency"], "kv_retention: tool_latency"),
        (["fleet.replicas=2"], "fleet of 2 replicas behind a simulated round_robin router"),
        (
            ["engine.num_gpu_blocks_override=100000"],
            "engine.num_gpu_blocks_override=100000: 195.3 GiB of KV cache where H100-SXM-80GB",
        ),
    ],
)
def test_a_what_if_run_says_so_after_its_tables(
    tmp_path: Path, overrides: list[str], expected: str
) -> None:
    out = tmp_path / "run"
    args = ["run", str(DEFAULT_SCENARIO), "--out", str(out), "--quiet"]
    sets = [a for o in ["workload.sessions=4", *overrides] for a in ("--set", o)]
    code, output = run(*args, *sets)
    assert code == 0, output
    assert what_if_line(json.loads((out / "summary.json").read_text())) in output
    assert "the run is a what-if, not vLLM 0.32's own behaviour" in output and expected in output
    plain = ["run", str(DEFAULT_SCENARIO), "--out", str(tmp_path / "plain"), "--quiet"]
    code, output = run(*plain, "--set", "workload.sessions=4")
    assert code == 0 and "what-if" not in output


def test_trace_rows_skipped_as_too_long_are_counted_and_said(tmp_path: Path) -> None:
    path = trace_scenario(tmp_path, TRACE_ROWS + "0.7,5000,4\n")
    out = tmp_path / "run"
    code, output = run(
        "run", str(path), "--set", "workload.on_too_long=skip", "--out", str(out), "--quiet"
    )
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["num_requests"] == 2 and summary["trace_rows_skipped"] == 1
    assert too_long_line(summary) in output
    assert "skipped 1 of its trace's 3 rows, longer than max_model_len" in output
    whole = trace_scenario(tmp_path, TRACE_ROWS)
    code, output = run("run", str(whole), "--out", str(tmp_path / "whole"), "--quiet")
    assert code == 0 and "rows, longer than max_model_len" not in output


def test_open_loop_requests_cut_to_fit_max_model_len_are_counted_and_said(
    tmp_path: Path,
) -> None:
    workload = (
        "{kind: open_loop, num_requests: 6, prompt_tokens: {kind: fixed, value: 5000}, "
        "output_tokens: {kind: fixed, value: 8}}"
    )
    out = tmp_path / "run"
    code, output = run("run", str(tiny(tmp_path, workload=workload)), "--out", str(out), "--quiet")
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests_clipped"] == 6
    assert "cut 6 of its 6 requests to fit max_model_len" in output
    assert too_long_line(summary) in output


def test_scenarios_lists_the_readmes_table_with_fleets() -> None:
    code, output = run("scenarios")
    assert code == 0, output
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("| scenario | question |", 1)[1].split("\n\n", 1)[0]
    table = re.findall(r"^\| `([\w/.-]+\.yaml)` \|", section, flags=re.MULTILINE)
    assert "fleet/coding-agents-fleet-8b-h100.yaml" in table
    for name in table:
        assert f"{name}: " in output, name


def test_a_missing_scenario_names_the_shipped_ones_where_they_are(tmp_path: Path) -> None:
    output = refused(tmp_path, str(tmp_path / "nope.yaml"))
    assert f"the shipped scenarios, in {SCENARIO_DIR}: agent-burst.yaml" in output
    assert "fleet/coding-agents-fleet-8b-h100.yaml" in output


def test_an_error_message_is_text_not_rich_markup(tmp_path: Path) -> None:
    # "[/x]" would close a markup tag that was never opened: a MarkupError traceback.
    output = refused(tmp_path, str(tmp_path / "[/x]" / "s.yaml"))
    assert "/[/x]/s.yaml' is not a file" in output
