"""One engine step as a typed record, built the same way for simulated and measured runs.

kvsim's scheduler and vLLM's (replayed by ``validate/``) both hand over, after each
``schedule()``, the tokens scheduled per request and each request's token counts. From those,
:func:`batch_shape` is the one classification of prefill vs decode, and :func:`step_record`
the one mapping of a :class:`~sim.scheduler.output.SchedulerOutput` onto a row of
``steps.parquet``. New step metrics are added here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from sim.kv.offload import OffloadStep
from sim.kv.swap import SwapStep
from sim.scheduler.output import BatchShape, SchedulerOutput

if TYPE_CHECKING:
    import pandas as pd


class ScheduledRequest(Protocol):
    """What :func:`batch_shape` reads of a request (kvsim's ``Request`` and vLLM's alike)."""

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


def is_decode(
    num_new_tokens: int, num_context_tokens: int, num_tokens: int, num_prompt_tokens: int
) -> bool:
    """Whether computing ``num_new_tokens`` after ``num_context_tokens`` is a decode: one
    token, the last one, of a request past its prompt (the token it sampled last step).

    Everything else computes a prefill chunk: prompt tokens, the last prompt token, and the
    prompt plus output that a request preempted by recompute computes again.
    """
    return (
        num_new_tokens == 1
        and num_context_tokens == num_tokens - 1
        and num_tokens > num_prompt_tokens
    )


def batch_shape(
    num_scheduled_tokens: Mapping[str, int],
    requests: Mapping[str, ScheduledRequest],
    computed_includes_scheduled: bool = False,
) -> BatchShape:
    """The batch the cost model prices, from the tokens scheduled per request.

    ``requests[id].num_computed_tokens`` is read as the context before this step's tokens,
    or, with ``computed_includes_scheduled`` (vLLM's scheduler advances it inside
    ``schedule()``), as the context after them.
    """
    num_decode = decode_context = num_prefill_reqs = num_prefill_tokens = 0
    prefill_pairs = 0.0
    for request_id, n in num_scheduled_tokens.items():
        request = requests[request_id]
        context = request.num_computed_tokens
        if computed_includes_scheduled:
            context -= n
        if is_decode(n, context, request.num_tokens, request.num_prompt_tokens):
            num_decode += 1
            decode_context += context
        else:
            num_prefill_reqs += 1
            num_prefill_tokens += n
            # Query-key pairs causal attention computes for the chunk.
            prefill_pairs += n * (context + n / 2)
    return BatchShape(
        num_prefill_tokens, num_prefill_reqs, prefill_pairs, num_decode, decode_context
    )


def kv_unused_slots(num_held_blocks: int, block_size: int, num_computed_tokens: int) -> int:
    """Slots in blocks held by running requests that hold no token yet: the partial tail
    block of each request (internal fragmentation) plus slots allocated ahead."""
    return num_held_blocks * block_size - num_computed_tokens


class StepRecord(NamedTuple):
    """One row of ``steps.parquet``: the fields are its columns, in order (a tuple, so the
    recorder appends it column by column without looking names up)."""

    step: int
    start_s: float
    duration_s: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_reqs: int
    decode_context_tokens: int
    prefill_attention_pairs: float
    num_requests_running: int  # vllm:num_requests_running
    num_requests_waiting: int  # vllm:num_requests_waiting
    kv_cache_usage_perc: float  # vllm:kv_cache_usage_perc, a fraction
    num_free_blocks: int
    num_preemptions: int  # vllm:num_preemptions
    prefix_cache_queries: int  # vllm:prefix_cache_queries (first admissions)
    prefix_cache_hits: int  # vllm:prefix_cache_hits (first admissions)
    resumed_prefix_cache_hits: int  # hits of requests re-admitted after preemption
    kv_unused_slots: int
    shared_kv_tokens: int  # BatchShape.shared_kv_tokens: KV re-read in blocks others hold too

    def row(self) -> dict[str, Any]:
        """Column name -> value."""
        return self._asdict()


STEP_RECORD_COLUMNS: tuple[str, ...] = StepRecord._fields


def step_record(
    step: int, output: SchedulerOutput, start_s: float, end_s: float, kv_unused_slots: int
) -> StepRecord:
    """The record of one step that ran from ``start_s`` to ``end_s`` as ``output`` planned."""
    shape = output.shape
    return StepRecord(
        step=step,
        start_s=start_s,
        duration_s=end_s - start_s,
        num_prefill_tokens=shape.num_prefill_tokens,
        num_decode_tokens=shape.num_decode_reqs,
        num_prefill_reqs=shape.num_prefill_reqs,
        decode_context_tokens=shape.decode_context_tokens,
        prefill_attention_pairs=shape.prefill_attention_pairs,
        num_requests_running=output.num_running,
        num_requests_waiting=output.num_waiting,
        kv_cache_usage_perc=output.kv_usage,
        num_free_blocks=output.num_free_blocks,
        num_preemptions=len(output.preempted_ids),
        prefix_cache_queries=output.num_prefix_query_tokens,
        prefix_cache_hits=output.num_prefix_hit_tokens,
        resumed_prefix_cache_hits=output.num_resumed_prefix_hit_tokens,
        kv_unused_slots=kv_unused_slots,
        shared_kv_tokens=shape.shared_kv_tokens,
    )


# Extra step columns of a swap-preemption run (engine.preemption_mode=swap) only, so the
# vLLM-exact engine's steps.parquet keeps its columns. Bytes are one GPU's (per-GPU blocks).
SWAP_STEP_COLUMNS: tuple[str, ...] = (
    "swap_out_blocks",  # GPU -> CPU copies this step
    "swap_in_blocks",  # CPU -> GPU copies this step
    "swap_in_reused_blocks",  # swapped blocks found still cached in HBM (not copied)
    "swap_out_bytes",
    "swap_in_bytes",
    "swap_transfer_s",  # part of duration_s spent copying (float)
    "num_swap_outs",  # requests preempted by swap this step
    "num_swap_ins",  # requests resumed from the SWAPPED queue this step
    "num_swap_fallbacks",  # victims preempted by recompute because the CPU pool was full
    "num_requests_swapped",  # requests in the SWAPPED queue after scheduling
)


def swap_step_values(swap: SwapStep) -> tuple[int | float, ...]:
    """One step's values of :data:`SWAP_STEP_COLUMNS`, in order."""
    num_out = len(swap.swap_out)
    num_in = len(swap.swap_in)
    return (
        num_out,
        num_in,
        swap.reused_blocks,
        num_out * swap.bytes_per_block,
        num_in * swap.bytes_per_block,
        swap.transfer_s,
        len(swap.swapped_out_ids),
        len(swap.swapped_in_ids),
        len(swap.fallback_ids),
        swap.num_swapped,
    )


