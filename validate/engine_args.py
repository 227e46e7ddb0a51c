"""The scenario's engine settings as vLLM engine arguments (same names, same meaning)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sim.config.sizing import size_kv_cache
from sim.errors import KvsimConfigError
from sim.scenario import Scenario

GIB = 1 << 30


def resolve_model_dir(scenario: Scenario, model: str | None) -> str:
    """What vLLM loads: ``--model`` if given, else the folder of the scenario's config.json."""
    if model:
        path = Path(model)
        return str(path.parent if path.name == "config.json" else path)
    if scenario.model.source_path:
        return str(Path(scenario.model.source_path).parent)
    raise KvsimConfigError(
        f"scenario {scenario.name!r}: model {scenario.model.name!r} is a preset, not a local "
        "config; pass --model PATH_OR_NAME (a local model folder, or a hub name on a GPU box)"
    )


def engine_kwargs(
    scenario: Scenario, device: str, model: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """``EngineArgs`` keyword arguments and the environment variables the device needs."""
    e = scenario.engine
    kwargs: dict[str, Any] = {
        "model": model,
        "block_size": e.block_size,
        "max_model_len": e.max_model_len,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "enable_chunked_prefill": e.enable_chunked_prefill,
        "long_prefill_token_threshold": e.long_prefill_token_threshold,
        "enable_prefix_caching": e.enable_prefix_caching,
        "scheduling_policy": e.scheduling_policy,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "tensor_parallel_size": e.tensor_parallel_size,
        "num_gpu_blocks_override": e.num_gpu_blocks_override,
        "scheduler_cls": "validate.recording_scheduler.RecordingScheduler",
        "seed": scenario.seed,
        "disable_log_stats": False,
        # Conformance runs with async scheduling off (it is off on CPU anyway).
        "async_scheduling": False,
    }
    env: dict[str, str] = {}
    if device == "cpu":
        if e.block_size % 32:
            raise KvsimConfigError(
                f"engine.block_size={e.block_size}: vLLM's CPU backend needs a multiple of 32"
            )
        kwargs.update(
            load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16"
        )
        sizing = size_kv_cache(scenario.model, scenario.hardware, e)
        kv_bytes = sizing.num_gpu_blocks * sizing.bytes_per_block
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_bytes / GIB) + 1))
    elif device == "cuda":
        if Path(model).exists():
            kwargs.update(skip_tokenizer_init=True)
        if (
            scenario.model.source_path is not None
            and Path(model) == Path(scenario.model.source_path).parent
        ):
            kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    else:
        raise KvsimConfigError(f"--device {device!r}: expected cpu or cuda")
    return kwargs, env
