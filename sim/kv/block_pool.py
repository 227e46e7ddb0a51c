"""The pool of paged KV blocks in HBM, ordered exactly as vLLM V1 orders them.

Mirrors ``vllm/v1/core/block_pool.py`` (vLLM 0.32):

- Block 0 is the *null block*: popped at start-up, never allocated, never freed. Usage is
  ``1 - free / (num_gpu_blocks - 1)``.
- The free queue starts in block-id order. New blocks are popped from the front; a popped
  block that still carried a prefix-cache hash is evicted from the cache at that moment.
- Freed blocks (ref count reaching 0) go back in the order given (the caller passes a
  request's blocks tail first): blocks without a hash to the *front* (reused first, LIFO),
  hashed blocks to the *tail* (kept as prefix cache, evicted LRU).
- A prefix hit on a block with ref count 0 takes it out of the free queue (``touch``).

The free queue is an ``OrderedDict`` keyed by block id: O(1) pop-front, append, prepend and
remove from the middle, like vLLM's hand-made doubly linked list.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import compress, islice, repeat
from operator import add, attrgetter, eq, is_not, not_, sub

import numpy as np

# The pool's bulk operations walk thousands of blocks per call (a long agent context is
# touched on admission and freed on finish): they iterate with map() and friends, in C.
_block_id = attrgetter("block_id")
_ref_cnt = attrgetter("ref_cnt")
_block_hash = attrgetter("block_hash")

# Evicted hashes the pool logs between two prefix lookups (see BlockPool.eviction_log); a
# batch of evictions is logged whole while the log is below the cap, so it can exceed it.
EVICTION_LOG_CAP = 4096


def _consume(iterator: Iterable[object]) -> None:
    deque(iterator, maxlen=0)


class KVBlock:
    """One block of ``block_size`` token slots in HBM."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        # Set while the block is registered in the prefix cache.
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """Allocates, frees and caches KV blocks; owns the free queue and the prefix-cache map."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks={num_gpu_blocks}: need the null block plus one")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_gpu_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        # vLLM does not de-duplicate identical blocks (two requests prefilling the same prefix
        # at once each cache theirs), and a lookup returns the earliest-registered one. Such
        # duplicates are rare, so the common case is one flat dict: hash -> first block;
        # ``duplicate_blocks`` holds {block_id: block} in registration order for hashes with
        # more than one holder (the first included).
        self.first_cached_block: dict[int, KVBlock] = {}
        self.duplicate_blocks: dict[int, dict[int, KVBlock]] = {}
        self.null_block = self.free_queue.popitem(last=False)[1]
        self.num_evicted_blocks = 0
        # The hashes evicted since the KV cache manager last emptied this log (its prefix
        # lookup memo reads it), up to EVICTION_LOG_CAP of them: when more pile up the log
        # is incomplete (shorter than the eviction count says) and the memo is dropped.
        self.eviction_log: list[int] = []

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_gpu_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks not in the free queue (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - len(self.free_queue) / (self.num_gpu_blocks - 1)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold prefix-cache content (evictable)."""
        return sum(1 for b in self.free_queue.values() if b.block_hash is not None)

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        """The block holding this prefix hash, if any (the earliest registered)."""
        return self.first_cached_block.get(block_hash)

    @property
    def cached_blocks(self) -> dict[int, dict[int, KVBlock]]:
        """hash -> {block_id: block} in registration order (a view for checks and reports)."""
        return {
            h: dict(self.duplicate_blocks.get(h) or {b.block_id: b})
            for h, b in self.first_cached_block.items()
        }

    def cached_block_ids(self) -> np.ndarray:
        """Ids of blocks in the prefix cache: all the free ones (evictable), and the owned
        ones too when walking every cached block is shorter than walking the free queue
        (each step touches a block object, the cost of a snapshot of the block map)."""
        first = self.first_cached_block
        if len(first) < len(self.free_queue):
            ids = np.fromiter(map(_block_id, first.values()), np.int64, count=len(first))
            if self.duplicate_blocks:
                more = [i for holders in self.duplicate_blocks.values() for i in holders]
                ids = np.concatenate([ids, np.asarray(more, dtype=np.int64)])
            return ids
        free = self.free_queue.values()
        hashed = map(is_not, map(_block_hash, free), repeat(None))
        return np.fromiter(map(_block_id, compress(free, hashed)), np.int64)

    def free_block_ids(self) -> list[int]:
        """Free queue order, front (allocated next) first."""
        return list(self.free_queue)

    # -- transitions --------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Pop ``num_blocks`` from the front of the free queue, evicting their cached hashes."""
        free_queue = self.free_queue
        if num_blocks > len(free_queue):
            raise ValueError(f"cannot get {num_blocks} free blocks from {len(free_queue)}")
        if num_blocks == 1:
            out = [free_queue.popitem(last=False)[1]]
        else:
            out = list(islice(free_queue.values(), num_blocks))
            _consume(map(free_queue.__delitem__, map(_block_id, out)))
        if self.enable_caching:
            hashes = list(map(_block_hash, out))
            if hashes.count(None) != num_blocks:
                hashed = list(map(is_not, hashes, repeat(None)))
                if self.duplicate_blocks:
                    for block in compress(out, hashed):
                        self.evict(block)
                else:
                    evicted = list(compress(hashes, hashed))
                    _consume(map(self.first_cached_block.__delitem__, evicted))
                    self.num_evicted_blocks += len(evicted)
                    if len(self.eviction_log) < EVICTION_LOG_CAP:
                        self.eviction_log += evicted
                    _consume(map(setattr, out, repeat("block_hash"), repeat(None)))
        _consume(map(setattr, out, repeat("ref_cnt"), repeat(1)))
        return out

    def evict(self, block: KVBlock) -> None:
        """Forget a block's prefix-cache hash (its content is about to be overwritten)."""
        block_hash = block.block_hash
        assert block_hash is not None
        holders = self.duplicate_blocks.get(block_hash)
        if holders is None:
            del self.first_cached_block[block_hash]
        else:
            del holders[block.block_id]
            self.first_cached_block[block_hash] = next(iter(holders.values()))
            if len(holders) == 1:
                del self.duplicate_blocks[block_hash]
        block.block_hash = None
        self.num_evicted_blocks += 1
        if len(self.eviction_log) < EVICTION_LOG_CAP:
            self.eviction_log.append(block_hash)

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue."""
        refs = list(map(_ref_cnt, blocks))
        num_free = refs.count(0)
        if num_free == len(refs):  # the common case: a whole freed context hit again
            _consume(map(self.free_queue.__delitem__, map(_block_id, blocks)))
            _consume(map(setattr, blocks, repeat("ref_cnt"), repeat(1)))
            return
        if num_free:
            free_queue = self.free_queue
            _consume(map(free_queue.__delitem__, compress(map(_block_id, blocks), map(not_, refs))))
        _consume(map(setattr, blocks, repeat("ref_cnt"), map(add, refs, repeat(1))))

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free queue.

        ``ordered_blocks`` is in eviction order (first = evicted first): un-hashed blocks are
        prepended in that order, hashed blocks appended in that order.
        """
        blocks = list(ordered_blocks)
        refs = list(map(_ref_cnt, blocks))
        if refs.count(1) == len(refs):  # the common case: a finished request's own blocks
            _consume(map(setattr, blocks, repeat("ref_cnt"), repeat(0)))
        else:
            assert 0 not in refs, blocks
            _consume(map(setattr, blocks, repeat("ref_cnt"), map(sub, refs, repeat(1))))
            blocks = list(compress(blocks, map(eq, refs, repeat(1))))
            if not blocks:
                return
        free_queue = self.free_queue
        if self.enable_caching:
            hashes = list(map(_block_hash, blocks))
            if None not in hashes:
                free_queue.update(zip(map(_block_id, blocks), blocks, strict=True))
                return
            hashed = list(map(is_not, hashes, repeat(None)))
            kept = list(compress(blocks, hashed))
            free_queue.update(zip(map(_block_id, kept), kept, strict=True))
            evict_first = list(compress(blocks, map(not_, hashed)))
        else:
            evict_first = blocks
        move_to_end = free_queue.move_to_end
        for block in reversed(evict_first):
            free_queue[block.block_id] = block
            move_to_end(block.block_id, last=False)

    def cache_full_blocks(
        self,
        block_hashes: Sequence[int],
        blocks: Sequence[KVBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under their hashes."""
        if num_full_blocks - num_cached_blocks == 1:  # a decode filled its last block
            block = blocks[num_cached_blocks]
            block_hash = block_hashes[num_cached_blocks]
            assert block.block_hash is None, block
            block.block_hash = block_hash
            self._register(block, block_hash)
            return
        first = self.first_cached_block
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        assert not any(map(is_not, map(_block_hash, new_blocks), repeat(None))), new_blocks
        _consume(map(setattr, new_blocks, repeat("block_hash"), new_hashes))
        if not any(map(first.__contains__, new_hashes)) and len(set(new_hashes)) == len(new_hashes):
            first.update(zip(new_hashes, new_blocks, strict=True))
            return
        _consume(map(self._register, new_blocks, new_hashes))

    def _register(self, block: KVBlock, block_hash: int) -> None:
        """Map a hash to its block (a second holder of a cached hash is a duplicate)."""
        holder = self.first_cached_block.get(block_hash)
        if holder is None:
            self.first_cached_block[block_hash] = block
        else:
            holders = self.duplicate_blocks.setdefault(block_hash, {holder.block_id: holder})
            holders[block.block_id] = block
