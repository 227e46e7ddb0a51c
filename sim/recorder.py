"""Records what happened, per request and per step, in the results schema of design.md.

The recorder is written to from the engine's hot loop. Storage is columnar: each step column
is a typed ``array.array`` (int64 or float64, the dtype it has in ``steps.parquet``) and each
request's token times one float64 ``array.array``, so a run of 100k requests and millions
of steps costs 8 bytes per value, not a Python object per value. DataFrames are built at the
end. The recorder keeps a reference to a request only while the request is alive: a
finished agent turn can hold tens of thousands of token ids.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import pandas as pd

from sim.block_map import BlockMapRecorder
from sim.request import Request
from sim.scheduler.output import SchedulerOutput, StepUpdate
from sim.step_record import (
    OFFLOAD_STEP_COLUMNS,
    STEP_RECORD_COLUMNS,
    SWAP_STEP_COLUMNS,
    StepRecord,
    kv_unused_slots,
    offload_step_values,
    step_record,
    swap_step_values,
)
from sim.workload.base import RequestMeta

if TYPE_CHECKING:
    from sim.scheduler.scheduler import Scheduler

NAN = math.nan
_request_id = attrgetter("request_id")
_num_computed_tokens = attrgetter("num_computed_tokens")


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
        self.token_times_s = array("d")


class StretchBatch(NamedTuple):
    """The batch of every step of an engine stretch: running requests that decode (in
    running order), and at most one prefill, the last running request, by chunks."""

    decoders: Sequence[Request]
    decode_context0: int  # the decodes' summed context before the stretch
    prefill_chunks: Sequence[int]  # tokens the prefill computes each step; empty: none
    prefill_pairs: Sequence[float]  # its prefill_attention_pairs each step
    prefill_context0: int  # its computed tokens before the stretch (0 without one)
    shared_kv_tokens: int = 0  # BatchShape.shared_kv_tokens of every step of it


class Recorder:
    """Collects request and step records during a run."""

    def __init__(self, block_size: int, block_map: BlockMapRecorder | None = None) -> None:
        self.block_size = block_size
        self.block_map = block_map
        self.requests: dict[str, RequestRecord] = {}
        self._order: list[RequestRecord] = []
        self.steps: dict[str, array] = {name: array(STEP_TYPECODES[name]) for name in STEP_COLUMNS}
        # The StepRecord columns, in order (swap runs add more after them).
        self._record_columns = list(self.steps.values())
        self._swap_columns: list[array] = []
        self._offload_columns: list[array] = []
        # Each recorded step's end time, by step number - 1 (a lazy decode's token times).
        self.step_ends = array("d")

    def _add_columns(
        self, names: tuple[str, ...], float_names: tuple[str, ...] = ()
    ) -> list[array]:
        assert not len(self.steps["step"]), "columns are added before the first step"
        for name in names:
            self.steps[name] = array("d" if name in float_names else "q")
        return [self.steps[name] for name in names]

    def add_swap_columns(self) -> None:
        """Give the step table the swap-preemption columns (before the first step)."""
        assert not self._swap_columns
        self._swap_columns = self._add_columns(SWAP_STEP_COLUMNS, ("swap_transfer_s",))

    def add_offload_columns(self) -> None:
        """Give the step table the CPU offload tier's columns (before the first step)."""
        assert not self._offload_columns
        self._offload_columns = self._add_columns(OFFLOAD_STEP_COLUMNS, ("offload_transfer_s",))

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

    def add_token_times(self, request: Request, after_step: int, last_step: int) -> None:
        """A lazy decode (``Scheduler.enable_lazy_decodes``) sampled one token in each of
        steps ``after_step + 1 .. last_step``, all recorded."""
        self.requests[request.request_id].token_times_s.extend(self.step_ends[after_step:last_step])

    def add_record(self, record: StepRecord) -> None:
        """Append one row to the step table (its fields are STEP_COLUMNS, in order)."""
        for column, value in zip(self._record_columns, record, strict=True):
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
        self.step_ends.append(end_s)
        tables = scheduler.kv_cache_manager.req_to_blocks
        # A lazy decode's num_computed_tokens is as of its lazy_step; the scheduler keeps the
        # lazy ones' blocks and computed tokens as sums.
        lazy_computed = scheduler.lazy_computed_tokens(output.step)
        eager = scheduler.eager_running
        if eager is None:  # a pass over every running request, lazy ones' stale counts out
            counted, held, computed = scheduler.running, 0, -scheduler.lazy_computed_sum
        else:  # every running request is lazy or in ``eager``
            counted, held, computed = eager, scheduler.lazy_held_blocks, 0
        held += sum(map(len, map(tables.__getitem__, map(_request_id, counted))))
        computed += sum(map(_num_computed_tokens, counted)) + lazy_computed
        unused = kv_unused_slots(held, self.block_size, computed)
        self.add_record(step_record(output.step, output, start_s, end_s, unused))
        if self._swap_columns:
            assert output.swap is not None
            for column, value in zip(
                self._swap_columns, swap_step_values(output.swap), strict=True
            ):
                column.append(value)
        if self._offload_columns:
            assert output.offload is not None
            for column, value in zip(
                self._offload_columns, offload_step_values(output.offload), strict=True
            ):
                column.append(value)
        if self.block_map is not None:
            self.block_map.maybe_snapshot(output.step, end_s, scheduler, self._class_of)

    def on_stretch(
        self,
        first_step: int,
        starts: Sequence[float],
        ends: Sequence[float],
        batch: StretchBatch,
        num_held_blocks: int,
        new_blocks_by_step: Sequence[int],
        free_blocks_by_step: Sequence[int],
        num_gpu_blocks: int,
        num_waiting: int,
    ) -> None:
        """Record a stretch (see ``sim.engine``) when it is planned: ``len(starts)`` steps
        of the same batch, the rows :meth:`on_step` would have written one step at a time
        (the last step's unused slots still count the requests it finishes: see
        :meth:`on_stretch_end`), and its decodes' token times."""
        assert not self._swap_columns, "a swap-preemption run takes no stretches"
        num_steps = len(starts)
        decoders = batch.decoders
        num_decode = len(decoders)
        chunks = batch.prefill_chunks
        num_running = num_decode + (1 if chunks else 0)
        block_size = self.block_size
        steps = self.steps
        records = self.requests
        for request in decoders:
            records[request.request_id].token_times_s.extend(ends)
        self.step_ends.extend(ends)
        zeros = array("q", bytes(8 * num_steps))
        steps["step"].extend(range(first_step, first_step + num_steps))
        steps["start_s"].extend(starts)
        steps["duration_s"].extend([e - s for s, e in zip(starts, ends, strict=True)])
        steps["num_decode_tokens"].extend(array("q", [num_decode]) * num_steps)
        context0 = batch.decode_context0
        steps["decode_context_tokens"].extend([context0 + num_decode * k for k in range(num_steps)])
        if chunks:
            steps["num_prefill_tokens"].extend(chunks)
            steps["num_prefill_reqs"].extend(array("q", [1]) * num_steps)
            steps["prefill_attention_pairs"].extend(batch.prefill_pairs)
        else:
            steps["num_prefill_tokens"].extend(zeros)
            steps["num_prefill_reqs"].extend(zeros)
            steps["prefill_attention_pairs"].extend(array("d", bytes(8 * num_steps)))
        steps["num_requests_running"].extend(array("q", [num_running]) * num_steps)
        steps["num_requests_waiting"].extend(array("q", [num_waiting]) * num_steps)
        usable = num_gpu_blocks - 1
        steps["kv_cache_usage_perc"].extend([1.0 - f / usable for f in free_blocks_by_step])
        steps["num_free_blocks"].extend(free_blocks_by_step)
        for name in ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
            steps[name].extend(zeros)
        steps["resumed_prefix_cache_hits"].extend(zeros)
        steps["shared_kv_tokens"].extend(array("q", [batch.shared_kv_tokens]) * num_steps)
        # Unused slots after each step: held blocks x block_size - computed tokens.
        unused = steps["kv_unused_slots"]
        held = num_held_blocks
        computed = context0 + batch.prefill_context0
        for k, new_blocks in enumerate(new_blocks_by_step):
            held += new_blocks
            computed += num_decode + (chunks[k] if chunks else 0)
            unused.append(held * block_size - computed)

    def cut_stretch(self, num_steps: int, decoders: Sequence[Request]) -> None:
        """Take back the last ``num_steps`` steps of the stretch just recorded (a fleet's
        replica: a request was submitted to it before they started)."""
        for column in self.steps.values():
            _drop_last(column, num_steps)
        _drop_last(self.step_ends, num_steps)
        records = self.requests
        for request in decoders:
            _drop_last(records[request.request_id].token_times_s, num_steps)

    def on_stretch_end(
        self,
        last_step: int,
        end_s: float,
        finished: Sequence[Request],
        freed_unused_slots: int,
        scheduler: Scheduler,
    ) -> None:
        """The recorded stretch has run and its blocks are applied: ``finished`` finished
        in its last step, freeing ``freed_unused_slots`` of that step's unused slots;
        ``scheduler`` is in its state after that step."""
        for request in finished:
            self.on_finished(request, end_s)
        if freed_unused_slots:
            self.steps["kv_unused_slots"][-1] -= freed_unused_slots
        if self.block_map is not None:
            self.block_map.maybe_snapshot(last_step, end_s, scheduler, self._class_of)

    def _class_of(self, request_id: str) -> str:
        return self.requests[request_id].meta.priority_class

    # -- tables -------------------------------------------------------------------------------
    def requests_frame(self) -> pd.DataFrame:
        """One row per request (finished or not), in arrival order."""
        rows = []
        for rec in self._order:
            # A float64 view of the recorded times, not a list of floats (8 bytes a token, not
            # 32: a 100k-request run decodes millions of tokens).
            times = np.frombuffer(rec.token_times_s, dtype=np.float64)
            if rec.request is not None:  # unfinished at the end of the run
                rec.output_tokens = rec.request.num_output_tokens
                rec.num_preemptions = rec.request.num_preemptions
            first_token = float(times[0]) if len(times) else NAN
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
        """One row per engine step (int64 and float64 columns, as in ``steps.parquet``;
        typed even when no step ran)."""
        return pd.DataFrame(
            {
                name: np.frombuffer(
                    column, dtype=np.int64 if column.typecode == "q" else np.float64
                ).copy()
                for name, column in self.steps.items()
            },
            copy=False,  # the copies above are the frame's own
        )


def _drop_last(column: array, num_values: int) -> None:
    """Drop the last ``num_values`` values of ``column`` in place, keeping its buffer: an
    array reallocates to shrink when 16 or more values go at once, and the stretch written
    next grows it again (copying a step column of a long run, every time a fleet's
    replica cuts a stretch short)."""
    end = len(column)
    while num_values > 0:
        n = min(num_values, 15)
        del column[end - n : end]
        end -= n
        num_values -= n


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

# Storage type of each step column: "d" float64, "q" int64.
STEP_TYPECODES = {
    name: "d"
    if name in ("start_s", "duration_s", "prefill_attention_pairs", "kv_cache_usage_perc")
    else "q"
    for name in STEP_COLUMNS
}