# Extra step columns of a run with a CPU offload tier (engine.kv_offload_gib) only.
OFFLOAD_STEP_COLUMNS: tuple[str, ...] = (
    "offload_stored_blocks",  # blocks whose copy to the CPU store started after this step
    "offload_loaded_blocks",  # blocks whose load from the CPU store started with this step
    # First admissions only (as vLLM's external_prefix_cache_queries / _hits count them):
    "offload_query_tokens",  # tokens asked of the CPU store (past the HBM hits)
    "offload_hit_tokens",  # of them, hits (their loads started)
    "offload_dropped_blocks",  # blocks of offers the full store dropped (again if re-offered)
    "num_requests_loading",  # requests waiting for their load after scheduling
    "offload_store_blocks",  # blocks in the CPU store after the step
    "offload_transfer_s",  # PCIe seconds of the copies started (both ways; not in duration_s)
)


def offload_step_values(offload: OffloadStep) -> tuple[int, ...]:
    """One step's values of :data:`OFFLOAD_STEP_COLUMNS`, in order."""
    return (
        offload.stored_blocks,
        offload.loaded_blocks,
        offload.query_tokens,
        offload.hit_tokens,
        offload.dropped_blocks,
        offload.num_loading,
        offload.store_blocks_used,
        offload.transfer_s,
    )


# The step columns a batch shape is read from (shared_kv_tokens too, when recorded).
SHAPE_COLUMNS = (
    "num_prefill_tokens",
    "num_prefill_reqs",
    "prefill_attention_pairs",
    "num_decode_tokens",
    "decode_context_tokens",
)


def shapes_of_steps(steps: pd.DataFrame) -> list[BatchShape]:
    """The batch shape of every row of a step table (the inverse of :func:`step_record`).
    Tables written before ``shared_kv_tokens`` was recorded read as sharing nothing."""
    shared = steps["shared_kv_tokens"] if "shared_kv_tokens" in steps else [0] * len(steps)
    return [
        BatchShape(
            num_prefill_tokens=int(p),
            num_prefill_reqs=int(pr),
            prefill_attention_pairs=float(pairs),
            num_decode_reqs=int(d),
            decode_context_tokens=int(ctx),
            shared_kv_tokens=int(sh),
        )
        for p, pr, pairs, d, ctx, sh in zip(
            steps["num_prefill_tokens"],
            steps["num_prefill_reqs"],
            steps["prefill_attention_pairs"],
            steps["num_decode_tokens"],
            steps["decode_context_tokens"],
            shared,
            strict=True,
        )
    ]
