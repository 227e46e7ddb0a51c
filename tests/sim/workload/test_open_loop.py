import math

import numpy as np
import pytest
from pydantic import ValidationError

from sim.request import Request
from sim.workload.distributions import (
    BurstArrivals,
    FixedLength,
    PoissonArrivals,
    PriorityClass,
    UniformLength,
)
from sim.workload.open_loop import OpenLoopWorkload
from tests.sim.workload.fake_sink import FakeSink, run_workload, stream


def make_open_loop(**overrides) -> OpenLoopWorkload:
    args = {
        "num_requests": 50,
        "arrival": PoissonArrivals(rate_per_s=10.0),
        "prompt_tokens": UniformLength(low=20, high=60),
        "output_tokens": UniformLength(low=1, high=10),
    }
    return OpenLoopWorkload(**(args | overrides))


def test_poisson_submissions_have_the_configured_rate():
    n = 4000
    sink = run_workload(make_open_loop(num_requests=n), seed=1)
    times = [s.submit_s for s in sink.submissions]
    assert times == sorted(times) and len(times) == n
    # n exponential gaps of mean 0.1 s: the mean gap is within 5 standard errors of 0.1.
    assert abs(times[-1] / n - 0.1) < 5 * 0.1 / math.sqrt(n)
    assert [s.request.request_id for s in sink.submissions] == [f"req-{i}" for i in range(n)]
    assert all(s.request.arrival_time_s == s.submit_s for s in sink.submissions)


def test_same_seed_same_stream_other_seed_differs():
    workload = make_open_loop(shared_prefix_tokens=40)
    assert stream(run_workload(workload, seed=7)) == stream(run_workload(workload, seed=7))
    assert stream(run_workload(workload, seed=7)) != stream(run_workload(workload, seed=8))


def test_shared_prefix_is_common_and_rest_is_unique():
    sink = run_workload(make_open_loop(shared_prefix_tokens=40), block_size=16)
    prompts = [s.request.token_ids[: s.request.num_prompt_tokens] for s in sink.submissions]
    assert all(20 + 40 <= len(p) <= 60 + 40 for p in prompts)
    assert len({tuple(p[:40]) for p in prompts}) == 1
    assert len({tuple(p[40:60]) for p in prompts}) == len(prompts)
    for s in sink.submissions:
        assert s.request.block_hashes[:2] == sink.submissions[0].request.block_hashes[:2]


def test_prompt_block_hashes_equal_what_request_computes():
    sink = run_workload(make_open_loop(shared_prefix_tokens=37), block_size=8)
    for s in sink.submissions:
        prompt = s.request.token_ids[: s.request.num_prompt_tokens]
        own = Request("x", prompt, 1, block_size=8).block_hashes
        assert s.request.block_hashes[: len(own)] == own


def test_planned_outputs_are_emitted():
    sink = run_workload(make_open_loop(output_tokens=FixedLength(value=5)))
    for s in sink.submissions:
        assert s.request.num_output_tokens == s.request.max_tokens == 5


def test_priority_classes_set_priority_and_meta():
    classes = [
        PriorityClass(name="interactive", priority=0, weight=1),
        PriorityClass(name="batch", priority=5, weight=1),
    ]
    sink = run_workload(make_open_loop(num_requests=400, priority_classes=classes))
    by_class = {"interactive": 0, "batch": 5}
    for s in sink.submissions:
        assert s.request.priority == by_class[s.meta.priority_class]
        assert s.meta.session_id is None
    assert 150 < sum(s.meta.priority_class == "batch" for s in sink.submissions) < 250


def test_lengths_clipped_to_max_model_len():
    workload = make_open_loop(
        arrival=BurstArrivals(),
        shared_prefix_tokens=10,
        prompt_tokens=FixedLength(value=100),
        output_tokens=UniformLength(low=1, high=200),
    )
    sink = run_workload(workload, max_model_len=64)
    for s in sink.submissions:
        r = s.request
        assert r.num_prompt_tokens + r.max_tokens <= 64 and r.num_prompt_tokens > 10
        assert r.max_tokens >= 1
    # Every prompt (10 + 100 tokens) was cut: counted on the run's record, not the config.
    assert sink.workload_run is not None
    assert sink.workload_run.requests_clipped == len(sink.submissions) > 0
    roomy = run_workload(workload, max_model_len=4096)
    assert roomy.workload_run is not None and roomy.workload_run.requests_clipped == 0
    with pytest.raises(ValueError, match="shared_prefix_tokens=63 leaves no room"):
        run_workload(make_open_loop(shared_prefix_tokens=63), max_model_len=64)


def test_expected_num_requests_and_validation():
    assert make_open_loop(num_requests=12).expected_num_requests() == 12
    with pytest.raises(ValidationError, match="duplicate names"):
        make_open_loop(priority_classes=[PriorityClass(name="a"), PriorityClass(name="a")])
    with pytest.raises(ValidationError):
        OpenLoopWorkload(num_requests=1, extra_field=1)


def test_running_does_not_draw_from_the_run_rng():
    # The workload spawns children at start, so what else draws from the run's generator
    # during the simulation cannot change the requests.
    workload = make_open_loop()
    started_and_run, started_only = np.random.default_rng(3), np.random.default_rng(3)
    sink = FakeSink()
    workload.start(sink, started_and_run)
    sink.env.run()
    workload.start(FakeSink(), started_only)
    assert started_and_run.random() == started_only.random()
