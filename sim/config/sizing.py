"""How many KV blocks vLLM gets on one GPU: the memory budget, term by term.

vLLM's V1 worker profiles a forward pass at ``max_num_batched_tokens`` tokens, then gives the
KV cache ``total_memory * gpu_memory_utilization - weights - activation peak - CUDA graphs and
other non-torch memory`` and divides by the page size. The sim cannot profile, so the two
middle terms are estimates with named constants; calibration against a real startup log
replaces them. :func:`size_deployable_kv_cache` also checks that a pinned block count
(``num_gpu_blocks_override``) fits that budget, as a deployment needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.config.engine import EngineConfig
from sim.config.hardware import GIB, Hardware
from sim.config.limits import MAX_NUM_GPU_BLOCKS
from sim.config.model import ModelGeometry
from sim.errors import KvsimConfigError

# Full-width (hidden_size) activations alive at the peak of one layer: the residual, the
# normed input, the attention output and the o_proj/all-reduce output. Not sharded by TP,
# because every rank holds the full residual stream.
ACTIVATION_HIDDEN_BUFFERS = 4
# MLP intermediates alive together: gate_up_proj's output (2 x intermediate) and SiluAndMul's
# output (1 x intermediate), each sharded by TP. This dominates the profile-run peak.
ACTIVATION_INTERMEDIATE_BUFFERS = 3
# The profile run also samples one row per request (max_num_seqs rows): logits are cast to
# fp32 and the sampler makes one more fp32 copy of the same size (probabilities).
LOGITS_FP32_BYTES = 4
LOGITS_COPIES = 2
# Memory vLLM keeps out of the KV cache beyond weights and torch activations: the CUDA graph
# pool plus non-torch allocations (CUDA context, cuBLAS workspaces, NCCL buffers). vLLM
# startup logs show 0.5 to 1.8 GiB on one GPU; 1 GiB is a middle default.
CUDAGRAPH_RESERVE_BYTES = 1 * GIB

# Block 0 is vLLM's null block (padding in block tables); it never holds KV.
NUM_NULL_BLOCKS = 1


@dataclass(frozen=True)
class KVSizing:
    """Every term of the KV budget of one GPU, in bytes unless named otherwise."""

    hbm_bytes: int
    gpu_memory_utilization: float
    budget_bytes: int  # hbm_bytes * gpu_memory_utilization
    weight_bytes: int
    activation_peak_bytes: int
    cudagraph_bytes: int
    kv_cache_bytes: int  # budget left for KV after the three terms above
    block_size: int  # tokens per block
    kv_bytes_per_token: int
    bytes_per_block: int
    num_gpu_blocks: int  # including the null block; num_gpu_blocks_override if set
    num_usable_blocks: int  # num_gpu_blocks - 1
    max_tokens_in_kv: int  # num_usable_blocks * block_size


def estimate_activation_peak_bytes(model: ModelGeometry, engine: EngineConfig) -> int:
    """Peak torch activation memory of vLLM's profile run at ``max_num_batched_tokens``."""
    tp = engine.tensor_parallel_size
    per_token_elements = (
        ACTIVATION_HIDDEN_BUFFERS * model.hidden_size
        + ACTIVATION_INTERMEDIATE_BUFFERS * model.intermediate_size // tp
    )
    hidden_bytes = engine.max_num_batched_tokens * per_token_elements * model.dtype_bytes
    # The logits are gathered to the full vocabulary on every rank before sampling.
    logits_bytes = engine.max_num_seqs * model.vocab_size * LOGITS_FP32_BYTES * LOGITS_COPIES
    return hidden_bytes + logits_bytes


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def size_kv_cache(model: ModelGeometry, hardware: Hardware, engine: EngineConfig) -> KVSizing:
    """Size the KV cache of one GPU as vLLM does at startup, or raise as vLLM would.

    Raises ``KvsimConfigError`` (a ``ValueError``) when the weights, activations and CUDA
    graphs do not fit the budget, when fewer than 2 blocks remain, or when one request of
    ``max_model_len`` tokens could not fit in the usable blocks.
    """
    tp = engine.tensor_parallel_size
    util = engine.gpu_memory_utilization
    kv_bytes_per_token = model.kv_bytes_per_token(tp)  # also checks that tp divides the heads
    bytes_per_block = kv_bytes_per_token * engine.block_size
    budget_bytes = int(hardware.hbm_bytes * util)
    weight_bytes = model.weight_bytes(tp)
    activation_peak_bytes = estimate_activation_peak_bytes(model, engine)
    non_kv_bytes = weight_bytes + activation_peak_bytes + CUDAGRAPH_RESERVE_BYTES
    # Checked even with num_gpu_blocks_override: vLLM could not load the weights at all.
    if non_kv_bytes > budget_bytes:
        raise KvsimConfigError(
            f"model {model.name} needs {_gib(non_kv_bytes)} per GPU at tensor_parallel_size="
            f"{tp} ({_gib(weight_bytes)} of weights + {_gib(activation_peak_bytes)} "
            f"activation peak at max_num_batched_tokens={engine.max_num_batched_tokens} + "
            f"{_gib(CUDAGRAPH_RESERVE_BYTES)} CUDA graphs), but gpu_memory_utilization={util} "
            f"of {hardware.name} leaves {_gib(budget_bytes)}; raise tensor_parallel_size or "
            "gpu_memory_utilization, or use a larger GPU"
        )
    kv_cache_bytes = budget_bytes - non_kv_bytes

    if engine.num_gpu_blocks_override is not None:
        num_gpu_blocks = engine.num_gpu_blocks_override
    else:
        num_gpu_blocks = kv_cache_bytes // bytes_per_block
        if num_gpu_blocks < NUM_NULL_BLOCKS + 1:
            raise KvsimConfigError(
                f"{_gib(kv_cache_bytes)} left for the KV cache of {model.name} on "
                f"{hardware.name} holds {num_gpu_blocks} blocks of {bytes_per_block} bytes "
                f"(block_size={engine.block_size}), but vLLM needs at least 2; raise "
                "gpu_memory_utilization or tensor_parallel_size"
            )
        if num_gpu_blocks > MAX_NUM_GPU_BLOCKS:
            raise KvsimConfigError(
                f"{_gib(kv_cache_bytes)} left for the KV cache of {model.name} on "
                f"{hardware.name} holds {num_gpu_blocks:,} blocks of {engine.block_size} tokens, "
                f"more than kvsim simulates ({MAX_NUM_GPU_BLOCKS:,}); set "
                "engine.num_gpu_blocks_override, lower gpu_memory_utilization or raise block_size"
            )
    num_usable_blocks = num_gpu_blocks - NUM_NULL_BLOCKS

    # vLLM refuses to start if a single max_model_len request could never be scheduled.
    blocks_needed = math.ceil(engine.max_model_len / engine.block_size)
    if blocks_needed > num_usable_blocks:
        max_len = num_usable_blocks * engine.block_size
        more = (
            f"raise engine.num_gpu_blocks_override to {blocks_needed + NUM_NULL_BLOCKS:,} or more"
            if engine.num_gpu_blocks_override is not None
            else "raise gpu_memory_utilization or tensor_parallel_size"
        )
        raise KvsimConfigError(
            f"max_model_len={engine.max_model_len} needs {blocks_needed:,} KV blocks of "
            f"{engine.block_size} tokens for one request, but only {num_usable_blocks:,} are "
            f"available for {model.name} on {hardware.name}; lower max_model_len to "
            f"{max_len} or less, or {more}"
        )

    return KVSizing(
        hbm_bytes=hardware.hbm_bytes,
        gpu_memory_utilization=util,
        budget_bytes=budget_bytes,
        weight_bytes=weight_bytes,
        activation_peak_bytes=activation_peak_bytes,
        cudagraph_bytes=CUDAGRAPH_RESERVE_BYTES,
        kv_cache_bytes=kv_cache_bytes,
        block_size=engine.block_size,
        kv_bytes_per_token=kv_bytes_per_token,
        bytes_per_block=bytes_per_block,
        num_gpu_blocks=num_gpu_blocks,
        num_usable_blocks=num_usable_blocks,
        max_tokens_in_kv=num_usable_blocks * engine.block_size,
    )


