"""Trace replay: recorded requests (JSONL or CSV) submitted open loop at their timestamps.

Rows carry ``timestamp``, ``input_length``, ``output_length`` and optionally ``session_id``,
``turn``, ``priority`` and Mooncake-style ``hash_ids``: one id per 512-token block of the
prompt, equal ids meaning equal content. The tokens of hash id ``h`` are a function of
``(seed, h)`` only, so equal ids give equal token blocks and the prefix cache shares them; the
prompt past the hashed blocks is unique to the row. Other columns are ignored.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sim.request import Request
from sim.workload.base import RequestMeta, RequestSink
from sim.workload.distributions import stash, stashed
from sim.workload.tokens import DEFAULT_VOCAB_SIZE, MIN_TOKEN_ID, HashIdTokens, TokenSource

TraceFormat = Literal["jsonl", "csv"]
TimestampUnit = Literal["s", "ms"]
_SUFFIX_FORMATS: dict[str, TraceFormat] = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
_MS_PER_S = 1000.0


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One trace row, validated; ``timestamp_s`` is in seconds whatever the file's unit."""

    line: int
    timestamp_s: float
    input_length: int
    output_length: int
    session_id: int | None = None
    turn: int | None = None
    priority: int | None = None
    hash_ids: tuple[int, ...] = ()


def trace_format(path: str | Path, format: TraceFormat | None = None) -> TraceFormat:
    """``format`` if given, else the one ``path``'s suffix names."""
    if format is not None:
        return format
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIX_FORMATS:
        raise ValueError(
            f"trace {path}: cannot infer the format from suffix {suffix!r} (known: "
            f"{sorted(_SUFFIX_FORMATS)}); set format to 'jsonl' or 'csv'"
        )
    return _SUFFIX_FORMATS[suffix]


def load_trace(
    path: str | Path, format: TraceFormat | None = None, timestamp_unit: TimestampUnit = "s"
) -> list[TraceRecord]:
    """Read and validate every row of a trace, in file order.

    A malformed row raises ``ValueError`` naming the file, line, field and value.
    """
    fmt = trace_format(path, format)
    scale = 1.0 / _MS_PER_S if timestamp_unit == "ms" else 1.0
    with Path(path).open(newline="") as f:
        rows = _jsonl_rows(f, path) if fmt == "jsonl" else _csv_rows(f)
        records = [_parse_row(row, f"{path}:{line}", line, scale) for line, row in rows]
    if not records:
        raise ValueError(f"trace {path}: no rows")
    return records


def _jsonl_rows(lines: Iterator[str], path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for line_num, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_num}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_num}: expected a JSON object, got {text.strip()!r}")
        yield line_num, row


