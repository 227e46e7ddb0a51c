"""Block tables per request on top of the block pool, as vLLM V1's ``KVCacheManager``.

One full-attention KV cache group (every decoder-only dense model), so this folds vLLM's
``KVCacheManager`` -> ``KVCacheCoordinator`` -> ``FullAttentionManager`` chain into one class.
Read with ``vllm/v1/core/kv_cache_manager.py`` and ``single_type_kv_cache_manager.py``.
Blocks are ids into the pool's arrays (see ``sim/kv/block_pool.py``): a block table is a
list of ints, prefix hits and new blocks are lists of ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from sim.config.retention import RetentionConfig
from sim.kv.block_pool import BlockPool
from sim.kv.retention import KVRetention
from sim.request import Request, RequestStatus


class _LookupMemo:
    """The last prefix lookup: its request, the block count it could hit, the pool's
    eviction count it is valid at, its hits, and (built on first need) the hits as an
    array."""

    __slots__ = ("hit_array", "hits", "max_blocks", "request", "version")

    def __init__(self, request: Request, max_blocks: int, version: int, hits: list[int]) -> None:
        self.request = request
        self.max_blocks = max_blocks
        self.version = version
        self.hits = hits
        self.hit_array: np.ndarray | None = None


def _short(pool: BlockPool, needed: int, hits: Sequence[int]) -> bool:
    """Whether ``needed`` free blocks plus one per prefix hit on a free (ref 0) block exceed
    the pool's free blocks: touching a free hit takes it out of the free queue, so it costs
    a free block like a fresh allocation. The hits are only counted when the bounds (none
    or all of them free) do not decide."""
    num_free = pool.num_free_blocks
    if needed > num_free:
        return True
    if needed + len(hits) <= num_free:
        return False
    return needed + pool.num_free_among(hits) > num_free


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates slots for scheduled tokens, finds prefix hits, caches full blocks, frees."""

    def __init__(
        self,
        num_gpu_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = True,
        watermark: float = 0.0,
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_gpu_blocks, enable_caching)
        # vLLM counts the watermark against all blocks, the null block included.
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        # Block ids per request, in token order.
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        # get_computed_blocks' last answer.
        self._lookup_memo: _LookupMemo | None = None
        # The what-if KV retention (see enable_retention); None: vLLM's free at finish.
        self.retention: KVRetention | None = None

    def enable_retention(self, config: RetentionConfig, clock: Callable[[], float]) -> None:
        """Turn on session-aware KV retention (``sim/kv/retention.py``), reading simulated
        time from ``clock``. The retaining versions of allocate_slots, get_computed_blocks,
        free and on_arrival replace the plain ones on this instance, so a manager without
        retention runs exactly the code it ran before (no branch on its hot path)."""
        retention = KVRetention(config, self.block_pool, clock)
        self.retention = retention
        plain_allocate = self.allocate_slots
        plain_lookup = self.get_computed_blocks
        plain_free = self.free
        tick = retention.tick

        def allocate_slots(request: Request, *args: object, **kwargs: object) -> list[int] | None:
            tick()
            if request.request_id in self.req_to_blocks:
                new_blocks = plain_allocate(request, *args, **kwargs)  # type: ignore[arg-type]
                # Nor a lone running request: it would preempt itself to free HBM that only
                # pins hold (and be re-admitted once they go).
                while new_blocks is None and len(self.req_to_blocks) == 1:
                    if not retention.release_oldest():
                        break
                    new_blocks = plain_allocate(request, *args, **kwargs)  # type: ignore[arg-type]
                return new_blocks
            new_blocks = plain_allocate(request, *args, **kwargs)  # type: ignore[arg-type]
            # Pins never starve an engine with nothing running: its queue's head would wait
            # for them forever (or until they expire) with the GPU idle.
            while new_blocks is None and not kwargs.get("has_scheduled_reqs", True):
                if not retention.release_oldest():
                    break
                new_blocks = plain_allocate(request, *args, **kwargs)  # type: ignore[arg-type]
            if new_blocks is not None:
                retention.on_admit(request)
            return new_blocks

        def get_computed_blocks(request: Request) -> tuple[list[int], int]:
            tick()
            return plain_lookup(request)

        def free(request: Request) -> None:
            tick()
            if request.status is not RequestStatus.FINISHED_LENGTH_CAPPED:
                plain_free(request)  # a preemption: recompute frees as vLLM does
                return
            blocks = self.req_to_blocks.get(request.request_id)
            num_cached = self.num_cached_block.get(request.request_id, 0)
            keep = retention.blocks_to_keep(request, blocks, num_cached) if blocks else 0
            if not keep:
                plain_free(request)
                return
            del self.req_to_blocks[request.request_id]
            del self.num_cached_block[request.request_id]
            # The rest as free would have freed it (tail first), the kept head held.
            rest = blocks[keep:]
            if rest:
                self.block_pool.free_blocks(rest[::-1])
            retention.retain(request, blocks[:keep])

        self.allocate_slots = allocate_slots  # type: ignore[method-assign]
        self.get_computed_blocks = get_computed_blocks  # type: ignore[method-assign]
        self.free = free  # type: ignore[method-assign]
        self.on_arrival = retention.on_arrival  # type: ignore[method-assign]

    def on_arrival(self, request: Request) -> None:
        """A request arrived at the engine (only KV retention listens)."""

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_shared_refs(self) -> int:
        """References beyond the first that requests hold to blocks in use (a shared prefix
        once per holder beyond the first): ``BlockPool.num_shared_refs``, less KV retention's
        holders, which read nothing."""
        retention = self.retention
        if retention is None or not retention.num_held_blocks:
            return self.block_pool.num_shared_refs
        return retention.num_shared_request_refs()

    @property
    def shared_kv_tokens(self) -> int:
        """``BatchShape.shared_kv_tokens`` now: :attr:`num_shared_refs` full blocks."""
        return self.num_shared_refs * self.block_size

    def block_table(self, request_id: str) -> list[int]:
        """Block ids of a request, in token order."""
        return list(self.req_to_blocks.get(request_id, ()))

    # -- prefix cache -------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest chain of cached full blocks matching the request, and its token count.

        Capped at ``num_tokens - 1``: with every token cached the last one must still be
        computed to produce logits, which recomputes its whole block.
        """
        hits = self._lookup(request)
        return list(hits), len(hits) * self.block_size

    def _lookup(self, request: Request) -> list[int]:
        """:meth:`get_computed_blocks`' hits, not copied: the memo's own list (read only)."""
        if not self.enable_caching:
            return []
        max_blocks = (len(request.token_ids) - 1) // self.block_size
        pool = self.block_pool
        get = pool.first_cached_block.get
        hashes = request.block_hashes
        # The scheduler asks again for the head of the queue every step it cannot admit it.
        # Registrations only add holders behind a hash's first block and only the eviction
        # of that block changes it, so the last answer for this request still stands up to
        # its first hit block evicted since (the pool stamps evictions): look further from
        # there.
        version = pool.num_evicted_blocks
        memo = self._lookup_memo
        if memo is not None and memo.request is request and memo.max_blocks == max_blocks:
            hits = memo.hits
            if version != memo.version:
                if hits:
                    hit_array = memo.hit_array
                    if hit_array is None or len(hit_array) != len(hits):
                        hit_array = np.asarray(hits, dtype=np.int64)
                    stale = np.flatnonzero(pool.evicted_at[hit_array] > memo.version)
                    if len(stale):
                        cut = int(stale[0])
                        del hits[cut:]
                        hit_array = hit_array[:cut]
                    memo.hit_array = hit_array
                memo.version = version
            num_hits = len(hits)
            if num_hits < max_blocks and get(hashes[num_hits]) is not None:
                more = list(map(get, hashes[num_hits:max_blocks]))
                if None in more:
                    del more[more.index(None) :]
                hits += more
        else:
            # Look every hash up in C, then cut at the first miss.
            hits = list(map(get, hashes[:max_blocks]))
            if None in hits:
                del hits[hits.index(None) :]
            self._lookup_memo = _LookupMemo(request, max_blocks, version, hits)
        return hits

    # -- allocation ---------------------------------------------------------------------------
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
        """Give the request slots for ``num_new_tokens`` more tokens, or None if HBM is short.

        The scheduler sets ``full_sequence_must_fit`` when admitting a waiting request: its
        whole current sequence must fit (vLLM's ``scheduler_reserve_full_isl``, on by
        default), so chunked prefill cannot admit a prompt it could never finish. The
        watermark applies only to waiting/preempted requests when something is already
        scheduled. Full blocks are cached now, at scheduling time, so a request admitted
        later in this very step can already hit them (as in vLLM).
        """
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None:
            # A running request growing: the hot path of every decode step.
            assert not num_new_computed_tokens and not full_sequence_must_fit
            return self._grow(
                request, blocks, num_new_tokens + num_lookahead_tokens, num_new_tokens
            )
        return self._admit(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            full_sequence_must_fit,
            has_scheduled_reqs,
        )

    def _grow(
        self, request: Request, blocks: list[int], num_slot_tokens: int, num_new_tokens: int
    ) -> list[int] | None:
        num_computed = request.num_computed_tokens
        num_tokens_need_slot = num_computed + num_slot_tokens
        if num_tokens_need_slot > self.max_model_len:
            num_tokens_need_slot = self.max_model_len
        num_new_blocks = -(-num_tokens_need_slot // self.block_size) - len(blocks)
        new_blocks: list[int] = []
        if num_new_blocks > 0:
            pool = self.block_pool
            if num_new_blocks > pool.num_free_blocks:
                return None
            new_blocks = pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
        if self.enable_caching:
            num_tokens_to_cache = num_computed + num_new_tokens
            num_tokens = len(request.token_ids)
            if num_tokens_to_cache > num_tokens:
                num_tokens_to_cache = num_tokens
            if num_tokens_to_cache // self.block_size > self.num_cached_block[request.request_id]:
                self.cache_blocks(request, num_tokens_to_cache)
        return new_blocks

    def _admit(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: Sequence[int],
        num_lookahead_tokens: int,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
    ) -> list[int] | None:
        assert num_new_tokens > 0 or num_new_computed_tokens > 0
        pool = self.block_pool
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_computed, self.max_model_len)
        watermark_blocks = 0
        if has_scheduled_reqs and request.status is not RequestStatus.RUNNING:
            watermark_blocks = self.watermark_blocks
        # A prefix hit on a free (ref 0) block takes it out of the free queue, so it costs a
        # free block just like a fresh allocation.
        num_hit = len(new_computed_blocks)
        if full_sequence_must_fit and _short(
            pool,
            self._full_sequence_new_blocks(request, num_hit) + watermark_blocks,
            new_computed_blocks,
        ):
            return None

        num_tokens_need_slot = min(
            total_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_new_blocks = max(cdiv(num_tokens_need_slot, self.block_size) - num_hit, 0)
        if _short(pool, num_new_blocks + watermark_blocks, new_computed_blocks):
            return None

        if self.enable_caching:
            pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks[request.request_id] = list(new_computed_blocks)
        self.num_cached_block[request.request_id] = num_hit
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            num_tokens_to_cache = min(total_computed + num_new_tokens, request.num_tokens)
            self.cache_blocks(request, num_tokens_to_cache)
        return new_blocks

    # -- the CPU offload tier (sim/kv/offload.py) ------------------------------------------------
    def allocate_for_load(
        self,
        request: Request,
        hits: Sequence[int],
        num_external_tokens: int,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> bool:
        """Admit a request whose next ``num_external_tokens`` after its ``hits`` are loaded
        from the CPU offload tier: vLLM's ``allocate_slots`` with no new tokens,
        ``num_external_computed_tokens`` and ``delay_cache_blocks`` (the loaded blocks are
        registered once the load has finished: :meth:`cache_blocks`), the full-sequence
        check, and ``reserved_blocks`` kept free for the prefills in flight. False, with
        nothing changed, when the blocks are short."""
        pool = self.block_pool
        num_hit = len(hits)
        watermark_blocks = self.watermark_blocks if has_scheduled_reqs else 0
        if _short(pool, self._full_sequence_new_blocks(request, num_hit) + watermark_blocks, hits):
            return False
        total = min(num_hit * self.block_size + num_external_tokens, self.max_model_len)
        num_new_blocks = max(cdiv(total, self.block_size) - num_hit, 0)
        if _short(pool, num_new_blocks + watermark_blocks + reserved_blocks, hits):
            return False
        if self.enable_caching:
            pool.touch(hits)
        blocks = self.req_to_blocks[request.request_id] = list(hits)
        self.num_cached_block[request.request_id] = num_hit
        blocks.extend(pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else ())
        return True

    def allocate_after_load(
        self, request: Request, num_new_tokens: int, has_scheduled_reqs: bool
    ) -> list[int] | None:
        """Schedule the rest of a request whose load has finished (it holds its blocks and
        is WAITING or PREEMPTED): vLLM's ``allocate_slots`` with the full-sequence check and
        the watermark of an admission."""
        blocks = self.req_to_blocks[request.request_id]
        watermark_blocks = self.watermark_blocks if has_scheduled_reqs else 0
        full = cdiv(min(request.num_tokens, self.max_model_len), self.block_size)
        if full - len(blocks) + watermark_blocks > self.block_pool.num_free_blocks:
            return None
        need = min(request.num_computed_tokens + num_new_tokens, self.max_model_len)
        if cdiv(need, self.block_size) - len(blocks) + watermark_blocks > (
            self.block_pool.num_free_blocks
        ):
            return None
        return self._grow(request, blocks, num_new_tokens, num_new_tokens)

    def remaining_blocks(self, request: Request) -> int:
        """Blocks the request still needs to hold its whole sequence (vLLM's
        ``_request_remaining_blocks``)."""
        full = cdiv(min(request.num_tokens, self.max_model_len), self.block_size)
        return max(full - len(self.req_to_blocks.get(request.request_id, ())), 0)

    def _full_sequence_new_blocks(self, request: Request, num_hit: int) -> int:
        """Blocks beyond its ``num_hit`` prefix hits that the request's whole sequence takes
        (the hits on free blocks cost a free block too: see :func:`_short`)."""
        full_num_tokens = min(request.num_tokens, self.max_model_len)
        return max(cdiv(full_num_tokens, self.block_size) - num_hit, 0)

    def admission_blocked(self, request: Request) -> tuple[bool, int | None]:
        """Whether the scheduler would refuse to admit this waiting request now for want of
        free blocks (the full-sequence check of :meth:`allocate_slots`, with the watermark
        of a step that already scheduled someone), and the hash of its first block that
        misses the prefix cache (None if all that can hit do).

        The refusal holds for as long as the free queue only shrinks and that missing hash
        is not registered: evictions never lower the need (a lost hit on a free block
        frees its cost too), and only that registration can add hits.
        """
        hits = self._lookup(request)
        needed = self._full_sequence_new_blocks(request, len(hits)) + self.watermark_blocks
        blocked = _short(self.block_pool, needed, hits)
        miss: int | None = None
        if self.enable_caching and len(hits) < (len(request.token_ids) - 1) // self.block_size:
            miss = request.block_hashes[len(hits)]
        return blocked, miss

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks up to ``num_tokens`` in the prefix cache."""
        request_id = request.request_id
        num_cached = self.num_cached_block[request_id]
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request.block_hashes, self.req_to_blocks[request_id], num_cached, num_full
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first so the prefix cache evicts tails first."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])
