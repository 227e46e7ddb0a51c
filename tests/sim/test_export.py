"""`kvsim export`: a scenario's engine config as vllm serve args, vllm serve YAML or a Triton
model repository (vLLM's own parser reads them back in tests/validate/test_export_vllm.py)."""

from __future__ import annotations

import errno
import json
import os
import shlex
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from typer.testing import CliRunner

from sim import files
from sim.cli import app
from sim.config.sizing import size_kv_cache
from sim.errors import KvsimConfigError
from sim.export import (
    check_deployable,
    engine_args,
    export,
    serve_argv,
    serve_command,
    serve_yaml,
    served_model,
    triton_model_json,
)
from sim.scenario import SCENARIO_DIR, load_scenario
from tests.sim.test_files import half_written

runner = CliRunner()
FLEET = SCENARIO_DIR / "fleet-70b-tp4-h200.yaml"
CODING = SCENARIO_DIR / "coding-agents-8b-h100.yaml"
TINY = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
AGENT_FLEET = SCENARIO_DIR / "fleet" / "coding-agents-fleet-8b-h100.yaml"
PRIORITY = SCENARIO_DIR / "priority-mix.yaml"
TRACE_FLEET = SCENARIO_DIR / "fleet" / "mooncake-fleet-8b-h100.yaml"


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_engine_args_carry_every_scheduling_and_memory_setting_of_the_scenario() -> None:
    spec = load_scenario(FLEET, ["engine.enable_prefix_caching=false"])
    e = spec.engine
    assert engine_args(spec) == {
        "dtype": "bfloat16",
        "block_size": e.block_size,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "tensor_parallel_size": 4,
        "max_model_len": e.max_model_len,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": e.long_prefill_token_threshold,
        "enable_prefix_caching": False,
        "scheduling_policy": e.scheduling_policy,
        "watermark": 0.0,
        "async_scheduling": False,
    }
    # A pinned block count is exported too.
    assert engine_args(load_scenario(TINY))["num_gpu_blocks_override"] == 1024


