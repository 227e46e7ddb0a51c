"""Lazy decodes: the scheduler's fast path for steady decodes (see
:meth:`LazyDecodes.enable_lazy_decodes`).

A mixin of :class:`sim.scheduler.scheduler.Scheduler`, kept apart from vLLM's scheduling loop
because it changes how a steady decode is kept, not what is decided: the running pass counts
a lazy decode's token of budget and its place in the batch each step without touching its
request, and these methods bring the request up to date when it must be scheduled one by
one again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sim.kv.kv_cache_manager import KVCacheManager
from sim.request import NOT_LAZY, Request

if TYPE_CHECKING:
    from sim.kv.offload import Offloader
    from sim.kv.swap import Swapper

# A steady decode goes lazy only if it stays so for at least this many steps.
MIN_LAZY_STEPS = 2


class LazyDecodes:
    """The lazy-decode bookkeeping of a scheduler (its running requests, KV cache manager,
    ``max_model_len`` and what-if tiers are the scheduler's own)."""

    kv_cache_manager: KVCacheManager
    running: list[Request]
    max_model_len: int
    swapper: Swapper | None
    offloader: Offloader | None

    def _init_lazy_decodes(self) -> None:
        # Off unless enable_lazy_decodes: how many running requests are lazy, the sums of
        # their lazy_step and of their (stale) num_computed_tokens, and the running requests
        # that are not lazy after the last update_from_output (None: not known, e.g. a
        # running pass that stopped early).
        self.lazy = False
        self.lazy_count = 0
        self.lazy_step_sum = 0
        self.lazy_computed_sum = 0
        self.lazy_held_blocks = 0  # blocks they hold (a lazy request gets none while lazy)
        self.eager_running: list[Request] | None = None
        self._complete_pass = False
        self._on_lazy_tokens: Callable[[Request, int, int], None] | None = None

    def enable_lazy_decodes(self, on_tokens: Callable[[Request, int, int], None]) -> bool:
        """Advance steady decodes in bulk instead of one request at a time (the engine's fast
        path; the decisions and every output stay those of the step-by-step path).

        A running request that has just sampled a token and will, for the next steps, only
        decode one token in a block it holds, register no block and not finish is *lazy*:
        each step counts it in the batch (one token of budget, one decode of its context)
        without touching it, and its token ids, computed tokens and token times are brought
        up to date (:meth:`materialize`) when it must be scheduled one by one again (the
        step it needs a block, registers a block or finishes: ``lazy_until``), when it is
        preempted, when a running pass stops before it, or when the engine plans a stretch
        or ends the run. ``on_tokens(request, after_step, last_step)`` then records the
        token times of steps ``after_step + 1 .. last_step``.

        Only the plain KV cache manager, without swap or the offload tier: returns whether
        lazy decodes are on."""
        kv = self.kv_cache_manager
        plain = type(kv) is KVCacheManager and "allocate_slots" not in vars(kv)
        if not plain or self.swapper is not None or self.offloader is not None:
            return False
        self.lazy = True
        self._on_lazy_tokens = on_tokens
        return True

    def lazy_computed_tokens(self, after_step: int) -> int:
        """The lazy decodes' computed tokens in all, as of the end of ``after_step``: each
        has one more per step since its lazy_step (0 with none lazy)."""
        return self.lazy_computed_sum + self.lazy_count * after_step - self.lazy_step_sum

    def materialize(self, request: Request, last_step: int) -> None:
        """Bring a lazy request up to date as of the end of ``last_step`` (its tokens
        sampled through that step); it is scheduled one by one from then on."""
        after_step = request.lazy_step
        self.lazy_count -= 1
        self.lazy_step_sum -= after_step
        self.lazy_computed_sum -= request.num_computed_tokens
        self.lazy_held_blocks -= len(self.kv_cache_manager.req_to_blocks[request.request_id])
        request.lazy_step = -1
        request.lazy_until = 0
        request.lazy_finish = NOT_LAZY
        num_steps = last_step - after_step
        if num_steps > 0:
            request.append_output_token_ids(num_steps)
            request.num_computed_tokens += num_steps
            assert self._on_lazy_tokens is not None
            self._on_lazy_tokens(request, after_step, last_step)

    def materialize_all(self, last_step: int) -> None:
        """Bring every lazy running request up to date as of the end of ``last_step``."""
        if self.lazy_count:
            for request in self.running:
                if request.lazy_step >= 0:
                    self.materialize(request, last_step)
        self.eager_running = None

    def _lazify(self, request: Request, step: int) -> bool:
        """Make a running request, up to date as of the end of ``step`` with one token to
        compute (it sampled it), lazy from the next step on if it decodes steadily for at
        least ``MIN_LAZY_STEPS`` steps (see :meth:`enable_lazy_decodes`).

        Step ``t`` after ``step`` schedules it with ``c = computed + t - step - 1`` tokens
        of context; the one-by-one path decodes it there without calling allocate_slots and
        without finishing it while ``c`` stays below the smallest of: ``max_model_len - 2``
        (its slot check, and a finish at ``max_model_len``), its held slots (a new block),
        the last slot of its first block not yet registered (a registration), and
        ``max_tokens + prompt - 2`` (a finish at ``max_tokens``)."""
        computed = request.num_computed_tokens
        request_id = request.request_id
        kv = self.kv_cache_manager
        block_size = kv.block_size
        limit = self.max_model_len - 2
        num_blocks = len(kv.req_to_blocks[request_id])
        held = num_blocks * block_size
        if held < limit:
            limit = held
        finish = request.max_tokens + request.num_prompt_tokens
        if finish - 2 < limit:
            limit = finish - 2
        if kv.enable_caching:
            unregistered = (kv.num_cached_block[request_id] + 1) * block_size - 1
            if unregistered < limit:
                limit = unregistered
        num_lazy = limit - computed
        if num_lazy < MIN_LAZY_STEPS:
            return False
        request.lazy_step = step
        request.lazy_until = step + 1 + num_lazy
        if self.max_model_len < finish:
            finish = self.max_model_len
        # The step whose sampled token ends it (as the engine's stretches count it).
        request.lazy_finish = step + finish - computed - 1
        self.lazy_count += 1
        self.lazy_step_sum += step
        self.lazy_computed_sum += computed
        self.lazy_held_blocks += num_blocks
        return True
