"""`kvsim export`: a scenario's engine config as vllm serve args, vllm serve YAML or a Triton
model repository (vLLM's own parser reads them back in tests/validate/test_export_vllm.py)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest
import yaml
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2
from typer.testing import CliRunner

from sim.cli import app
from sim.errors import KvsimConfigError
from sim.export import engine_args, export, serve_argv, served_model
from sim.scenario import SCENARIO_DIR, load_scenario

runner = CliRunner()
FLEET = SCENARIO_DIR / "fleet-70b-tp4-h200.yaml"
CODING = SCENARIO_DIR / "coding-agents-8b-h100.yaml"
TINY = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.output


def test_engine_args_carry_every_scheduling_and_memory_setting_of_the_scenario() -> None:
    spec = load_scenario(FLEET, ["engine.enable_prefix_caching=false"])
    e = spec.engine
    assert engine_args(spec) == {
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
