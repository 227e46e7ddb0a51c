"""A CPU offload tier, a what-if with vLLM 0.32's offloading connector (``engine.kv_offload_gib``).

``vllm serve --kv-offloading-size GiB`` (``kv_offloading_backend=native``) runs the
``OffloadingConnector`` with a CPU store of that many bytes. Read with vLLM's
``distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py`` (the scheduler side),
``v1/kv_offload/cpu/manager.py`` (the store) and ``v1/kv_offload/cpu/policies/lru.py`` (its
eviction order); the V1 scheduler's hooks are in ``v1/core/sched/scheduler.py``. What kvsim
follows, for one full-attention KV group with an offload chunk of one GPU block:

- **Store.** After every step, each scheduled request offers the full prompt blocks its
  computed tokens now cover and it has not offered before (vLLM's default
  ``offload_prompt_only``; prefix-cache hits included, but not the blocks it loaded). The
  store skips the ones it holds; for the rest it evicts least recently used entries that no
  load holds, never one of the offered blocks. When that cannot make room the whole offer is
  dropped (``prepare_store`` returns None) and made again with the request's next blocks. A
  stored entry is *pending* until its copy to host memory has finished, then readable.
- **Lookup.** A waiting request with nothing computed (new, or preempted and recomputing)
  first looks its blocks up in HBM's prefix cache, then the blocks after the HBM hits in the
  store: the run of consecutive entries up to the first miss. An entry still being stored
  (or being loaded for another request) defers the request: it is skipped this step and asks
  again the next. A hit shorter than one block is none.
- **Load.** A hit is loaded asynchronously: the request gets its blocks (the HBM hits and
  fresh ones for the loaded tokens, with vLLM's full-sequence check), takes no token budget
  and no running slot, and waits (``WAITING_FOR_REMOTE_KVS``) until the copy has finished.
  The copy's end releases its hold on the store's entries; the first step planned after it
  registers the loaded blocks in the prefix cache, recomputes
  the last token when the whole prompt was loaded, and schedules the rest of the prompt like
  any admission. Loads and stores run on their own copy streams beside the forward pass: a
  step does not wait for them, only the request waits for its load.
- **Time.** Host-to-device loads and device-to-host stores each go through one PCIe
  direction in submission order, ``bytes_per_block`` per block at the cost model's
  ``kv_transfer_time_s``. A load starts when the step that admitted it ends (vLLM submits
  it after that step's forward pass), a store when the step that computed its blocks ends;
  the scheduler sees a transfer finished at the first step it plans at or after the
  transfer's end.
- **Recency.** Storing makes an entry most recent; a lookup or a load does not. A finished
  request makes every block it offered or loaded most recent, its first block most of all
  (vLLM re-ranks the request's keys in reverse block order).

What kvsim leaves out: vLLM's store threshold and ARC policy (defaults: store at the first
offer, LRU); a store's fence on a freed block that is reused before the copy finished, and
the host's wait for a preempted request's stores (copies are short beside a step); the one
last offer vLLM makes for a request in the step after it finished (its prompt blocks were
offered as they were computed); and failed transfers. A finished request re-ranks its
blocks before the next step's stores, vLLM after them.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from sim.metrics import returning_turns
from sim.request import Request


class _Entry:
    """One stored block: its CPU slot, how many loads hold it, whether its copy is done."""

    __slots__ = ("cpu_id", "num_loads", "ready")

    def __init__(self, cpu_id: int) -> None:
        self.cpu_id = cpu_id
        self.num_loads = 0
        self.ready = False


class CpuOffloadStore:
    """vLLM's ``CPUOffloadingManager`` with its LRU policy, keyed by block hash.

    ``entries`` is in recency order, least recent first; an entry is evictable when it is
    ready and no load holds it.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks={num_blocks} must be >= 0")
        self.num_blocks = num_blocks
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self._next_unused = 0
        self._free: list[int] = []
        self.num_evicted = 0
        self.num_pending = 0  # entries whose store has not finished
        # Bumped whenever what a lookup answers can change (entries added, evicted, ready).
        self.version = 0

    @property
    def num_used_blocks(self) -> int:
        return len(self.entries)

    def lookup(self, hashes: list[int]) -> int | None:
        """Consecutive hits from the start of ``hashes`` (up to the first miss), or None when
        one of them is still being stored (the request must ask again later)."""
        found = list(map(self.entries.get, hashes))  # in C: a head of the queue asks often
        num_hits = found.index(None) if None in found else len(found)
        if self.num_pending and not all(entry.ready for entry in found[:num_hits]):
            return None
        return num_hits

    def touch(self, hashes: list[int]) -> None:
        """Make these entries most recent, the first most of all (vLLM touches in reverse)."""
        entries = self.entries
        for block_hash in reversed(hashes):
            if block_hash in entries:
                entries.move_to_end(block_hash)

    def hold(self, hashes: list[int]) -> list[int]:
        """A load starts: hold its (ready) entries against eviction; their CPU slots."""
        ids = []
        for block_hash in hashes:
            entry = self.entries[block_hash]
            assert entry.ready, block_hash
            entry.num_loads += 1
            ids.append(entry.cpu_id)
        return ids

    def release(self, hashes: list[int]) -> None:
        """A load finished: drop its hold."""
        for block_hash in hashes:
            self.entries[block_hash].num_loads -= 1

    def prepare_store(self, hashes: list[int]) -> list[tuple[int, int]] | None:
        """Offer blocks to store: (hash, CPU slot) of those newly stored (pending), after
        evicting least recent evictable entries not among the offer; None, with nothing
        changed, when eviction cannot make room (the offer is dropped)."""
        entries = self.entries
        new = [h for h in dict.fromkeys(hashes) if h not in entries]
        if not new:
            return []
        to_evict = len(new) - (self.num_blocks - self._next_unused + len(self._free))
        if to_evict > 0:
            offered = set(hashes)
            victims = []
            for block_hash, entry in entries.items():
                if entry.ready and not entry.num_loads and block_hash not in offered:
                    victims.append(block_hash)
                    if len(victims) == to_evict:
                        break
            if len(victims) < to_evict:
                return None
            for block_hash in victims:
                self._free.append(entries.pop(block_hash).cpu_id)
            self.num_evicted += len(victims)
        stored = []
        for block_hash in new:
            if self._next_unused < self.num_blocks:
                cpu_id = self._next_unused
                self._next_unused += 1
            else:
                cpu_id = self._free.pop()
            entries[block_hash] = _Entry(cpu_id)
            stored.append((block_hash, cpu_id))
        self.num_pending += len(stored)
        self.version += 1
        return stored

    def complete_store(self, hashes: list[int]) -> None:
        """Stores whose copy finished: their entries become ready (lookups can hit them)."""
        for block_hash in hashes:
            entry = self.entries[block_hash]  # pending entries are never evicted
            entry.ready = True
        self.num_pending -= len(hashes)
        self.version += 1


