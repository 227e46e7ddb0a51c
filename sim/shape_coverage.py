"""Which batch shapes a calibration profile was fitted on, and how much of a run lies there.

A fitted cost model interpolates well between the batch shapes it was fitted on and may not
extrapolate: a profile fitted on decode batches of 1 to 32 requests says little about 128.
Shapes are binned into cells on a log2 grid (bucket ``k`` holds ``2**(k-1)`` to
``2**k - 1``; 0 holds 0):

- a decode-only step: (0, bucket of its decodes, bucket of their mean context, 0);
- a step with prefill chunks: (1, bucket of its prefill tokens, bucket of the mean context
  before a chunk, bucket of its decodes).

``kvsim calibrate`` records the cells with at least :data:`MIN_STEPS_PER_CELL` measured steps
in the profile (``CalibrationProfile.shape_cells``; per token budget with a fit of its own,
``shape_cells_by_budget``, which covers the runs that fit prices). A run's step lies inside
the fitted range when its cell is one of them, or lies between two of them along one axis,
the other coordinates equal (e.g. decodes of 8-15 requests at a context where 4-7 and 16-31
were fitted: interpolation, not extrapolation). A run's coverage is the share of its non-empty
steps inside. Below :data:`WARN_BELOW` the run's step times are largely extrapolated and
``kvsim run`` / ``kvsim validate`` say so.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sim.scheduler.output import BatchShape

ShapeCell = tuple[int, int, int, int]
# A cell counts as fitted with this many measured steps in it.
MIN_STEPS_PER_CELL = 5
# Warn when fewer of a run's steps than this lie in fitted cells.
WARN_BELOW = 0.9
# Cells named in a warning.
NUM_NAMED = 3


def shape_cell(shape: BatchShape) -> ShapeCell:
    """The coverage cell of a non-empty batch (see the module docstring)."""
    num_decodes = shape.num_decode_reqs
    if shape.num_prefill_reqs:
        chunk = shape.num_prefill_tokens / shape.num_prefill_reqs
        # Mean context before a chunk, from the attention pairs sum(c_i * (ctx_i + c_i / 2)):
        # exact for one chunk or equal chunks.
        context = max(
            0, round(shape.prefill_attention_pairs / shape.num_prefill_tokens - chunk / 2)
        )
        prefill_tokens = shape.num_prefill_tokens
        return (1, prefill_tokens.bit_length(), context.bit_length(), num_decodes.bit_length())
    context = shape.decode_context_tokens // max(num_decodes, 1)
    return (0, num_decodes.bit_length(), context.bit_length(), 0)


def fitted_cells(shapes: Iterable[BatchShape]) -> list[ShapeCell]:
    """The cells with at least :data:`MIN_STEPS_PER_CELL` of ``shapes``, sorted."""
    counts = Counter(shape_cell(s) for s in shapes if s.num_tokens)
    return sorted(cell for cell, n in counts.items() if n >= MIN_STEPS_PER_CELL)


@dataclass(frozen=True)
class ShapeCoverage:
    num_steps: int  # non-empty steps of the run
    num_covered: int  # of which in a fitted cell
    uncovered: list[tuple[ShapeCell, int]]  # the other cells, most steps first

    @property
    def fraction(self) -> float:
        return self.num_covered / self.num_steps if self.num_steps else 1.0

    def line(self) -> str:
        """One line for a report: the share of steps inside the fitted shapes."""
        return (
            f"{100 * self.fraction:.1f}% of {self.num_steps:,} steps are batch shapes the "
            "calibration profile was fitted on"
        )

    def warning(self) -> str | None:
        """Why this run's step times are extrapolated, or None when it is covered enough."""
        if self.fraction >= WARN_BELOW:
            return None
        named = "; ".join(
            f"{describe_cell(cell)} ({n:,} steps)" for cell, n in self.uncovered[:NUM_NAMED]
        )
        return (
            f"only {self.line()}: the cost model extrapolates the step times of the others, "
            f"most of them {named}. Calibrate on runs that reach these shapes (kvsim replay a "
            "scenario like this one, then kvsim calibrate with it)."
        )


def shape_coverage(shapes: Sequence[BatchShape], cells: Iterable[ShapeCell]) -> ShapeCoverage:
    """How many of ``shapes``' non-empty steps lie inside the fitted ``cells`` (in one, or
    between two along one axis: see the module docstring)."""
    inside = _Inside(cells)
    counts = Counter(shape_cell(s) for s in shapes if s.num_tokens)
    missing = Counter({cell: n for cell, n in counts.items() if not inside(cell)})
    num_steps = sum(counts.values())
    return ShapeCoverage(num_steps, num_steps - sum(missing.values()), missing.most_common())


class _Inside:
    """Whether a cell is fitted or lies between two fitted cells along one axis."""

    def __init__(self, cells: Iterable[ShapeCell]) -> None:
        self.fitted = {tuple(c) for c in cells}
        # Per axis (1, 2, 3) and the cell's other coordinates: the fitted range on that axis.
        self.ranges: dict[tuple[int, tuple[int, ...]], tuple[int, int]] = {}
        for cell in self.fitted:
            for axis in (1, 2, 3):
                key = (axis, cell[:axis] + cell[axis + 1 :])
                low, high = self.ranges.get(key, (cell[axis], cell[axis]))
                self.ranges[key] = (min(low, cell[axis]), max(high, cell[axis]))

    def __call__(self, cell: ShapeCell) -> bool:
        if cell in self.fitted:
            return True
        for axis in (1, 2, 3):
            span = self.ranges.get((axis, cell[:axis] + cell[axis + 1 :]))
            if span is not None and span[0] < cell[axis] < span[1]:
                return True
        return False


def describe_cell(cell: ShapeCell) -> str:
    """A cell in words, e.g. 'decode-only steps of 16-31 requests at 1,024-2,047 tokens of
    context each'."""
    kind, a, b, c = cell
    if kind == 0:
        return f"decode-only steps of {_span(a)} requests at {_span(b)} tokens of context each"
    beside = f" beside {_span(c)} decodes" if c else ""
    return f"steps with {_span(a)} prefill tokens after {_span(b)} tokens of context{beside}"


def _span(bucket: int) -> str:
    if bucket <= 1:
        return str(bucket)
    return f"{1 << (bucket - 1):,}-{(1 << bucket) - 1:,}"
