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


# Files that hold a model's weights (or index them): a local model folder without any is a
# config only, which a replay loads with dummy weights.
WEIGHT_FILE_PATTERNS = (
    "*.safetensors",
    "pytorch_model*.bin",  # not training_args.bin, which a config-only copy may carry
    "model*.bin",
    "*.pt",
    "*.index.json",
)


def looks_like_path(model: str) -> bool:
    """Whether ``--model`` names a local path, not a hub name: absolute, starting with ``.``
    or ``~``, or a file or folder that exists."""
    return (
        Path(model).is_absolute()
        or model.startswith((".", "~"))
        or Path(model).expanduser().exists()
    )


def local_model_folder(model: str) -> Path:
    """The folder ``--model`` names (its config.json's folder when it names the file),
    resolved; refuses one that does not exist or holds no config.json."""
    path = Path(model).expanduser()
    folder = path.parent if path.name == "config.json" else path
    if not folder.is_dir():
        raise KvsimConfigError(
            f"--model {model}: no such folder; give a local model folder holding config.json "
            "(with or without weights), or a hub name such as org/model on a GPU box"
        )
    if not (folder / "config.json").is_file():
        raise KvsimConfigError(
            f"--model {model}: the folder {folder} holds no config.json, which vLLM and kvsim "
            "read the model's shape from; give the folder of a Hugging Face model"
        )
    return folder.resolve()


def resolve_model_dir(scenario: Scenario, model: str | None) -> str:
    """What vLLM loads: ``--model`` if given (a local folder, resolved, or a hub name), else
    the folder of the scenario's config.json."""
    if model:
        return str(local_model_folder(model)) if looks_like_path(model) else model
    if scenario.model.source_path:
        return str(Path(scenario.model.source_path).parent)
    raise KvsimConfigError(
        f"scenario {scenario.name!r}: model {scenario.model.name!r} is a preset, not a local "
        "config; pass --model PATH_OR_NAME (a local model folder, or a hub name on a GPU box)"
    )


def holds_weights(folder: Path) -> bool:
    """Whether a local model folder holds weight files (:data:`WEIGHT_FILE_PATTERNS`)."""
    return any(next(folder.glob(pattern), None) is not None for pattern in WEIGHT_FILE_PATTERNS)


def load_format_of(kwargs: dict[str, Any]) -> str:
    """How vLLM loads the weights under these engine arguments: ``dummy`` or ``auto``."""
    return str(kwargs.get("load_format", "auto"))


def check_vocab(scenario: Scenario) -> None:
    """Refuse token ids the model has no embedding row for (under ``skip_tokenizer_init``
    vLLM does not check them: on CUDA a device-side assert mid-run)."""
    drawn, rows = scenario.workload.vocab_size, scenario.model.vocab_size
    if drawn > rows:
        raise KvsimConfigError(
            f"workload.vocab_size={drawn} exceeds model.vocab_size={rows} of "
            f"{scenario.model.name!r}: a replay would send token ids past the model's "
            f"embedding table; set workload.vocab_size to at most {rows}"
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
    check_vocab(scenario)
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
        folder = Path(model).expanduser()
        if folder.is_dir():  # a local folder: dummy weights only when it holds none
            kwargs.update(skip_tokenizer_init=True)
            if not holds_weights(folder):
                kwargs.update(load_format="dummy")
    else:
        raise KvsimConfigError(f"--device {device!r}: expected cpu or cuda")
    return kwargs, env