def test_serve_argv_writes_booleans_as_vllms_optional_flags() -> None:
    argv = serve_argv(load_scenario(CODING, ["engine.enable_prefix_caching=false"]))
    assert argv[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B"]
    assert "--no-enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    assert argv[argv.index("--max-num-seqs") + 1] == "256"
    assert serve_argv(load_scenario(CODING), model="my/ckpt")[2] == "my/ckpt"


def test_a_local_model_config_is_served_from_its_folder() -> None:
    spec = load_scenario(TINY)
    assert served_model(spec) == str(Path(spec.model.source_path).parent)


def test_the_watermark_and_synchronous_scheduling_are_exported() -> None:
    argv = serve_argv(load_scenario(CODING, ["engine.watermark=0.05"]))
    assert argv[argv.index("--watermark") + 1] == "0.05"
    assert "--no-async-scheduling" in argv


def test_cli_prints_args_and_yaml_and_writes_each_format(tmp_path: Path) -> None:
    code, out = run("export", str(CODING), "--set", "engine.max_num_seqs=128")
    assert code == 0, out
    assert shlex.split(out)[:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B"]
    assert "--max-num-seqs 128" in out

    code, out = run("export", str(FLEET), "--format", "vllm-yaml")
    assert code == 0, out
    assert out.startswith("# vLLM engine config from kvsim scenario 'fleet-70b-tp4-h200'")
    assert yaml.safe_load(out)["tensor-parallel-size"] == 4

    script = tmp_path / "serve.sh"
    code, out = run("export", str(FLEET), "--format", "vllm-args", "--out", str(script))
    assert code == 0, out
    assert script.read_text().splitlines()[-1] == shlex.join(serve_argv(load_scenario(FLEET)))
    assert os.access(script, os.X_OK)


def test_triton_repository_parses_with_tritons_model_config_proto(tmp_path: Path) -> None:
    code, out = run("export", str(FLEET), "--format", "triton", "--out", str(tmp_path / "repo"))
    assert code == 0, out
    model_dir = tmp_path / "repo" / "fleet-70b-tp4-h200"
    config = text_format.Parse(
        (model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    assert config.name == "fleet-70b-tp4-h200" and config.backend == "vllm"
    assert config.model_transaction_policy.decoupled is True
    assert config.max_batch_size == 0
    assert config.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_MODEL
    assert {i.name for i in config.input} >= {"text_input", "stream", "sampling_parameters"}
    model_json = json.loads((model_dir / "1" / "model.json").read_text())
    spec = load_scenario(FLEET)
    assert model_json == {"model": "meta-llama/Llama-3.1-70B", **engine_args(spec)}


def test_a_run_directory_exports_the_scenario_it_ran(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    code, out = run(
        "run", str(CODING), "--set", "workload.sessions=2", "--set", "engine.max_num_seqs=64",
        "--out", str(run_dir), "--quiet",
    )  # fmt: skip
    assert code == 0, out
    code, out = run("export", str(run_dir))
    assert code == 0, out
    assert "--max-num-seqs 64" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "helm"], "--format 'helm': expected one of vllm-args, vllm-yaml, triton"),
        (["--format", "triton"], "--format triton writes a model repository: give --out"),
        (["--format", "vllm-yaml", "--out", "serve.txt"], "reads only .yaml or .yml files"),
        (["--set", "engine.max_num_seqs=0"], "engine.max_num_seqs"),
    ],
)
def test_bad_export_requests_are_one_clear_error(args: list[str], message: str) -> None:
    code, out = run("export", str(CODING), *args)
    assert code == 2
    assert message in " ".join(out.split()) and "Traceback" not in out


def test_export_never_overwrites_and_a_folder_must_be_a_run(tmp_path: Path) -> None:
    existing = tmp_path / "serve.sh"
    existing.write_text("mine")
    code, out = run("export", str(CODING), "--out", str(existing))
    assert code == 2 and "already exists" in out and existing.read_text() == "mine"
    with pytest.raises(FileExistsError):
        export(load_scenario(CODING), "triton", tmp_path)
    code, out = run("export", str(tmp_path))
    assert code == 2 and "without scenario.yaml" in " ".join(out.split())


def test_a_cpu_offload_tier_is_exported_as_vllms_own_flag() -> None:
    # vLLM 0.32 runs the offloading connector itself: the deployment is the simulated one.
    spec = load_scenario(CODING, ["engine.kv_offload_gib=64"])
    args = engine_args(spec)
    assert args["kv_offloading_size"] == 64 and args["kv_offloading_backend"] == "native"
    argv = serve_argv(spec)
    at = argv.index("--kv-offloading-size")
    assert argv[at + 1] == "64.0"
    assert argv[argv.index("--kv-offloading-backend") + 1] == "native"
    assert "kv_offloading_size" not in engine_args(load_scenario(CODING))


@pytest.mark.parametrize(
    "sets",
    [
        ["engine.preemption_mode=swap", "engine.swap_space_gib=4"],
        ["engine.allocator=static"],
    ],
)
def test_a_what_if_policy_is_not_exported(sets: list[str], tmp_path: Path) -> None:
    spec = load_scenario(CODING, sets)
    with pytest.raises(KvsimConfigError, match=r"vLLM 0\.32 has no such policy"):
        engine_args(spec)
    out = tmp_path / "serve.sh"
    args = [f"--set={s}" for s in sets]
    result = runner.invoke(
        app, ["export", str(CODING), *args, "--format", "vllm-args", "--out", str(out)]
    )
    assert result.exit_code == 2
    assert "drop the policy to export" in " ".join(result.output.split())
    assert not out.exists()


def one_line(text: str) -> str:
    return " ".join(text.split()).replace("# ", "")


def test_a_fleets_replicas_and_router_are_in_every_format(tmp_path: Path) -> None:
    # vLLM serves one engine: the 4 replicas and the session-affinity router the results
    # depend on are the user's to deploy, and every format says so.
    fleet_note = (
        "kvsim simulated 4 replicas of this engine behind a session_affinity router "
        "(view_delay_s=0.0, load_factor=1.25, virtual_nodes=100), a what-if: vLLM 0.32 "
        "serves one engine, and the router was kvsim's model of one."
    )
    deploy = "run 4 engines with it and deploy a session_affinity router in front of them"
    code, out = run("export", str(AGENT_FLEET))
    assert code == 0, out
    assert fleet_note in one_line(out) and deploy in one_line(out) and "llm-d" in out
    spec = load_scenario(AGENT_FLEET)
    assert out.splitlines()[-1] == shlex.join(serve_argv(spec))

    script = tmp_path / "serve.sh"
    assert run("export", str(AGENT_FLEET), "--out", str(script))[0] == 0
    text = script.read_text()
    assert "simulated on 1 x H100-SXM-80GB per replica, 4 replicas" in text
    assert fleet_note in one_line(text)

    config = tmp_path / "serve.yaml"
    assert run("export", str(AGENT_FLEET), "--format", "vllm-yaml", "--out", str(config))[0] == 0
    assert fleet_note in one_line(config.read_text()) and deploy in one_line(config.read_text())
    keys = {name.replace("_", "-"): value for name, value in engine_args(spec).items()}
    assert yaml.safe_load(config.read_text()) == keys

    repo = tmp_path / "repo"
    assert run("export", str(AGENT_FLEET), "--format", "triton", "--out", str(repo))[0] == 0
    pbtxt = (repo / "coding-agents-fleet-8b-h100" / "config.pbtxt").read_text()
    assert fleet_note in one_line(pbtxt) and deploy in one_line(pbtxt)
    assert text_format.Parse(pbtxt, model_config_pb2.ModelConfig()).backend == "vllm"

    # One engine under FCFS: the command line alone, as before.
    code, out = run("export", str(CODING))
    assert code == 0 and out.count("\n") == 1 and out.startswith("vllm serve ")


def test_a_pinned_block_count_beyond_the_gpus_memory_is_not_exported(tmp_path: Path) -> None:
    # vLLM allocates override x 2 MiB at startup: 100,000 blocks are 195 GiB on an 80 GB H100.
    spec = load_scenario(CODING, ["engine.num_gpu_blocks_override=100000"])
    with pytest.raises(KvsimConfigError, match=r"num_gpu_blocks_override=100000 needs 195\.3 GiB"):
        check_deployable(spec)
    for build in (serve_argv, serve_yaml, triton_model_json):
        with pytest.raises(KvsimConfigError, match="would run out of memory at startup"):
            build(spec)
    # The mapping itself (kvsim replay's too: vLLM's CPU backend gets the KV space the
    # blocks need) and the simulation (a what-if) still take it.
    assert engine_args(spec)["num_gpu_blocks_override"] == 100_000
    assert size_kv_cache(spec.model, spec.hardware, spec.engine).num_gpu_blocks == 100_000
    out = tmp_path / "serve.sh"
    code, output = run(
        "export", str(CODING), "--set", "engine.num_gpu_blocks_override=100000", "--out", str(out)
    )
    message = " ".join(output.split())
    assert code == 2 and not out.exists()
    assert "but Llama-3.1-8B on H100-SXM-80GB leaves 55.7 GiB for it" in message
    assert "lower it to 28,541 or less" in message
    fits = load_scenario(CODING, ["engine.num_gpu_blocks_override=28541"])
    assert "--num-gpu-blocks-override 28541" in serve_command(fits)


def test_the_dtype_kvsim_simulated_is_exported(tmp_path: Path) -> None:
    # vLLM's dtype "auto" would run a float32 checkpoint in 16 bits on a GPU, while kvsim
    # sized its weights and KV at 4 bytes.
    raw = json.loads((Path(load_scenario(TINY).model.source_path)).read_text())
    model_dir = tmp_path / "tiny-fp32"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(raw | {"torch_dtype": "float32"}))
    spec = load_scenario(TINY, [f"model={model_dir / 'config.json'}"])
    assert spec.model.dtype_bytes == 4
    argv = serve_argv(spec)
    assert argv[3:5] == ["--dtype", "float32"]
    assert yaml.safe_load(serve_yaml(spec))["dtype"] == "float32"
    (_, model_json) = export(spec, "triton", tmp_path / "repo")
    assert json.loads(model_json.read_text())["dtype"] == "float32"
    assert serve_argv(load_scenario(CODING))[3:5] == ["--dtype", "bfloat16"]


