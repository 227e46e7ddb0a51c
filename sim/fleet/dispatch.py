"""The fleet as a workload sees it: one request sink that routes every submit to a replica.

Each replica is a whole :class:`sim.engine.Engine` (own scheduler, block pool, cost model
and recorder) on the fleet's SimPy clock. On each submit the dispatcher builds the routers'
views (its own in-flight counts; each replica's queue lengths and KV usage as reported by
its last step that ended more than ``view_delay_s`` before now), asks the router, and hands
the request to that replica's engine. Reported metrics come from the steps a replica has
recorded, so the fast path (which records a stretch's steps ahead) and the
step-by-step reference show a router the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import simpy

from sim.engine import Engine
from sim.fleet.routers import ReplicaView, Router, RoutingKey
from sim.recorder import Recorder
from sim.request import Request
from sim.scheduler.scheduler import Scheduler
from sim.workload.base import RequestMeta


@dataclass
class Replica:
    """One engine of the fleet."""

    index: int
    engine: Engine

    @property
    def scheduler(self) -> Scheduler:
        return self.engine.scheduler

    @property
    def recorder(self) -> Recorder:
        return self.engine.recorder


class _Reported:
    """Walks a replica's recorded steps up to a cut-off time (cut-offs never go back)."""

    __slots__ = ("cursor", "recorder")

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.cursor = 0  # steps ended before the last cut-off

    def last_before(self, cutoff_s: float) -> int:
        """Index of the last step that ended before ``cutoff_s`` (-1 if none).

        A step's end is read back as ``start_s + duration_s``, which can be an ulp off the
        time its step really ended; a step ending within two ulps of the cut-off counts as
        not ended, so that a step ending at the very instant of an arrival is hidden from
        the router whether or not the engine has recorded it yet (the fast path records a
        stretch's steps ahead, the reference when each ends)."""
        steps = self.recorder.steps
        start, duration = steps["start_s"], steps["duration_s"]
        before = cutoff_s - 2 * math.ulp(cutoff_s)
        n, i = len(start), self.cursor
        while i < n and start[i] + duration[i] < before:
            i += 1
        self.cursor = i
        return i - 1


class FleetDispatcher:
    """A ``RequestSink`` in front of the replicas (see the module docstring)."""

    def __init__(
        self,
        env: simpy.Environment,
        replicas: Sequence[Replica],
        router: Router,
        view_delay_s: float,
    ) -> None:
        self._env = env
        self.replicas = list(replicas)
        self.router = router
        self.view_delay_s = view_delay_s
        self.in_flight = [0] * len(self.replicas)
        # The replica of every request, in submit order.
        self.assignments: list[int] = []
        self._reported = [_Reported(r.recorder) for r in self.replicas]

    @property
    def env(self) -> simpy.Environment:
        return self._env

    @property
    def block_size(self) -> int:
        return self.replicas[0].engine.block_size

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].engine.max_model_len

    def views(self) -> list[ReplicaView]:
        """The routers' view of every replica now."""
        cutoff_s = self._env.now - self.view_delay_s
        out = []
        for replica, reported, in_flight in zip(
            self.replicas, self._reported, self.in_flight, strict=True
        ):
            last = reported.last_before(cutoff_s)
            if last < 0:
                out.append(ReplicaView(replica.index, in_flight, 0, 0, 0.0))
                continue
            steps = replica.recorder.steps
            out.append(
                ReplicaView(
                    replica.index,
                    in_flight,
                    steps["num_requests_running"][last],
                    steps["num_requests_waiting"][last],
                    steps["kv_cache_usage_perc"][last],
                )
            )
        return out

    def submit(self, request: Request, meta: RequestMeta) -> simpy.Event:
        index = self.router.choose(RoutingKey(request, meta.session_id), self.views())
        self.assignments.append(index)
        self.in_flight[index] += 1
        done = self.replicas[index].engine.submit(request, meta)
        done.callbacks.append(lambda _event, i=index: self._finished(i))
        return done

    def _finished(self, index: int) -> None:
        self.in_flight[index] -= 1
