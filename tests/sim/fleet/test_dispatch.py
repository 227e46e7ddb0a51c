"""The dispatcher: what a router sees of each replica, and its in-flight counts."""

from __future__ import annotations

from typing import Any

import simpy

from sim.fleet.dispatch import FleetDispatcher, Replica
from sim.fleet.routers import ReplicaView, Router, RoutingKey
from sim.recorder import Recorder
from sim.request import Request
from sim.workload.base import RequestMeta


class FakeEngine:
    """Takes a request and finishes it when the test says so."""

    def __init__(self, env: simpy.Environment, recorder: Recorder) -> None:
        self.env = env
        self.recorder = recorder
        self.block_size = 16
        self.max_model_len = 4096
        self.done: list[simpy.Event] = []

    def submit(self, request: Request, meta: RequestMeta) -> simpy.Event:
        event = self.env.event()
        self.done.append(event)
        return event


class Fixed(Router):
    """Always the same replica; remembers what it was shown."""

    def __init__(self, num_replicas: int, target: int) -> None:
        super().__init__(num_replicas)
        self.target = target
        self.seen: list[list[ReplicaView]] = []

    def choose(self, key: RoutingKey, views: Any) -> int:
        self.seen.append(list(views))
        return self.target


def recorded(steps: list[tuple[float, float, int, int, float]]) -> Recorder:
    """A recorder holding steps (start, duration, running, waiting, usage)."""
    recorder = Recorder(16)
    for start, duration, running, waiting, usage in steps:
        recorder.steps["start_s"].append(start)
        recorder.steps["duration_s"].append(duration)
        recorder.steps["num_requests_running"].append(running)
        recorder.steps["num_requests_waiting"].append(waiting)
        recorder.steps["kv_cache_usage_perc"].append(usage)
    return recorder


def fleet_at(now_s: float, view_delay_s: float) -> tuple[FleetDispatcher, list[FakeEngine]]:
    env = simpy.Environment(initial_time=now_s)
    # Replica 0: a step ending at 4 s and one ending exactly at 10 s; replica 1: none yet.
    recorders = [recorded([(0.0, 4.0, 2, 1, 0.1), (4.0, 6.0, 3, 0, 0.3)]), recorded([])]
    engines = [FakeEngine(env, recorder) for recorder in recorders]
    replicas = [Replica(i, engine) for i, engine in enumerate(engines)]  # type: ignore[arg-type]
    return FleetDispatcher(env, replicas, Fixed(2, 0), view_delay_s), engines


def test_a_step_ending_now_is_not_seen_yet() -> None:
    dispatcher, _ = fleet_at(10.0, 0.0)
    assert dispatcher.views() == [ReplicaView(0, 0, 2, 1, 0.1), ReplicaView(1, 0, 0, 0, 0.0)]


def test_the_view_delay_hides_the_last_seconds_of_reports() -> None:
    dispatcher, _ = fleet_at(10.1, 0.0)
    assert dispatcher.views()[0] == ReplicaView(0, 0, 3, 0, 0.3)
    dispatcher, _ = fleet_at(10.1, 5.0)  # reports up to 5.1 s: the first step only
    assert dispatcher.views()[0] == ReplicaView(0, 0, 2, 1, 0.1)
    dispatcher, _ = fleet_at(10.1, 7.0)  # up to 3.1 s: nothing reported yet
    assert dispatcher.views()[0] == ReplicaView(0, 0, 0, 0, 0.0)


def test_in_flight_counts_submits_until_the_request_finishes() -> None:
    dispatcher, engines = fleet_at(10.1, 0.0)
    meta = RequestMeta()
    for i in range(2):
        dispatcher.submit(Request(f"r{i}", [1, 2, 3], max_tokens=2, block_size=16), meta)
    assert dispatcher.in_flight == [2, 0]
    assert dispatcher.assignments == [0, 0]
    engines[0].done[0].succeed()
    dispatcher.env.run()
    assert dispatcher.in_flight == [1, 0]
    # The router saw its own count, current at each submit.
    assert [v[0].in_flight for v in dispatcher.router.seen] == [0, 1]  # type: ignore[attr-defined]
