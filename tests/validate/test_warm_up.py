"""The replay's warm-up plan (validate.replay.warm_up_sizes): no vLLM needed."""

from __future__ import annotations

from itertools import pairwise

import pytest

from validate.replay import WARM_EVERY_SIZE_UP_TO, WARM_STRIDE, warm_up_sizes


@pytest.mark.parametrize(
    ("budget", "max_num_seqs", "max_model_len"),
    [(512, 16, 4096), (2048, 32, 4096), (8192, 256, 4096), (100, 16, 4096), (256, 32, 4096)],
)
def test_warm_up_runs_every_small_count_last_and_every_stride_above(
    budget: int, max_num_seqs: int, max_model_len: int
) -> None:
    sizes = warm_up_sizes(budget, max_num_seqs, max_model_len)
    top = min(budget, max_model_len - 1)
    small = min(top, max(WARM_EVERY_SIZE_UP_TO, max_num_seqs))
    assert len(sizes) == len(set(sizes))
    # The decode batch sizes and short prefills come last, in order: the most recently used
    # kernels when the replay starts.
    assert sizes[-small:] == list(range(1, small + 1))
    large = sizes[:-small]
    assert large == sorted(large, reverse=True)
    assert all(small < s <= top for s in large)
    if top > small:
        assert large[0] == top  # the largest step, its buffers
        gaps = [a - b for a, b in pairwise(large)]
        assert max(gaps, default=0) <= WARM_STRIDE
        assert large[-1] - small <= WARM_STRIDE


def test_a_budget_within_the_small_counts_warms_every_count() -> None:
    assert warm_up_sizes(48, 16, 4096) == list(range(1, 49))
    # The model length caps the budget: a prompt of max_model_len tokens leaves no output.
    assert warm_up_sizes(4096, 16, 40) == list(range(1, 40))


def test_the_plan_costs_a_fraction_of_every_count() -> None:
    every_count = sum(range(1, 513))
    assert sum(warm_up_sizes(512, 16, 4096)) < every_count / 10
