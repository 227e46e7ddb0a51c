import pytest

from sim.config.engine import EngineConfig
from sim.config.hardware import GIB, HARDWARE_PRESETS
from sim.config.model import MODEL_PRESETS
from sim.config.sizing import (
    CUDAGRAPH_RESERVE_BYTES,
    estimate_activation_peak_bytes,
    kv_cache_summary,
    size_deployable_kv_cache,
    size_kv_cache,
)

LLAMA_8B = MODEL_PRESETS["Llama-3.1-8B"]
LLAMA_70B = MODEL_PRESETS["Llama-3.1-70B"]
H100 = HARDWARE_PRESETS["H100-SXM-80GB"]
H200 = HARDWARE_PRESETS["H200-141GB"]


def make_engine(**overrides):
    return EngineConfig(**({"gpu_memory_utilization": 0.92, "block_size": 16} | overrides))


def test_llama_8b_on_h100():
    sizing = size_kv_cache(LLAMA_8B, H100, make_engine())
    assert sizing.budget_bytes == int(H100.hbm_bytes * 0.92)
    assert sizing.weight_bytes == 16_060_522_496
    # 8192 tokens x (4 x 4096 + 3 x 14336) x 2 bytes + 256 rows x 128256 x 4 bytes x 2 copies
    assert sizing.activation_peak_bytes == 973_078_528 + 262_668_288
    assert sizing.cudagraph_bytes == CUDAGRAPH_RESERVE_BYTES
    assert sizing.kv_cache_bytes == (
        sizing.budget_bytes
        - sizing.weight_bytes
        - sizing.activation_peak_bytes
        - sizing.cudagraph_bytes
    )
    assert 50 * GIB <= sizing.kv_cache_bytes <= 62 * GIB
    assert sizing.bytes_per_block == 131_072 * 16
    assert sizing.num_gpu_blocks == 28_541
    assert sizing.num_usable_blocks == 28_540
    assert sizing.max_tokens_in_kv == 456_640
    assert kv_cache_summary(sizing) == "28,540 blocks x 16 tokens = 456,640 tokens (55.7 GiB)"


def test_70b_on_one_h100_does_not_fit():
    with pytest.raises(ValueError) as info:
        size_kv_cache(LLAMA_70B, H100, make_engine())
    message = str(info.value)
    assert "131.4 GiB of weights" in message
    assert "tensor_parallel_size=1" in message
    assert "gpu_memory_utilization=0.92" in message
    assert "H100-SXM-80GB leaves 72.9 GiB" in message
    assert "raise tensor_parallel_size" in message


def test_70b_tp4_on_h200_fits():
    sizing = size_kv_cache(LLAMA_70B, H200, make_engine(tensor_parallel_size=4))
    assert sizing.weight_bytes == 35_276_853_248
    assert sizing.bytes_per_block == 81_920 * 16
    assert sizing.num_gpu_blocks == 76_750
    assert sizing.max_tokens_in_kv == 76_749 * 16


def test_activation_peak_scales_with_token_budget():
    small = estimate_activation_peak_bytes(LLAMA_8B, make_engine(max_num_batched_tokens=2048))
    large = estimate_activation_peak_bytes(LLAMA_8B, make_engine(max_num_batched_tokens=8192))
    assert large - small == 6144 * (4 * 4096 + 3 * 14336) * 2


def test_override_replaces_the_block_count():
    sizing = size_kv_cache(LLAMA_8B, H100, make_engine(num_gpu_blocks_override=2049))
    assert sizing.num_gpu_blocks == 2049
    assert sizing.num_usable_blocks == 2048
    assert sizing.max_tokens_in_kv == 2048 * 16
    # The derived terms are still reported.
    assert sizing.kv_cache_bytes == size_kv_cache(LLAMA_8B, H100, make_engine()).kv_cache_bytes


def test_a_deployment_refuses_an_override_beyond_the_memory_left_for_kv():
    # vLLM allocates override x bytes per block at startup: 28,541 blocks of 2 MiB fit the
    # 55.7 GiB an H100 leaves for Llama-3.1-8B's KV, one more would not.
    fits = make_engine(num_gpu_blocks_override=28_541)
    assert size_deployable_kv_cache(LLAMA_8B, H100, fits).num_gpu_blocks == 28_541
    too_many = make_engine(num_gpu_blocks_override=28_542)
    with pytest.raises(ValueError) as info:
        size_deployable_kv_cache(LLAMA_8B, H100, too_many)
    message = str(info.value)
    assert message.startswith(
        "engine.num_gpu_blocks_override=28542 needs 55.7 GiB of KV cache per GPU (28,542 "
        "blocks x 2,097,152 bytes at block_size=16), but Llama-3.1-8B on H100-SXM-80GB leaves "
        "55.7 GiB for it"
    )
    assert "lower it to 28,541 or less" in message
    # A simulation may still pin it (a what-if: the claims report's ample KV cache).
    assert size_kv_cache(LLAMA_8B, H100, too_many).num_gpu_blocks == 28_542
    # Without an override, the deployment is sized as vLLM sizes it.
    assert size_deployable_kv_cache(LLAMA_8B, H100, make_engine()) == size_kv_cache(
        LLAMA_8B, H100, make_engine()
    )


def test_override_still_needs_max_model_len_to_fit():
    engine = make_engine(num_gpu_blocks_override=100, max_model_len=1600)
    with pytest.raises(ValueError, match=r"max_model_len=1600 needs 100 KV blocks.*only 99"):
        size_kv_cache(LLAMA_8B, H100, engine)
    fits = make_engine(num_gpu_blocks_override=101, max_model_len=1600)
    assert size_kv_cache(LLAMA_8B, H100, fits).num_usable_blocks == 100


def test_max_model_len_too_large_raises():
    engine = make_engine(max_model_len=1_000_000)
    with pytest.raises(ValueError) as info:
        size_kv_cache(LLAMA_8B, H100, engine)
    message = str(info.value)
    assert "max_model_len=1000000 needs 62,500 KV blocks" in message
    assert "only 28,540 are available" in message
    assert "lower max_model_len to 456640 or less" in message


def test_too_few_blocks_raises():
    # Leave just under two 2 MiB blocks after weights, activations and CUDA graphs.
    engine = make_engine(max_model_len=16)
    sizing = size_kv_cache(LLAMA_8B, H100, engine)
    non_kv = sizing.weight_bytes + sizing.activation_peak_bytes + sizing.cudagraph_bytes
    hw = H100.model_copy(update={"hbm_bytes": non_kv + 2 * sizing.bytes_per_block - 1})
    with pytest.raises(ValueError, match=r"holds 1 blocks .* at least 2"):
        size_kv_cache(LLAMA_8B, hw, make_engine(max_model_len=16, gpu_memory_utilization=1.0))


def test_tp_that_does_not_divide_heads_raises():
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        size_kv_cache(LLAMA_70B, H200, make_engine(tensor_parallel_size=3))
