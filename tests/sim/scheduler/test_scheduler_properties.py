"""Invariants and theory checks of the scheduler over random request streams (hypothesis).

A stream is an engine config, a pool size and requests with arrival steps, drawn like the vLLM
conformance suite's streams (shared prefixes, full-prompt repeats, tight and loose pools) but
run through kvsim alone, to completion. After every ``schedule()`` and every
``update_from_output()`` the block accounting must hold: each usable block is free xor
referenced, a block's ref count equals the number of block tables holding it, no table holds a
block twice, the prefix-cache map agrees with the blocks, the step fits the token budget and
``max_num_seqs``. Theory checks: a pool that holds every request at once never preempts; a lone
request's first token comes after ceil(prompt / budget) steps; a lightly loaded engine admits
everything on arrival.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.config.engine import EngineConfig
from sim.request import Request, RequestStatus
from sim.scheduler.output import SchedulerOutput
from sim.scheduler.scheduler import Scheduler

MAX_MODEL_LEN = 512
# What the invariant property exercised (checked by the test after it, as the conformance
# suite does).
COVERAGE = Counter()
PROPERTY_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StreamRequest:
    request_id: str
    arrival_step: int
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    priority: int


@dataclass(frozen=True)
class Stream:
    config: EngineConfig
    num_gpu_blocks: int
    requests: tuple[StreamRequest, ...]

    def blocks_for_all(self) -> int:
        """Blocks that hold every request's whole sequence at once (null block included)."""
        bs = self.config.block_size
        return 1 + sum(cdiv(len(r.prompt_token_ids) + r.max_tokens, bs) for r in self.requests)

    def step_bound(self) -> int:
        """Generous bound on the steps to finish everything when each request fits alone."""
        budget = self.config.max_num_batched_tokens
        work = sum(cdiv(len(r.prompt_token_ids), budget) + r.max_tokens for r in self.requests)
        tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)
        last_arrival = max(r.arrival_step for r in self.requests)
        return last_arrival + 4 * (work + tokens) + 50


@st.composite
def engine_configs(draw: st.DrawFn) -> EngineConfig:
    budget = draw(st.sampled_from([8, 16, 24, 32, 64, 100, 256, 512, 2048]))
    return EngineConfig(
        block_size=draw(st.sampled_from([4, 16])),
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, 8)),
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=draw(st.booleans()) if budget >= MAX_MODEL_LEN else True,
        long_prefill_token_threshold=draw(st.one_of(st.just(0), st.integers(1, 64))),
        enable_prefix_caching=draw(st.booleans()),
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.05, 0.1])),
    )


