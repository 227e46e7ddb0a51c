"""The random pieces of a workload: token lengths, arrival times, tool latencies, priority mixes.

Each is a small frozen pydantic config, discriminated on ``kind`` so a scenario names it in
YAML, with a vectorised ``sample(rng, n)``. Workloads draw from the run's generator (or a
child spawned from it), never from global state.
"""

from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from statistics import NormalDist
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, Field, model_validator

from sim.config.limits import (
    MAX_ABS_PRIORITY,
    MAX_DATA_FILE_BYTES,
    MAX_RATE_PER_S,
    MAX_REQUESTS,
    MAX_SECONDS,
    MAX_TOKENS,
    MAX_WEIGHT,
    MIN_RATE_PER_S,
    KvsimModel,
)
from sim.config.loading import read_text
from sim.errors import KvsimConfigError, short_repr

# z-score of the 95th percentile of a standard normal: p95 = median * exp(1.645 * sigma).
_Z95 = 1.6448536269514722


class _Config(KvsimModel):
    """A frozen distribution config (see :class:`KvsimModel`)."""


class _Stashed:
    """Holds a value a frozen config derives after parsing (a file's contents, a run's plan).

    It lives in the instance ``__dict__`` under a non-field name, as ``functools.cached_property``
    values do, so pydantic leaves it out of dumps and, thanks to this ``__eq__``, out of equality
    (pydantic compares ``__dict__`` first; a numpy array there would make ``==`` raise, and a
    PrivateAttr would make two equal configs unequal once one had run).
    """

    __slots__ = ("value",)
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stashed)


def stash(config: BaseModel, name: str, value: Any) -> None:
    """Attach derived ``value`` to a frozen ``config`` without changing what it compares as."""
    config.__dict__[name] = _Stashed(value)


def stashed(config: BaseModel, name: str) -> Any | None:
    """What :func:`stash` attached under ``name``, or None."""
    holder = config.__dict__.get(name)
    return None if holder is None else holder.value


# -- token lengths (also used for turns per session) --------------------------------------------
class _Length(_Config):
    """A length distribution: ``sample(rng, n)`` draws an array; ``sample_one`` one length."""

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        raise NotImplementedError

    def sample_one(self, rng: np.random.Generator) -> int:
        """One length: ``int(sample(rng, 1)[0])``, and the same draw from ``rng``."""
        return int(self.sample(rng, 1)[0])


class FixedLength(_Length):
    """Always the same length."""

    kind: Literal["fixed"] = "fixed"
    value: int = Field(
        gt=0, le=MAX_TOKENS, description="The length (tokens, or turns for turns-per-session)."
    )

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` copies of ``value``."""
        return np.full(n, self.value, dtype=np.int64)


class UniformLength(_Length):
    """Uniform integer length in ``[low, high]``, both ends included."""

    kind: Literal["uniform"] = "uniform"
    low: int = Field(gt=0, le=MAX_TOKENS, description="Smallest length, inclusive.")
    high: int = Field(gt=0, le=MAX_TOKENS, description="Largest length, inclusive.")

    @model_validator(mode="after")
    def _check_range(self) -> UniformLength:
        if self.low > self.high:
            raise ValueError(f"uniform length: low={self.low} > high={self.high}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` integers drawn uniformly from ``[low, high]``."""
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)


class LogNormalLength(_Length):
    """Log-normal length (heavy right tail, like prompt and output lengths), rounded, clipped."""

    kind: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0, le=MAX_TOKENS, description="Median length (exp of the log-mean).")
    sigma: float = Field(ge=0, le=10, description="Standard deviation of the log length.")
    min: int = Field(1, ge=1, le=MAX_TOKENS, description="Lengths below this are raised to it.")
    max: int | None = Field(
        None,
        ge=1,
        le=MAX_TOKENS,
        description="Lengths above this are cut to it (None: at "
        f"{MAX_TOKENS:,}, kvsim's bound on any length).",
    )

    @model_validator(mode="after")
    def _check_range(self) -> LogNormalLength:
        if self.max is not None and self.min > self.max:
            raise ValueError(f"lognormal length: min={self.min} > max={self.max}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` log-normal lengths, rounded to integers and clipped to ``[min, max]``."""
        draws = np.rint(rng.lognormal(math.log(self.median), self.sigma, size=n))
        upper = MAX_TOKENS if self.max is None else self.max
        return np.clip(draws, self.min, upper).astype(np.int64)

    def sample_one(self, rng: np.random.Generator) -> int:
        """One length, drawn without arrays (a session draws its lengths one at a time):
        the scalar draw consumes ``rng`` as ``size=1`` does, and ``round`` rounds half to
        even as ``np.rint``."""
        length = round(rng.lognormal(math.log(self.median), self.sigma))
        upper = MAX_TOKENS if self.max is None else self.max
        return self.min if length < self.min else upper if length > upper else length


