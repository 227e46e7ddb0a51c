"""Block-map snapshots against a block-by-block reading of the pool at the same moment."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

import sim.runner
from dashboard.loaders import read_block_map
from sim.block_map import CACHED, FREE, OWNED_BASE, BlockMapRecorder
from sim.runner import simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.scheduler.scheduler import Scheduler


class CheckedBlockMap(BlockMapRecorder):
    """Checks every snapshot it takes against the pool read block by block."""

    instances: ClassVar[list[CheckedBlockMap]] = []

    def __init__(self) -> None:
        super().__init__(max_snapshots=10_000, first_interval=3)
        self.checked = 0
        self.with_cached_free = 0  # snapshots showing evictable prefix-cache blocks
        CheckedBlockMap.instances.append(self)

    def maybe_snapshot(
        self, step: int, now_s: float, scheduler: Scheduler, class_of: Callable[[str], str]
    ) -> None:
        taken = len(self.states)
        pool = scheduler.kv_cache_manager.block_pool
        super().maybe_snapshot(step, now_s, scheduler, class_of)
        if len(self.states) == taken:
            return
        expected = np.full(pool.num_gpu_blocks, FREE, dtype=np.uint8)
        # Read from the prefix-cache map (hash -> holders), not the pool's per-block flags.
        for holders in pool.cached_blocks.values():
            expected[holders] = CACHED
        tables = scheduler.kv_cache_manager.req_to_blocks
        for request in scheduler.running:
            code = OWNED_BASE + self.classes[class_of(request.request_id)]
            for block_id in tables[request.request_id]:
                expected[block_id] = code
        np.testing.assert_array_equal(self.states[-1], expected)
        self.checked += 1
        self.with_cached_free += bool((expected == CACHED).any())


@pytest.mark.parametrize("num_blocks", [600, 20_000])
def test_snapshots_match_the_pool_block_by_block(
    monkeypatch: pytest.MonkeyPatch, num_blocks: int
) -> None:
    # A tight pool (evicting) and a roomy one; priority classes share the system prompt's
    # blocks.
    scenario = load_scenario(
        SCENARIO_DIR / "priority-mix.yaml",
        [
            f"engine.num_gpu_blocks_override={num_blocks}",
            "engine.max_model_len=8192",
            "workload.max_context_tokens=8192",
            "workload.sessions=12",
            "limits.max_duration_s=120",
        ],
    )
    CheckedBlockMap.instances.clear()
    monkeypatch.setattr(sim.runner, "BlockMapRecorder", CheckedBlockMap)
    simulate(scenario)
    (block_map,) = CheckedBlockMap.instances
    assert block_map.checked > 20
    assert len(block_map.classes) >= 2
    assert block_map.with_cached_free > 0


class CheckedCpuMap(BlockMapRecorder):
    """Checks every CPU map snapshot against the CPU pool at that moment: the swap pool's
    tables here, the offload store in :class:`CheckedOffloadMap`."""

    instances: ClassVar[list[CheckedCpuMap]] = []

    def __init__(self) -> None:
        super().__init__(max_snapshots=10_000, first_interval=3)
        self.with_held = 0  # snapshots showing blocks held for a request
        type(self).instances.append(self)

    def maybe_snapshot(
        self, step: int, now_s: float, scheduler: Scheduler, class_of: Callable[[str], str]
    ) -> None:
        taken = len(self.states)
        super().maybe_snapshot(step, now_s, scheduler, class_of)
        if len(self.states) > taken:
            self.check(scheduler, class_of)

    def check(self, scheduler: Scheduler, class_of: Callable[[str], str]) -> None:
        """The snapshot just taken, against the CPU pool now."""
        assert len(self.cpu_states) == len(self.states)
        expected, held = self.expected(scheduler, class_of)
        np.testing.assert_array_equal(self.cpu_states[-1], expected)
        self.with_held += held

    def expected(
        self, scheduler: Scheduler, class_of: Callable[[str], str]
    ) -> tuple[np.ndarray, bool]:
        assert scheduler.swapper is not None
        cpu = scheduler.swapper.cpu
        expected = np.full(cpu.num_blocks, FREE, dtype=np.uint8)
        for request_id, cpu_ids in cpu.tables.items():
            for block_id in cpu_ids:
                expected[block_id] = OWNED_BASE + self.classes[class_of(request_id)]
        return expected, bool(cpu.tables)


def test_a_swap_run_snapshots_its_cpu_swap_pool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    overrides = [
        "workload.sessions=32",
        "engine.num_gpu_blocks_override=2100",
        "limits.max_duration_s=600",
    ]
    scenario = load_scenario(
        SCENARIO_DIR / "priority-mix.yaml",
        [*overrides, "engine.preemption_mode=swap", "engine.swap_space_gib=2"],
    )
    CheckedCpuMap.instances.clear()
    monkeypatch.setattr(sim.runner, "BlockMapRecorder", CheckedCpuMap)
    result = simulate(scenario)
    (block_map,) = CheckedCpuMap.instances
    assert block_map.with_held > 2
    assert result.summary["swap"]["num_swap_outs"] > 0
    monkeypatch.undo()
    # Written beside the HBM map and read back as the dashboard reads it; a run without swap
    # writes no CPU map.
    result.write(tmp_path / "swap")
    read = read_block_map(tmp_path / "swap")
    assert read is not None and read.cpu_states is not None
    assert read.cpu_states.shape == (len(read.times_s), 1024)  # 2 GiB of 2 MiB blocks
    simulate(load_scenario(SCENARIO_DIR / "priority-mix.yaml", overrides)).write(tmp_path / "plain")
    with np.load(tmp_path / "plain" / "block_map.npz") as npz:
        assert "cpu_states" not in npz.files
    plain = read_block_map(tmp_path / "plain")
    assert plain is not None and plain.cpu_states is None


class CheckedOffloadMap(CheckedCpuMap):
    """Checks every CPU offload store snapshot against the store at that moment."""

    instances: ClassVar[list[CheckedCpuMap]] = []
    with_loading = 0  # snapshots with a request waiting for its load

    def check(self, scheduler: Scheduler, class_of: Callable[[str], str]) -> None:
        super().check(scheduler, class_of)
        # A request waiting for its load holds its HBM blocks (the copy's destination):
        # owned, in its class (unless a running request shares them), never free.
        tables = scheduler.kv_cache_manager.req_to_blocks
        running = {b for r in scheduler.running for b in tables[r.request_id]}
        for request in scheduler.loading:
            code = OWNED_BASE + self.classes[class_of(request.request_id)]
            blocks = [b for b in tables[request.request_id] if b not in running]
            assert blocks and (self.states[-1][blocks] == code).all()
            self.with_loading += 1

    def expected(
        self, scheduler: Scheduler, class_of: Callable[[str], str]
    ) -> tuple[np.ndarray, bool]:
        offloader = scheduler.offloader
        assert offloader is not None
        store = offloader.store
        expected = np.full(store.num_blocks, FREE, dtype=np.uint8)
        for entry in store.entries.values():
            expected[entry.cpu_id] = CACHED
        for request_id, transfer in offloader.loads.items():
            for block_hash in transfer.hashes:
                code = OWNED_BASE + self.classes[class_of(request_id)]
                expected[store.entries[block_hash].cpu_id] = code
        return expected, bool(offloader.loads)


def test_an_offload_run_snapshots_its_cpu_store(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    scenario = load_scenario(
        SCENARIO_DIR / "priority-mix.yaml",
        [
            "workload.sessions=32",
            "engine.num_gpu_blocks_override=2100",
            "limits.max_duration_s=600",
            "engine.kv_offload_gib=2",
        ],
    )
    CheckedOffloadMap.instances.clear()
    monkeypatch.setattr(sim.runner, "BlockMapRecorder", CheckedOffloadMap)
    result = simulate(scenario)
    (block_map,) = CheckedOffloadMap.instances
    assert block_map.with_held > 0
    assert isinstance(block_map, CheckedOffloadMap) and block_map.with_loading > 0
    assert result.summary["offload"]["num_loads"] > 0
    monkeypatch.undo()
    result.write(tmp_path / "offload")
    read = read_block_map(tmp_path / "offload")
    assert read is not None and read.cpu_states is not None and read.cpu_kind == "offload"
    assert read.cpu_states.shape == (len(read.times_s), 1024)  # 2 GiB of 2 MiB blocks
