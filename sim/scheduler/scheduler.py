"""vLLM V1's scheduling loop, step for step (``vllm/v1/core/sched/scheduler.py``, vLLM 0.32).

One call to :meth:`Scheduler.schedule` is one engine step:

1. RUNNING requests, in order, each get ``min(remaining tokens, token budget,
   long_prefill_token_threshold)`` tokens. If ``allocate_slots`` fails, the policy's victim
   is preempted (recompute: blocks freed, hashed ones stay in the prefix cache, computed
   tokens reset, back to the waiting queue) and allocation is retried; if the victim is the
   request itself, the running pass stops.
2. WAITING requests, only if nobody was preempted this step, while budget remains and fewer
   than ``max_num_seqs`` run: prefix lookup, then allocation with the full-sequence
   reservation and the watermark. The first failure stops admission (head-of-line).
3. Every scheduled request advances ``num_computed_tokens`` by its share.

Swap preemption (``engine.preemption_mode=swap``, a what-if, see ``sim/kv/swap.py``) keeps
this V1 step structure and changes only what preemption does, as vLLM V0's
``preemption_mode="swap"``: the victim (the same policy's choice) has its computed blocks
copied to the CPU pool and waits in the SWAPPED queue with its computed tokens kept; a full
CPU pool falls back to recompute. Between steps 1 and 2, when nobody was preempted this
step (V0: ``_schedule_swapped`` only runs when ``_schedule_running`` preempted nobody),
swapped requests resume in queue order while their blocks fit with the watermark (V0's
``can_swap_in``; as in V1's admission the watermark is waived when nothing else is
scheduled, so a lone request always resumes) and stop at the first that does not. New
admissions (step 2) wait until the SWAPPED queue is empty (V0's default scheduler; its
chunked-prefill scheduler admitted behind a swapped request that did not fit), except,
under the priority policy, a request that sorts before the SWAPPED queue's head (kvsim's
choice, so interactive turns do not wait for swapped background agents).

:meth:`Scheduler.update_from_output` then plays the model's part: a request whose computed
tokens reached its length samples its next (planned) token; a request at ``max_tokens`` or
``max_model_len`` finishes and frees its blocks. No clock anywhere: the engine owns time.
"""

from __future__ import annotations

from sim.config.engine import EngineConfig
from sim.kv.allocators import make_kv_manager
from sim.kv.swap import Swapper, num_cpu_blocks
from sim.request import Request, RequestStatus
from sim.scheduler.output import BatchShape, SchedulerOutput, StepUpdate
from sim.scheduler.policy import make_policy


def running_chunk(
    num_tokens: int, num_computed: int, threshold: int, token_budget: int, max_model_len: int
) -> int:
    """Tokens a running request computes this step (vLLM's running pass): what it lacks,
    capped by the long-prefill threshold (0: none), the token budget left and
    ``max_model_len`` (the last position is never computed); 0 or less: none."""
    num_new = num_tokens - num_computed
    if 0 < threshold < num_new:
        num_new = threshold
    if num_new > token_budget:
        num_new = token_budget
    if num_new > max_model_len - num_computed - 1:
        num_new = max_model_len - num_computed - 1
    return num_new


