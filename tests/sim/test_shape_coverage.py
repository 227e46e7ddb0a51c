"""Batch-shape cells and a run's coverage by a calibration profile's fitted cells."""

from __future__ import annotations

from sim.scheduler.output import BatchShape
from sim.shape_coverage import (
    MIN_STEPS_PER_CELL,
    describe_cell,
    fitted_cells,
    shape_cell,
    shape_coverage,
)


def decode(num_reqs: int, context_each: int) -> BatchShape:
    return BatchShape(num_decode_reqs=num_reqs, decode_context_tokens=num_reqs * context_each)


def prefill(chunk: int, context: int, num_decodes: int = 0) -> BatchShape:
    return BatchShape(
        num_prefill_tokens=chunk,
        num_prefill_reqs=1,
        prefill_attention_pairs=chunk * (context + chunk / 2),
        num_decode_reqs=num_decodes,
        decode_context_tokens=num_decodes * 100,
    )


def test_cells_are_log2_buckets_of_batch_and_context() -> None:
    assert shape_cell(decode(1, 1500)) == (0, 1, 11, 0)
    assert shape_cell(decode(16, 1024)) == shape_cell(decode(31, 2047)) == (0, 5, 11, 0)
    assert shape_cell(decode(32, 1024)) == (0, 6, 11, 0)
    # A prefill chunk's context is read back from its attention pairs.
    assert shape_cell(prefill(512, 0)) == (1, 10, 0, 0)
    assert shape_cell(prefill(300, 2000, num_decodes=3)) == (1, 9, 11, 2)
    # Several chunks: the mean context before one (four fresh prompts: 0, not 192).
    four = BatchShape(
        num_prefill_tokens=512, num_prefill_reqs=4, prefill_attention_pairs=4 * 128 * 64
    )
    assert shape_cell(four) == (1, 10, 0, 0)
    two = BatchShape(
        num_prefill_tokens=200, num_prefill_reqs=2, prefill_attention_pairs=2 * 100 * (1500 + 50)
    )
    assert shape_cell(two) == (1, 8, 11, 0)
    assert describe_cell((0, 5, 11, 0)) == (
        "decode-only steps of 16-31 requests at 1,024-2,047 tokens of context each"
    )
    assert describe_cell((1, 9, 0, 2)) == (
        "steps with 256-511 prefill tokens after 0 tokens of context beside 2-3 decodes"
    )


def test_coverage_counts_steps_in_cells_with_enough_fitted_steps() -> None:
    fitted = [decode(4, 600)] * MIN_STEPS_PER_CELL + [decode(64, 600)] * (MIN_STEPS_PER_CELL - 1)
    cells = fitted_cells([*fitted, BatchShape()])
    assert cells == [shape_cell(decode(4, 600))]
    run = [decode(5, 700)] * 8 + [decode(64, 5000)] * 2 + [BatchShape()] * 3  # empty: ignored
    coverage = shape_coverage(run, cells)
    assert (coverage.num_steps, coverage.num_covered, coverage.fraction) == (10, 8, 0.8)
    assert coverage.uncovered == [(shape_cell(decode(64, 5000)), 2)]
    warning = coverage.warning()
    assert warning is not None
    assert "only 80.0% of 10 steps" in warning
    assert "decode-only steps of 64-127 requests at 4,096-8,191 tokens" in warning
    assert shape_coverage(run[:8], cells).warning() is None
    assert shape_coverage([], cells).fraction == 1.0


def test_a_cell_between_two_fitted_cells_on_one_axis_is_inside() -> None:
    fitted = [shape_cell(decode(4, 600)), shape_cell(decode(16, 600)), shape_cell(decode(4, 3000))]
    between = decode(8, 600)  # 8-15 requests, between 4-7 and 16-31 at the same context
    beyond = decode(32, 600)  # past the largest fitted batch: extrapolated
    diagonal = decode(8, 1500)  # between on no single axis
    coverage = shape_coverage([between, beyond, diagonal, decode(4, 1500)], fitted)
    assert coverage.num_covered == 2  # the in-between batch, and 4-7 between two contexts
    assert {cell for cell, _ in coverage.uncovered} == {shape_cell(beyond), shape_cell(diagonal)}
