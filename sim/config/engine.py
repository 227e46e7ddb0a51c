"""Engine settings, named as vLLM names them (``vllm serve --help``).

Only the settings that change what the KV cache manager and the V1 scheduler decide live here;
model geometry, hardware and KV sizing live in their own modules.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sim.config.limits import (
    MAX_NUM_GPU_BLOCKS,
    MAX_NUM_SEQS,
    MAX_TENSOR_PARALLEL,
    MAX_TOKENS,
    KvsimModel,
)
from sim.config.retention import RetentionConfig

SchedulingPolicy = Literal["fcfs", "priority"]


class EngineConfig(KvsimModel):
    """vLLM engine arguments that the simulated KV cache and scheduler obey."""

    block_size: int = Field(
        16, gt=0, le=MAX_TOKENS, description="Tokens per KV block (vLLM GPU default 16)."
    )
    num_gpu_blocks_override: int | None = Field(
        None,
        gt=1,
        le=MAX_NUM_GPU_BLOCKS,
        description="Pin the number of KV blocks (including vLLM's null block 0) instead of "
        "deriving it from HBM.",
    )
    gpu_memory_utilization: float = Field(
        0.92, gt=0.0, le=1.0, description="Fraction of HBM vLLM may use (weights + KV + rest)."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=MAX_TENSOR_PARALLEL, description="GPUs the model is sharded over."
    )
    max_num_batched_tokens: int = Field(
        8192,
        gt=0,
        le=MAX_TOKENS,
        description="Token budget of one engine step (prefill chunks + decodes).",
    )
    max_num_seqs: int = Field(
        256, gt=0, le=MAX_NUM_SEQS, description="Most requests running in one step."
    )
    max_model_len: int = Field(
        32768, gt=0, le=MAX_TOKENS, description="Longest prompt + output, in tokens."
    )
    enable_chunked_prefill: bool = Field(
        True, description="Split long prefills over steps to fit the token budget."
    )
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        le=MAX_TOKENS,
        description="Cap on tokens one request may prefill per step (0 = no cap).",
    )
    enable_prefix_caching: bool = Field(
        True, description="Reuse full KV blocks whose token prefix was seen before."
    )
    scheduling_policy: SchedulingPolicy = Field(
        "fcfs", description="fcfs: arrival order; priority: lowest (priority, arrival) first."
    )
    watermark: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of KV blocks kept free when admitting waiting or preempted "
        "requests (vLLM's --watermark; 0, its default, disables it).",
    )
    kv_retention: RetentionConfig = Field(
        default_factory=RetentionConfig,
        description="Session-aware KV retention during tool waits (a what-if; policy none, "
        "the default, is vLLM 0.32).",
    )

    def what_if_policies(self) -> list[str]:
        """The memory policies this config turns on that vLLM 0.32 does not run as configured
        (swap preemption, a CPU offload tier, KV retention, a non-paged allocator), each as one
        line for the outputs; empty for the vLLM-exact engine.

        Results of a run with any of them are what-ifs: ``summary.json`` says so under
        ``what_if``, and the engine runs every step through the scheduler (the decode-stretch
        fast path is proven exact only for the vLLM-exact engine).
        """
        return [line for line in (self.kv_retention.what_if(),) if line is not None]

    @model_validator(mode="after")
    def _check_budget(self) -> EngineConfig:
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len} with enable_chunked_prefill=false: a "
                "long prompt could never be scheduled; raise max_num_batched_tokens or "
                "enable chunked prefill"
            )
        return self