def _csv_rows(lines: Iterator[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(lines)
    for row in reader:
        # Empty cells mean "absent", as a missing JSON key does.
        yield reader.line_num, {k: v for k, v in row.items() if v not in (None, "")}


def _parse_row(row: dict[str, Any], where: str, line: int, scale: float) -> TraceRecord:
    timestamp = _float(_get(row, "timestamp", where), "timestamp", where)
    return TraceRecord(
        line=line,
        timestamp_s=timestamp * scale,
        input_length=_int(_get(row, "input_length", where), "input_length", where, minimum=1),
        output_length=_int(_get(row, "output_length", where), "output_length", where, minimum=1),
        session_id=_optional_int(row, "session_id", where, minimum=0),
        turn=_optional_int(row, "turn", where, minimum=0),
        priority=_optional_int(row, "priority", where, minimum=None),
        hash_ids=_hash_ids(row.get("hash_ids"), where),
    )


def _get(row: dict[str, Any], field: str, where: str) -> Any:
    if row.get(field) is None:
        raise ValueError(f"{where}: missing field {field!r}")
    return row[field]


def _bad(where: str, field: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"{where}: field {field!r} = {value!r} is not {expected}")


def _float(value: Any, field: str, where: str) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise _bad(where, field, value, "a finite number >= 0")
    return number


def _int(value: Any, field: str, where: str, minimum: int | None) -> int:
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, bool):
        raise _bad(where, field, value, expected)
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            raise _bad(where, field, value, expected) from None
    else:
        raise _bad(where, field, value, expected)
    if minimum is not None and number < minimum:
        raise _bad(where, field, value, expected)
    return number


def _optional_int(row: dict[str, Any], field: str, where: str, minimum: int | None) -> int | None:
    value = row.get(field)
    return None if value is None else _int(value, field, where, minimum)


def _hash_ids(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value
    if isinstance(value, str):
        # CSV cells: a JSON list "[1, 2]" or ids separated by spaces, commas or semicolons.
        text = value.strip()
        try:
            items = (
                json.loads(text)
                if text.startswith("[")
                else text.replace(";", " ").replace(",", " ").split()
            )
        except json.JSONDecodeError:
            raise _bad(where, "hash_ids", value, "a list of integers >= 0") from None
    if not isinstance(items, list):
        raise _bad(where, "hash_ids", value, "a list of integers >= 0")
    return tuple(_int(item, "hash_ids", where, minimum=0) for item in items)


class TraceWorkload(BaseModel):
    """Replay a recorded trace open loop: each row is submitted at its (scaled) timestamp."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["trace"] = "trace"
    path: str = Field(description="Trace file (.jsonl or .csv; other suffixes need format).")
    format: TraceFormat | None = Field(None, description="File format; None: from the suffix.")
    timestamp_unit: TimestampUnit = Field(
        "s", description="Unit of the timestamp field (Mooncake traces use ms)."
    )
    time_scale: float = Field(
        1.0, gt=0, description="Multiplies timestamps (0.5 replays twice as fast)."
    )
    hash_block_tokens: int = Field(512, gt=0, description="Prompt tokens per hash id (Mooncake).")
    on_too_long: Literal["error", "skip"] = Field(
        "error", description="Rows whose input + output exceed max_model_len: raise or skip."
    )
    vocab_size: int = Field(
        DEFAULT_VOCAB_SIZE, gt=MIN_TOKEN_ID, description="Token ids are drawn below this."
    )

    @model_validator(mode="after")
    def _check_format(self) -> TraceWorkload:
        trace_format(self.path, self.format)  # no I/O: the suffix alone
        return self

    def records(self) -> list[TraceRecord]:
        """The trace's rows (read once, on first use)."""
        records = stashed(self, "_records")
        if records is None:
            records = load_trace(self.path, self.format, self.timestamp_unit)
            stash(self, "_records", records)
        return records

    def expected_num_requests(self) -> int | None:
        """The number of rows (rows skipped as too long are still counted)."""
        return len(self.records())

    def start(self, sink: RequestSink, rng: np.random.Generator) -> None:
        """Read the trace and spawn one process that submits its rows in timestamp order."""
        records = sorted(self.records(), key=lambda r: r.timestamp_s)
        too_long = [r for r in records if r.input_length + r.output_length > sink.max_model_len]
        if too_long and self.on_too_long == "error":
            r = too_long[0]
            raise ValueError(
                f"{self.path}:{r.line}: input_length {r.input_length} + output_length "
                f"{r.output_length} exceeds max_model_len={sink.max_model_len} "
                f"({len(too_long)} such rows; on_too_long='skip' drops them)"
            )
        if too_long:
            records = [r for r in records if r.input_length + r.output_length <= sink.max_model_len]
        seed_rng, token_rng = rng.spawn(2)
        blocks = HashIdTokens(
            int(seed_rng.integers(2**63)), self.hash_block_tokens, self.vocab_size
        )
        sink.env.process(
            self._replay(sink, records, blocks, TokenSource(token_rng, self.vocab_size))
        )

    def _replay(
        self,
        sink: RequestSink,
        records: list[TraceRecord],
        blocks: HashIdTokens,
        tokens: TokenSource,
    ) -> Generator[Any, Any, None]:
        env = sink.env
        for i, record in enumerate(records):
            arrival_s = record.timestamp_s * self.time_scale
            if arrival_s > env.now:
                yield env.timeout(arrival_s - env.now)
            shared = blocks.tokens(record.hash_ids, record.input_length)
            unique = tokens.take_array(record.input_length - len(shared))
            request = Request(
                f"req-{i}",
                np.concatenate((shared, unique)).tolist(),
                max_tokens=record.output_length,
                block_size=sink.block_size,
                arrival_time_s=env.now,
                priority=record.priority or 0,
                output_token_ids=tokens.take(record.output_length),
            )
            meta = RequestMeta(
                session_id=record.session_id,
                turn=record.turn,
                priority_class="default" if record.priority is None else f"p{record.priority}",
            )
            sink.submit(request, meta)
