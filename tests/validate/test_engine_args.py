"""The scenario's engine settings as vLLM engine arguments (no vLLM needed)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from sim.errors import KvsimConfigError
from sim.scenario import SCENARIO_DIR, load_scenario
from validate import engine_args
from validate.engine_args import (
    GIB,
    cpu_replay_dtype,
    engine_kwargs,
    load_format_of,
    resolve_model_dir,
)

AVX2_ONLY = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n"
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: avx2 avx512f amx_bf16 amx_tile\n"


@pytest.mark.parametrize(
    ("cpuinfo", "dtype"),
    [
        (AVX2_ONLY, "float32"),
        (ZEN4, "bfloat16"),
        (SAPPHIRE_RAPIDS, "bfloat16"),
        # AVX-512 without its bf16 extension (Skylake) still emulates bfloat16.
        ("flags\t\t: avx2 avx512f avx512bw\n", "float32"),
        # A flag-like word outside the flags line does not count.
        ("model name\t: avx512_bf16 lookalike\nflags\t\t: avx2\n", "float32"),
    ],
)
def test_the_cpu_replay_runs_bfloat16_only_where_the_cpu_has_it_natively(
    cpuinfo: str, dtype: str
) -> None:
    assert cpu_replay_dtype(cpuinfo) == dtype


@pytest.mark.parametrize(("dtype", "widen"), [("bfloat16", 1), ("float32", 2)])
def test_the_cpu_kv_cache_space_holds_kvsims_blocks_in_the_replay_dtype(
    monkeypatch: pytest.MonkeyPatch, dtype: str, widen: int
) -> None:
    monkeypatch.setattr(engine_args, "cpu_replay_dtype", lambda: dtype)
    # 80,000 blocks of the tiny model (bfloat16: 64 KiB each): 4.9 GiB, 9.8 GiB in float32.
    scenario = load_scenario(
        SCENARIO_DIR / "validation" / "agentic-multiturn.yaml",
        ["engine.num_gpu_blocks_override=80000"],
    )
    kwargs, env = engine_kwargs(scenario, "cpu", "tiny")
    assert kwargs["dtype"] == dtype
    block_bytes = scenario.engine.block_size * scenario.model.kv_bytes_per_token()
    expected = -(-80_000 * block_bytes * widen // GIB) + 1
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(expected)


def test_a_fleet_scenario_is_refused_for_replay_naming_the_field() -> None:
    from sim.errors import KvsimConfigError

    scenario = load_scenario(
        SCENARIO_DIR / "validation" / "agentic-multiturn.yaml", ["fleet.replicas=2"]
    )
    with pytest.raises(KvsimConfigError, match=r"fleet\.replicas=2: a replay drives one vLLM"):
        engine_kwargs(scenario, "cpu", "tiny")


def test_an_offload_scenario_is_refused_for_replay_naming_the_field() -> None:
    from sim.errors import KvsimConfigError

    scenario = load_scenario(
        SCENARIO_DIR / "validation" / "agentic-multiturn.yaml", ["engine.kv_offload_gib=4"]
    )
    with pytest.raises(KvsimConfigError, match=r"engine\.kv_offload_gib=4: kvsim's replay"):
        engine_kwargs(scenario, "cpu", "tiny")


TINY_CONFIG = Path(engine_args.__file__).parent / "models" / "tiny-llama" / "config.json"
AGENTIC = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"


def model_folder(parent: Path, weights: tuple[str, ...]) -> Path:
    """A copy of the tiny model's config.json, with empty files of the names ``weights``."""
    folder = parent / "my-model"
    folder.mkdir()
    shutil.copy(TINY_CONFIG, folder / "config.json")
    for name in weights:
        (folder / name).write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    ("weights", "load_format"),
    [
        ((), "dummy"),
        (("model.safetensors",), "auto"),
        (("pytorch_model.bin",), "auto"),
        (("consolidated.pt",), "auto"),
        (("model.safetensors.index.json",), "auto"),
        (("tokenizer.json", "generation_config.json"), "dummy"),
    ],
)
def test_on_cuda_dummy_weights_load_only_from_a_folder_without_weight_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, weights: tuple[str, ...], load_format: str
) -> None:
    folder = model_folder(tmp_path, weights)
    # The scenario's model is that folder's config.json: however --model spells the folder
    # (or leaves it out), its files decide, not the spelling.
    scenario = load_scenario(AGENTIC, [f"model={folder / 'config.json'}"])
    monkeypatch.chdir(tmp_path)
    spellings = [None, str(folder), f"{folder}/", str(folder / "config.json"), "./my-model"]
    for spelling in spellings:
        model_dir = resolve_model_dir(scenario, spelling)
        assert model_dir == str(folder.resolve())
        kwargs, _ = engine_kwargs(scenario, "cuda", model_dir)
        assert load_format_of(kwargs) == load_format, spelling
        assert kwargs["skip_tokenizer_init"] is True
    # A hub name loads its weights; a CPU replay always runs the dummy-weight tiny config.
    hub, _ = engine_kwargs(scenario, "cuda", "meta-llama/Llama-3.1-8B-Instruct")
    assert load_format_of(hub) == "auto" and "skip_tokenizer_init" not in hub
    cpu, _ = engine_kwargs(scenario, "cpu", str(folder))
    assert load_format_of(cpu) == "dummy"


def test_a_model_path_that_does_not_exist_or_holds_no_config_is_refused_naming_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario = load_scenario(AGENTIC)
    monkeypatch.setenv("HOME", str(tmp_path))
    for missing in (
        "/nonexistent",
        "./no-such-model",
        "~/no-such-model",
        "/nonexistent/config.json",
    ):
        with pytest.raises(
            KvsimConfigError, match=rf"--model {re.escape(missing)}: no such folder"
        ):
            resolve_model_dir(scenario, missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(KvsimConfigError, match=r"--model .*empty: the folder .* holds no config"):
        resolve_model_dir(scenario, str(tmp_path / "empty"))
    # A name that is not a path is a hub name, for vLLM to fetch on a GPU box.
    assert resolve_model_dir(scenario, "meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    # ~ is expanded: vLLM would not.
    model_folder(tmp_path, ())
    assert resolve_model_dir(scenario, "~/my-model") == str((tmp_path / "my-model").resolve())


def test_a_workload_vocabulary_larger_than_the_models_is_refused_naming_both() -> None:
    scenario = load_scenario(AGENTIC, ["workload.vocab_size=5000"])
    with pytest.raises(
        KvsimConfigError, match=r"workload\.vocab_size=5000 exceeds model\.vocab_size=4096"
    ):
        engine_kwargs(scenario, "cuda", "tiny")
    engine_kwargs(load_scenario(AGENTIC, ["workload.vocab_size=4096"]), "cpu", "tiny")
