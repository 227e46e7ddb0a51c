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

Lazy decodes (:meth:`Scheduler.enable_lazy_decodes`, the engine's fast path) change how a
steady decode is kept, not what is decided: it takes its token of budget and its place in
the batch each step without its request being touched until it must be scheduled one by one.
"""

from __future__ import annotations

from sim.config.engine import EngineConfig
from sim.config.sizing import num_cpu_blocks, num_offload_blocks
from sim.kv.allocators import make_kv_manager
from sim.kv.kv_cache_manager import KVCacheManager
from sim.kv.offload import Offloader
from sim.kv.swap import Swapper
from sim.request import Request, RequestStatus
from sim.scheduler.lazy_decodes import LazyDecodes
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


class Scheduler(LazyDecodes):
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
        # CPU offload tier only: the connector's side, and the requests that hold blocks
        # while they wait (their load in flight or just done; vLLM's kv_holding_waiting).
        self.offloader: Offloader | None = None
        self.loading = self.policy.new_waiting_queue()
        self._carried_counts = (0, 0, 0)
        if config.kv_offload_gib is not None:
            self.offloader = Offloader(
                num_offload_blocks(
                    config.kv_offload_gib, bytes_per_block, config.tensor_parallel_size
                ),
                config.block_size,
                bytes_per_block,
                config.tensor_parallel_size,
            )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self.num_preemptions = 0
        self._init_lazy_decodes()

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + len(self.swapped) + len(self.loading)

    def has_unfinished_requests(self) -> bool:
        return (
            bool(self.running)
            or len(self.waiting) > 0
            or len(self.swapped) > 0
            or len(self.loading) > 0
        )

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
        offloader = self.offloader
        # Requests holding blocks while they wait for a load count as waiting.
        num_loading = len(self.loading) if offloader is not None else 0
        if len(running) + len(self.waiting) + num_swapped + num_loading <= 1:
            threshold = 0

        # 1. RUNNING requests.
        allocate_slots = kv.allocate_slots
        max_model_len = self.max_model_len
        # A decode whose next slot lies in a block it holds and that fills no block to
        # register: vLLM's allocate_slots does nothing for it. Told apart here, without the
        # call, when allocate_slots is the plain one (no what-if wraps or replaces it).
        plain = type(kv) is KVCacheManager and "allocate_slots" not in vars(kv)
        tables = kv.req_to_blocks if plain else {}
        num_cached = kv.num_cached_block if plain and kv.enable_caching else None
        block_size = kv.block_size
        step = self.num_steps + 1
        lazy = self.lazy
        complete = True  # every running request was scheduled (or is a lazy decode)
        req_index = 0
        num_running = len(running)  # kept up to date as victims leave
        while req_index < num_running and token_budget > 0:
            request = running[req_index]
            if step < request.lazy_until:
                token_budget -= 1  # a lazy decode
                req_index += 1
                continue
            if lazy and request.lazy_step >= 0:
                self.materialize(request, step - 1)  # its lazy decodes end here
            computed = request.num_computed_tokens
            num_new = len(request.token_ids) - computed
            if num_new == 1 and computed + 2 <= max_model_len and plain:
                request_id = request.request_id
                if computed < len(tables[request_id]) * block_size and (
                    num_cached is None or (computed + 1) // block_size <= num_cached[request_id]
                ):
                    if (
                        lazy
                        and computed >= request.num_prompt_tokens  # a decode (see step 3)
                        and self._lazify(request, step - 1)
                    ):
                        token_budget -= 1  # a lazy decode from this step on
                        req_index += 1
                        continue
                    num_scheduled[request_id] = 1
                    token_budget -= 1
                    req_index += 1
                    continue
            num_new = running_chunk(
                len(request.token_ids), computed, threshold, token_budget, max_model_len
            )
            if num_new <= 0:
                complete = False
                req_index += 1
                continue
            while True:
                new_blocks = allocate_slots(request, num_new)
                if new_blocks is not None:
                    break
                victim_index = self.policy.victim_index(running)
                victim = running.pop(victim_index)
                num_running -= 1
                if victim.lazy_step >= 0:
                    self.materialize(victim, step - 1)
                    if victim_index < req_index:
                        token_budget += 1  # its lazy decode this step is taken back
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
        if req_index < len(running):
            # The pass stopped early: the lazy decodes after it compute nothing this step.
            complete = False
            if self.lazy_count:
                for request in running[req_index:]:
                    if request.lazy_step >= 0:
                        self.materialize(request, step - 1)

        # 1b. SWAPPED requests (swap preemption only), unless this step had to preempt.
        if num_swapped and not preempted:
            token_budget = self._schedule_swapped(token_budget, threshold, num_scheduled)

        # 2. WAITING requests, unless this step had to preempt; while swapped requests wait
        # (swap preemption), only those the policy puts ahead of them.
        num_query_tokens = num_hit_tokens = num_resumed_hit_tokens = 0
        if offloader is not None:
            # Counts of a step that ran nothing (discard_empty_step) go to this one.
            num_query_tokens, num_hit_tokens, num_resumed_hit_tokens = self._carried_counts
            self._carried_counts = (0, 0, 0)
            if not preempted:
                counts = self._schedule_waiting_offload(
                    token_budget, threshold, num_scheduled, admitted_ids, admitted_hit_tokens
                )
                num_query_tokens += counts[0]
                num_hit_tokens += counts[1]
                num_resumed_hit_tokens += counts[2]
        elif not preempted:
            waiting = self.waiting
            swapped = self.swapped if swapper is not None else None
            while token_budget > 0 and len(waiting) and len(running) < self.max_num_seqs:
                request = waiting.peek()
                if swapped and not self.policy.ahead_of_swapped(request, swapped.peek()):
                    break
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                num_new = self._first_chunk(request.num_tokens - num_hit, threshold, token_budget)
                if num_new is None or self._admit_slots(request, num_new, hit_blocks) is None:
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
        num_lazy = self.lazy_count
        if num_lazy:
            num_decode += num_lazy
            decode_context += self.lazy_computed_tokens(step - 1)  # their context before it
        if lazy:
            self._complete_pass = complete
        pool = kv.block_pool
        shape = BatchShape(
            num_prefill_tokens,
            num_prefill_reqs,
            prefill_pairs,
            num_decode,
            decode_context,
            kv.shared_kv_tokens,
        )

        self.num_steps += 1
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
            offload=None if offloader is None else offloader.take_step(len(self.loading)),
            num_lazy_decodes=num_lazy,
        )

    def discard_empty_step(self, output: SchedulerOutput) -> None:
        """Take back a step that schedules nothing while loads from the CPU offload tier are
        in flight (the engine waits for one instead of running empty steps): its number is
        reused, its counts go to the next step."""
        assert output.is_empty and output.offload is not None and self.offloader is not None
        self.num_steps -= 1
        self._carried_counts = (
            self._carried_counts[0] + output.num_prefix_query_tokens,
            self._carried_counts[1] + output.num_prefix_hit_tokens,
            self._carried_counts[2] + output.num_resumed_prefix_hit_tokens,
        )
        self.offloader.carry(output.offload)

    def _first_chunk(self, num_new: int, threshold: int, token_budget: int) -> int | None:
        """Tokens a waiting request computes in the step that admits it, out of the
        ``num_new`` it lacks: capped by the long-prefill threshold and the budget left;
        None when chunked prefill is off and they do not fit (admission stops)."""
        if 0 < threshold < num_new:
            num_new = threshold
        if not self.enable_chunked_prefill and num_new > token_budget:
            return None
        return min(num_new, token_budget)

    def _admit_slots(
        self, request: Request, num_new: int, hit_blocks: list[int]
    ) -> list[int] | None:
        """Blocks for admitting a waiting request after its prefix hits (vLLM's admission
        ``allocate_slots``: the full sequence must fit, the watermark applies once someone
        is scheduled), or None."""
        return self.kv_cache_manager.allocate_slots(
            request,
            num_new,
            num_new_computed_tokens=len(hit_blocks) * self.kv_cache_manager.block_size,
            new_computed_blocks=hit_blocks,
            full_sequence_must_fit=True,
            has_scheduled_reqs=bool(self.running),
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
            chunk = self._first_chunk(num_new, threshold, token_budget)
            if chunk is None or chunk <= 0:
                break
            num_new = chunk
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

    def _schedule_waiting_offload(
        self,
        token_budget: int,
        threshold: int,
        num_scheduled: dict[str, int],
        admitted_ids: list[str],
        admitted_hit_tokens: list[int],
    ) -> tuple[int, int, int]:
        """Step 2 with the CPU offload tier (vLLM's waiting pass with the offloading
        connector; see ``sim/kv/offload.py``): the requests holding blocks first (loads in
        flight or done), then the waiting queue. A request whose load is in flight, or whose
        lookup must wait for a transfer, is skipped (it keeps its place for the next step)
        and the pass goes on; one whose store lookup hits is given its blocks and its load
        starts, also without budget or a running slot. Returns the prefix-cache counts
        (queries, hits, hits on re-admission)."""
        kv = self.kv_cache_manager
        offloader = self.offloader
        assert offloader is not None
        running = self.running
        block_size = kv.block_size
        skipped_loading: list[Request] = []
        skipped_waiting: list[Request] = []
        # Prefix-cache counts of the admissions that looked up (queries, hits, re-admission
        # hits), counted once the blocks are given, as vLLM records them.
        counts = [0, 0, 0]

        def count_lookup(request: Request, num_hit: int, num_external: int = 0) -> None:
            offloader.count_lookup(request, num_hit, num_external)
            if request.num_preemptions:
                counts[2] += num_hit
            else:
                counts[0] += request.num_tokens
                counts[1] += num_hit

        while token_budget > 0:
            queue = self.loading if len(self.loading) else self.waiting
            if not len(queue) or len(running) >= self.max_num_seqs:
                break
            request = queue.peek()
            if request.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if not offloader.load_done(request):
                    skipped_loading.append(queue.pop())
                    continue
                kv.cache_blocks(request, request.num_computed_tokens)
                if request.num_computed_tokens == request.num_tokens:
                    request.num_computed_tokens -= 1  # the last token samples the next
                request.status = (
                    RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
                )
            num_hit = 0
            if request.num_computed_tokens == 0:
                hit_blocks, num_hit = kv.get_computed_blocks(request)
                num_ext_blocks = offloader.lookup(request, len(hit_blocks))
                if num_ext_blocks is None:  # a transfer first: ask again next step
                    skipped_waiting.append(queue.pop())
                    continue
                if num_ext_blocks:
                    num_external = num_ext_blocks * block_size
                    # Blocks for the hits and the loaded tokens; the load runs between steps.
                    reserved = sum(
                        kv.remaining_blocks(r)
                        for r in (*running, *self.loading, *skipped_loading)
                        if r.num_computed_tokens + num_scheduled.get(r.request_id, 0) < r.num_tokens
                    )
                    if not kv.allocate_for_load(
                        request, hit_blocks, num_external, reserved, bool(running)
                    ):
                        break
                    offloader.start_load(request, len(hit_blocks), num_ext_blocks)
                    count_lookup(request, num_hit, num_external)
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    request.num_computed_tokens = num_hit + num_external
                    queue.pop()
                    skipped_loading.append(request)
                    continue
                num_new = request.num_tokens - num_hit
            else:
                num_new = request.num_tokens - request.num_computed_tokens
            chunk = self._first_chunk(num_new, threshold, token_budget)
            if chunk is None:
                break
            num_new = chunk
            if request.num_computed_tokens == 0:
                new_blocks = self._admit_slots(request, num_new, hit_blocks)
                if new_blocks is not None:
                    count_lookup(request, num_hit)
            else:
                num_hit = request.num_computed_tokens  # loaded, and HBM hits before them
                new_blocks = kv.allocate_after_load(request, num_new, bool(running))
            if new_blocks is None:
                break
            queue.pop()
            running.append(request)
            request.mark_running(num_hit)
            admitted_ids.append(request.request_id)
            admitted_hit_tokens.append(num_hit)
            num_scheduled[request.request_id] = num_new
            token_budget -= num_new
        # The skipped keep their places, ahead of the rest (vLLM prepends them back).
        for queue, skipped in ((self.loading, skipped_loading), (self.waiting, skipped_waiting)):
            for request in reversed(skipped):
                queue.prepend(request)
        return counts[0], counts[1], counts[2]

    def update_from_output(self, output: SchedulerOutput) -> StepUpdate:
        """Apply a finished step: sample tokens, finish and free requests."""
        sampled: list[Request] = []
        finished: list[Request] = []
        requests = self.requests
        max_model_len = self.max_model_len
        lazy = self.lazy
        eager: list[Request] = []  # lazy decodes on: the running requests not lazy now
        for request_id in output.num_scheduled_tokens:
            request = requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # preempted later in the same step (priority policy)
            num_tokens = len(request.token_ids)
            if request.num_computed_tokens < num_tokens:
                # A prefill chunk that did not reach the end samples nothing.
                if lazy:
                    eager.append(request)
                continue
            request.sample_output_token()
            sampled.append(request)
            num_tokens += 1
            if num_tokens - request.num_prompt_tokens >= request.max_tokens or (
                num_tokens >= max_model_len
            ):
                request.mark_finished()
                self.kv_cache_manager.free(request)
                if self.offloader is not None:
                    self.offloader.on_finished(request)
                del requests[request_id]
                finished.append(request)
            elif lazy:
                eager.append(request)
        running = self.running
        for request in finished:
            running.remove(request)  # by identity (a Request has no __eq__), in C
        if lazy:
            self.eager_running = eager if self._complete_pass else None
        return StepUpdate(sampled, finished)
