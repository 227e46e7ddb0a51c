"""Traffic sources: open-loop requests, closed-loop agent sessions, trace replay.

Each workload config is itself a :class:`Workload`: parse a scenario's ``workload`` section
with :data:`WorkloadConfig`, then call ``start(sink, rng)`` once at simulated time 0.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from sim.workload.agent_sessions import AgentSessionsWorkload, FanoutConfig
from sim.workload.base import RequestMeta, RequestSink, Workload
from sim.workload.open_loop import OpenLoopWorkload
from sim.workload.trace import TraceRecord, TraceWorkload, load_trace

WorkloadConfig = Annotated[
    OpenLoopWorkload | AgentSessionsWorkload | TraceWorkload, Field(discriminator="kind")
]


def build_workload(config: WorkloadConfig, seed: int | None = None) -> Workload:
    """The workload a scenario's ``workload`` section describes: the config itself.

    ``seed`` is accepted for the runner's call shape but unused: every random choice is drawn
    from the generator passed to ``start`` (children spawned from it), which the run seeds from
    the scenario, so the same scenario and seed give the same requests.
    """
    del seed
    return config


__all__ = [
    "AgentSessionsWorkload",
    "FanoutConfig",
    "OpenLoopWorkload",
    "RequestMeta",
    "RequestSink",
    "TraceRecord",
    "TraceWorkload",
    "Workload",
    "WorkloadConfig",
    "build_workload",
    "load_trace",
]