@dataclass(slots=True)
class _Transfer:
    """One copy: its request ("" for a step's stores), the blocks' hashes, and when it
    ends in simulated seconds (inf until it is started)."""

    request_id: str
    hashes: list[int]
    end_s: float = math.inf


@dataclass(slots=True)
class OffloadStep:
    """The offload tier's work in one step, for the steps table."""

    stored_blocks: int = 0  # blocks whose store was submitted after this step
    loaded_blocks: int = 0  # blocks whose load was submitted with this step
    # First admissions (not re-admissions after preemption), as vLLM's external prefix
    # cache metrics count them: tokens asked of the store (past the HBM hits), tokens hit.
    query_tokens: int = 0
    hit_tokens: int = 0
    # Blocks of offers the full store dropped, counted again each time a request re-offers
    # them (OffloadTotals.dropped_blocks_distinct counts each once).
    dropped_blocks: int = 0
    num_loading: int = 0  # requests waiting for their load after scheduling
    store_blocks_used: int = 0  # entries in the CPU store after the step
    transfer_s: float = 0.0  # PCIe seconds of the copies started (stores and loads)


@dataclass
class OffloadTotals:
    """Whole-run counters the steps table does not carry."""

    load_requests: int = 0  # loads started (one per admission that hit the store)
    deferred_lookups: int = 0  # lookups told to wait a step for a transfer
    load_wait_s: float = 0.0  # seconds requests waited for their loads, summed
    # Blocks whose offer the full store dropped at least once, each request's block once
    # (OffloadStep.dropped_blocks counts every re-offer).
    dropped_blocks_distinct: int = 0


