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
PreemptionMode = Literal["recompute", "swap"]

# Most CPU swap space per GPU kvsim accepts, in GiB (1 PiB: far beyond any host).
MAX_SWAP_SPACE_GIB = float(1 << 20)

AllocatorKind = Literal["paged", "static", "orca_max", "orca_pow2", "orca_oracle"]

# What each non-paged allocator does, one line for the outputs' ``what_if`` list (the
# allocators themselves: sim/kv/allocators.py).
ALLOCATOR_DESCRIPTIONS: dict[str, str] = {
    "static": "static allocation of max_model_len per request (HuggingFace-style)",
    "orca_max": "Orca-style reservation of max_model_len per request (PagedAttention's Orca (Max))",
    "orca_pow2": "Orca-style reservation of prompt + next power of two of the output length "
    "(PagedAttention's Orca (Pow2))",
    "orca_oracle": "Orca-style reservation of prompt + the true output length "
    "(PagedAttention's Orca (Oracle))",
}


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
    allocator: AllocatorKind = Field(
        "paged",
        description="KV allocator: paged (vLLM's block tables, the default); static (a "
        "contiguous max_model_len region per request, HuggingFace-style); orca_max, orca_pow2, "
        "orca_oracle (Orca-style contiguous reservation of max_model_len, prompt + next power "
        "of two of the output length, prompt + the true output length). The contiguous ones "
        "are what-ifs and run without prefix caching (a region is private to its request).",
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
    preemption_mode: PreemptionMode = Field(
        "recompute",
        description="recompute: a preempted request frees its KV and recomputes it later "
        "(vLLM 0.32, the only mode V1 has); swap: a what-if with vLLM V0's "
        "preemption_mode='swap', the victim's KV is copied to a CPU block pool over PCIe and "
        "copied back when it resumes (needs swap_space_gib).",
    )
    swap_space_gib: float | None = Field(
        None,
        gt=0.0,
        le=MAX_SWAP_SPACE_GIB,
        description="CPU swap space per GPU in GiB for preemption_mode=swap (vLLM V0's "
        "--swap-space); its KV blocks are this many bytes over the per-GPU block size. "
        "Must be unset with preemption_mode=recompute.",
    )
    kv_offload_gib: float | None = Field(
        None,
        gt=0.0,
        le=MAX_SWAP_SPACE_GIB,
        description="Host memory in GiB for a CPU offload tier, for the whole engine (all its "
        "GPUs' shards; vLLM's --kv-offloading-size): a what-if with vLLM 0.32's offloading "
        "connector. Full prompt blocks are stored to an LRU store in host RAM as they are "
        "computed, and a prefix lookup that misses in HBM loads the blocks it hits there over "
        "PCIe before the request runs. Unset: no offload tier.",
    )
    kv_retention: RetentionConfig = Field(
        default_factory=RetentionConfig,
        description="Session-aware KV retention during tool waits (a what-if; policy none, "
        "the default, is vLLM 0.32).",
    )

    def what_if_policies(self) -> list[str]:
        """The memory policies this config turns on that kvsim does not run as vLLM 0.32
        does, step for step (swap preemption, a non-paged allocator, KV retention: vLLM 0.32
        has none of them; a CPU offload tier: vLLM 0.32's own, modelled from its source but
        not checked against it), each as one line for the outputs; empty for the vLLM-exact
        engine.

        Results of a run with any of them are what-ifs: ``summary.json`` says so under
        ``what_if``, and the engine runs every step through the scheduler (the stretch
        fast path is proven exact only for the vLLM-exact engine).
        """
        policies = self.policies_vllm_lacks()
        if self.kv_offload_gib is not None:
            policies.append(
                f"CPU offload tier of {self.kv_offload_gib:g} GiB (vLLM 0.32's offloading "
                "connector, --kv-offloading-size, modelled from its source; not checked "
                "against vLLM, whose CPU build cannot run it)"
            )
        return policies

    def policies_vllm_lacks(self) -> list[str]:
        """The what-if policies vLLM 0.32 cannot run at all (what an export refuses)."""
        policies: list[str] = []
        if self.preemption_mode == "swap":
            policies.append("swap preemption (vLLM V0 semantics; vLLM 0.32 preempts by recompute)")
        if self.allocator != "paged":
            line = f"engine.allocator={self.allocator}: {ALLOCATOR_DESCRIPTIONS[self.allocator]}"
            if self.enable_prefix_caching:
                line += "; prefix caching off (a contiguous region is private to its request)"
            policies.append(f"{line}; vLLM 0.32 pages its KV cache")
        if (line := self.kv_retention.what_if()) is not None:
            policies.append(line)
        return policies

    @model_validator(mode="after")
    def _check_retention(self) -> EngineConfig:
        policy = self.kv_retention.policy
        if policy == "none":
            return self
        if self.allocator != "paged":
            raise ValueError(
                f"engine.kv_retention.policy={policy} keeps prefix-cached blocks of paged KV; "
                f"engine.allocator={self.allocator} has no prefix cache: use one of the two"
            )
        if not self.enable_prefix_caching:
            raise ValueError(
                f"engine.kv_retention.policy={policy} keeps a session's prefix-cached blocks "
                "for its next turn, and engine.enable_prefix_caching=false caches none: turn "
                "prefix caching on or set engine.kv_retention.policy=none"
            )
        return self

    @model_validator(mode="after")
    def _check_swap(self) -> EngineConfig:
        if self.preemption_mode == "swap" and self.swap_space_gib is None:
            raise ValueError(
                "engine.swap_space_gib is required with engine.preemption_mode=swap: set the "
                "CPU swap space per GPU in GiB (vLLM V0's --swap-space, e.g. 4)"
            )
        if self.preemption_mode == "swap" and self.allocator != "paged":
            raise ValueError(
                f"engine.preemption_mode=swap never swaps with engine.allocator="
                f"{self.allocator}: a request's contiguous reservation is never preempted; "
                "use one of the two"
            )
        if self.preemption_mode == "recompute" and self.swap_space_gib is not None:
            raise ValueError(
                f"engine.swap_space_gib={self.swap_space_gib:g} is set but "
                "engine.preemption_mode=recompute never swaps: set engine.preemption_mode=swap "
                "or remove engine.swap_space_gib"
            )
        return self

    @model_validator(mode="after")
    def _check_offload(self) -> EngineConfig:
        gib = self.kv_offload_gib
        if gib is None:
            return self
        if self.allocator != "paged" or not self.enable_prefix_caching:
            what = (
                f"engine.allocator={self.allocator}"
                if self.allocator != "paged"
                else "engine.enable_prefix_caching=false"
            )
            raise ValueError(
                f"engine.kv_offload_gib={gib:g} stores and finds KV blocks by their "
                f"prefix-cache hash, and {what} has none: use paged KV with prefix caching "
                "or remove engine.kv_offload_gib"
            )
        if self.kv_retention.policy != "none":
            raise ValueError(
                f"engine.kv_offload_gib={gib:g} and engine.kv_retention.policy="
                f"{self.kv_retention.policy} are two what-ifs kvsim does not combine yet: "
                "use one of the two"
            )
        if self.preemption_mode == "swap":
            raise ValueError(
                f"engine.kv_offload_gib={gib:g} is vLLM V1's offloading connector and "
                "engine.preemption_mode=swap is vLLM V0's swap: kvsim runs one or the other"
            )
        return self

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
