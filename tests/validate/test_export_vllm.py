"""`kvsim export` output read back by the installed vLLM's own argument parser."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sim.export import engine_args, export, serve_argv
from sim.scenario import SCENARIO_DIR, load_scenario

pytestmark = pytest.mark.vllm

SCENARIOS = [
    (
        SCENARIO_DIR / "fleet-70b-tp4-h200.yaml",
        ["engine.enable_prefix_caching=false", "engine.watermark=0.05"],
    ),
    (SCENARIO_DIR / "priority-mix.yaml", ["engine.kv_offload_gib=64"]),
    (SCENARIO_DIR / "validation" / "open-loop-burst.yaml", []),
    # A fleet: the YAML opens with comment lines (the replicas and the router).
    (SCENARIO_DIR / "fleet" / "coding-agents-fleet-8b-h100.yaml", []),
]


def serve_parser() -> Any:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser())


def assert_engine_args(parsed: Any, expected: dict[str, Any]) -> None:
    for name, value in expected.items():
        assert getattr(parsed, name) == value, name


@pytest.mark.parametrize(("path", "overrides"), SCENARIOS, ids=lambda p: getattr(p, "stem", ""))
def test_vllm_serve_parses_the_exported_args_and_yaml(
    path: Path, overrides: list[str], tmp_path: Path
) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    spec = load_scenario(path, overrides)
    expected = engine_args(spec)
    argv = serve_argv(spec)
    args = serve_parser().parse_args(argv[2:])  # after "vllm serve"
    assert args.model_tag == argv[2]
    assert_engine_args(AsyncEngineArgs.from_cli_args(args), expected)

    config = tmp_path / "serve.yaml"
    export(spec, "vllm-yaml", config)
    args = serve_parser().parse_args([argv[2], "--config", str(config)])
    assert_engine_args(AsyncEngineArgs.from_cli_args(args), expected)

    repo = tmp_path / "repo"
    (_, model_json) = export(spec, "triton", repo)
    # Triton's vLLM backend: AsyncEngineArgs(**json.load(model.json)).
    loaded = AsyncEngineArgs(**json.loads(model_json.read_text()))
    assert loaded.model == argv[2]
    assert_engine_args(loaded, expected)


def test_vllm_runs_the_dtype_kvsim_simulated(tmp_path: Path) -> None:
    # A float32 checkpoint: vLLM's default dtype "auto" would downcast it to 16 bits on a
    # GPU ("Downcast for float32 models"), while kvsim sized its weights and KV at 4 bytes.
    import torch
    from vllm.config.model import _STR_DTYPE_TO_TORCH_DTYPE
    from vllm.engine.arg_utils import AsyncEngineArgs

    tiny = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
    raw = json.loads(Path(load_scenario(tiny).model.source_path or "").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"torch_dtype": "float32"}))
    spec = load_scenario(tiny, [f"model={tmp_path / 'config.json'}"])
    argv = serve_argv(spec)
    parsed = AsyncEngineArgs.from_cli_args(serve_parser().parse_args(argv[2:]))
    assert parsed.dtype == "float32"
    # An explicit dtype is taken as given (only "auto" downcasts).
    assert _STR_DTYPE_TO_TORCH_DTYPE[parsed.dtype] == torch.float32
    (_, model_json) = export(spec, "triton", tmp_path / "repo")
    assert AsyncEngineArgs(**json.loads(model_json.read_text())).dtype == "float32"
