"""Swap preemption, a what-if with vLLM V0's semantics (``preemption_mode="swap"``).

vLLM 0.32 (V1) only preempts by recompute. V0 could instead copy a victim's KV blocks to a
CPU block pool of ``--swap-space`` GiB per GPU (``Scheduler._preempt_by_swap`` ->
``BlockSpaceManager.swap_out``), keep the request in a SWAPPED queue, and copy the blocks
back into fresh GPU blocks when ``can_swap_in`` found room (``_schedule_swapped``); the
worker ran ``cache_engine.swap_in``/``swap_out`` before the forward pass of the same step.
This module holds the CPU side: :class:`CpuBlockPool` (block ids, per-request tables) and
:class:`Swapper`, which moves one request's blocks and records the step's transfers in a
:class:`SwapStep`. The scheduler decides when (``sim/scheduler/scheduler.py``), the engine
charges the transfer time to the step (``sim/engine.py``).

What kvsim does differently from V0, on purpose:

- A full CPU pool falls back to recompute (V0 aborted the request with "Aborted due to the
  lack of CPU swap space"); the fallback is counted.
- Prefix caching: the swapped-out GPU blocks are freed like a recompute preemption frees
  them, so the hashed ones stay in the prefix cache as evictable blocks (others may hit
  them, the free queue may evict them). Swap-in first looks the request's full computed
  blocks up in the prefix cache, as V0's prefix-caching allocator did when it re-allocated
  full blocks on swap-in: the leading ones still cached in HBM (a shared system prompt,
  its own blocks not yet evicted) are reused and not copied; the rest get fresh blocks and
  are copied back. V0 reused any full block still cached (kvsim: the leading run, as a
  prefix lookup stops at the first miss) and still copied the hits (identical content, its
  swap mapping listed every block); kvsim does not charge them.
- Every computed block is copied out, those shared with other requests (prefix hits)
  included: the CPU copy is the request's own (V0's CPU allocator deduplicated full blocks
  by hash; kvsim's CPU pool does not, so it fills a little sooner).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.kv.kv_cache_manager import KVCacheManager
from sim.request import Request


class CpuBlockPool:
    """Fixed-size pool of CPU KV blocks; ids are handed out lowest first, freed ids reused
    most recent first. Memory grows with the blocks in use, not the pool's size."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        self.num_blocks = num_blocks
        self._next_unused = 0
        self._free: list[int] = []
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_unused + len(self._free)

    def allocate(self, request_id: str, num_blocks: int) -> list[int] | None:
        """``num_blocks`` CPU blocks for ``request_id``, or None when the pool is short."""
        if num_blocks > self.num_free_blocks:
            return None
        assert request_id not in self.tables, request_id
        reused = min(num_blocks, len(self._free))
        ids = [self._free.pop() for _ in range(reused)]
        fresh = num_blocks - reused
        ids += range(self._next_unused, self._next_unused + fresh)
        self._next_unused += fresh
        self.tables[request_id] = ids
        return ids

    def free(self, request_id: str) -> list[int]:
        """Release a request's CPU blocks; returns them in its token order."""
        ids = self.tables.pop(request_id)
        self._free.extend(reversed(ids))
        return ids


@dataclass(slots=True)
class SwapStep:
    """The swaps of one step: (GPU block, CPU block) pairs copied out, (CPU block, GPU
    block) pairs copied in, who moved, who fell back to recompute."""

    bytes_per_block: int
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_out_ids: list[str] = field(default_factory=list)
    swapped_in_ids: list[str] = field(default_factory=list)
    fallback_ids: list[str] = field(default_factory=list)
    # Swapped blocks a swap-in found still cached in HBM (reused, not copied).
    reused_blocks: int = 0
    # Requests in the SWAPPED queue after scheduling.
    num_swapped: int = 0
    # Seconds the engine charged for the copies (set by the engine, which owns time).
    transfer_s: float = 0.0

    @property
    def num_blocks_moved(self) -> int:
        return len(self.swap_out) + len(self.swap_in)


class Swapper:
    """Moves whole requests between the GPU block pool and a :class:`CpuBlockPool`."""

    def __init__(self, kv: KVCacheManager, num_cpu_blocks: int, bytes_per_block: int) -> None:
        self.kv = kv
        self.cpu = CpuBlockPool(num_cpu_blocks)
        self.bytes_per_block = bytes_per_block
        self.step = SwapStep(bytes_per_block)
        self.num_fallbacks = 0

    def take_step(self, num_swapped: int) -> SwapStep:
        """This step's swaps (and a fresh record for the next step)."""
        step = self.step
        step.num_swapped = num_swapped
        self.step = SwapStep(self.bytes_per_block)
        return step

    def swap_out(self, request: Request) -> bool:
        """Copy the blocks holding the request's computed tokens to CPU and free all its GPU
        blocks (hashed ones stay cached, evictable). False, with nothing changed, when the
        CPU pool lacks room (the caller recomputes instead) or nothing is computed."""
        kv = self.kv
        num_blocks = -(-request.num_computed_tokens // kv.block_size)
        if num_blocks == 0:
            return False
        cpu_ids = self.cpu.allocate(request.request_id, num_blocks)
        if cpu_ids is None:
            self.num_fallbacks += 1
            self.step.fallback_ids.append(request.request_id)
            return False
        gpu_ids = kv.req_to_blocks[request.request_id][:num_blocks]
        self.step.swap_out += zip(gpu_ids, cpu_ids, strict=True)
        self.step.swapped_out_ids.append(request.request_id)
        kv.free(request)
        return True

    def swap_in(self, request: Request, num_hit_blocks: int) -> None:
        """Record the copy back of a request the KV cache manager just gave its blocks: its
        first ``num_hit_blocks`` are prefix-cache hits (still in HBM, not copied), the rest
        of its CPU blocks go, in order, into the fresh blocks after them. Frees its CPU
        blocks."""
        cpu_ids = self.cpu.free(request.request_id)
        gpu_ids = self.kv.req_to_blocks[request.request_id][num_hit_blocks : len(cpu_ids)]
        self.step.swap_in += zip(cpu_ids[num_hit_blocks:], gpu_ids, strict=True)
        self.step.reused_blocks += num_hit_blocks
        self.step.swapped_in_ids.append(request.request_id)
