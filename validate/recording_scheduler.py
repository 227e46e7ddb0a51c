"""A vLLM scheduler that records each step's batch in kvsim's terms.

Installed through vLLM's own extension point (``scheduler_cls``), it runs vLLM's scheduler
unchanged and, after each ``schedule()``, appends one :class:`RecordedStep` to a list the
replay driver drains: kvsim's :class:`~sim.scheduler.output.SchedulerOutput` of the step (the
batch shape from :func:`sim.step_record.batch_shape`, the same classification of prefill vs
decode as kvsim's scheduler; admissions with their prefix hits, preemptions, queue lengths,
KV usage) and the KV slots held ahead. It only works with the in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which the replay uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.core.sched.scheduler import Scheduler

from sim.scheduler.output import SchedulerOutput
from sim.step_record import batch_shape, kv_unused_slots


def held_and_shared_refs(scheduler: Scheduler) -> tuple[int, int]:
    """Blocks held by a vLLM scheduler's running requests, and the references beyond the
    first to the blocks in use (kvsim's ``BlockPool.num_shared_refs``): the running requests
    hold every block in use, a shared prefix once per holder."""
    kv = scheduler.kv_cache_manager
    held = sum(len(kv.get_block_ids(r.request_id)[0]) for r in scheduler.running)
    pool = kv.block_pool
    return held, held - (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())


@dataclass(frozen=True)
class RecordedStep:
    """What vLLM's scheduler decided in one step, in kvsim's types."""

    # ``step`` is 0: the replay numbers the steps it records (warm-up steps are not).
    output: SchedulerOutput
    kv_unused_slots: int


class RecordingScheduler(Scheduler):
    """vLLM's V1 scheduler, plus a record of every step."""

    # The driver swaps in a fresh list per run; one engine per process at a time.
    records: ClassVar[list[RecordedStep]] = []

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        was_running = {r.request_id for r in self.running}
        output = super().schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            RecordingScheduler.records.append(self._describe(output, was_running))
        return output

    def _describe(self, output: Any, was_running: set[str]) -> RecordedStep:
        scheduled: dict[str, int] = output.num_scheduled_tokens
        requests = self.requests
        admitted_ids: list[str] = []
        admitted_hit_tokens: list[int] = []
        num_query_tokens = num_hit_tokens = num_resumed_hit_tokens = 0
        for request_id, n in scheduled.items():
            if request_id in was_running:
                continue
            # Admitted from the waiting queue this step; schedule() already advanced its
            # computed tokens by n, so what it started from is its prefix hit.
            request = requests[request_id]
            num_hit = request.num_computed_tokens - n
            admitted_ids.append(request_id)
            admitted_hit_tokens.append(num_hit)
            if request.num_preemptions:
                num_resumed_hit_tokens += num_hit
            elif self.cache_config.enable_prefix_caching:
                num_query_tokens += request.num_tokens
                num_hit_tokens += num_hit
        num_running, num_waiting = self.get_request_counts()
        kv = self.kv_cache_manager
        held, num_shared_refs = held_and_shared_refs(self)
        shape = batch_shape(scheduled, requests, computed_includes_scheduled=True)
        shape.shared_kv_tokens = num_shared_refs * self.block_size
        step = SchedulerOutput(
            step=0,
            num_scheduled_tokens=dict(scheduled),
            admitted_ids=admitted_ids,
            admitted_hit_tokens=admitted_hit_tokens,
            preempted_ids=sorted(output.preempted_req_ids or ()),
            num_prefix_query_tokens=num_query_tokens,
            num_prefix_hit_tokens=num_hit_tokens,
            num_resumed_prefix_hit_tokens=num_resumed_hit_tokens,
            shape=shape,
            num_free_blocks=kv.block_pool.get_num_free_blocks(),
            kv_usage=kv.usage,
            num_running=num_running,
            num_waiting=num_waiting,
        )
        computed = sum(r.num_computed_tokens for r in self.running)
        return RecordedStep(step, kv_unused_slots(held, self.block_size, computed))
