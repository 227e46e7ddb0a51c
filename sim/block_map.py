"""Snapshots of every KV block's state over a run: the HBM block map of the dashboard.

Each snapshot is one uint8 per block: 0 free, 1 cached-but-free (prefix cache, evictable),
2+k owned by a running request of priority class k, or by one waiting for its CPU offload
load (k capped so codes stay below 255), 255
retained: held by the what-if KV retention for a session expected back, and by no running
request. Snapshots are taken every ``interval``
steps; when more than ``max_snapshots`` pile up, every other one is dropped and the interval
doubles, so a run of any length keeps an evenly spaced map of bounded size.

A swap-preemption run (a what-if) also snapshots its CPU swap pool, one uint8 per CPU block:
0 free, 2+k holding the KV of a swapped-out request of class k (``cpu_states``): the swapped
KV lives on the host, so it is a map of its own beside the HBM one, where a swapped-out
request's blocks are freed.

A run with a CPU offload tier (a what-if) snapshots its CPU store the same way: 0 free, 1
stored (a readable copy of a prefix block, or one still being copied out), 2+k being loaded
into HBM for a request of class k. ``cpu_kind`` says which of the two the CPU map is.

Written as ``block_map.npz`` (``times_s``, ``steps``, ``states``, ``classes``, and
``cpu_states`` and ``cpu_kind`` for swap and offload runs) next to the run's other files;
measured runs have none.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from sim.scheduler.scheduler import Scheduler

FREE, CACHED, OWNED_BASE, RETAINED = 0, 1, 2, 255
BLOCK_MAP_FILE = "block_map.npz"


class BlockMapRecorder:
    """Takes evenly spaced block-state snapshots during a run."""

    def __init__(self, max_snapshots: int = 120, first_interval: int = 32) -> None:
        # Each snapshot costs ~2 ms on a 30k-block pool; with thinning a run takes about
        # max_snapshots x (1 + log2(steps / (first_interval x max_snapshots)) / 2) of them.
        self.max_snapshots = max_snapshots
        self.interval = first_interval
        self.times_s: list[float] = []
        self.steps: list[int] = []
        self.states: list[np.ndarray] = []
        self.cpu_states: list[np.ndarray] = []  # swap and offload runs, one per snapshot
        self.cpu_kind: str | None = None  # "swap" or "offload"
        self.classes: dict[str, int] = {}

    def owned_code(self, class_name: str) -> int:
        """The state code of a block held for a request of this priority class."""
        return min(OWNED_BASE + self.class_index(class_name), RETAINED - 1)

    def class_index(self, name: str) -> int:
        index = self.classes.get(name)
        if index is None:
            index = self.classes[name] = len(self.classes)
        return index

    def maybe_snapshot(
        self, step: int, now_s: float, scheduler: Scheduler, class_of: Callable[[str], str]
    ) -> None:
        """Snapshot after ``step`` (counted from 1) if it falls on the interval."""
        if (step - 1) % self.interval:
            return
        kv = scheduler.kv_cache_manager
        pool = kv.block_pool
        # Every block in the prefix cache is free or owned (by a running request, a request
        # waiting for its offload load, or a retention pin), and the owned ones are marked
        # next.
        states = np.zeros(pool.num_gpu_blocks, dtype=np.uint8)
        states[pool.cached_block_ids()] = CACHED
        retention = getattr(kv, "retention", None)
        if retention is not None:  # the what-if KV retention's held blocks
            states[retention.held_refs > 0] = RETAINED
        # Requests waiting for a CPU offload load hold their blocks too (the copy's
        # destination); listed first, so a block a running request shares shows its class.
        holders = chain(scheduler.loading, scheduler.running)
        owners = [
            (request.request_id, blocks)
            for request in holders
            if (blocks := kv.req_to_blocks.get(request.request_id))
        ]
        if owners:
            codes = [self.owned_code(class_of(request_id)) for request_id, _ in owners]
            lengths = [len(blocks) for _, blocks in owners]
            owned = np.fromiter(
                chain.from_iterable(blocks for _, blocks in owners),
                np.int64,
                count=sum(lengths),
            )
            # Request by request, in running order: a block shared by two running requests
            # (a common prefix) shows the class of the later one.
            start = 0
            for code, length in zip(codes, lengths, strict=True):
                states[owned[start : start + length]] = code
                start += length
        if scheduler.swapper is not None:
            cpu = scheduler.swapper.cpu
            cpu_states = np.zeros(cpu.num_blocks, dtype=np.uint8)
            for request_id, cpu_ids in cpu.tables.items():
                cpu_states[cpu_ids] = self.owned_code(class_of(request_id))
            self.cpu_states.append(cpu_states)
            self.cpu_kind = "swap"
        if scheduler.offloader is not None:
            self.cpu_states.append(self._offload_states(scheduler, class_of))
            self.cpu_kind = "offload"
        self.times_s.append(now_s)
        self.steps.append(step)
        self.states.append(states)
        if len(self.states) > self.max_snapshots:
            del self.times_s[1::2], self.steps[1::2], self.states[1::2], self.cpu_states[1::2]
            self.interval *= 2

    def _offload_states(self, scheduler: Scheduler, class_of: Callable[[str], str]) -> np.ndarray:
        offloader = scheduler.offloader
        assert offloader is not None
        store = offloader.store
        states = np.zeros(store.num_blocks, dtype=np.uint8)
        entries = store.entries
        if entries:
            ids = np.fromiter((e.cpu_id for e in entries.values()), np.int64, count=len(entries))
            states[ids] = CACHED
        for request_id, transfer in offloader.loads.items():
            ids = [entries[h].cpu_id for h in transfer.hashes]
            states[ids] = self.owned_code(class_of(request_id))
        return states

    def save(self, run_dir: Path) -> None:
        """Write ``block_map.npz`` into a run directory (or its staging folder)."""
        arrays = {
            "times_s": np.asarray(self.times_s, dtype=np.float64),
            "steps": np.asarray(self.steps, dtype=np.int64),
            "states": np.stack(self.states) if self.states else np.zeros((0, 0), np.uint8),
            "classes": np.asarray(list(self.classes), dtype=str),
        }
        if self.cpu_states:
            arrays["cpu_states"] = np.stack(self.cpu_states)
            arrays["cpu_kind"] = np.asarray(self.cpu_kind, dtype=str)
        np.savez_compressed(Path(run_dir) / BLOCK_MAP_FILE, **arrays)