class Offloader:
    """The offloading connector's scheduler side over a :class:`CpuOffloadStore`, with the
    copy streams' timing. The scheduler calls :meth:`lookup`, :meth:`start_load`,
    :meth:`load_done`, :meth:`on_finished`; the engine calls :meth:`set_time` before it
    plans a step, :meth:`after_schedule` once it knows when the step ends, and sets the
    transfer pricing (``transfer_time_s``)."""

    def __init__(
        self, num_blocks: int, block_size: int, bytes_per_block: int, tensor_parallel: int = 1
    ) -> None:
        """``bytes_per_block`` is one GPU's share of a block (what each GPU copies over its
        own link); the store holds every GPU's share, ``tensor_parallel`` of them."""
        self.store = CpuOffloadStore(num_blocks)
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.tensor_parallel = tensor_parallel
        self.now_s = 0.0
        # Seconds to copy n blocks one way; the engine sets the cost model's.
        self.transfer_time_s: Callable[[int], float] = lambda num_blocks: 0.0
        self._h2d_free_s = 0.0  # when the host-to-device stream is free
        self._d2h_free_s = 0.0
        self._stores: deque[_Transfer] = deque()  # in flight, in submission (= end) order
        self._new_loads: list[_Transfer] = []  # planned this step, started when it ends
        self.loads: dict[str, _Transfer] = {}  # in flight (or planned), by request
        self._loading_hashes: dict[int, int] = {}  # hash -> loads in flight reading it
        self._last_store_end_s: dict[str, float] = {}  # per request
        self._offered: dict[str, int] = {}  # blocks offered per request (next_stored_chunk_idx)
        self._dropped: dict[str, int] = {}  # per request, blocks up to which an offer dropped
        self._touched: dict[str, list[int]] = {}  # hashes a request offered or loaded
        self._load_planned_s: dict[str, float] = {}
        self._loaded: set[str] = set()  # loads ended, requests not yet promoted
        self._loads_version = 0
        self._memo: tuple[tuple[Request, int, int, int, int], int | None] | None = None
        self.step = OffloadStep()
        # The record of the step just planned (take_step), which after_schedule completes
        # with the copies that step starts; None once it has.
        self._planned: OffloadStep | None = None
        self.totals = OffloadTotals()

    # -- time ---------------------------------------------------------------------------------
    def set_time(self, now_s: float) -> None:
        """The clock when a step is planned: stores that ended by now become readable, loads
        that ended release their hold on the store (their requests are promoted when the
        scheduler reaches them: :meth:`load_done`)."""
        self.now_s = now_s
        stores = self._stores
        while stores and stores[0].end_s <= now_s:
            self.store.complete_store(stores.popleft().hashes)
        if self.loads and min(t.end_s for t in self.loads.values()) <= now_s:
            for request_id, transfer in list(self.loads.items()):
                if transfer.end_s <= now_s:
                    self._end_load(request_id, transfer)

    def next_event_s(self) -> float | None:
        """When the next transfer in flight ends (None: none is): an engine with nothing
        to run but loads to wait for, or lookups waiting for stores, wakes then."""
        ends = [t.end_s for t in self.loads.values()]
        if self._stores:
            ends.append(self._stores[0].end_s)
        return min(ends, default=None)

    # -- the scheduler's hooks ----------------------------------------------------------------
    def lookup(self, request: Request, num_local_blocks: int) -> int | None:
        """Blocks after the ``num_local_blocks`` HBM hits that the store can load for this
        request (0: none), or None when the request must wait (its own stores, a block it
        would hit still being stored, or being loaded for another request)."""
        request_id = request.request_id
        if self._last_store_end_s.get(request_id, -math.inf) > self.now_s:
            self.totals.deferred_lookups += 1
            return None
        # The head of a blocked queue asks every step: the answer stands while the store
        # and the loads in flight are unchanged.
        key = (
            request,
            request.num_tokens,
            num_local_blocks,
            self.store.version,
            self._loads_version,
        )
        if self._memo is not None and self._memo[0] == key:
            num_hits = self._memo[1]
        else:
            hashes = request.block_hashes
            candidates = hashes[num_local_blocks : request.num_tokens // self.block_size]
            num_hits = self.store.lookup(candidates) if candidates else 0
            if num_hits and self._loading_hashes:
                loading = self._loading_hashes
                if any(h in loading for h in candidates[:num_hits]):
                    num_hits = None
            self._memo = (key, num_hits)
        if num_hits is None:
            self.totals.deferred_lookups += 1
        return num_hits

    def count_lookup(self, request: Request, num_local_tokens: int, num_hit_tokens: int) -> None:
        """An admission that looked the store up (counted once it got its blocks, as vLLM
        counts ``external_prefix_cache_queries``/``hits``; re-admissions after a preemption
        apart, so not here)."""
        if not request.num_preemptions:
            self.step.query_tokens += request.num_tokens - num_local_tokens
            self.step.hit_tokens += num_hit_tokens

    def start_load(self, request: Request, first_block: int, num_blocks: int) -> None:
        """The request was given its blocks: copy blocks ``first_block ..`` of its table in
        from the store. The copy starts when this step's forward pass has ended."""
        request_id = request.request_id
        hashes = request.block_hashes[first_block : first_block + num_blocks]
        self.store.hold(hashes)
        transfer = _Transfer(request_id, hashes)
        self.loads[request_id] = transfer
        self._new_loads.append(transfer)
        self._loads_version += 1
        for block_hash in hashes:
            self._loading_hashes[block_hash] = self._loading_hashes.get(block_hash, 0) + 1
        self._touched.setdefault(request_id, []).extend(hashes)
        self._load_planned_s[request_id] = self.now_s
        self.totals.load_requests += 1
        self.step.loaded_blocks += num_blocks
        # Chunk-level policy: the hit and loaded blocks are not offered for storing.
        self._offered[request_id] = first_block + num_blocks

    def _end_load(self, request_id: str, transfer: _Transfer) -> None:
        del self.loads[request_id]
        self._loads_version += 1
        self.store.release(transfer.hashes)
        loading = self._loading_hashes
        for block_hash in transfer.hashes:
            if loading[block_hash] == 1:
                del loading[block_hash]
            else:
                loading[block_hash] -= 1
        self.totals.load_wait_s += transfer.end_s - self._load_planned_s.pop(request_id)
        self._loaded.add(request_id)

    def load_done(self, request: Request) -> bool:
        """Whether the request's load has ended (it may be promoted; asked once it has)."""
        if request.request_id not in self._loaded:
            return False
        self._loaded.remove(request.request_id)
        return True

    def on_finished(self, request: Request) -> None:
        """A finished request: every block it offered or loaded becomes most recent, its
        first block most of all."""
        self._offered.pop(request.request_id, None)
        self._dropped.pop(request.request_id, None)
        self._last_store_end_s.pop(request.request_id, None)
        touched = self._touched.pop(request.request_id, None)
        if touched:
            self.store.touch(list(dict.fromkeys(touched)))

    # -- the engine's hook --------------------------------------------------------------------
    def after_schedule(
        self, num_scheduled: dict[str, int], requests: dict[str, Request], end_s: float
    ) -> None:
        """The step just planned ends at ``end_s``: start its loads then, and offer the
        full prompt blocks its scheduled requests have computed by then (vLLM's
        ``offload_prompt_only``), copied out once the step has ended. Counted on that
        step's record (the one :meth:`take_step` just gave), so each row of the steps table
        holds the copies its own step started."""
        step = self._planned if self._planned is not None else self.step
        self._planned = None
        for transfer in self._new_loads:
            duration_s = self.transfer_time_s(len(transfer.hashes))
            transfer.end_s = self._h2d_free_s = max(end_s, self._h2d_free_s) + duration_s
            step.transfer_s += duration_s
        self._new_loads.clear()
        block_size = self.block_size
        offered = self._offered
        to_store: list[int] = []
        storers: list[str] = []
        for request_id in num_scheduled:
            request = requests[request_id]
            num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // block_size
            start = offered.get(request_id, 0)
            if num_full <= start:
                continue
            hashes = request.block_hashes[start:num_full]
            self._touched.setdefault(request_id, []).extend(hashes)
            stored = self.store.prepare_store(hashes)
            if stored is None:  # all or nothing; offered again with the next step's blocks
                step.dropped_blocks += len(hashes)
                counted = max(start, self._dropped.get(request_id, 0))
                if num_full > counted:
                    self.totals.dropped_blocks_distinct += num_full - counted
                    self._dropped[request_id] = num_full
                continue
            offered[request_id] = num_full
            if stored:
                to_store += [block_hash for block_hash, _ in stored]
                storers.append(request_id)
        if to_store:
            duration_s = self.transfer_time_s(len(to_store))
            self._d2h_free_s = max(end_s, self._d2h_free_s) + duration_s
            self._stores.append(_Transfer("", to_store, self._d2h_free_s))
            for request_id in storers:
                self._last_store_end_s[request_id] = self._d2h_free_s
            step.stored_blocks += len(to_store)
            step.transfer_s += duration_s
        step.store_blocks_used = self.store.num_used_blocks

    def take_step(self, num_loading: int) -> OffloadStep:
        """This step's record (and a fresh one for the next step); :meth:`after_schedule`
        adds the copies the step starts to it."""
        step = self.step
        step.num_loading = num_loading
        step.store_blocks_used = self.store.num_used_blocks
        self.step = OffloadStep()
        self._planned = step
        return step

    def carry(self, step: OffloadStep) -> None:
        """Give back a step record taken by a schedule that ran no step (nothing to run
        while loads were in flight): every count of it goes to the next step, and so do the
        copies :meth:`after_schedule` starts for it."""
        nxt = self.step
        nxt.stored_blocks += step.stored_blocks
        nxt.loaded_blocks += step.loaded_blocks
        nxt.query_tokens += step.query_tokens
        nxt.hit_tokens += step.hit_tokens
        nxt.dropped_blocks += step.dropped_blocks
        nxt.transfer_s += step.transfer_s
        if self._planned is step:
            self._planned = None


def offload_summary(
    offloaders: Iterable[Offloader],
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    duration_s: float,
    bytes_per_block: int,
) -> dict[str, Any]:
    """``summary.json``'s ``offload`` section: what the CPU store held and moved, its hits
    apart from HBM prefix hits, how long requests waited for loads, and what returning
    turns (turn >= 1 of a session) got. ``bytes_per_block`` is one GPU's share of a block;
    bytes stored and loaded are the whole engine's (every GPU's shard), as the store's size
    (``kv_offload_gib``, ``store_blocks``) is."""
    offloaders = list(offloaders)
    tensor_parallel = max((o.tensor_parallel for o in offloaders), default=1)
    engine_bytes_per_block = bytes_per_block * tensor_parallel

    def total(name: str) -> int:
        return int(steps[name].sum()) if len(steps) else 0

    query = total("offload_query_tokens")
    hits = total("offload_hit_tokens")
    loads = sum(o.totals.load_requests for o in offloaders)
    wait_s = sum(o.totals.load_wait_s for o in offloaders)
    transfer_s = float(steps["offload_transfer_s"].sum()) if len(steps) else 0.0
    # A fleet has a store per replica: its size and the share of time spent copying are one
    # replica's (the peak is any replica's fullest), the counts are summed over them.
    replicas = max(1, len(offloaders))
    fleet = (
        {
            "note": f"a fleet of {replicas} replicas, a store each: store_blocks is one "
            "replica's store, store_blocks_peak the fullest any got, transfer_time_frac their "
            "mean; the other counts are summed over the replicas"
        }
        if replicas > 1
        else {}
    )
    return {
        **fleet,
        "store_blocks": max((o.store.num_blocks for o in offloaders), default=0),
        "store_blocks_peak": int(steps["offload_store_blocks"].max()) if len(steps) else 0,
        "stored_blocks": total("offload_stored_blocks"),
        "stored_bytes": total("offload_stored_blocks") * engine_bytes_per_block,
        "dropped_blocks": total("offload_dropped_blocks"),
        "dropped_blocks_distinct": sum(o.totals.dropped_blocks_distinct for o in offloaders),
        "evicted_blocks": sum(o.store.num_evicted for o in offloaders),
        "query_tokens": query,
        "hit_tokens": hits,
        "hit_rate": hits / query if query else None,
        "loaded_blocks": total("offload_loaded_blocks"),
        "loaded_bytes": total("offload_loaded_blocks") * engine_bytes_per_block,
        "num_loads": loads,
        "load_wait_s_mean": wait_s / loads if loads else None,
        "deferred_lookups": sum(o.totals.deferred_lookups for o in offloaders),
        "transfer_time_s": transfer_s,
        "transfer_time_frac": transfer_s / (duration_s * replicas) if duration_s > 0 else None,
        "peak_requests_loading": int(steps["num_requests_loading"].max()) if len(steps) else 0,
        "returning_turns": returning_turns(requests),
    }
