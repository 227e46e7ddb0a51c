"""KV allocators behind the paged KV cache manager's interface: the baselines paging replaced.

``engine.allocator`` picks one (:func:`make_kv_manager`):

- ``paged`` (the default): vLLM's block tables (:class:`sim.kv.kv_cache_manager.KVCacheManager`),
  blocks taken one at a time as tokens arrive, full blocks shared through the prefix cache.
- ``static``: one contiguous region of ``max_model_len`` tokens per request, reserved when the
  request is admitted and held until it finishes (HuggingFace-style static allocation).
- ``orca_max`` / ``orca_pow2`` / ``orca_oracle``: Orca-style contiguous reservation of the
  prompt plus ``max_model_len`` (the PagedAttention paper's "Orca (Max)", which reserves
  ``max_model_len`` in all), the next power of two of the output length ("Orca (Pow2)") or the
  true output length ("Orca (Oracle)"), each capped at ``max_model_len``. The output length is
  the request's ``max_tokens``: a simulated request always generates exactly that many tokens.

The contiguous allocators share one address space of the paged pool's usable blocks (block ids
1 .. num_gpu_blocks - 1; id 0 stays vLLM's null block), so every allocator has the same HBM
capacity. A region is a run of whole blocks (a reservation that is not a multiple of
``block_size`` rounds up: that rounding is a contiguous allocator's internal fragmentation),
placed first-fit. Admission fails when no free gap holds the whole reservation, and the
scheduler then stops admitting (head-of-line, as vLLM's waiting loop does). A running request
never outgrows its reservation, so ``allocate_slots`` never fails for it and nobody is ever
preempted. There is no prefix cache: a contiguous region is private to its request.

A region is exposed as a ``range`` of block ids in ``req_to_blocks``, so the step table's
``kv_unused_slots`` (held slots minus computed tokens) and the HBM block map read a contiguous
allocator as they read block tables.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from sim.kv.kv_cache_manager import KVCacheManager, cdiv
from sim.request import Request, RequestStatus

if TYPE_CHECKING:
    from sim.config.engine import EngineConfig

CONTIGUOUS_KINDS: tuple[str, ...] = ("static", "orca_max", "orca_pow2", "orca_oracle")


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


def reservation_tokens(kind: str, request: Request, max_model_len: int) -> int:
    """Tokens a contiguous allocator of ``kind`` reserves for ``request`` at admission."""
    if kind in ("static", "orca_max"):
        return max_model_len
    if kind == "orca_pow2":
        output = next_power_of_two(request.max_tokens)
    elif kind == "orca_oracle":
        output = request.max_tokens
    else:
        raise ValueError(f"engine.allocator={kind!r} is not a contiguous allocator")
    return min(request.num_prompt_tokens + output, max_model_len)


class ContiguousSpace:
    """The pool-side counters the scheduler, recorder and block map read (``block_pool``)."""

    def __init__(self, num_gpu_blocks: int) -> None:
        self.num_gpu_blocks = num_gpu_blocks
        self.num_usable_blocks = num_gpu_blocks - 1
        self.num_free_blocks = self.num_usable_blocks
        self.num_cached_free_blocks = 0
        self.num_evicted_blocks = 0

    @property
    def usage(self) -> float:
        """Fraction of usable blocks reserved (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def cached_block_ids(self) -> np.ndarray:
        """No prefix cache: no cached blocks."""
        return np.zeros(0, dtype=np.int64)


class ContiguousKVManager:
    """Contiguous per-request reservations, with the paged manager's interface."""

    enable_caching = False

    def __init__(
        self,
        kind: str,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        watermark: float = 0.0,
    ) -> None:
        if kind not in CONTIGUOUS_KINDS:
            raise ValueError(f"engine.allocator={kind!r} is not a contiguous allocator")
        self.kind = kind
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.block_pool = ContiguousSpace(num_gpu_blocks)
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        # Each request's region as a range of block ids, and its reservation in tokens.
        self.req_to_blocks: dict[str, range] = {}
        self.reserved_tokens: dict[str, int] = {}
        self.num_cached_block: dict[str, int] = {}
        # Start block of every region, sorted, and each start's region length in blocks.
        self._starts: list[int] = []
        self._lengths: dict[int, int] = {}

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_shared_refs(self) -> int:
        """No prefix cache: no block has two holders."""
        return 0

    @property
    def shared_kv_tokens(self) -> int:
        """No prefix cache: no KV block is re-read."""
        return 0

    def block_table(self, request_id: str) -> list[int]:
        """Block ids of a request's region, in order."""
        return list(self.req_to_blocks.get(request_id, ()))

    def reservation_blocks(self, request: Request) -> int:
        """Blocks the request's region takes."""
        return cdiv(reservation_tokens(self.kind, request, self.max_model_len), self.block_size)

    def gaps(self) -> list[tuple[int, int]]:
        """Free runs of blocks as (first block id, length), in address order."""
        out: list[tuple[int, int]] = []
        cursor = 1
        for start in self._starts:
            if start > cursor:
                out.append((cursor, start - cursor))
            cursor = start + self._lengths[start]
        end = self.block_pool.num_gpu_blocks
        if end > cursor:
            out.append((cursor, end - cursor))
        return out

    def _first_fit(self, num_blocks: int) -> int | None:
        cursor = 1
        for start in self._starts:
            if start - cursor >= num_blocks:
                return cursor
            cursor = start + self._lengths[start]
        if self.block_pool.num_gpu_blocks - cursor >= num_blocks:
            return cursor
        return None

    # -- the KV cache manager's interface -----------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """No prefix cache: never a hit."""
        return [], 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[int] = (),
        num_lookahead_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
    ) -> list[int] | None:
        """Reserve the request's region at its admission (None if no free gap holds it, or
        if it would leave fewer free blocks than the watermark); a running request's slots
        are already reserved, so growing it returns no new blocks and never fails."""
        region = self.req_to_blocks.get(request.request_id)
        if region is not None:
            need = request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
            assert min(need, self.max_model_len) <= self.reserved_tokens[request.request_id], (
                f"request {request.request_id} outgrew its reservation"
            )
            return []
        assert not new_computed_blocks and not num_new_computed_tokens
        tokens = reservation_tokens(self.kind, request, self.max_model_len)
        num_blocks = cdiv(tokens, self.block_size)
        pool = self.block_pool
        watermark_blocks = 0
        if has_scheduled_reqs and request.status is not RequestStatus.RUNNING:
            watermark_blocks = self.watermark_blocks
        if num_blocks + watermark_blocks > pool.num_free_blocks:
            return None
        start = self._first_fit(num_blocks)
        if start is None:
            return None
        insort(self._starts, start)
        self._lengths[start] = num_blocks
        pool.num_free_blocks -= num_blocks
        region = range(start, start + num_blocks)
        self.req_to_blocks[request.request_id] = region
        self.reserved_tokens[request.request_id] = tokens
        self.num_cached_block[request.request_id] = 0
        return list(region)

    def admission_blocked(self, request: Request) -> tuple[bool, int | None]:
        """Whether admitting this waiting request now fails (no gap holds its region, with
        the watermark of a step that already scheduled someone); no hash can unblock it."""
        num_blocks = self.reservation_blocks(request)
        if num_blocks + self.watermark_blocks > self.block_pool.num_free_blocks:
            return True, None
        return self._first_fit(num_blocks) is None, None

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """No prefix cache: nothing to register."""

    def on_arrival(self, request: Request) -> None:
        """A request arrived at the engine (only the paged manager's KV retention listens;
        retention needs prefix caching, which contiguous allocation has not)."""

    def free(self, request: Request) -> None:
        """Release the request's region."""
        region = self.req_to_blocks.pop(request.request_id, None)
        self.reserved_tokens.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if region is None:
            return
        start = region.start
        del self._starts[bisect_left(self._starts, start)]
        del self._lengths[start]
        self.block_pool.num_free_blocks += len(region)


KVManager = KVCacheManager | ContiguousKVManager


def make_kv_manager(config: EngineConfig, num_gpu_blocks: int) -> KVManager:
    """The KV cache manager ``config.allocator`` names, over ``num_gpu_blocks`` blocks (the
    null block included)."""
    if config.allocator == "paged":
        return KVCacheManager(
            num_gpu_blocks=num_gpu_blocks,
            block_size=config.block_size,
            max_model_len=config.max_model_len,
            enable_caching=config.enable_prefix_caching,
            watermark=config.watermark,
        )
    return ContiguousKVManager(
        config.allocator,
        num_gpu_blocks=num_gpu_blocks,
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        watermark=config.watermark,
    )
