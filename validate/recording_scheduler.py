"""A vLLM scheduler that records each step's batch in kvsim's terms.

Installed through vLLM's own extension point (``scheduler_cls``), it runs vLLM's scheduler
unchanged and, after each ``schedule()``, appends one :class:`StepBatch` to a list the
replay driver drains: the batch composition the cost model prices, admissions with their
prefix hits, preemptions, queue lengths and KV usage, computed exactly as kvsim's scheduler
reports them. It only works with the in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
which the replay uses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vllm.v1.core.sched.scheduler import Scheduler


@dataclass
class StepBatch:
    """What vLLM's scheduler decided in one step."""

    num_prefill_tokens: int = 0
    num_prefill_reqs: int = 0
    prefill_attention_pairs: float = 0.0
    num_decode_reqs: int = 0
    decode_context_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    resumed_prefix_cache_hits: int = 0
    admitted: list[tuple[str, int]] = field(default_factory=list)  # (request id, hit tokens)
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    kv_unused_slots: int = 0


class RecordingScheduler(Scheduler):
    """vLLM's V1 scheduler, plus a record of every step."""

    # The driver swaps in a fresh list per run; one engine per process at a time.
    records: ClassVar[list[StepBatch]] = []

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        was_running = {r.request_id for r in self.running}
        output = super().schedule(*args, **kwargs)
        if output.total_num_scheduled_tokens:
            RecordingScheduler.records.append(self._describe(output, was_running))
        return output

    def _describe(self, output: Any, was_running: set[str]) -> StepBatch:
        batch = StepBatch()
        for request_id, n in output.num_scheduled_tokens.items():
            request = self.requests[request_id]
            context = request.num_computed_tokens - n  # already advanced by schedule()
            num_tokens = request.num_tokens
            if n == 1 and context == num_tokens - 1 and request.num_output_tokens:
                batch.num_decode_reqs += 1
                batch.decode_context_tokens += context
            else:
                batch.num_prefill_reqs += 1
                batch.num_prefill_tokens += n
                batch.prefill_attention_pairs += n * (context + n / 2)
            if request_id not in was_running:  # admitted from the waiting queue this step
                batch.admitted.append((request_id, context))
                if request.num_preemptions:
                    batch.resumed_prefix_cache_hits += context
                elif self.cache_config.enable_prefix_caching:
                    batch.prefix_cache_queries += num_tokens
                    batch.prefix_cache_hits += context
        batch.num_preemptions = len(output.preempted_req_ids or ())
        num_running, num_waiting = self.get_request_counts()
        batch.num_running, batch.num_waiting = num_running, num_waiting
        kv = self.kv_cache_manager
        batch.kv_cache_usage = kv.usage
        batch.num_free_blocks = kv.block_pool.get_num_free_blocks()
        held = sum(len(kv.get_block_ids(r.request_id)[0]) for r in self.running)
        batch.kv_unused_slots = held * self.block_size - sum(
            r.num_computed_tokens for r in self.running
        )
        return batch
