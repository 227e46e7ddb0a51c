"""The scenario's engine settings as vLLM engine arguments (no vLLM needed)."""

from __future__ import annotations

import pytest

from sim.scenario import SCENARIO_DIR, load_scenario
from validate import engine_args
from validate.engine_args import GIB, cpu_replay_dtype, engine_kwargs

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