def test_the_priority_policy_tells_clients_to_send_each_requests_priority(
    tmp_path: Path,
) -> None:
    note = (
        "clients must send each request's priority (the 'priority' field of vLLM's "
        "OpenAI-compatible API; a lower value is served first, default 0), as simulated: "
        "0 for interactive (30% of the sessions), 1 for background (70%)"
    )
    spec = load_scenario(PRIORITY)
    assert note in one_line(serve_command(spec)) and note in one_line(serve_yaml(spec))
    code, out = run("export", str(PRIORITY))
    assert code == 0 and note in one_line(out)
    script = tmp_path / "serve.sh"
    assert run("export", str(PRIORITY), "--out", str(script))[0] == 0
    assert note in one_line(script.read_text())
    # Under FCFS vLLM ignores priorities: no note.
    assert "priority" not in serve_command(
        load_scenario(PRIORITY, ["engine.scheduling_policy=fcfs"])
    )


def test_triton_warns_that_its_backend_sends_no_priority(tmp_path: Path) -> None:
    # Triton's vLLM backend calls generate without a priority: every request runs at 0.
    repo = tmp_path / "repo"
    code, out = run("export", str(PRIORITY), "--format", "triton", "--out", str(repo))
    assert code == 0, out
    warning = "Triton's vLLM backend passes no per-request priority to the engine"
    assert "warning: scheduling_policy priority, but " + warning in one_line(out)
    pbtxt = (repo / "priority-mix" / "config.pbtxt").read_text()
    assert pbtxt.startswith("# WARNING: scheduling_policy priority, but Triton's vLLM")
    assert warning in one_line(pbtxt) and "first come first served" in one_line(pbtxt)
    assert text_format.Parse(pbtxt, model_config_pb2.ModelConfig()).name == "priority-mix"
    model_json = json.loads((repo / "priority-mix" / "1" / "model.json").read_text())
    assert model_json["scheduling_policy"] == "priority"
    # FCFS: no warning.
    code, out = run("export", str(CODING), "--format", "triton", "--out", str(tmp_path / "r2"))
    assert code == 0 and "warning" not in out.lower()