class EmpiricalLength(_Length):
    """Resample observed lengths: inline ``values`` or a ``path`` (one integer per line, or a CSV
    column). The file is read on first use, not when the scenario is parsed."""

    kind: Literal["empirical"] = "empirical"
    values: list[int] | None = Field(
        None, max_length=MAX_REQUESTS, description="Observed lengths to resample from."
    )
    path: str | None = Field(
        None, description="File of observed lengths: one integer per line, or a .csv file."
    )
    column: str | None = Field(
        None, description="CSV column holding the lengths (needed if the CSV has several)."
    )

    @model_validator(mode="after")
    def _check_source(self) -> EmpiricalLength:
        if (self.values is None) == (self.path is None):
            raise ValueError("empirical length: give exactly one of values or path")
        if self.values is not None:
            if not self.values:
                raise ValueError("empirical length: values is empty")
            bad = [v for v in self.values if not 1 <= v <= MAX_TOKENS]
            if bad:
                raise ValueError(
                    f"empirical length: values must be between 1 and {MAX_TOKENS:,}, "
                    f"got {short_repr(bad)}"
                )
        if self.column is not None and self.path is None:
            raise ValueError(f"empirical length: column={self.column!r} needs a path")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` lengths drawn with replacement from the observed ones."""
        return rng.choice(self.observed(), size=n)

    def observed(self) -> np.ndarray:
        """The observed lengths (a ``path`` is read once, on first use); a file that cannot
        be read, or holds a bad length, raises KvsimConfigError naming it."""
        observed = stashed(self, "_observed")
        if observed is None:
            values = self.values if self.values is not None else _read_lengths(self)
            observed = np.asarray(values, dtype=np.int64)
            stash(self, "_observed", observed)
        return observed


def _read_lengths(dist: EmpiricalLength) -> list[int]:
    path = Path(dist.path or "")
    text = read_text(path, "empirical lengths file", MAX_DATA_FILE_BYTES)
    values: list[int] = []
    is_csv = path.suffix.lower() == ".csv"
    if dist.column is not None and not is_csv:
        raise KvsimConfigError(
            f"{path}: column={short_repr(dist.column)} is for a .csv file; this one is read as "
            "one length per line"
        )
    if is_csv:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            fields = reader.fieldnames or []
        except csv.Error as exc:
            raise KvsimConfigError(f"{path}: not valid CSV ({exc})") from None
        column = dist.column
        if column is None:
            if len(fields) != 1:
                raise KvsimConfigError(
                    f"{path}: {len(fields)} columns {short_repr(fields)}; set column"
                )
            column = fields[0]
        if column not in fields:
            raise KvsimConfigError(
                f"{path}: no column {short_repr(column)}; columns are {short_repr(fields)}"
            )
        lines = ((reader.line_num, row.get(column)) for row in reader)
    else:
        lines = ((i, line) for i, line in enumerate(text.splitlines(), start=1))
    try:
        for line_num, cell in lines:
            cell = (cell or "").strip()
            if is_csv and not cell:  # a row without the length would bias the resampling
                raise KvsimConfigError(f"{path}:{line_num}: column {short_repr(column)} is empty")
            if not cell or cell.startswith("#"):
                continue
            try:
                value = int(cell)
            except ValueError:
                value = 0
            if not 1 <= value <= MAX_TOKENS:
                raise KvsimConfigError(
                    f"{path}:{line_num}: length {short_repr(cell)} is not an integer between 1 "
                    f"and {MAX_TOKENS:,}"
                )
            values.append(value)
            if len(values) > MAX_REQUESTS:
                raise KvsimConfigError(f"{path}: more than {MAX_REQUESTS:,} lengths")
    except csv.Error as exc:
        raise KvsimConfigError(f"{path}: not valid CSV ({exc})") from None
    if not values:
        raise KvsimConfigError(f"{path}: no lengths")
    return values


LengthDist = Annotated[
    FixedLength | UniformLength | LogNormalLength | EmpiricalLength, Field(discriminator="kind")
]


def shortest(dist: FixedLength | UniformLength | LogNormalLength | EmpiricalLength) -> int:
    """The least length ``dist`` can draw (an empirical one's file is read)."""
    if isinstance(dist, FixedLength):
        return dist.value
    if isinstance(dist, UniformLength):
        return dist.low
    if isinstance(dist, LogNormalLength):
        return dist.min
    return int(dist.observed().min())


# -- arrivals -----------------------------------------------------------------------------------
class PoissonArrivals(_Config):
    """Memoryless arrivals: exponential gaps at a constant mean rate."""

    kind: Literal["poisson"] = "poisson"
    rate_per_s: float = Field(
        ge=MIN_RATE_PER_S, le=MAX_RATE_PER_S, description="Mean arrivals per second."
    )

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Sorted arrival times (s) of ``n`` arrivals; the first comes one gap after 0."""
        return np.cumsum(rng.exponential(1.0 / self.rate_per_s, size=n))


class GammaArrivals(_Config):
    """Bursty (cv > 1) or regular (cv < 1) arrivals: gamma-distributed gaps."""

    kind: Literal["gamma"] = "gamma"
    rate_per_s: float = Field(
        ge=MIN_RATE_PER_S, le=MAX_RATE_PER_S, description="Mean arrivals per second."
    )
    cv: float = Field(
        ge=1e-3,
        le=1e3,
        description="Coefficient of variation of the gaps (1 = Poisson, > 1 = bursty).",
    )

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Sorted arrival times (s) of ``n`` arrivals with mean gap ``1 / rate_per_s``."""
        shape = 1.0 / (self.cv * self.cv)
        return np.cumsum(rng.gamma(shape, 1.0 / (self.rate_per_s * shape), size=n))


class BurstArrivals(_Config):
    """Everything arrives at once (a fleet of agents started together)."""

    kind: Literal["burst"] = "burst"
    at_s: float = Field(0.0, ge=0, le=MAX_SECONDS, description="When the burst arrives (s).")

    def arrival_times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` copies of ``at_s``."""
        return np.full(n, self.at_s, dtype=np.float64)


ArrivalProcess = Annotated[
    PoissonArrivals | GammaArrivals | BurstArrivals, Field(discriminator="kind")
]


# -- tool latency -------------------------------------------------------------------------------
class LogNormalLatency(_Config):
    """Heavy-tailed tool latency given by its median and 95th percentile."""

    kind: Literal["lognormal"] = "lognormal"
    median_s: float = Field(ge=1e-6, le=MAX_SECONDS, description="Median tool latency (s).")
    p95_s: float = Field(gt=0, le=MAX_SECONDS, description="95th-percentile tool latency (s).")

    @model_validator(mode="after")
    def _check_tail(self) -> LogNormalLatency:
        if self.p95_s < self.median_s:
            raise ValueError(
                f"lognormal latency: p95_s={self.p95_s} is below median_s={self.median_s}"
            )
        return self

    @property
    def sigma(self) -> float:
        """Standard deviation of the log latency."""
        return math.log(self.p95_s / self.median_s) / _Z95

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` latencies (s)."""
        return rng.lognormal(math.log(self.median_s), self.sigma, size=n)

    def quantile(self, q: float) -> float:
        """The latency (s) below which a fraction ``q`` (0 < q < 1) of draws fall."""
        return math.exp(math.log(self.median_s) + self.sigma * NormalDist().inv_cdf(q))


