"""The simulated vLLM engine: a SimPy process that runs scheduler steps back to back.

Each step: the scheduler decides (no time passes), the cost model prices the batch, SimPy
advances the clock by that duration, then the step's tokens are delivered (sampled tokens,
finished requests, their completion events). When nothing is queued the engine sleeps
until the next arrival; the step that wakes it is priced as after idle (see CostModel).
This module and the workload processes are the only simpy users.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol

import simpy

from sim.recorder import Recorder
from sim.request import Request
from sim.scheduler.output import BatchShape
from sim.scheduler.scheduler import Scheduler
from sim.workload.base import RequestMeta, SinkBase


class StepCost(Protocol):
    def step_time_s(
        self, shape: BatchShape, after_idle: bool = False, steps_since_prefill: int = 0
    ) -> float: ...


class Engine(SinkBase):
    """Owns the scheduler and the clock; implements the workloads' ``RequestSink``."""

    def __init__(
        self,
        env: simpy.Environment,
        scheduler: Scheduler,
        cost_model: StepCost,
        recorder: Recorder,
    ) -> None:
        super().__init__(env, scheduler.config.block_size, scheduler.max_model_len)
        self.scheduler = scheduler
        self.cost_model = cost_model
        self.recorder = recorder
        self._done: dict[str, simpy.Event] = {}
        self.process = env.process(self._run())

    def submit(self, request: Request, meta: RequestMeta) -> simpy.Event:
        """Queue a request now; the returned event fires with it once it has finished."""
        request.arrival_time_s = self._env.now
        self.scheduler.add_request(request)
        self.recorder.on_arrival(request, meta, self._env.now)
        done = self._env.event()
        self._done[request.request_id] = done
        self._wake()
        return done

    # -- the step loop ------------------------------------------------------------------------
    def _run(self) -> Generator[simpy.Event, Any, None]:
        env = self._env
        scheduler = self.scheduler
        step_time_s = self.cost_model.step_time_s
        recorder = self.recorder
        done = self._done
        after_idle = True  # the first step wakes the engine up
        since_prefill = -1  # steps past the last prefill step; -1 before the first one
        while True:
            if not scheduler.has_unfinished_requests():
                yield self._idle()
                after_idle = True
                continue
            output = scheduler.schedule()
            # Sizing guarantees one max_model_len request fits, so an idle engine can always
            # admit the head of the queue: an empty step with work queued is a bug.
            assert not output.is_empty, "scheduler made no progress with requests queued"
            start_s = env.now
            if output.shape.num_prefill_reqs:
                since_prefill = 0
            elif since_prefill >= 0:
                since_prefill += 1
            duration_s = step_time_s(output.shape, after_idle, since_prefill)
            after_idle = False
            yield env.timeout(duration_s)
            update = scheduler.update_from_output(output)
            recorder.on_step(output, update, start_s, env.now, scheduler)
            for request in update.finished:
                done.pop(request.request_id).succeed(request)
