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

Blocks are plain ids (block tables are lists of ints) and the per-block state lives in numpy
arrays indexed by id (``ref_cnt``, ``block_hash`` with its ``hashed`` flag), so the bulk
operations (a long agent context touched on admission and freed on finish, a prefill's new
blocks) run vectorised instead of visiting one Python object per block.

The free queue is two arrays: every front insertion lands before everything else in the
queue, so it is a *front stack* (un-hashed frees, the top is the front of the queue)
followed by a *tail FIFO* (the initial blocks, then hashed frees, with a head index).
Only hashed free blocks are ever taken out of the middle (a prefix hit), and those are all
in the FIFO: a touch deletes lazily, by clearing the block's ``fifo_pos`` (the index of its
live FIFO entry); pops skip entries whose block no longer points at them, and the FIFO is
compacted when it runs out of room. ``num_free_blocks`` is kept exact.

The prefix cache is a dict from hash to the earliest-registered holder's id (duplicates,
rare, listed apart). Each eviction stamps the block with the running eviction count
(``evicted_at``), which lets the KV cache manager keep a prefix lookup across steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

import numpy as np


def _consume(iterator: Iterable[object]) -> None:
    deque(iterator, maxlen=0)


class BlockPool:
    """Allocates, frees and caches KV blocks; owns the free queue and the prefix-cache map."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool) -> None:
        if num_gpu_blocks < 2:
            raise ValueError(f"num_gpu_blocks={num_gpu_blocks}: need the null block plus one")
        n = num_gpu_blocks
        self.num_gpu_blocks = n
        self.enable_caching = enable_caching
        # Per-block state, indexed by block id.
        self.ref_cnt = np.zeros(n, dtype=np.int32)
        # A block's prefix-cache hash, meaningful while ``hashed`` is set (it is registered).
        self.block_hash = np.zeros(n, dtype=np.int64)
        self.hashed = np.zeros(n, dtype=bool)
        # ``num_evicted_blocks`` just after the block's last eviction (0: never evicted): a
        # prefix lookup made when the count was v still holds for a hit block unless this
        # is above v (see KVCacheManager._lookup).
        self.evicted_at = np.zeros(n, dtype=np.int64)
        # The free queue (see the module docstring). Block 0, the null block, is never in it.
        self._stack = np.empty(n, dtype=np.int64)  # front stack; [top - 1] is the front
        self._top = 0
        self._fifo = np.empty(2 * n, dtype=np.int64)
        self._fifo[: n - 1] = np.arange(1, n)
        self._head = 0
        self._tail = n - 1
        # Index in _fifo of the block's live FIFO entry, -1 when it has none.
        self._fifo_pos = np.full(n, -1, dtype=np.int64)
        self._fifo_pos[1:] = np.arange(n - 1)
        self.num_free_blocks = n - 1
        # vLLM does not de-duplicate identical blocks (two requests prefilling the same prefix
        # at once each cache theirs), and a lookup returns the earliest-registered one. Such
        # duplicates are rare, so the common case is one flat dict: hash -> first block id;
        # ``duplicate_blocks`` holds the ids in registration order for hashes with more than
        # one holder (the first included).
        self.first_cached_block: dict[int, int] = {}
        self.duplicate_blocks: dict[int, list[int]] = {}
        self.null_block = 0
        self.num_evicted_blocks = 0
        # The sum of the ref counts: references to blocks by the requests holding them.
        self.num_refs = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """All blocks but the null block."""
        return self.num_gpu_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks not in the free queue (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    @property
    def num_shared_refs(self) -> int:
        """References beyond the first to the blocks in use: a block held by k requests (a
        prefix they share) counts k - 1. Attention reads such a block once per holder."""
        return self.num_refs - (self.num_gpu_blocks - 1 - self.num_free_blocks)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold prefix-cache content (evictable)."""
        return int(np.count_nonzero(self.hashed & (self.ref_cnt == 0)))

    def block_hash_of(self, block_id: int) -> int | None:
        """The prefix-cache hash a block is registered under, None if it has none."""
        return int(self.block_hash[block_id]) if self.hashed[block_id] else None

    def get_cached_block(self, block_hash: int) -> int | None:
        """The id of the block holding this prefix hash, if any (the earliest registered)."""
        return self.first_cached_block.get(block_hash)

    @property
    def cached_blocks(self) -> dict[int, list[int]]:
        """hash -> block ids in registration order (a view for checks and reports)."""
        duplicates = self.duplicate_blocks
        return {h: list(duplicates.get(h) or (b,)) for h, b in self.first_cached_block.items()}

    def cached_block_ids(self) -> np.ndarray:
        """Ids of the blocks in the prefix cache, free (evictable) and owned."""
        return np.flatnonzero(self.hashed)

    def num_free_among(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks are free (ref count 0)."""
        if len(block_ids) == 1:
            return int(self.ref_cnt[block_ids[0]] == 0)
        return int(np.count_nonzero(self.ref_cnt[np.asarray(block_ids, dtype=np.int64)] == 0))

    def free_block_ids(self) -> list[int]:
        """Free queue order, front (allocated next) first."""
        fifo = self._fifo[self._head : self._tail]
        live = fifo[self._fifo_pos[fifo] == np.arange(self._head, self._tail)]
        return self._stack[: self._top][::-1].tolist() + live.tolist()

    # -- the free queue -----------------------------------------------------------------------
    def _pop_front(self, num_blocks: int) -> np.ndarray:
        """Take ``num_blocks`` (at most ``num_free_blocks``) from the front of the queue."""
        top = self._top
        from_stack = min(num_blocks, top)
        parts: list[np.ndarray] = []
        if from_stack:
            self._top = top - from_stack
            parts.append(self._stack[top - from_stack : top][::-1].copy())
        need = num_blocks - from_stack
        fifo = self._fifo
        fifo_pos = self._fifo_pos
        head = self._head
        while need:
            assert head < self._tail, "free count above the queue's live entries"
            # Live entries are at least `need` among the rest: read a chunk, keep its live ones.
            end = min(self._tail, head + need + (need >> 1) + 32)
            chunk = fifo[head:end]
            live = np.flatnonzero(fifo_pos[chunk] == np.arange(head, end))
            num_live = len(live)
            if num_live >= need:
                # Stop right after the need-th live entry.
                num_live = need
                end = head + int(live[need - 1]) + 1
                live = live[:need]
            taken = chunk[: end - head] if num_live == end - head else chunk[live]
            parts.append(taken)
            fifo_pos[taken] = -1
            need -= num_live
            head = end
        self._head = head
        self.num_free_blocks -= num_blocks
        if len(parts) == 1:
            # Possibly a view into the FIFO: the caller reads it before the FIFO changes.
            return parts[0]
        return np.concatenate(parts)

    def _pop_one(self) -> int:
        """The front block, taken out of the queue (the 1-block path, in plain Python)."""
        self.num_free_blocks -= 1
        if self._top:
            self._top -= 1
            return int(self._stack[self._top])
        fifo = self._fifo
        fifo_pos = self._fifo_pos
        head = self._head
        while True:
            block_id = int(fifo[head])
            if fifo_pos[block_id] == head:
                break
            head += 1
        fifo_pos[block_id] = -1
        self._head = head + 1
        return block_id

    def _push_front(self, block_ids: np.ndarray) -> None:
        """Prepend blocks one by one in the given order (the last ends up at the front)."""
        top = self._top
        self._stack[top : top + len(block_ids)] = block_ids
        self._top = top + len(block_ids)

    def _append(self, block_ids: np.ndarray) -> None:
        """Append blocks to the tail in the given order."""
        count = len(block_ids)
        if self._tail + count > len(self._fifo):
            self._compact(count)
        tail = self._tail
        self._fifo[tail : tail + count] = block_ids
        self._fifo_pos[block_ids] = np.arange(tail, tail + count)
        self._tail = tail + count

    def _compact(self, room: int) -> None:
        """Drop the FIFO's dead entries and move the live ones to the start, with ``room``
        more entries of space after them."""
        head, tail = self._head, self._tail
        fifo = self._fifo[head:tail]
        live = fifo[self._fifo_pos[fifo] == np.arange(head, tail)]
        size = max(len(self._fifo), 2 * (len(live) + room))
        new = np.empty(size, dtype=np.int64)
        new[: len(live)] = live
        self._fifo = new
        self._fifo_pos[live] = np.arange(len(live))
        self._head = 0
        self._tail = len(live)

    # -- transitions --------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` from the front of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks from {self.num_free_blocks}")
        if num_blocks <= 0:
            return []
        if num_blocks == 1:
            block_id = self._pop_one()
            if self.enable_caching and self.hashed[block_id]:
                self.evict(block_id)
            self.ref_cnt[block_id] = 1
            self.num_refs += 1
            return [block_id]
        ids = self._pop_front(num_blocks)
        if self.enable_caching:
            hashed = self.hashed[ids]
            if hashed.any():
                evicted_ids = ids[hashed]
                if self.duplicate_blocks:
                    _consume(map(self.evict, evicted_ids.tolist()))
                else:
                    evicted = self.block_hash[evicted_ids].tolist()
                    self.hashed[evicted_ids] = False
                    _consume(map(self.first_cached_block.__delitem__, evicted))
                    self.num_evicted_blocks += len(evicted)
                    self.evicted_at[evicted_ids] = self.num_evicted_blocks
        self.ref_cnt[ids] = 1
        self.num_refs += num_blocks
        return ids.tolist()

    def evict(self, block_id: int) -> None:
        """Forget a block's prefix-cache hash (its content is about to be overwritten)."""
        assert self.hashed[block_id], block_id
        block_hash = int(self.block_hash[block_id])
        holders = self.duplicate_blocks.get(block_hash)
        if holders is None:
            del self.first_cached_block[block_hash]
        else:
            holders.remove(block_id)
            self.first_cached_block[block_hash] = holders[0]
            if len(holders) == 1:
                del self.duplicate_blocks[block_hash]
        self.hashed[block_id] = False
        self.num_evicted_blocks += 1
        self.evicted_at[block_id] = self.num_evicted_blocks

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the free queue.

        The ids are distinct (one request's prefix hits), as in :meth:`free_blocks`: the
        array updates count a repeated id once."""
        if not len(block_ids):
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        refs = self.ref_cnt[ids]
        free = refs == 0
        num_free = int(np.count_nonzero(free))
        if num_free:
            # Free hashed blocks sit in the FIFO: drop their entries there (lazily).
            self._fifo_pos[ids if num_free == len(ids) else ids[free]] = -1
            self.num_free_blocks -= num_free
        self.ref_cnt[ids] = refs + 1
        self.num_refs += len(ids)

    def free_blocks(self, ordered_block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching 0 return to the free queue.

        ``ordered_block_ids`` is in eviction order (first = evicted first): un-hashed blocks
        are prepended in that order, hashed blocks appended in that order. The ids are
        distinct (one request's block table).
        """
        if not len(ordered_block_ids):
            return
        ids = np.asarray(ordered_block_ids, dtype=np.int64)
        refs = self.ref_cnt[ids]
        self.num_refs -= len(ids)
        last = refs == 1
        if last.all():  # the common case: a finished request's own blocks
            self.ref_cnt[ids] = 0
        else:
            assert refs.all(), ids
            self.ref_cnt[ids] = refs - 1
            ids = ids[last]
            if not len(ids):
                return
        self.num_free_blocks += len(ids)
        if self.enable_caching:
            hashed = self.hashed[ids]
            if hashed.all():
                self._append(ids)
                return
            if hashed.any():
                self._append(ids[hashed])
                ids = ids[~hashed]
        # Pushed in reverse eviction order, so the first ends up at the very front (vLLM's
        # prepend of the whole list).
        self._push_front(ids[::-1])

    def cache_full_blocks(
        self,
        block_hashes: Sequence[int],
        block_ids: Sequence[int],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register ``block_ids[num_cached_blocks:num_full_blocks]`` under their hashes."""
        if num_full_blocks - num_cached_blocks == 1:  # a decode filled its last block
            block_id = block_ids[num_cached_blocks]
            block_hash = block_hashes[num_cached_blocks]
            assert not self.hashed[block_id], block_id
            self.hashed[block_id] = True
            self.block_hash[block_id] = block_hash
            self._register(block_id, block_hash)
            return
        new_ids = block_ids[num_cached_blocks:num_full_blocks]
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        ids = np.asarray(new_ids, dtype=np.int64)
        assert not self.hashed[ids].any(), new_ids
        self.hashed[ids] = True
        self.block_hash[ids] = new_hashes
        # One pass over the map: each hash gets its block unless it already has a holder
        # (an earlier one, or a repeat within these blocks), which then stays first.
        holders = list(map(self.first_cached_block.setdefault, new_hashes, new_ids))
        if holders != new_ids:
            for block_id, block_hash, holder in zip(new_ids, new_hashes, holders, strict=True):
                if holder != block_id:
                    self.duplicate_blocks.setdefault(block_hash, [holder]).append(block_id)

    def _register(self, block_id: int, block_hash: int) -> None:
        """Map a hash to its block (a second holder of a cached hash is a duplicate)."""
        holder = self.first_cached_block.setdefault(block_hash, block_id)
        if holder != block_id:
            self.duplicate_blocks.setdefault(block_hash, [holder]).append(block_id)