@st.composite
def stream_requests(draw: st.DrawFn, max_requests: int = 12) -> tuple[StreamRequest, ...]:
    # Shared prefixes (system prompts, tool schemas) that later requests hit.
    prefixes = [
        tuple(100 + 1000 * k + j for j in range(draw(st.integers(0, 80)))) for k in range(3)
    ]
    requests: list[StreamRequest] = []
    for i in range(draw(st.integers(1, max_requests))):
        if requests and draw(st.integers(0, 9)) == 0:
            prompt = draw(st.sampled_from(requests)).prompt_token_ids  # a full-prompt repeat
        else:
            suffix = tuple(5000 + 500 * i + j for j in range(draw(st.integers(1, 100))))
            prompt = draw(st.sampled_from(prefixes)) + suffix
        requests.append(
            StreamRequest(
                request_id=f"r{i}",
                arrival_step=draw(st.integers(0, 20)),
                prompt_token_ids=prompt,
                max_tokens=draw(st.integers(1, 24)),
                priority=draw(st.integers(0, 3)),
            )
        )
    return tuple(requests)


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    config = draw(engine_configs())
    requests = draw(stream_requests())
    bs = config.block_size
    # Every request fits alone; "tight" pools force preemption when several run.
    min_blocks = max(cdiv(len(r.prompt_token_ids) + r.max_tokens, bs) for r in requests)
    if draw(st.integers(0, 2)):  # two thirds of the streams run tight
        extra = draw(st.integers(0, min_blocks // 2))
    else:
        extra = draw(st.integers(min_blocks, 8 * min_blocks))
    return Stream(config, min_blocks + 1 + extra, requests)


def make_request(r: StreamRequest, block_size: int) -> Request:
    return Request(
        r.request_id,
        r.prompt_token_ids,
        r.max_tokens,
        block_size=block_size,
        arrival_time_s=float(r.arrival_step),
        priority=r.priority,
    )


# -- invariants -----------------------------------------------------------------------------------
def check_block_accounting(scheduler: Scheduler) -> None:
    """Free xor referenced, ref counts == table memberships, no duplicates, cache map."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    free = pool.free_block_ids()
    assert len(set(free)) == len(free) == pool.num_free_blocks
    free_set = set(free)
    assert pool.null_block == 0
    assert 0 not in free_set
    assert pool.ref_cnt[0] == 0

    owners: Counter[int] = Counter()
    for request_id, block_ids in kv.req_to_blocks.items():
        assert len(set(block_ids)) == len(block_ids), (request_id, block_ids)
        assert 0 not in block_ids, (request_id, block_ids)
        owners.update(block_ids)

    num_referenced = 0
    for block_id in range(1, pool.num_gpu_blocks):
        ref_cnt = int(pool.ref_cnt[block_id])
        assert ref_cnt >= 0, block_id
        assert ref_cnt == owners[block_id], (block_id, ref_cnt, owners[block_id])
        assert (block_id in free_set) != (ref_cnt > 0), block_id
        num_referenced += ref_cnt > 0
    assert pool.num_free_blocks + num_referenced == pool.num_usable_blocks
    assert 0.0 <= pool.usage <= 1.0

    num_hashed = 0
    for block_hash, holders in pool.cached_blocks.items():
        assert holders, block_hash
        assert len(set(holders)) == len(holders), holders
        for block_id in holders:
            assert pool.block_hash_of(block_id) == block_hash
            num_hashed += 1
    hashed = {i for i in range(pool.num_gpu_blocks) if pool.block_hash_of(i) is not None}
    assert num_hashed == len(hashed)
    assert set(pool.cached_block_ids().tolist()) == hashed
    if not kv.enable_caching:
        assert num_hashed == 0


def check_requests(scheduler: Scheduler) -> None:
    """Running requests own exactly the blocks their computed tokens need; others own none."""
    kv = scheduler.kv_cache_manager
    bs = kv.block_size
    assert len(scheduler.running) <= scheduler.max_num_seqs
    running_ids = [r.request_id for r in scheduler.running]
    assert len(set(running_ids)) == len(running_ids)
    assert set(kv.req_to_blocks) == set(running_ids)
    for request in scheduler.running:
        assert request.status is RequestStatus.RUNNING
        assert 0 < request.num_computed_tokens <= request.num_tokens
        blocks = kv.req_to_blocks[request.request_id]
        assert len(blocks) == cdiv(request.num_computed_tokens, bs)
        if kv.enable_caching:
            # Full computed blocks are cached under the request's own hashes; the rest are not.
            num_full = request.num_computed_tokens // bs
            assert kv.num_cached_block[request.request_id] == num_full
            hashes = [kv.block_pool.block_hash_of(b) for b in blocks]
            assert hashes[:num_full] == request.block_hashes[:num_full]
            assert hashes[num_full:] == [None] * (len(blocks) - num_full)
    for request in scheduler.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0
        assert request.request_id not in running_ids


def check_output(scheduler: Scheduler, output: SchedulerOutput) -> None:
    config = scheduler.config
    assert output.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert all(n > 0 for n in output.num_scheduled_tokens.values())
    running_ids = {r.request_id for r in scheduler.running}
    assert set(output.num_scheduled_tokens) <= running_ids
    assert set(output.admitted_ids) <= set(output.num_scheduled_tokens)
    assert not (set(output.preempted_ids) & set(output.num_scheduled_tokens))
    if output.preempted_ids:
        assert output.admitted_ids == []
    assert output.num_running == len(scheduler.running)
    assert output.num_waiting == len(scheduler.waiting)
    assert output.num_free_blocks == scheduler.kv_cache_manager.block_pool.num_free_blocks
    shape = output.shape
    assert shape.num_tokens == output.total_num_scheduled_tokens
    assert shape.num_prefill_reqs + shape.num_decode_reqs == len(output.num_scheduled_tokens)


@dataclass
class RunResult:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefix_hit_tokens: int = 0
    num_resumed_prefix_hit_tokens: int = 0
    finished: dict[str, Request] = field(default_factory=dict)
    first_token_step: dict[str, int] = field(default_factory=dict)
    finish_step: dict[str, int] = field(default_factory=dict)
    admit_step: dict[str, int] = field(default_factory=dict)


def run_stream(stream: Stream, max_steps: int, *, check: bool = True) -> RunResult:
    """Drive the stream to completion (or ``max_steps``), checking invariants every step."""
    scheduler = Scheduler(stream.config, stream.num_gpu_blocks)
    bs = stream.config.block_size
    pending = sorted(stream.requests, key=lambda r: (r.arrival_step, r.request_id))
    result = RunResult()
    nxt = 0
    for step_index in range(max_steps):
        while nxt < len(pending) and pending[nxt].arrival_step <= step_index:
            scheduler.add_request(make_request(pending[nxt], bs))
            nxt += 1
        if nxt == len(pending) and not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        step_number = step_index + 1  # steps are counted from 1, as SchedulerOutput.step
        if check:
            check_output(scheduler, output)
            check_block_accounting(scheduler)
            check_requests(scheduler)
        result.num_prefix_hit_tokens += output.num_prefix_hit_tokens
        result.num_resumed_prefix_hit_tokens += output.num_resumed_prefix_hit_tokens
        for request_id in output.admitted_ids:
            result.admit_step.setdefault(request_id, step_number)
        update = scheduler.update_from_output(output)
        for request in update.sampled:
            result.first_token_step.setdefault(request.request_id, step_number)
        for request in update.finished:
            assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
            assert request.num_output_tokens == request.max_tokens
            assert request.request_id not in result.finished
            result.finished[request.request_id] = request
            result.finish_step[request.request_id] = step_number
        if check:
            check_block_accounting(scheduler)
            check_requests(scheduler)
        result.num_steps = step_number
    result.num_preemptions = scheduler.num_preemptions
    return result


# -- properties -----------------------------------------------------------------------------------
@PROPERTY_SETTINGS
@given(stream=streams())
def test_invariants_hold_every_step_and_every_request_finishes(stream: Stream) -> None:
    result = run_stream(stream, stream.step_bound())
    assert sorted(result.finished) == sorted(r.request_id for r in stream.requests), (
        f"unfinished after {result.num_steps} steps: "
        f"{sorted({r.request_id for r in stream.requests} - set(result.finished))}"
    )
    COVERAGE["streams"] += 1
    COVERAGE["preempting"] += result.num_preemptions > 0
    COVERAGE["prefix_hits"] += result.num_prefix_hit_tokens > 0
    COVERAGE["resumed_hits"] += result.num_resumed_prefix_hit_tokens > 0
    COVERAGE[stream.config.scheduling_policy] += 1


def test_the_invariant_streams_covered_preemption_prefix_hits_and_both_policies() -> None:
    if not COVERAGE["streams"]:
        pytest.skip("the invariant property did not run in this session")
    n = COVERAGE["streams"]
    assert COVERAGE["preempting"] >= n / 5, COVERAGE
    assert COVERAGE["prefix_hits"] >= n / 5, COVERAGE
    assert COVERAGE["resumed_hits"] >= n / 20, COVERAGE
    assert min(COVERAGE["fcfs"], COVERAGE["priority"]) >= n / 4, COVERAGE


@PROPERTY_SETTINGS
@given(config=engine_configs(), requests=stream_requests())
def test_a_pool_that_holds_every_request_at_once_never_preempts(
    config: EngineConfig, requests: tuple[StreamRequest, ...]
) -> None:
    stream = Stream(config, 0, requests)
    stream = Stream(config, stream.blocks_for_all(), requests)
    result = run_stream(stream, stream.step_bound())
    assert result.num_preemptions == 0
    assert len(result.finished) == len(requests)


@PROPERTY_SETTINGS
@given(
    prompt_len=st.integers(1, 500),
    max_tokens=st.integers(1, 12),
    budget=st.sampled_from([1, 7, 16, 33, 64, 100, 256, 499, 500, 4096]),
    block_size=st.sampled_from([4, 16]),
    threshold=st.one_of(st.just(0), st.integers(1, 64)),
    enable_prefix_caching=st.booleans(),
)
def test_a_lone_request_gets_its_first_token_after_ceil_prompt_over_budget_steps(
    prompt_len: int,
    max_tokens: int,
    budget: int,
    block_size: int,
    threshold: int,
    enable_prefix_caching: bool,
) -> None:
    max_tokens = min(max_tokens, MAX_MODEL_LEN - prompt_len)
    config = EngineConfig(
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        long_prefill_token_threshold=threshold,  # lifted: nobody else to starve
        enable_prefix_caching=enable_prefix_caching,
    )
    request = StreamRequest("solo", 0, tuple(range(prompt_len)), max_tokens, 0)
    stream = Stream(config, 1 + cdiv(prompt_len + max_tokens, block_size), (request,))
    result = run_stream(stream, 10_000)
    ttft_steps = cdiv(prompt_len, budget)
    assert result.admit_step == {"solo": 1}
    assert result.first_token_step == {"solo": ttft_steps}
    assert result.finish_step == {"solo": ttft_steps + max_tokens - 1}
    assert result.num_preemptions == 0


@PROPERTY_SETTINGS
@given(requests=stream_requests(max_requests=8), block_size=st.sampled_from([4, 16]))
def test_a_lightly_loaded_engine_admits_every_request_on_arrival(
    requests: tuple[StreamRequest, ...], block_size: int
) -> None:
    # Budget, sequence slots and blocks for everyone at once: no queueing anywhere.
    config = EngineConfig(
        block_size=block_size,
        max_num_batched_tokens=sum(len(r.prompt_token_ids) for r in requests),
        max_num_seqs=len(requests),
        max_model_len=MAX_MODEL_LEN,
    )
    stream = Stream(config, 0, requests)
    stream = Stream(config, stream.blocks_for_all(), requests)
    result = run_stream(stream, stream.step_bound())
    for r in requests:
        arrival = r.arrival_step + 1  # a request added before step k's schedule() is in step k
        assert result.admit_step[r.request_id] == arrival
        assert result.first_token_step[r.request_id] == arrival
        assert result.finish_step[r.request_id] == arrival + r.max_tokens - 1
    assert result.num_preemptions == 0