def override_bytes_beyond_memory(sizing: KVSizing, engine: EngineConfig) -> int | None:
    """The KV bytes a ``num_gpu_blocks_override`` needs when they exceed what the GPU
    leaves for the KV cache (vLLM would not start), or None when it fits or is not set."""
    if engine.num_gpu_blocks_override is None:
        return None
    needed = engine.num_gpu_blocks_override * sizing.bytes_per_block
    return needed if needed > sizing.kv_cache_bytes else None


def oversized_override_line(
    model: ModelGeometry, hardware: Hardware, engine: EngineConfig
) -> str | None:
    """The what-if line of a ``num_gpu_blocks_override`` beyond the GPU's memory (a larger
    GPU than the hardware's: vLLM would not start with it), or None."""
    sizing = size_kv_cache(model, hardware, engine)
    needed = override_bytes_beyond_memory(sizing, engine)
    if needed is None:
        return None
    return (
        f"engine.num_gpu_blocks_override={engine.num_gpu_blocks_override}: {_gib(needed)} of "
        f"KV cache where {hardware.name} leaves {_gib(sizing.kv_cache_bytes)} for it (a larger "
        "GPU than the hardware's; vLLM would run out of memory at startup)"
    )


def size_deployable_kv_cache(
    model: ModelGeometry, hardware: Hardware, engine: EngineConfig
) -> KVSizing:
    """:func:`size_kv_cache`, and also refuse a ``num_gpu_blocks_override`` whose blocks do
    not fit the memory left for the KV cache.

    vLLM allocates ``num_gpu_blocks_override`` x bytes per block whatever memory is free
    (``v1/core/kv_cache_utils.py``), so an engine started with a larger override runs out
    of memory at startup. A simulation may pin more blocks than fit (a what-if: ``kvsim
    report claims`` runs one on a KV cache 8 times the GPU's), so :func:`size_kv_cache`
    accepts it; a deployment (``kvsim export``) may not. Raises ``KvsimConfigError``.
    """
    sizing = size_kv_cache(model, hardware, engine)
    override = engine.num_gpu_blocks_override
    needed_bytes = override_bytes_beyond_memory(sizing, engine)
    if override is not None and needed_bytes is not None:
        fits = sizing.kv_cache_bytes // sizing.bytes_per_block
        raise KvsimConfigError(
            f"engine.num_gpu_blocks_override={override} needs {_gib(needed_bytes)} of KV cache "
            f"per GPU ({override:,} blocks x {sizing.bytes_per_block:,} bytes at block_size="
            f"{engine.block_size}), but {model.name} on {hardware.name} leaves "
            f"{_gib(sizing.kv_cache_bytes)} for it (gpu_memory_utilization="
            f"{engine.gpu_memory_utilization} of {_gib(hardware.hbm_bytes)} less "
            f"{_gib(sizing.weight_bytes)} of weights, {_gib(sizing.activation_peak_bytes)} "
            f"activation peak and {_gib(sizing.cudagraph_bytes)} CUDA graphs): vLLM allocates "
            f"the override whatever memory is free and would run out of memory at startup; "
            f"lower it to {fits:,} or less, or remove it to let vLLM size the cache"
        )
    return sizing


