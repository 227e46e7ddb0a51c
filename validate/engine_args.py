"""The scenario's engine settings as vLLM engine arguments (same names, same meaning)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from sim.config.model import DTYPE_BYTES
from sim.config.sizing import size_kv_cache
from sim.errors import KvsimConfigError
from sim.export import engine_args as export_engine_args
from sim.scenario import Scenario

GIB = 1 << 30
# CPU flags with native bfloat16 matrix math (x86). Without them, torch runs bfloat16 GEMMs
# emulated: measured on a 2-core AVX2-only AMD EPYC with the tiny model, decode steps ~5x and
# the first step of every new token count ~15x slower than in float32, which turned the
# six-round CI validation (~25 min on AVX-512 machines) into more than two hours.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_replay_dtype(cpuinfo: str | None = None) -> str:
    """The dtype the CPU replay runs in: ``bfloat16`` where the CPU has native bfloat16 math
    (``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's flags), ``float32`` elsewhere.

    The dtype changes step times, not scheduling: the KV cache is sized by
    ``num_gpu_blocks_override`` or kvsim's own sizing, and a profile is fitted on the machine
    that replays. Each measured run's summary records the dtype it ran in.
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "bfloat16"  # not Linux (e.g. Apple silicon): vLLM's own default there
    flags = {
        flag
        for line in cpuinfo.splitlines()
        if line.split(":", 1)[0].strip() == "flags"
        for flag in line.split(":", 1)[1].split()
    }
    return "bfloat16" if flags & NATIVE_BF16_FLAGS else "float32"


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
    if scenario.fleet is not None:
        raise KvsimConfigError(
            f"fleet.replicas={scenario.fleet.replicas}: a replay drives one vLLM engine, and "
            "routers exist only in the simulator; remove the fleet section to replay (or "
            "validate) one replica's engine"
        )
    if what_if := scenario.engine.policies_vllm_lacks():
        raise KvsimConfigError(
            f"engine: {'; '.join(what_if)}: a replay runs vLLM 0.32 itself, which has no such "
            "policy; drop it to replay (or validate) the scenario"
        )
    if (gib := scenario.engine.kv_offload_gib) is not None:
        raise KvsimConfigError(
            f"engine.kv_offload_gib={gib:g}: kvsim's replay records vLLM's scheduler without "
            "a KV connector, and vLLM's offloading connector needs a CUDA or XPU GPU; "
            "remove engine.kv_offload_gib to replay (or validate) the scenario"
        )
    e = scenario.engine
    # The scenario's engine settings, named as kvsim exports them for rollout (one mapping),
    # plus what a replay needs: the recording scheduler, the seed, stats on.
    kwargs: dict[str, Any] = {
        "model": model,
        **export_engine_args(scenario),
        "scheduler_cls": "validate.recording_scheduler.RecordingScheduler",
        "seed": scenario.seed,
        "disable_log_stats": False,
    }
    env: dict[str, str] = {}
    if device == "cpu":
        if e.block_size % 32:
            raise KvsimConfigError(
                f"engine.block_size={e.block_size}: vLLM's CPU backend needs a multiple of 32"
            )
        dtype = cpu_replay_dtype()
        kwargs.update(
            load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype=dtype
        )
        sizing = size_kv_cache(scenario.model, scenario.hardware, e)
        # The cache holds kvsim's block count in the replay's dtype, not the model's.
        widen = DTYPE_BYTES[dtype] / scenario.model.dtype_bytes
        kv_bytes = sizing.num_gpu_blocks * sizing.bytes_per_block * max(widen, 1.0)
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