def test_an_export_does_not_read_the_workloads_trace() -> None:
    # The engine config needs the model, hardware and engine sections only.
    spec = load_scenario(TRACE_FLEET)
    assert not Path(spec.workload.path).exists()
    assert serve_argv(spec)[2] == "meta-llama/Llama-3.1-8B"
    assert "--max-num-batched-tokens 2048" in serve_command(spec)


def test_cli_exports_a_trace_scenario_without_its_trace() -> None:
    code, out = run("export", str(TRACE_FLEET))
    assert code == 0, out


def test_an_empty_model_name_is_refused() -> None:
    code, out = run("export", str(CODING), "--model", "")
    assert code == 2 and "--model '': give the hub name or path" in out


@pytest.mark.parametrize(
    ("fmt", "name"), [("vllm-args", "serve.sh"), ("vllm-yaml", "serve.yaml"), ("triton", "repo")]
)
def test_an_export_that_fails_half_way_leaves_nothing_to_block_the_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, name: str
) -> None:
    out = tmp_path / name
    with monkeypatch.context() as patch:
        patch.setattr(files, "_write_all", half_written(errno.ENOSPC))
        code, text = run("export", str(CODING), "--format", fmt, "--out", str(out))
    assert code == 2 and "No space left on device" in text and "Traceback" not in text
    assert os.listdir(tmp_path) == []  # no half file or repository, no temporary
    code, text = run("export", str(CODING), "--format", fmt, "--out", str(out))
    assert code == 0, text
    if fmt == "vllm-args":
        assert os.access(out, os.X_OK)
