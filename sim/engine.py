"""The simulated vLLM engine: a SimPy process that runs scheduler steps back to back.

Each step: the scheduler decides (no time passes), the cost model prices the batch, SimPy
advances the clock by that duration, then the step's tokens are delivered (sampled tokens,
finished requests, their completion events). When nothing is queued the engine sleeps
until the next arrival; the step that wakes it is priced as after idle (see CostModel).
This module and the workload processes are the only simpy users.

Fast path (the default): a *stretch* is a run of steps in which nothing the scheduler
reacts to can happen: every running request decodes one token, except perhaps the last one
(the request admitted last), which computes its prompt (prompt and outputs, resumed after a
preemption) in chunks that do not reach its end;
nobody can be admitted (the waiting queue is empty, ``max_num_seqs`` / the token budget is
full, or the queue's head does not fit in the free blocks and no block it could hit gets
registered); no decode reaches its output length or ``max_model_len`` before the stretch's
last step; the free queue covers every block the stretch needs (so nobody is preempted); no
SimPy event (an arrival, a tool-call wake-up) falls inside it and it ends before the
engine's horizon (the run's time limit). Such a stretch is advanced in bulk: step durations
from the cost model one after the other, block allocations and prefix-cache registrations in
the order vLLM's scheduler makes them (step by step, running requests in order), the
finishing requests of its last step freed in running order, and one SimPy timeout to the
exact end time the step-by-step path reaches. The chunk that ends a prompt (it samples a
token) and every step that admits or preempts go through
:meth:`Scheduler.schedule`. ``Engine(..., fast=False)`` runs every step through it, the
reference the fast path is tested against (``tests/sim/test_fast_path.py``): both give
identical step and request tables.

Lazy decodes (the fast path inside the scheduler, for the steps a stretch cannot take: an
arrival, an admission, a prefill chunk or a finish somewhere in the batch): a running
request that will only decode for its next steps, in a block it holds, registering no block
and not finishing, is counted in each step's batch without being touched, and brought up to
date when it must be scheduled one by one again (``Scheduler.enable_lazy_decodes``). The
step-by-step path schedules every request one by one.

A stretch is planned whole when it starts: its tokens and step rows are written then; its
new blocks, cache registrations and finishes are applied when it has run
(:meth:`Engine._end_stretch`). One engine bounds a stretch by the clock's next event. A
fleet's replica does not: on a shared clock that event is mostly another replica's step.
It sleeps through the stretch step by step, as the reference does, and when a request was
submitted to it during a step, it ends the stretch after that step (its later steps are
taken back: tokens, rows, token times), so the scheduler sees the request exactly when the
step-by-step path would. Nothing else a fleet does changes what a replica's scheduler
decides, and the router reads only the step rows that have ended.

Swap preemption (a what-if, ``engine.preemption_mode=swap``): a step that copies KV blocks
between HBM and the CPU swap pool lasts the model's time plus the copies' time (the cost
model's ``kv_transfer_time_s``: bytes over PCIe bandwidth x its transfer efficiency, swap-outs
and swap-ins one after the other), as vLLM V0's worker ran ``swap_in``/``swap_out`` before
the forward pass of the same step. What-if runs take no stretches.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from operator import attrgetter
from typing import Any

import simpy

from sim.cost_model import StepCost
from sim.kernel_builds import KernelBuilds
from sim.recorder import Recorder, StretchBatch
from sim.request import Request
from sim.scheduler.output import BatchShape
from sim.scheduler.scheduler import Scheduler, running_chunk
from sim.stretch_blocks import Stretch, apply_stretch_blocks, delay_to, unregistered_hashes
from sim.workload.base import RequestMeta, SinkBase

# A stretch shorter than this is run as ordinary steps (the bulk set-up would cost more).
MIN_STRETCH_STEPS = 2

_lazy_finish = attrgetter("lazy_finish")
_num_computed_tokens = attrgetter("num_computed_tokens")


class Engine(SinkBase):
    """Owns the scheduler and the clock; implements the workloads' ``RequestSink``."""

    def __init__(
        self,
        env: simpy.Environment,
        scheduler: Scheduler,
        cost_model: StepCost,
        recorder: Recorder,
        fast: bool = True,
        jitter: Callable[[int], float] | None = None,
    ) -> None:
        """``jitter(k)``, when given, multiplies the model time of step ``k`` (the
        scheduler's step counter; sim/step_jitter.py)."""
        super().__init__(env, scheduler.config.block_size, scheduler.max_model_len)
        self.scheduler = scheduler
        self.cost_model = cost_model
        self.jitter = jitter
        self.recorder = recorder
        # A what-if memory policy changes what a stretch may assume: step by step only.
        self.fast = fast and not scheduler.config.what_if_policies()
        if scheduler.swapper is not None:
            recorder.add_swap_columns()
        offloader = scheduler.offloader
        if offloader is not None:
            bytes_per_block = offloader.bytes_per_block
            transfer_time_s = cost_model.kv_transfer_time_s
            offloader.transfer_time_s = lambda n: transfer_time_s(n, bytes_per_block)
            recorder.add_offload_columns()
        # No step of a stretch may end after this time (the run's time limit: the
        # step-by-step path never records a step ending past it).
        self.horizon_s = math.inf
        self.num_stretches = 0
        self.num_stretch_steps = 0
        self.num_prefill_stretch_steps = 0  # of which a prefill chunk ran in
        # Stretches planned and given up (the queue's head would hit a block they register),
        # and stretches whose pops and registrations were replayed one by one; by whether
        # a prefill was in the batch (False, True).
        self.num_stretch_undos = [0, 0]
        self.num_stretch_replays = [0, 0]
        # Stretches a submit cut short (a fleet's replica), by the same split.
        self.num_stretch_cuts = [0, 0]
        self._stretch_end_s = 0.0
        # A fleet's replica: a stretch is not bounded by the clock's next event (most are
        # other replicas' steps) but cut after the step in which a request is submitted
        # to this engine, the only event that changes what its scheduler would do.
        self.cut_by_submits = False
        self._submitted = False
        self._stretch: Stretch | None = None  # planned, its blocks not applied yet
        self._done: dict[str, simpy.Event] = {}
        # Steady decodes advanced in bulk between the steps that must see them (the fast
        # path inside the scheduler: see Scheduler.enable_lazy_decodes).
        self.lazy = self.fast and scheduler.enable_lazy_decodes(recorder.add_token_times)
        # The token counts this engine process has built kernels for, when steps pay for it.
        min_tokens = cost_model.kernel_build_min_tokens
        self.kernel_builds = (
            None
            if min_tokens is None
            else KernelBuilds(min_tokens, scheduler.max_num_batched_tokens)
        )
        self.process = env.process(self._run())

    def submit(self, request: Request, meta: RequestMeta) -> simpy.Event:
        """Queue a request now; the returned event fires with it once it has finished."""
        request.arrival_time_s = self._env.now
        self.scheduler.add_request(request)
        self.scheduler.kv_cache_manager.on_arrival(request)  # KV retention's session hint
        self.recorder.on_arrival(request, meta, self._env.now)
        self._submitted = True
        done = self._env.event()
        self._done[request.request_id] = done
        self._wake()
        return done

    def settle(self) -> None:
        """Bring lazy decodes up to date with the last recorded step (the run has ended, or
        stopped at its time limit with a step in flight): their tokens and token times are
        then those of the step-by-step path."""
        if self.lazy:
            self.scheduler.materialize_all(len(self.recorder.step_ends))

    # -- the step loop ------------------------------------------------------------------------
    def _run(self) -> Generator[simpy.Event, Any, None]:
        env = self._env
        scheduler = self.scheduler
        step_time_s = self.cost_model.step_time_s
        recorder = self.recorder
        done = self._done
        fast = self.fast
        jitter = self.jitter
        offloader = scheduler.offloader  # CPU offload tier only
        builds = self.kernel_builds
        after_idle = True  # the first step wakes the engine up
        idle_since_s = env.now  # since when the engine has had nothing to run
        since_prefill = -1  # steps past the last prefill step; -1 before the first one
        while True:
            if not scheduler.has_unfinished_requests():
                if not after_idle:
                    idle_since_s = env.now
                yield self._idle()
                after_idle = True
                continue
            if fast and not after_idle:
                durations = self._plan_stretch(since_prefill)
                if durations is not None:
                    end_s = self._stretch_end_s
                    num_steps = len(durations)
                    delay = None if self.cut_by_submits else delay_to(env.now, end_s)
                    if delay is not None:
                        yield env.timeout(delay)
                    else:  # step by step, as the reference adds them up
                        self._submitted = False
                        for k, duration_s in enumerate(durations):
                            yield env.timeout(duration_s)
                            if self._submitted and self.cut_by_submits:
                                # A request arrived during step k: the step after it
                                # goes through the scheduler, which sees it.
                                num_steps = k + 1
                                break
                    since_prefill, finished = self._end_stretch(num_steps)
                    assert env.now == self._stretch_end_s
                    for request in finished:
                        done.pop(request.request_id).succeed(request)
                    continue
            if offloader is not None:
                offloader.set_time(env.now)
            output = scheduler.schedule()
            # Nothing to run until a copy ends (vLLM spins through empty steps): no step;
            # wait for the copy or an arrival, whichever comes first.
            if (
                output.is_empty
                and offloader is not None
                and not output.preempted_ids
                and (offloader.loads or offloader.next_event_s() is not None)
            ):
                scheduler.discard_empty_step(output)
                offloader.after_schedule({}, scheduler.requests, env.now)  # start loads
                wake_s = offloader.next_event_s()
                assert wake_s is not None
                if not after_idle:
                    idle_since_s = env.now
                yield env.any_of([env.timeout(max(wake_s - env.now, 0.0)), self._idle()])
                after_idle = True
                continue
            # Sizing guarantees one max_model_len request fits, so an idle engine can always
            # admit the head of the queue: an empty step with work queued is a bug, unless
            # it preempted. vLLM then runs an empty step too: a request that could not grow
            # and was itself the preemption victim ends the running loop, and a step that
            # preempted admits nobody.
            assert not output.is_empty or output.preempted_ids, (
                "scheduler made no progress with requests queued"
            )
            start_s = env.now
            if output.shape.num_prefill_reqs:
                since_prefill = 0
            elif since_prefill >= 0:
                since_prefill += 1
            shape = output.shape
            duration_s = step_time_s(
                shape,
                after_idle,
                since_prefill,
                env.now - idle_since_s if after_idle else 0.0,
                builds is not None and builds.run(shape.num_tokens),
            )
            if jitter is not None:
                duration_s *= jitter(output.step)
            swap = output.swap
            if swap is not None and swap.num_blocks_moved:
                swap.transfer_s = self.cost_model.kv_transfer_time_s(
                    swap.num_blocks_moved, swap.bytes_per_block
                )
                duration_s += swap.transfer_s
            after_idle = False
            if offloader is not None:
                offloader.after_schedule(
                    output.num_scheduled_tokens, scheduler.requests, env.now + duration_s
                )
            yield env.timeout(duration_s)
            update = scheduler.update_from_output(output)
            recorder.on_step(output, update, start_s, env.now, scheduler)
            for request in update.finished:
                done.pop(request.request_id).succeed(request)

    # -- stretches ---------------------------------------------------------------------------------
    def _plan_stretch(self, since_prefill: int) -> list[float] | None:
        """Plan a stretch if one starts now (see the module docstring): its tokens and step
        rows are written ahead; its blocks, cache registrations and finishes wait for
        :meth:`_end_stretch` (at once for one engine; once it has run for a fleet's
        replica, which a submit may cut short).

        Returns its step durations and sets ``_stretch_end_s``, or None when the next step
        must go through the scheduler.
        """
        scheduler = self.scheduler
        running = scheduler.running
        num_running = len(running)
        max_num_batched_tokens = scheduler.max_num_batched_tokens
        if not num_running or num_running > max_num_batched_tokens:
            return None
        max_model_len = scheduler.max_model_len
        # The batch: every running request decodes, but the last may compute a prefill chunk
        # (the request admitted last, working through a long prompt). Checked first: a batch
        # that is neither (a step that admitted, a prefill ending) is told apart in a few
        # microseconds, the queue head's admission below costs a prefix lookup.
        chunked: Request | None = running[-1]
        done_steps = scheduler.num_steps
        num_lazy = scheduler.lazy_count
        if chunked.lazy_step >= 0:
            chunked = None
        else:
            last_len = len(chunked.token_ids)
            if chunked.num_computed_tokens == last_len - 1 and last_len > chunked.num_prompt_tokens:
                chunked = None
        decoders = running if chunked is None else running[:-1]
        # Steps until each decode finishes (its f-th step from now samples its last token).
        k_cap = 1 << 62
        checked: list[Request] = decoders
        if num_lazy:
            # Lazy decodes decode steadily by construction and know their last step; only
            # the others are checked one by one.
            eager = scheduler.eager_running
            if eager is None:
                return None
            checked = [request for request in eager if request is not chunked]
        for request in checked:
            num_tokens = len(request.token_ids)
            if (
                request.num_computed_tokens != num_tokens - 1
                or num_tokens <= request.num_prompt_tokens
            ):
                return None  # a prefill (or a resumed recompute) before the last request
            left = request.max_tokens - (num_tokens - request.num_prompt_tokens)
            if max_model_len - num_tokens < left:
                left = max_model_len - num_tokens
            if left < k_cap:
                k_cap = left
        if num_lazy:
            k_cap = min(k_cap, min(map(_lazy_finish, decoders)) - done_steps)
        num_decode = len(decoders)
        # The prefill's chunks, as Scheduler.schedule sizes them with the decodes ahead of it
        # in the budget, for as long as a chunk leaves part of the prompt to compute: the
        # chunk that ends the prompt samples a token and goes through the scheduler.
        chunks: list[int] = []
        budget = max_num_batched_tokens - num_decode
        can_admit = budget > 0  # a decode-only step leaves budget to admit with
        if chunked is not None:
            threshold = scheduler.long_prefill_token_threshold
            if num_running + len(scheduler.waiting) <= 1:
                threshold = 0  # nobody else to starve: vLLM lifts the cap
            computed = chunked.num_computed_tokens
            prefill_len = len(chunked.token_ids)
            can_admit = False
            while len(chunks) < k_cap:
                num_new = running_chunk(prefill_len, computed, threshold, budget, max_model_len)
                if num_new <= 0 or computed + num_new >= prefill_len:
                    break
                if num_new < budget:
                    can_admit = True
                chunks.append(num_new)
                computed += num_new
            k_cap = len(chunks)
        if k_cap < MIN_STRETCH_STEPS:
            return None
        kv = scheduler.kv_cache_manager
        head_miss: int | None = None
        if len(scheduler.waiting) and num_running < scheduler.max_num_seqs and can_admit:
            # The scheduler tries to admit the head of the queue every step that leaves
            # budget: the stretch goes on only while that fails for want of free blocks
            # (see admission_blocked).
            blocked, head_miss = kv.admission_blocked(scheduler.waiting.peek())
            if not blocked:
                return None
        recorder = self.recorder
        block_map = recorder.block_map
        first_step = scheduler.num_steps + 1
        if block_map is not None:
            # A block-map snapshot is taken after its step: end the stretch there.
            interval = block_map.interval
            to_snapshot = (-(first_step - 1)) % interval + 1
            if to_snapshot < k_cap:
                k_cap = to_snapshot
        if k_cap < MIN_STRETCH_STEPS:
            return None

        # Step times, one after the other as the step-by-step path adds them, until a SimPy
        # event would intervene (it must be seen by the scheduler of the step after it) or
        # a step would end past the horizon. Timed first: a stretch cut short here costs no
        # block planning.
        env = self._env
        next_event_s = math.inf if self.cut_by_submits else env.peek()
        horizon_s = self.horizon_s
        step_time_s = self.cost_model.step_time_s
        jitter = self.jitter
        builds = self.kernel_builds  # a step that would build kernels ends the stretch
        # The decoders are the checked ones and the lazy ones (kept as sums).
        decode_context0 = sum(map(_num_computed_tokens, checked))
        decode_context0 += scheduler.lazy_computed_tokens(done_steps)
        shared_kv_tokens = scheduler.kv_cache_manager.shared_kv_tokens  # fixed in a stretch
        shape = BatchShape(0, 0, 0.0, num_decode, decode_context0, shared_kv_tokens)
        prefill_context = chunked.num_computed_tokens if chunked is not None else 0
        now_s = env.now
        starts: list[float] = []
        ends: list[float] = []
        durations: list[float] = []
        pairs: list[float] = []
        step_since_prefill = since_prefill
        num_steps = 0
        while num_steps < k_cap:
            if num_steps and now_s >= next_event_s:
                break
            shape.decode_context_tokens = decode_context0 + num_decode * num_steps
            if chunks:
                n = chunks[num_steps]
                # As Scheduler.schedule sums it (from 0.0) for its one prefill.
                shape.num_prefill_tokens = n
                shape.num_prefill_reqs = 1
                shape.prefill_attention_pairs = n * (prefill_context + n / 2)
                step_since_prefill = 0
            elif step_since_prefill >= 0:
                step_since_prefill += 1
            if builds is not None and builds.is_new(shape.num_tokens):
                break
            duration_s = step_time_s(shape, False, step_since_prefill)
            if jitter is not None:
                duration_s *= jitter(first_step + num_steps)
            end_s = now_s + duration_s
            if end_s > horizon_s:
                break
            if chunks:
                pairs.append(shape.prefill_attention_pairs)
                prefill_context += n
            durations.append(duration_s)
            starts.append(now_s)
            ends.append(end_s)
            now_s = end_s
            num_steps += 1
        if num_steps < MIN_STRETCH_STEPS:
            return None
        # The stretch is planned from here on: every request up to date, one by one.
        scheduler.materialize_all(done_steps)

        pool = kv.block_pool
        block_size = kv.block_size
        tables = kv.req_to_blocks
        # New blocks (step, running index): a block is popped from the free queue when the
        # token at its start is computed. vLLM pops inside allocate_slots, step by step,
        # request by request (the prefill last: it is last in the batch).
        pops: list[tuple[int, int]] = []
        num_held = 0
        for index, request in enumerate(decoders):
            num_blocks = len(tables[request.request_id])
            num_held += num_blocks
            k = num_blocks * block_size - request.num_computed_tokens
            while k < num_steps:
                pops.append((k, index))
                k += block_size
        if chunked is not None:
            held = len(tables[chunked.request_id])
            num_held += held
            computed = chunked.num_computed_tokens
            for k in range(num_steps):
                computed += chunks[k]
                # allocate_slots' num_tokens_need_slot (under max_model_len: see the chunks).
                while held * block_size < computed:
                    pops.append((k, num_decode))
                    held += 1
        num_free = pool.num_free_blocks
        if pops:
            pops.sort()
            if len(pops) > num_free:
                # The step of the first pop the free queue cannot serve: stop before it.
                num_steps = pops[num_free][0]
                if num_steps < MIN_STRETCH_STEPS:
                    return None
                del starts[num_steps:], ends[num_steps:], durations[num_steps:]
                pops = [pop for pop in pops if pop[0] < num_steps]
        del chunks[num_steps:], pairs[num_steps:]

        # Tokens first (a decode's next tokens complete the blocks the stretch registers).
        num_hashes = [len(request.block_hashes) for request in decoders]
        for request in decoders:
            request.append_output_token_ids(num_steps)
            request.num_computed_tokens += num_steps
        prefill_context0 = 0
        if chunked is not None:
            prefill_context0 = chunked.num_computed_tokens
            chunked.num_computed_tokens += sum(chunks)
        if (
            kv.enable_caching
            and head_miss is not None
            and head_miss in unregistered_hashes(kv, running)
        ):
            # The queue's head would hit this block once registered: undo, step by step.
            for request, n in zip(decoders, num_hashes, strict=True):
                del request.token_ids[-num_steps:], request.block_hashes[n:]
                request.num_computed_tokens -= num_steps
            if chunked is not None:
                chunked.num_computed_tokens = prefill_context0
            self.num_stretch_undos[chunked is not None] += 1
            return None
        pops_by_step = [0] * num_steps
        for k, _ in pops:
            pops_by_step[k] += 1
        kv_free_counts: list[int] = []
        free = num_free
        for n in pops_by_step:
            free -= n
            kv_free_counts.append(free)
        # The step rows, ahead (a fleet's router reads those that ended before now).
        self.recorder.on_stretch(
            first_step,
            starts,
            ends,
            StretchBatch(
                decoders, decode_context0, chunks, pairs, prefill_context0, shared_kv_tokens
            ),
            num_held,
            pops_by_step,
            kv_free_counts,
            pool.num_gpu_blocks,
            len(scheduler.waiting),
        )
        self._stretch = Stretch(
            first_step, decoders, chunked, chunks, pops, prefill_context0, ends, since_prefill
        )
        self._stretch_end_s = ends[-1]
        return durations

    def _end_stretch(self, num_steps: int) -> tuple[int, list[Request]]:
        """Apply the planned stretch's first ``num_steps`` steps (all of them unless a
        submit cut it short; the rest are taken back): new blocks and cache registrations
        in vLLM's order, then the finishes of its last step. Returns (steps since prefill
        after it, requests finished)."""
        stretch = self._stretch
        assert stretch is not None
        self._stretch = None
        scheduler = self.scheduler
        kv = scheduler.kv_cache_manager
        running = scheduler.running
        decoders = stretch.decoders
        chunks = stretch.chunks
        pops = stretch.pops
        planned = len(stretch.ends)
        if num_steps < planned:
            cut = planned - num_steps
            block_size = self.block_size
            for request in decoders:
                del request.token_ids[-cut:]
                del request.block_hashes[len(request.token_ids) // block_size :]
                request.num_computed_tokens -= cut
            if stretch.chunked is not None:
                del chunks[num_steps:]
                stretch.chunked.num_computed_tokens = stretch.prefill_context0 + sum(chunks)
            pops = [pop for pop in pops if pop[0] < num_steps]
            self.recorder.cut_stretch(cut, decoders)
            self.num_stretch_cuts[stretch.chunked is not None] += 1
            self._stretch_end_s = stretch.ends[num_steps - 1]
        if apply_stretch_blocks(kv, running, pops, num_steps, chunks):
            self.num_stretch_replays[bool(chunks)] += 1
        scheduler.num_steps += num_steps
        self.num_stretches += 1
        self.num_stretch_steps += num_steps
        since_prefill = stretch.since_prefill
        if chunks:
            self.num_prefill_stretch_steps += num_steps
            since_prefill = 0
        elif since_prefill >= 0:
            since_prefill += num_steps

        # The last step may finish decodes: as update_from_output, in running order. Their
        # slots leave the step's unused count, which was written ahead.
        finished: list[Request] = []
        freed_unused = 0
        if num_steps == planned:
            requests = scheduler.requests
            max_model_len = scheduler.max_model_len
            tables = kv.req_to_blocks
            block_size = self.block_size
            for request in decoders:
                num_tokens = len(request.token_ids)
                if (
                    num_tokens - request.num_prompt_tokens >= request.max_tokens
                    or num_tokens >= max_model_len
                ):
                    freed_unused += (
                        len(tables[request.request_id]) * block_size - request.num_computed_tokens
                    )
                    request.mark_finished()
                    kv.free(request)
                    del requests[request.request_id]
                    finished.append(request)
            if finished:
                gone = {id(r) for r in finished}
                scheduler.running = [r for r in running if id(r) not in gone]
        self.recorder.on_stretch_end(
            stretch.first_step + num_steps - 1,
            self._stretch_end_s,
            finished,
            freed_unused,
            scheduler,
        )
        return since_prefill, finished
