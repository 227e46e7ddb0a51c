"""What a workload is to the engine: SimPy processes that submit requests and wait on them.

A workload never touches the scheduler. It builds :class:`sim.request.Request` objects
(token ids chosen deterministically from the run's ``numpy.random.Generator``, so shared
prefixes are really shared and nothing else is) and hands them to a :class:`RequestSink`
(the engine). ``submit`` returns a SimPy event that fires when the request has produced its
last token, which is what a closed-loop agent session waits on before its tool call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import simpy

from sim.request import Request


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """Who sent a request: recorded next to it in ``requests.parquet``."""

    session_id: int | None = None
    turn: int | None = None
    # Name of the priority class ("interactive", "background", ...); "default" if none.
    priority_class: str = "default"
    # Index of the sub-agent call within a fan-out turn (None for the main call).
    subcall: int | None = None


class ToolLatency(Protocol):
    """A tool-latency distribution, as KV retention reads it."""

    def quantile(self, q: float) -> float:
        """The latency (s) below which a fraction ``q`` of tool calls finish."""
        ...


@dataclass(frozen=True, slots=True)
class SessionHint:
    """What a session tells the engine about one of its requests beyond the tokens (vLLM
    discusses such session hints; vLLM 0.32 has none): only the what-if KV retention reads it
    (``sim/kv/retention.py``)."""

    session_id: int
    # Another turn of the session is expected after this request (a tool wait follows).
    returns: bool
    # How many leading tokens of this request the next turn re-sends (None: all of them,
    # prompt and output; a fan-out sub-call shares only the turn's context).
    num_reused_tokens: int | None = None
    # The distribution the tool wait before the next turn is drawn from.
    tool_latency: ToolLatency | None = None


class RequestSink(Protocol):
    """The engine, as a workload sees it."""

    @property
    def env(self) -> simpy.Environment: ...

    @property
    def block_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    def submit(self, request: Request, meta: RequestMeta) -> simpy.Event:
        """Queue ``request`` now; the event fires with the request when it has finished."""
        ...


@dataclass
class WorkloadRun:
    """One run of a workload: what it planned and what it changed to fit the engine. ``start``
    returns it and the workload's processes update it as they submit; the summary reads it.
    Per run, never on the (shared, frozen) workload config."""

    # The requests this run will submit, when known (progress bars; the requests a cut run
    # never sent). None for agent sessions with fan-out.
    planned_requests: int | None = None
    # Requests submitted so far whose prompt or output was cut to fit max_model_len.
    requests_clipped: int = 0
    # Trace rows left out as too long for max_model_len (``on_too_long: skip``).
    trace_rows_skipped: int = 0
    # Agent sessions only (None otherwise): how many the workload plans, how many have
    # started, and which have started and not ended (a run cut at its time limit leaves some
    # mid-turn or in a tool wait; they are alive at the cut).
    sessions_planned: int | None = None
    sessions_started: int = 0
    open_sessions: set[int] = field(default_factory=set)
    # Sessions that ended before their last turn, their context past the cap
    # (max_model_len or max_context_tokens), and the turns they never sent.
    sessions_cut_by_context: int = 0
    turns_not_sent: int = 0
    context_cap_tokens: int | None = None  # min(max_model_len, max_context_tokens)


class Workload(Protocol):
    """A traffic source. ``start`` is called once, at simulated time 0."""

    def start(self, sink: RequestSink, rng: np.random.Generator) -> WorkloadRun:
        """Spawn the SimPy processes that submit this workload's requests."""
        ...

    def expected_num_requests(self) -> int | None:
        """How many requests the workload will submit, if known before a run starts."""
        ...


class SinkBase:
    """What the simulated engine and the real-vLLM driver share as a ``RequestSink``: the
    clock, the engine limits workloads read, and waking the idle step loop on an arrival."""

    def __init__(self, env: simpy.Environment, block_size: int, max_model_len: int) -> None:
        self._env = env
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._wakeup: simpy.Event | None = None

    @property
    def env(self) -> simpy.Environment:
        return self._env

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def _idle(self) -> simpy.Event:
        """The event the step loop sleeps on until the next submit."""
        self._wakeup = self._env.event()
        return self._wakeup

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.triggered:
            self._wakeup.succeed()
