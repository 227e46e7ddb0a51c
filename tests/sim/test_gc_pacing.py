"""sim/gc_pacing.py: the collector's pace during a run, and the caller's restored after it."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from sim import gc_pacing
from sim.gc_pacing import MIDDLE_EVERY, OLD_EVERY, YOUNG_THRESHOLD, paced_collection
from sim.runner import simulate
from sim.scenario import DEFAULT_SCENARIO, load_scenario

PACED = (YOUNG_THRESHOLD, MIDDLE_EVERY, OLD_EVERY)
CALLER = (531, 7, 9)


@pytest.fixture
def caller_thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    gc.set_threshold(*CALLER)
    yield
    gc.set_threshold(*before)


def test_paces_inside_and_restores_after(caller_thresholds: None) -> None:
    with paced_collection():
        assert gc.get_threshold() == PACED
    assert gc.get_threshold() == CALLER
    assert gc_pacing._depth == 0


def test_restores_when_the_body_raises(caller_thresholds: None) -> None:
    with pytest.raises(RuntimeError, match="boom"), paced_collection():
        raise RuntimeError("boom")
    assert gc.get_threshold() == CALLER
    assert gc_pacing._depth == 0


def test_nested_and_threaded_runs_restore_once_the_last_one_leaves(
    caller_thresholds: None,
) -> None:
    inside = threading.Event()
    release = threading.Event()

    def other_run() -> None:
        with paced_collection():
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=other_run)
    with paced_collection():
        worker.start()
        assert inside.wait(5)
        with paced_collection():
            assert gc.get_threshold() == PACED
        assert gc.get_threshold() == PACED  # the inner one left, two runs are still in
    assert gc.get_threshold() == PACED  # the other thread's run is still in
    release.set()
    worker.join(5)
    assert gc.get_threshold() == CALLER


def test_a_run_leaves_the_collector_as_it_found_it(caller_thresholds: None) -> None:
    scenario = load_scenario(DEFAULT_SCENARIO, ["workload.sessions=4"])
    seen: list[tuple[int, int, int]] = []
    simulate(scenario, progress=lambda *_: seen.append(gc.get_threshold()))
    assert seen and set(seen) == {PACED}
    assert gc.get_threshold() == CALLER
