"""Session-aware KV retention during tool waits: a what-if vLLM 0.32 does not run.

vLLM frees a finished request's blocks at once: its full blocks stay in the prefix cache, but
at the tail of the free queue, where any allocation may evict them while the agent waits for
its tool. With retention on, a finished turn whose session is expected back (its request's
:class:`sim.workload.base.SessionHint` says ``returns``) keeps the reference it held on its
full, prefix-cached blocks in a *holder* instead of dropping it: the blocks stay out of the
free queue, so they cannot be evicted, and count as used (they occupy HBM; ``kv usage`` and
``free blocks`` in the steps table include them). The partial last block (no hash) and any
blocks past what the next turn re-sends are freed at finish, as ``free`` would have freed
them. The block pool is untouched: a holder is one more reference on its blocks.

A holder is released (its blocks freed tail first, in the order ``free`` would have freed
them; blocks the next turn already touched merely drop to that turn's reference):

- on return: when the session's next turn is admitted, after its prefix lookup touched
  the blocks (so it hits them all); a request of the session that arrived before the pin
  (another sub-call of the same fan-out turn, admitted late) leaves it in place;
- on expiry: ``ttl`` after the turn finished (``policy: ttl`` and ``free_floor``: ``ttl_s``;
  ``policy: tool_latency``: the ``quantile`` of the session's tool-latency distribution).
  The pin covers the closed interval [finish, finish + ttl]; once the session's next
  request has *arrived* (it is then queued for admission and its lookup wants the blocks)
  the holder no longer expires and waits for that admission;
- early (``policy: free_floor`` only): whenever free blocks are below ``free_floor`` of the
  usable pool, the oldest holders (by finish time) are released until the floor is met or
  none is left; checked before every allocation and lookup and after each retention;
- starved (every policy): when nothing is running and the waiting queue's head cannot be
  admitted, the oldest holders are released one by one until it can (a pin must not leave
  the GPU idle with work queued). Running requests that cannot grow are preempted as
  usual: that is what the pins cost.

The KV cache manager has no clock, so expiry is lazy: every ``allocate_slots``,
``get_computed_blocks`` and ``free`` of a retaining manager first releases the holders whose
time has passed (their idle block-seconds are counted to the exact expiry time). A step's
scheduler decisions are all taken at one simulated instant, so nothing the scheduler sees
differs from releasing them at the exact time. A fixed TTL of 0 is read as ``policy: none``
(``sim/config/retention.py``); a ``tool_latency`` TTL of 0 (a session without a tool
latency) retains nothing.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import pandas as pd

from sim.config.retention import RetentionConfig
from sim.kv.block_pool import BlockPool
from sim.metrics import returning_turns
from sim.request import Request

RETURN, EXPIRY, FLOOR, STARVED = "return", "expiry", "floor", "starved"


class RetentionHolder:
    """The extra reference a finished turn's session keeps on its prefix blocks."""

    __slots__ = ("block_ids", "expiry_s", "returned", "seq", "session_id", "start_s")

    def __init__(
        self, session_id: int, block_ids: list[int], start_s: float, expiry_s: float, seq: int
    ) -> None:
        self.session_id = session_id
        self.block_ids = block_ids
        self.start_s = start_s
        self.expiry_s = expiry_s
        # The session's next turn has arrived (a request of the session arrived after the
        # pin): no expiry any more, and its admission releases the pin.
        self.returned = False
        self.seq = seq


