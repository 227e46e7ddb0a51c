"""What one scheduler step decided: the typed result of ``Scheduler.schedule()``."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.kv.offload import OffloadStep
from sim.kv.swap import SwapStep
from sim.request import Request


@dataclass(slots=True)
class BatchShape:
    """The batch composition the cost model prices (aggregates, so the hot loop stays flat)."""

    num_prefill_tokens: int = 0
    num_prefill_reqs: int = 0
    # Sum over prefill chunks of chunk_tokens x (context before the chunk + chunk_tokens / 2):
    # the query-key pairs causal attention computes for the chunk.
    prefill_attention_pairs: float = 0.0
    num_decode_reqs: int = 0
    # Sum of the context lengths the decodes attend over (KV read per step).
    decode_context_tokens: int = 0
    # KV tokens in blocks held by more than one request, counted once per holder beyond the
    # first (BlockPool.num_shared_refs x block_size, after the step's allocations): the part
    # of the KV read that re-reads a block another request of the batch reads too (a shared
    # prefix). Only full blocks are shared, so every such block holds block_size tokens.
    shared_kv_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_reqs


@dataclass(slots=True)
class SchedulerOutput:
    """One engine step as the scheduler planned it."""

    step: int
    # request id -> tokens computed this step, in vLLM's order (running first, then admitted).
    num_scheduled_tokens: dict[str, int]
    # Requests admitted from the waiting queue this step (new or resumed after preemption).
    admitted_ids: list[str]
    # Prefix-hit tokens of each admitted request, parallel to ``admitted_ids``.
    admitted_hit_tokens: list[int]
    # Requests preempted this step, in preemption order.
    preempted_ids: list[str]
    # Prefix-cache lookups of admitted requests: tokens asked for and tokens hit
    # (``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``).
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    # Prefix hits of requests re-admitted after preemption (their own blocks, re-hit).
    num_resumed_prefix_hit_tokens: int
    shape: BatchShape = field(default_factory=BatchShape)
    # State after scheduling (blocks for this step are allocated).
    num_free_blocks: int = 0
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    # Swap preemption only (engine.preemption_mode=swap): this step's block copies.
    swap: SwapStep | None = None
    # CPU offload tier only (engine.kv_offload_gib): this step's stores and loads.
    offload: OffloadStep | None = None
    # Lazy decodes (the fast path: Scheduler.enable_lazy_decodes): running requests that
    # decode one token this step and are not listed in ``num_scheduled_tokens``.
    num_lazy_decodes: int = 0

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values()) + self.num_lazy_decodes

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens and not self.num_lazy_decodes


@dataclass(slots=True)
class StepUpdate:
    """What a finished step produced: requests that sampled a token, requests that finished."""

    sampled: list[Request]  # every finished request is also in here
    finished: list[Request]