def kv_cache_summary(sizing: KVSizing) -> str:
    """One line for reports, counting usable blocks (the null block excluded)."""
    usable_bytes = sizing.num_usable_blocks * sizing.bytes_per_block
    return (
        f"{sizing.num_usable_blocks:,} blocks x {sizing.block_size} tokens = "
        f"{sizing.max_tokens_in_kv:,} tokens ({_gib(usable_bytes)})"
    )


# -- host memory of the what-if CPU tiers (swap space, offload store) -----------------------
PAGE_SIZE = 4096  # an offload chunk is rounded up to whole pages (vLLM's mmap.PAGESIZE)


def num_cpu_blocks(swap_space_gib: float, bytes_per_block: int) -> int:
    """CPU blocks in ``swap_space_gib`` GiB (V0: ``int(swap_space_bytes // block_bytes)``);
    ``bytes_per_block`` is one GPU's share of a block (under TP each GPU swaps its shard)."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block={bytes_per_block} must be > 0")
    return int(swap_space_gib * GIB // bytes_per_block)


def offload_chunk_bytes(bytes_per_block: int, tensor_parallel: int) -> int:
    """Host bytes one block takes in the offload store: every GPU's shard, in whole pages."""
    return -(-bytes_per_block * tensor_parallel // PAGE_SIZE) * PAGE_SIZE


def num_offload_blocks(kv_offload_gib: float, bytes_per_block: int, tensor_parallel: int) -> int:
    """Blocks the CPU store holds in ``kv_offload_gib`` GiB of host memory for the whole
    engine (vLLM's ``--kv-offloading-size``: every GPU's shard of a block is stored, each
    chunk rounded up to whole pages); ``bytes_per_block`` is one GPU's share of a block."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block={bytes_per_block} must be > 0")
    return int(kv_offload_gib * GIB) // offload_chunk_bytes(bytes_per_block, tensor_parallel)