class Scheduler:
    """Decides, each step, which requests compute how many tokens, and who is preempted."""

    def __init__(self, config: EngineConfig, num_gpu_blocks: int, bytes_per_block: int = 0) -> None:
        """``bytes_per_block`` (one GPU's share of a KV block) sizes the CPU swap pool; only
        swap preemption needs it."""
        self.config = config
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.long_prefill_token_threshold = config.long_prefill_token_threshold
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.kv_cache_manager = make_kv_manager(config, num_gpu_blocks)
        self.policy = make_policy(config.scheduling_policy)
        self.waiting = self.policy.new_waiting_queue()
        # Swap preemption only: the CPU pool and the SWAPPED queue (in the policy's order).
        self.swapper: Swapper | None = None
        self.swapped = self.policy.new_waiting_queue()
        if config.preemption_mode == "swap":
            assert config.swap_space_gib is not None  # checked by EngineConfig
            self.swapper = Swapper(
                self.kv_cache_manager,
                num_cpu_blocks(config.swap_space_gib, bytes_per_block),
                bytes_per_block,
            )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.swapped)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or len(self.swapped) > 0

    # -- transitions --------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """A request arrives: it joins the waiting queue."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_prompt_tokens + request.max_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt {request.num_prompt_tokens} + max_tokens "
                f"{request.max_tokens} tokens exceeds max_model_len={self.max_model_len}"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _preempt(self, request: Request) -> None:
        swapper = self.swapper
        if swapper is not None and swapper.swap_out(request):
            # Swapped: blocks on CPU, computed tokens kept, resumed from the SWAPPED queue.
            request.status = RequestStatus.PREEMPTED
            request.num_preemptions += 1
            self.swapped.add(request)
            self.num_preemptions += 1
            return
        self.kv_cache_manager.free(request)
        request.mark_preempted()
        self.waiting.prepend(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        """Plan one engine step (see the module docstring)."""
        kv = self.kv_cache_manager
        running = self.running
        token_budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        preempted: list[Request] = []
        admitted_ids: list[str] = []
        admitted_hit_tokens: list[int] = []
        # vLLM lifts the long-prefill cap when there is nobody else to starve.
        threshold = self.long_prefill_token_threshold
        swapper = self.swapper
        num_swapped = len(self.swapped) if swapper is not None else 0
        if len(running) + len(self.waiting) + num_swapped <= 1:
            threshold = 0

        # 1. RUNNING requests.
        allocate_slots = kv.allocate_slots
        max_model_len = self.max_model_len
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            num_new = running_chunk(
                len(request.token_ids),
                request.num_computed_tokens,
                threshold,
                token_budget,
                max_model_len,
            )
            if num_new <= 0:
                req_index += 1
                continue
            while True:
                new_blocks = allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim_index = self.policy.victim_index(running)
                victim = running.pop(victim_index)
                if victim_index < req_index:
                    req_index -= 1
                restored = num_scheduled.pop(victim.request_id, None)
                if restored is not None:
                    token_budget += restored
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
            req_index += 1

        # 1b. SWAPPED requests (swap preemption only), unless this step had to preempt.
        if num_swapped and not preempted:
            token_budget = self._schedule_swapped(token_budget, threshold, num_scheduled)

        # 2. WAITING requests, unless this step had to preempt; while swapped requests wait
        # (swap preemption), only those the policy puts ahead of them.
        num_query_tokens = num_hit_tokens = num_resumed_hit_tokens = 0
        if not preempted:
            waiting = self.waiting
            swapped = self.swapped if swapper is not None else None
            while token_budget > 0 and len(waiting) and len(running) < self.max_num_seqs:
                request = waiting.peek()
                if swapped and not self.policy.ahead_of_swapped(request, swapped.peek()):
                    break
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit
                if 0 < threshold < num_new:
                    num_new = threshold
                if not self.enable_chunked_prefill and num_new > token_budget:
                    break
                num_new = min(num_new, token_budget)
                new_blocks = kv.allocate_slots(
                    request,
                    num_new,
                    num_new_computed_tokens=num_hit,
                    new_computed_blocks=hit_blocks,
                    full_sequence_must_fit=True,
                    has_scheduled_reqs=bool(running),
                )
                if new_blocks is None:
                    break
                if kv.enable_caching:
                    # vLLM counts re-admissions after preemption apart from first lookups.
                    if request.num_preemptions:
                        num_resumed_hit_tokens += num_hit
                    else:
                        num_query_tokens += request.num_tokens
                        num_hit_tokens += num_hit
                waiting.pop()
                running.append(request)
                request.mark_running(num_hit)
                admitted_ids.append(request.request_id)
                admitted_hit_tokens.append(num_hit)
                num_scheduled[request.request_id] = num_new
                token_budget -= num_new

        # 3. Advance computed tokens; summarise the batch for the cost model.
        num_decode = decode_context = num_prefill_reqs = num_prefill_tokens = 0
        prefill_pairs = 0.0
        requests = self.requests
        for request_id, n in num_scheduled.items():
            request = requests[request_id]
            context = request.num_computed_tokens
            num_tokens = len(request.token_ids)
            if n == 1 and context == num_tokens - 1 and num_tokens > request.num_prompt_tokens:
                num_decode += 1
                decode_context += context
            else:
                num_prefill_reqs += 1
                num_prefill_tokens += n
                prefill_pairs += n * (context + n / 2)
            request.num_computed_tokens = context + n
        shape = BatchShape(
            num_prefill_tokens, num_prefill_reqs, prefill_pairs, num_decode, decode_context
        )

        self.num_steps += 1
        pool = kv.block_pool
        return SchedulerOutput(
            step=self.num_steps,
            num_scheduled_tokens=num_scheduled,
            admitted_ids=admitted_ids,
            admitted_hit_tokens=admitted_hit_tokens,
            preempted_ids=[r.request_id for r in preempted],
            num_prefix_query_tokens=num_query_tokens,
            num_prefix_hit_tokens=num_hit_tokens,
            num_resumed_prefix_hit_tokens=num_resumed_hit_tokens,
            shape=shape,
            num_free_blocks=pool.num_free_blocks,
            kv_usage=pool.usage,
            num_running=len(running),
            num_waiting=len(self.waiting),
            swap=None if swapper is None else swapper.take_step(len(self.swapped)),
        )

    def _schedule_swapped(
        self, token_budget: int, threshold: int, num_scheduled: dict[str, int]
    ) -> int:
        """Resume swapped requests in queue order while they fit (V0's ``_schedule_swapped``
        on V1's budget): fresh blocks for the kept computed tokens plus this step's tokens,
        the CPU copies recorded for the engine to time. Returns the budget left."""
        kv = self.kv_cache_manager
        swapper = self.swapper
        assert swapper is not None
        running = self.running
        swapped = self.swapped
        while token_budget > 0 and len(swapped) and len(running) < self.max_num_seqs:
            request = swapped.peek()
            num_computed = request.num_computed_tokens
            num_new = min(
                len(request.token_ids) - num_computed, self.max_model_len - num_computed - 1
            )
            if 0 < threshold < num_new:
                num_new = threshold
            if not self.enable_chunked_prefill and num_new > token_budget:
                break
            num_new = min(num_new, token_budget)
            if num_new <= 0:
                break
            # Full computed blocks still cached in HBM are reused, not copied (V0's swap-in
            # allocated full blocks through the prefix cache); the rest get fresh blocks.
            hits, num_hit = kv.get_computed_blocks(request)
            if num_hit > num_computed:
                num_hit = num_computed - num_computed % kv.block_size
                del hits[num_hit // kv.block_size :]
            # Allocated as an admission from num_hit: the computed tokens past the hits and
            # this step's tokens need slots. The request is PREEMPTED, so the watermark
            # applies when others are scheduled.
            request.num_computed_tokens = 0
            new_blocks = kv.allocate_slots(
                request,
                num_computed - num_hit + num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hits,
                has_scheduled_reqs=bool(running),
            )
            request.num_computed_tokens = num_computed
            if new_blocks is None:
                break
            swapped.pop()
            swapper.swap_in(request, len(hits))
            request.mark_running(num_computed)
            running.append(request)
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
        return token_budget

    def update_from_output(self, output: SchedulerOutput) -> StepUpdate:
        """Apply a finished step: sample tokens, finish and free requests."""
        sampled: list[Request] = []
        finished: list[Request] = []
        requests = self.requests
        max_model_len = self.max_model_len
        for request_id in output.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # preempted later in the same step (priority policy)
            num_tokens = len(request.token_ids)
            if request.num_computed_tokens < num_tokens:
                continue  # a prefill chunk that did not reach the end samples nothing
            request.append_output_token_id(request.next_output_token_id())
            sampled.append(request)
            num_tokens += 1
            if num_tokens - request.num_prompt_tokens >= request.max_tokens or (
                num_tokens >= max_model_len
            ):
                request.mark_finished()
                self.kv_cache_manager.free(request)
                del requests[request_id]
                finished.append(request)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        return StepUpdate(sampled, finished)
