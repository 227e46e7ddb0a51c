"""A stretch's blocks (sim/engine.py): what its running requests filled and the new blocks
they took, applied to the KV cache in the order vLLM's scheduler would have, step by step;
and the plan of a stretch, and its end time as a SimPy delay."""

from __future__ import annotations

import math
from typing import NamedTuple

from sim.kv.kv_cache_manager import KVCacheManager
from sim.request import Request


class Stretch(NamedTuple):
    """A planned stretch whose blocks, registrations and finishes are not applied yet."""

    first_step: int
    decoders: list[Request]
    chunked: Request | None  # the last running request, computing prefill chunks
    chunks: list[int]  # its chunk per step (empty: every request decodes)
    pops: list[tuple[int, int]]  # new blocks, (step, running index), in vLLM's order
    prefill_context0: int  # the chunked request's computed tokens before the stretch
    ends: list[float]  # each step's end time
    since_prefill: int  # steps since the last prefill step, before the stretch


def delay_to(now_s: float, target_s: float) -> float | None:
    """A delay ``d`` with ``now_s + d == target_s`` exactly (SimPy schedules at now + delay),
    or None when rounding skips the target (no such float ``d`` exists)."""
    delay = target_s - now_s
    while now_s + delay < target_s:
        delay = math.nextafter(delay, math.inf)
    while now_s + delay > target_s:
        delay = math.nextafter(delay, -math.inf)
    return delay if now_s + delay == target_s and delay >= 0 else None


def unregistered_hashes(kv: KVCacheManager, running: list[Request]) -> list[int]:
    """The hashes of the blocks the running requests filled and have not registered, in
    running order (a stretch's registrations)."""
    num_cached = kv.num_cached_block
    block_size = kv.block_size
    new_hashes: list[int] = []
    for request in running:
        new_hashes += request.block_hashes[
            num_cached[request.request_id] : request.num_computed_tokens // block_size
        ]
    return new_hashes


def apply_stretch_blocks(
    kv: KVCacheManager,
    running: list[Request],
    pops: list[tuple[int, int]],
    num_steps: int,
    chunks: list[int],
) -> bool:
    """Pop a stretch's new blocks (``pops``: (step, running index), in vLLM's order) into the
    block tables and, with prefix caching, register its newly full blocks. Returns whether
    the events had to be replayed one by one (below).

    vLLM interleaves both, step by step, request by request. Pops only evict hashes that
    are cached now; registrations only add hashes. When no hash registered in the stretch
    is cached now or registered twice (always so without prefix caching, which registers
    nothing), the two never meet, so all pops (in order) then all registrations (request by
    request) leave the same pool; otherwise the events are replayed one by one in vLLM's
    order. (Either way, the evictions of pops taken
    together share one eviction stamp, where vLLM's steps would stamp them apart: stamps
    only date evictions against prefix lookups, and none is made inside a stretch.)
    ``chunks``: the last request's prefill chunks, one per step (empty when every request
    decodes).
    """
    pool = kv.block_pool
    new_hashes = unregistered_hashes(kv, running) if kv.enable_caching else []
    if pool.first_cached_block.keys().isdisjoint(new_hashes) and len(set(new_hashes)) == len(
        new_hashes
    ):
        if pops:
            tables = kv.req_to_blocks
            for (_, index), block in zip(pops, pool.get_new_blocks(len(pops)), strict=True):
                tables[running[index].request_id].append(block)
        if new_hashes:
            for request in running:
                kv.cache_blocks(request, request.num_computed_tokens)
        return False
    tables = kv.req_to_blocks
    num_cached = kv.num_cached_block
    block_size = kv.block_size
    # Events (step, running index, kind, tokens): kind 0 = a new block popped, kind 1 =
    # full blocks registered up to that many computed tokens (a decode's at once if
    # already past: k clamps to 0; the prefill's after each of its chunks).
    events: list[tuple[int, int, int, int]] = [(k, index, 0, 0) for k, index in pops]
    decoders = running[:-1] if chunks else running
    for index, request in enumerate(decoders):
        computed0 = request.num_computed_tokens - num_steps
        k = (num_cached[request.request_id] + 1) * block_size - computed0 - 1
        while k < num_steps:
            k0 = k if k > 0 else 0
            events.append((k0, index, 1, computed0 + k0 + 1))
            k += block_size
    if chunks:
        computed = running[-1].num_computed_tokens - sum(chunks)
        for k, n in enumerate(chunks):
            computed += n
            events.append((k, len(decoders), 1, computed))
    events.sort()
    get_new_blocks = pool.get_new_blocks
    for _, index, kind, num_tokens in events:
        request = running[index]
        if kind == 0:
            tables[request.request_id] += get_new_blocks(1)
        else:
            kv.cache_blocks(request, num_tokens)
    return True
