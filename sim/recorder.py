"""Records what happened, per request and per step, in the results schema of design.md.

The recorder is written to from the engine's hot loop, so it appends to plain lists and
only builds DataFrames at the end. It keeps a reference to a request only while the request
is alive: a finished agent turn can hold tens of thousands of token ids.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from sim.block_map import BlockMapRecorder
from sim.request import Request
from sim.scheduler.output import SchedulerOutput, StepUpdate
from sim.step_record import STEP_RECORD_COLUMNS, StepRecord, kv_unused_slots, step_record
from sim.workload.base import RequestMeta

if TYPE_CHECKING:
    from sim.scheduler.scheduler import Scheduler

NAN = math.nan


class RequestRecord:
    """The life of one request; scalars copied out of the request when it finishes."""

    __slots__ = (
        "arrival_s",
        "cached_tokens",
        "finish_s",
        "first_scheduled_s",
        "meta",
        "num_preemptions",
        "output_tokens",
        "priority",
        "prompt_tokens",
        "request",
        "request_id",
        "token_times_s",
    )

    def __init__(self, request: Request, meta: RequestMeta, arrival_s: float) -> None:
        self.request: Request | None = request
        self.request_id = request.request_id
        self.meta = meta
        self.priority = request.priority
        self.arrival_s = arrival_s
        self.prompt_tokens = request.num_prompt_tokens
        self.output_tokens = 0
        self.first_scheduled_s = NAN
        self.finish_s = NAN
        self.cached_tokens = -1  # prefix-hit tokens at first admission; -1 until admitted
        self.num_preemptions = 0
        self.token_times_s: list[float] = []


class Recorder:
    """Collects request and step records during a run."""

    def __init__(self, block_size: int, block_map: BlockMapRecorder | None = None) -> None:
        self.block_size = block_size
        self.block_map = block_map
        self.requests: dict[str, RequestRecord] = {}
        self._order: list[RequestRecord] = []
        self.steps: dict[str, list[float]] = {name: [] for name in STEP_COLUMNS}

    def on_arrival(self, request: Request, meta: RequestMeta, now_s: float) -> None:
        record = RequestRecord(request, meta, now_s)
        self.requests[request.request_id] = record
        self._order.append(record)

    def on_admitted(self, request_id: str, num_hit_tokens: int, start_s: float) -> None:
        """First admission of a request: when, and how many prompt tokens hit the cache."""
        record = self.requests[request_id]
        if record.cached_tokens < 0:
            record.first_scheduled_s = start_s
            record.cached_tokens = num_hit_tokens

    def on_finished(self, request: Request, now_s: float) -> None:
        record = self.requests[request.request_id]
        record.finish_s = now_s
        record.output_tokens = request.num_output_tokens
        record.num_preemptions = request.num_preemptions
        record.request = None

    def add_record(self, record: StepRecord) -> None:
        """Append one row to the step table (its fields are STEP_COLUMNS, in order)."""
        for column, value in zip(self.steps.values(), record, strict=True):
            column.append(value)

    def on_step(
        self,
        output: SchedulerOutput,
        update: StepUpdate,
        start_s: float,
        end_s: float,
        scheduler: Scheduler,
    ) -> None:
        """Record one simulated step (the engine's hot loop)."""
        records = self.requests
        for request_id, num_hit in zip(
            output.admitted_ids, output.admitted_hit_tokens, strict=True
        ):
            self.on_admitted(request_id, num_hit, start_s)
        for request in update.sampled:
            records[request.request_id].token_times_s.append(end_s)
        for request in update.finished:
            self.on_finished(request, end_s)
        tables = scheduler.kv_cache_manager.req_to_blocks
        running = scheduler.running
        unused = kv_unused_slots(
            sum(len(tables[r.request_id]) for r in running),
            self.block_size,
            sum(r.num_computed_tokens for r in running),
        )
        self.add_record(step_record(output.step, output, start_s, end_s, unused))
        if self.block_map is not None:
            self.block_map.maybe_snapshot(output.step, end_s, scheduler, self._class_of)

    def _class_of(self, request_id: str) -> str:
        return self.requests[request_id].meta.priority_class

    # -- tables -------------------------------------------------------------------------------
    def requests_frame(self) -> pd.DataFrame:
        """One row per request (finished or not), in arrival order."""
        rows = []
        for rec in self._order:
            times = rec.token_times_s
            if rec.request is not None:  # unfinished at the end of the run
                rec.output_tokens = rec.request.num_output_tokens
                rec.num_preemptions = rec.request.num_preemptions
            first_token = times[0] if times else NAN
            itl = np.diff(times) if len(times) > 1 else None
            rows.append(
                (
                    rec.request_id,
                    rec.meta.session_id if rec.meta.session_id is not None else -1,
                    rec.meta.turn if rec.meta.turn is not None else -1,
                    rec.meta.subcall if rec.meta.subcall is not None else -1,
                    rec.meta.priority_class,
                    rec.priority,
                    rec.arrival_s,
                    rec.first_scheduled_s,
                    first_token,
                    rec.finish_s,
                    rec.prompt_tokens,
                    rec.output_tokens,
                    max(rec.cached_tokens, 0),
                    rec.num_preemptions,
                    first_token - rec.arrival_s,
                    rec.finish_s - rec.arrival_s,
                    rec.first_scheduled_s - rec.arrival_s,
                    float(itl.mean()) if itl is not None else NAN,
                    times,
                )
            )
        return pd.DataFrame.from_records(rows, columns=REQUEST_COLUMNS)

    def steps_frame(self) -> pd.DataFrame:
        """One row per engine step."""
        return pd.DataFrame(self.steps)


REQUEST_COLUMNS = [
    "request_id",
    "session_id",
    "turn",
    "subcall",
    "priority_class",
    "priority",
    "arrival_s",
    "first_scheduled_s",
    "first_token_s",
    "finish_s",
    "prompt_tokens",
    "output_tokens",
    "cached_tokens",
    "num_preemptions",
    "ttft_s",
    "e2e_s",
    "queue_s",
    "mean_itl_s",
    "token_times_s",
]

# The step table's columns are sim.step_record.StepRecord's fields.
STEP_COLUMNS = list(STEP_RECORD_COLUMNS)