class FixedLatency(_Config):
    """The same tool latency every time (exact timing in tests and what-ifs)."""

    kind: Literal["fixed"] = "fixed"
    value_s: float = Field(ge=0, le=MAX_SECONDS, description="Tool latency (s).")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` copies of ``value_s``."""
        return np.full(n, self.value_s, dtype=np.float64)

    def quantile(self, q: float) -> float:
        """``value_s`` for every ``q`` (0 < q < 1)."""
        return self.value_s


LatencyDist = Annotated[LogNormalLatency | FixedLatency, Field(discriminator="kind")]


# -- priority mix -------------------------------------------------------------------------------
class PriorityClass(_Config):
    """A share of the traffic with one vLLM priority (interactive users, background agents)."""

    name: str = Field(min_length=1, max_length=100, description="Label recorded with each request.")
    priority: int = Field(
        0,
        ge=-MAX_ABS_PRIORITY,
        le=MAX_ABS_PRIORITY,
        description="vLLM request priority: lower is scheduled first.",
    )
    weight: float = Field(
        1.0, gt=0, le=MAX_WEIGHT, description="Relative share of requests (or sessions)."
    )


DEFAULT_PRIORITY_CLASSES = (PriorityClass(name="default"),)


# Most traffic classes one workload declares.
MAX_PRIORITY_CLASSES = 1000


def check_priority_classes(classes: list[PriorityClass]) -> list[PriorityClass]:
    """``classes`` unchanged; ``ValueError`` unless it is non-empty with unique names."""
    if not classes:
        raise ValueError("priority_classes is empty; give at least one class")
    if len(classes) > MAX_PRIORITY_CLASSES:
        raise ValueError(
            f"priority_classes: {len(classes)} classes, more than {MAX_PRIORITY_CLASSES}"
        )
    names = [c.name for c in classes]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"priority_classes: duplicate names {duplicates}")
    return classes


# The traffic classes of a workload, checked wherever a workload declares them.
PriorityClasses = Annotated[list[PriorityClass], AfterValidator(check_priority_classes)]


def sample_priority_classes(
    rng: np.random.Generator, classes: list[PriorityClass], n: int
) -> np.ndarray:
    """Indices into ``classes`` for ``n`` draws, in proportion to the weights."""
    if len(classes) == 1:
        # One class: no draw, so a plain scenario spends no randomness on the mix.
        return np.zeros(n, dtype=np.int64)
    weights = np.array([c.weight for c in classes], dtype=np.float64)
    return rng.choice(len(classes), size=n, p=weights / weights.sum())
