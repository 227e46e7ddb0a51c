"""Where the KV cache's capacity goes, step by step, for every allocator (paged included).

After each step is scheduled (its tokens computed, its KV slots in use for the step's
duration) the capacity, ``num_usable_blocks x block_size`` slots, splits into:

- ``stored``: slots holding a running request's KV. Paged: the blocks held by running
  requests minus their unused slots (a full block shared through the prefix cache counts
  once). Contiguous:
  every live request's computed tokens.
- ``reserved_unused``: slots set aside for a live request beyond what it has computed,
  excluding its partial last block. Paged: whole blocks allocated ahead of the computed tokens
  (none after a step: vLLM allocates for exactly the step's tokens), so 0. Contiguous: the
  reservation minus the computed tokens (static: ``max_model_len`` minus the live length).
  Of these, ``reserved_never_used`` will never hold a token: the reservation beyond the
  request's final length (``min(prompt + max_tokens, max_model_len) - 1`` computed tokens:
  the last sampled token's KV is never computed); what the PagedAttention paper's Figure 2
  calls internal fragmentation for Orca-style allocators. 0 for paged.
- ``internal_fragmentation``: slots lost to allocation granularity. Paged: the unused slots of
  each request's partial last block, ``ceil(n / block_size) x block_size - n``. Contiguous: a
  region is whole blocks, so a reservation that is not a multiple of ``block_size`` rounds up;
  the rounding (0 for ``max_model_len`` a multiple of ``block_size``).
- ``held_idle``: slots in blocks that are not free but that no running request holds: a KV
  retention pin during a tool wait, a request waiting for its CPU offload load (what-ifs;
  0 without them and for contiguous allocators). They hold tokens nobody is decoding.
- ``external_fragmentation``: free slots in gaps too small for the head-of-line waiting
  request's region (it is refused while its size in total is free). 0 for paged (any free
  block serves any request) and when nobody waits.
- ``free``: the rest. Paged: the free queue, prefix-cached evictable blocks included.

``effective_utilization`` is ``stored / capacity``; ``stored_share_of_allocated`` is
``stored / (capacity - free - external_fragmentation)``: of the memory given to requests, the
share holding tokens (the PagedAttention paper's "effective" KV use). Each is time-weighted by
step duration (ratios of time integrals).

Opt-in: sampled by :class:`WasteTrackingScheduler`, which the runner uses for non-paged
allocators always and for the paged one when asked (``kvsim run --kv-waste``); it runs every
step through the scheduler (the stretch fast path skips it) and costs O(running
requests) per step. ``summary.json`` carries the result as ``kv_waste_breakdown``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from sim.config.engine import EngineConfig
from sim.kv.allocators import ContiguousKVManager
from sim.request import Request
from sim.scheduler.output import SchedulerOutput
from sim.scheduler.scheduler import Scheduler

# The parts of a sample, in slots, in this order (they add up to the capacity).
PARTS = (
    "stored",
    "reserved_unused",
    "internal_fragmentation",
    "held_idle",
    "external_fragmentation",
    "free",
)
# Sample columns: the parts, then the never-used share of reserved_unused, then live requests.
COLUMNS = (*PARTS, "reserved_never_used", "num_live")


def final_stored_tokens(request: Request, max_model_len: int) -> int:
    """Tokens whose KV a request will have computed when it finishes (the last sampled
    token's KV is never computed)."""
    return min(request.num_prompt_tokens + request.max_tokens, max_model_len) - 1


def paged_breakdown(kv: Any, running: Sequence[Request]) -> tuple[int, ...]:
    """One sample of a paged KV cache manager (see the module docstring), in COLUMNS order."""
    block_size = kv.block_size
    tables = kv.req_to_blocks
    internal = reserved = 0
    for request in running:
        computed = request.num_computed_tokens
        touched = -(-computed // block_size)
        internal += touched * block_size - computed
        reserved += (len(tables[request.request_id]) - touched) * block_size
    pool = kv.block_pool
    used_blocks = pool.num_gpu_blocks - 1 - pool.num_free_blocks
    idle = idle_blocks(kv, running) * block_size
    stored = used_blocks * block_size - idle - internal - reserved
    free = pool.num_free_blocks * block_size
    return (stored, reserved, internal, idle, 0, free, 0, len(running))


def idle_blocks(kv: Any, running: Sequence[Request]) -> int:
    """Blocks in use that no running request holds: every reference to them is a KV
    retention pin's or a request's that is not running (one waiting for its offload load).
    0, without a pass over the pool, when there are no such holders (vLLM's own engine)."""
    retention = kv.retention
    pinned = retention is not None and bool(retention.holders)
    tables = kv.req_to_blocks
    others: list[Sequence[int]] = []
    if len(tables) > len(running):
        running_ids = {r.request_id for r in running}
        others = [ids for rid, ids in tables.items() if rid not in running_ids]
    if not pinned and not others:
        return 0
    ref_cnt = kv.block_pool.ref_cnt
    by_running = ref_cnt - retention.held_refs if pinned else ref_cnt.copy()
    for ids in others:
        np.subtract.at(by_running, np.asarray(ids, dtype=np.int64), 1)
    return int(np.count_nonzero((ref_cnt > 0) & (by_running == 0)))


def contiguous_breakdown(
    kv: ContiguousKVManager, running: Sequence[Request], head: Request | None
) -> tuple[int, ...]:
    """One sample of a contiguous allocator (see the module docstring), in COLUMNS order;
    ``head`` is the request at the head of the waiting queue, if any."""
    block_size = kv.block_size
    max_model_len = kv.max_model_len
    tables = kv.req_to_blocks
    reserved_tokens = kv.reserved_tokens
    stored = reserved = never = internal = 0
    for request in running:
        request_id = request.request_id
        computed = request.num_computed_tokens
        tokens = reserved_tokens[request_id]
        stored += computed
        reserved += tokens - computed
        never += max(tokens - final_stored_tokens(request, max_model_len), 0)
        internal += len(tables[request_id]) * block_size - tokens
    external = 0
    if head is not None:
        need = kv.reservation_blocks(head)
        # Fragmentation only when the head's region is free in total but no gap holds it;
        # a pool that is simply short of memory has none.
        if kv.block_pool.num_free_blocks >= need:
            external = sum(size for _, size in kv.gaps() if size < need) * block_size
    free = kv.block_pool.num_free_blocks * block_size - external
    return (stored, reserved, internal, 0, external, free, never, len(running))


class WasteTrackingScheduler(Scheduler):
    """The scheduler, plus one waste sample after every step it schedules."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int, bytes_per_block: int = 0) -> None:
        super().__init__(config, num_gpu_blocks, bytes_per_block)
        self.waste_samples: dict[str, array] = {name: array("q") for name in COLUMNS}
        self.kv_capacity_slots = (num_gpu_blocks - 1) * config.block_size

    def schedule(self) -> SchedulerOutput:
        output = super().schedule()
        kv = self.kv_cache_manager
        if isinstance(kv, ContiguousKVManager):
            head = self.waiting.peek() if len(self.waiting) else None
            sample = contiguous_breakdown(kv, self.running, head)
        else:
            sample = paged_breakdown(kv, self.running)
        for column, value in zip(self.waste_samples.values(), sample, strict=True):
            column.append(value)
        return output


def kv_waste_breakdown(
    allocator: str,
    capacity_slots: int,
    samples: Sequence[dict[str, array]],
    durations: Sequence[Sequence[float]],
) -> dict[str, Any]:
    """The ``kv_waste_breakdown`` section of ``summary.json``: the time-weighted shares of KV
    capacity (see the module docstring) over every replica's steps; ``samples[i]`` and
    ``durations[i]`` are replica i's samples and step durations, step by step (a step still
    running at the time limit has a sample and no duration: it is left out)."""
    totals = dict.fromkeys(COLUMNS, 0.0)
    time_s = 0.0
    max_live = 0
    for replica_samples, replica_durations in zip(samples, durations, strict=True):
        weights = np.asarray(replica_durations, dtype=np.float64)
        n = min(len(weights), len(replica_samples["stored"]))
        weights = weights[:n]
        time_s += float(weights.sum())
        for name in COLUMNS:
            values = np.frombuffer(replica_samples[name], dtype=np.int64)[:n]
            totals[name] += float(values.astype(np.float64) @ weights)
        if n:
            live = np.frombuffer(replica_samples["num_live"], dtype=np.int64)[:n]
            max_live = max(max_live, int(live.max()))
    capacity_time = capacity_slots * time_s
    if not capacity_time:
        return {"allocator": allocator, "kv_capacity_slots": capacity_slots, "steps_time_s": 0.0}
    shares = {name: totals[name] / capacity_time for name in PARTS}
    allocated = capacity_time * (1.0 - shares["free"] - shares["external_fragmentation"])
    return {
        "allocator": allocator,
        "kv_capacity_slots": capacity_slots,
        "steps_time_s": time_s,
        "effective_utilization": shares["stored"],
        "stored_share_of_allocated": totals["stored"] / allocated if allocated > 0 else None,
        "shares_of_capacity": shares,
        "reserved_never_used_share": totals["reserved_never_used"] / capacity_time,
        "mean_slots": {name: totals[name] / time_s for name in (*PARTS, "reserved_never_used")},
        "mean_live_requests": totals["num_live"] / time_s,
        "max_live_requests": max_live,
    }


def wants_waste_tracking(config: EngineConfig, kv_waste: bool) -> bool:
    """Whether a run samples the waste breakdown: always for a contiguous allocator, for the
    paged one when asked (``kvsim run --kv-waste``)."""
    return kv_waste or config.allocator != "paged"


def summary_section(
    config: EngineConfig, schedulers: Sequence[Scheduler], durations: Sequence[Sequence[float]]
) -> dict[str, Any] | None:
    """``summary.json``'s ``kv_waste_breakdown`` for a run's replicas (their schedulers and
    step durations), or None when the run did not track waste."""
    tracked = [s for s in schedulers if isinstance(s, WasteTrackingScheduler)]
    if not tracked:
        return None
    return kv_waste_breakdown(
        config.allocator,
        tracked[0].kv_capacity_slots,
        [s.waste_samples for s in tracked],
        durations,
    )
