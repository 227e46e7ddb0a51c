"""A stand-in engine for workload tests: every request finishes after a fixed time per token."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import simpy

from sim.request import Request
from sim.workload.base import RequestMeta, Workload, WorkloadRun


@dataclass
class Submission:
    """One submitted request, when it was submitted and when it finished."""

    request: Request
    meta: RequestMeta
    submit_s: float
    finish_s: float | None = None


@dataclass
class FakeSink:
    """Serves each request in ``s_per_token * (prompt + output)`` seconds, without contention.

    With ``emit_outputs`` the fake appends the planned output tokens one by one as an engine
    would (so the request hashes its output blocks); the timing benchmark turns that off.
    """

    block_size: int = 16
    max_model_len: int = 32_768
    s_per_token: float = 0.001
    emit_outputs: bool = True
    env: simpy.Environment = field(default_factory=simpy.Environment)
    submissions: list[Submission] = field(default_factory=list)
    # What the workload's start returned (run_workload sets it).
    workload_run: WorkloadRun | None = None

    def submit(self, request: Request, meta: RequestMeta) -> simpy.Event:
        submission = Submission(request, meta, self.env.now)
        self.submissions.append(submission)
        done = self.env.event()
        self.env.process(self._serve(submission, done))
        return done

    def _serve(self, submission: Submission, done: simpy.Event) -> Generator[Any, Any, None]:
        request = submission.request
        yield self.env.timeout(self.s_per_token * (request.num_prompt_tokens + request.max_tokens))
        if self.emit_outputs:
            for _ in range(request.max_tokens):
                request.append_output_token_id(request.next_output_token_id())
        submission.finish_s = self.env.now
        done.succeed(request)

    def by_id(self) -> dict[str, Submission]:
        return {s.request.request_id: s for s in self.submissions}


def run_workload(workload: Workload, seed: int = 0, **sink_args: Any) -> FakeSink:
    """Start ``workload`` against a fresh fake sink, run to completion, return the sink."""
    sink = FakeSink(**sink_args)
    sink.workload_run = workload.start(sink, np.random.default_rng(seed))
    sink.env.run()
    return sink


def stream(sink: FakeSink) -> list[tuple[Any, ...]]:
    """Everything a workload decided, for comparing two runs."""
    return [
        (
            s.request.request_id,
            s.submit_s,
            tuple(s.request.token_ids[: s.request.num_prompt_tokens]),
            tuple(s.request.output_token_ids),
            s.request.priority,
            s.meta,
        )
        for s in sorted(sink.submissions, key=lambda s: (s.submit_s, s.request.request_id))
    ]