class KVRetention:
    """The holders of one KV cache manager, their release rules and their counters."""

    def __init__(self, config: RetentionConfig, pool: BlockPool, clock: Callable[[], float]):
        if config.policy == "none":
            raise ValueError("kv_retention.policy is none: nothing to retain")
        self.config = config
        self.pool = pool
        self.clock = clock
        self.policy = config.policy
        # Fewest free blocks while anything is held (free_floor only; -1: no floor).
        self.floor_blocks = (
            math.ceil(config.free_floor * pool.num_usable_blocks)
            if config.policy == "free_floor"
            else -1
        )
        # Session id -> holder, oldest first (a session has at most one).
        self.holders: dict[int, RetentionHolder] = {}
        # (expiry, seq, session id) of live holders (stale entries skipped when popped).
        self._expiries: list[tuple[float, int, int]] = []
        self._seq = 0
        # Holder references per block: a block several holders share (the system prompt
        # every session starts with) is one block of HBM.
        self.held_refs = np.zeros(pool.num_gpu_blocks, dtype=np.int32)
        self.num_held_blocks = 0  # distinct blocks with a holder reference
        self._last_change_s = 0.0
        # Counters for summary.json's retention section.
        self.num_retentions = 0
        self.num_retained_blocks = 0
        self.num_releases = {RETURN: 0, EXPIRY: 0, FLOOR: 0, STARVED: 0}
        self.num_blocks_hit_on_return = 0
        self.peak_held_blocks = 0
        self.held_block_s = 0.0  # integral of num_held_blocks over time, up to _last_change_s

    # -- policy -------------------------------------------------------------------------------
    def ttl_s(self, request: Request) -> float:
        """How long this finished request's blocks may stay pinned."""
        if self.policy == "tool_latency":
            hint = request.session_hint
            if hint is None or hint.tool_latency is None:
                return 0.0
            return float(hint.tool_latency.quantile(self.config.quantile))
        return self.config.ttl_s

    def blocks_to_keep(self, request: Request, blocks: list[int], num_cached: int) -> int:
        """How many leading blocks of a finished request to retain (0: free it as today)."""
        hint = request.session_hint
        if hint is None or not hint.returns or self.ttl_s(request) <= 0:
            return 0
        keep = num_cached  # the full blocks registered in the prefix cache
        if hint.num_reused_tokens is not None:
            keep = min(keep, hint.num_reused_tokens // request.block_size)
        return keep

    # -- transitions --------------------------------------------------------------------------
    def retain(self, request: Request, block_ids: list[int]) -> None:
        """Hold ``block_ids`` (in token order; the request's reference passes to the holder)."""
        hint = request.session_hint
        assert hint is not None and block_ids
        now = self.clock()
        old = self.holders.get(hint.session_id)
        if old is not None:  # not admitted back here before this turn (another replica)
            self._release(old, EXPIRY, now)
        self._seq += 1
        expiry_s = now + self.ttl_s(request)
        holder = RetentionHolder(hint.session_id, block_ids, now, expiry_s, self._seq)
        self.holders[hint.session_id] = holder
        heapq.heappush(self._expiries, (expiry_s, self._seq, hint.session_id))
        self.num_retentions += 1
        self.num_retained_blocks += len(block_ids)
        self._advance(now)
        ids = np.asarray(block_ids, dtype=np.int64)
        refs = self.held_refs[ids]
        self.num_held_blocks += int(np.count_nonzero(refs == 0))
        self.held_refs[ids] = refs + 1
        if self.num_held_blocks > self.peak_held_blocks:
            self.peak_held_blocks = self.num_held_blocks
        if self.floor_blocks >= 0:
            self._keep_floor(now)

    def num_shared_request_refs(self) -> int:
        """``BlockPool.num_shared_refs`` without the holders' references: references beyond
        the first to blocks in use, counting requests only (a holder reads nothing)."""
        by_requests = self.pool.ref_cnt - self.held_refs
        return int(np.maximum(by_requests - 1, 0).sum())

    def tick(self) -> None:
        """Release what is due now: expired holders, then (free_floor) the oldest ones
        while free blocks are below the floor."""
        expiries = self._expiries
        if expiries:
            now = self.clock()
            while expiries and expiries[0][0] < now:
                expiry_s, seq, session_id = heapq.heappop(expiries)
                holder = self.holders.get(session_id)
                if holder is not None and holder.seq == seq and not holder.returned:
                    self._release(holder, EXPIRY, expiry_s)
        if self.floor_blocks >= 0 and self.holders:
            self._keep_floor(self.clock())

    def on_arrival(self, request: Request) -> None:
        """A request arrived: if its session still holds blocks (a pin that expired before
        now is released first, at its expiry), they wait for its admission."""
        hint = request.session_hint
        if hint is not None:
            self.tick()
            holder = self.holders.get(hint.session_id)
            if holder is not None:
                holder.returned = True

    def on_admit(self, request: Request) -> None:
        """A request was admitted (its prefix hits touched): if it is its session's next
        turn, the session's holder goes. Only a request that arrived after the pin is (see
        :meth:`on_arrival`): the other sub-calls of a fan-out turn arrive with the one that
        pinned and may be admitted after it finished (queued, re-admitted after a
        preemption, swapped in); their admission leaves the pin for the next turn."""
        hint = request.session_hint
        if hint is not None:
            holder = self.holders.get(hint.session_id)
            if holder is not None and holder.returned:
                ids = np.asarray(holder.block_ids, dtype=np.int64)
                self.num_blocks_hit_on_return += int(np.count_nonzero(self.pool.ref_cnt[ids] > 1))
                self._release(holder, RETURN, self.clock())

    def release_oldest(self) -> bool:
        """Release the oldest holder because the engine cannot go on without its blocks
        (nothing running and the queue's head does not fit, or a lone running request cannot
        grow); False if there is none."""
        if not self.holders:
            return False
        self._release(next(iter(self.holders.values())), STARVED, self.clock())
        return True

    def _keep_floor(self, now: float) -> None:
        holders = self.holders
        pool = self.pool
        while holders and pool.num_free_blocks < self.floor_blocks:
            self._release(next(iter(holders.values())), FLOOR, now)

    def _advance(self, now: float) -> None:
        """Add the held blocks' block-seconds since the last change (times never go back:
        a lazy expiry is never earlier than a change already counted)."""
        if now > self._last_change_s:
            self.held_block_s += self.num_held_blocks * (now - self._last_change_s)
            self._last_change_s = now

    def _release(self, holder: RetentionHolder, reason: str, end_s: float) -> None:
        del self.holders[holder.session_id]
        self._advance(end_s)
        ids = np.asarray(holder.block_ids, dtype=np.int64)
        refs = self.held_refs[ids] - 1
        self.held_refs[ids] = refs
        self.num_held_blocks -= int(np.count_nonzero(refs == 0))
        self.pool.free_blocks(holder.block_ids[::-1])
        self.num_releases[reason] += 1

    # -- results ------------------------------------------------------------------------------
    def held_block_s_until(self, end_s: float) -> float:
        """Block-seconds of distinct held blocks up to ``end_s``, the live holders counted to
        their expiry (or ``end_s``, whichever is first) without releasing them."""
        total = self.held_block_s
        last_s = self._last_change_s
        held = self.num_held_blocks
        refs = self.held_refs.copy()
        ends = sorted(
            (end_s if holder.returned else min(holder.expiry_s, end_s), holder.seq, holder)
            for holder in self.holders.values()
        )
        for until_s, _, holder in ends:
            until_s = max(until_s, last_s)
            total += held * (until_s - last_s)
            last_s = until_s
            ids = np.asarray(holder.block_ids, dtype=np.int64)
            refs[ids] -= 1
            held -= int(np.count_nonzero(refs[ids] == 0))
        return total


def retention_summary(
    config: RetentionConfig,
    retentions: Iterable[KVRetention],
    requests: pd.DataFrame,
    duration_s: float,
) -> dict[str, Any]:
    """``summary.json``'s ``retention`` section: the policy, what returning turns (turn >= 1
    of a session) got from the prefix cache and how fast they started, and what the pins
    cost (blocks held idle, releases by reason, preemptions)."""
    retentions = list(retentions)
    block_s = sum(r.held_block_s_until(duration_s) for r in retentions)
    return {
        "policy": config.policy,
        "config": config.model_dump(mode="json"),
        "returning_turns": returning_turns(requests),
        "num_preemptions": int(requests["num_preemptions"].sum()),
        "num_retentions": sum(r.num_retentions for r in retentions),
        "num_retained_blocks": sum(r.num_retained_blocks for r in retentions),
        "num_released_on_return": sum(r.num_releases[RETURN] for r in retentions),
        "num_expirations": sum(r.num_releases[EXPIRY] for r in retentions),
        "num_early_releases": sum(r.num_releases[FLOOR] for r in retentions),
        "num_starved_releases": sum(r.num_releases[STARVED] for r in retentions),
        "num_blocks_hit_on_return": sum(r.num_blocks_hit_on_return for r in retentions),
        "held_block_s": block_s,
        "mean_held_blocks": block_s / duration_s if duration_s > 0 else 0.0,
        "peak_held_blocks": max((r.peak_held_blocks for r in retentions), default=0),
    }
