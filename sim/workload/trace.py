"""Trace replay: recorded requests (JSONL or CSV) submitted at their timestamps (open loop),
or a session's turns each after the previous one's answer (``replay: closed_loop``).

Rows carry ``timestamp``, ``input_length``, ``output_length`` and optionally ``session_id``,
``turn``, ``priority`` and Mooncake-style ``hash_ids``: one id per 512-token block of the
prompt, equal ids meaning equal content. The tokens of hash id ``h`` are a function of
``(seed, h)`` only, so equal ids give equal token blocks and the prefix cache shares them; the
prompt past the hashed blocks is unique to the row. Other columns are ignored.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import json
import math
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import simpy
from pydantic import Field, model_validator

from sim.config.limits import (
    MAX_DATA_FILE_BYTES,
    MAX_REQUESTS,
    MAX_SECONDS,
    MAX_TOKENS,
    MAX_VOCAB_SIZE,
    KvsimModel,
)
from sim.config.loading import read_text
from sim.errors import KvsimConfigError, short_repr
from sim.request import Request
from sim.workload.base import RequestMeta, RequestSink, WorkloadRun
from sim.workload.distributions import stash, stashed
from sim.workload.tokens import DEFAULT_VOCAB_SIZE, MIN_TOKEN_ID, HashIdTokens, TokenSource

TraceFormat = Literal["jsonl", "csv"]
TimestampUnit = Literal["s", "ms"]
_SUFFIX_FORMATS: dict[str, TraceFormat] = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv"}
_MS_PER_S = 1000.0


@dataclass(frozen=True, slots=True)
class TraceRecord:
    """One trace row, validated; ``timestamp_s`` is in seconds whatever the file's unit,
    after the trace's earliest row (which arrives at t = 0)."""

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
    if not suffix and Path(path).is_dir():
        raise KvsimConfigError(f"trace {short_repr(str(path))}: a folder, not a trace file")
    if suffix not in _SUFFIX_FORMATS:
        raise KvsimConfigError(
            f"trace {short_repr(str(path))}: cannot infer the format from suffix "
            f"{short_repr(suffix)} (known: {sorted(_SUFFIX_FORMATS)}); set format to 'jsonl' "
            "or 'csv'"
        )
    return _SUFFIX_FORMATS[suffix]


def load_trace(
    path: str | Path, format: TraceFormat | None = None, timestamp_unit: TimestampUnit = "s"
) -> list[TraceRecord]:
    """Read and validate every row of a trace, in file order.

    The file must be UTF-8 text (a byte-order mark, as spreadsheets write it, is accepted).
    A missing, unreadable or malformed file, or a malformed row, raises KvsimConfigError
    naming the file (and line, field and value).
    """
    fmt = trace_format(path, format)
    scale = 1.0 / _MS_PER_S if timestamp_unit == "ms" else 1.0
    text = read_text(path, "trace", MAX_DATA_FILE_BYTES)
    lines = io.StringIO(text, newline="")
    records: list[TraceRecord] = []
    try:
        rows = _jsonl_rows(lines, path) if fmt == "jsonl" else _csv_rows(lines)
        for line, row in rows:
            records.append(_parse_row(row, f"{path}:{line}", line, scale))
            if len(records) > MAX_REQUESTS:
                raise KvsimConfigError(
                    f"trace {path}: more than {MAX_REQUESTS:,} rows, kvsim's limit on requests"
                )
    except csv.Error as exc:
        raise KvsimConfigError(f"trace {path}: not valid CSV ({exc})") from None
    if not records:
        raise KvsimConfigError(f"trace {path}: no rows")
    if timestamp_unit == "s":
        _refuse_milliseconds(records, path)
    return _from_first_row(records, path)


# Seconds since 1970 of the year ~5000: a larger "seconds" timestamp is a Unix time in ms.
_MAX_UNIX_S = 1e11


def _refuse_milliseconds(records: list[TraceRecord], path: str | Path) -> None:
    """A trace in Unix milliseconds read as seconds would replay 1,000 times too slowly
    (its times count from its first row, so only the magnitude tells)."""
    last = max(records, key=lambda r: r.timestamp_s)
    if last.timestamp_s > _MAX_UNIX_S:
        raise KvsimConfigError(
            f"{path}:{last.line}: field 'timestamp' = {last.timestamp_s:,.0f} is no time in "
            "seconds (a Unix time in seconds is about 1.7e9): a Unix time in milliseconds "
            "needs timestamp_unit: ms"
        )


def _from_first_row(records: list[TraceRecord], path: str | Path) -> list[TraceRecord]:
    """The rows with their times counted from the earliest one: a trace cut from the middle
    of a recording, or stamped with Unix times, starts at t = 0 like one that starts at 0
    (a run's throughput is per second since t = 0)."""
    first = min(records, key=lambda r: r.timestamp_s)
    last = max(records, key=lambda r: r.timestamp_s)
    span_s = last.timestamp_s - first.timestamp_s
    if span_s > MAX_SECONDS:
        raise KvsimConfigError(
            f"trace {path}: its rows span {span_s:,.0f} s (line {first.line} to line "
            f"{last.line}), more than kvsim's limit of {MAX_SECONDS:,.0f} s (a year); "
            "timestamps in ms need timestamp_unit: ms"
        )
    t0 = first.timestamp_s
    if t0 == 0.0:
        return records
    return [dataclasses.replace(r, timestamp_s=r.timestamp_s - t0) for r in records]


def check_records(
    records: list[TraceRecord], path: str | Path, hash_block_tokens: int
) -> list[TraceRecord]:
    """``records`` unchanged; KvsimConfigError if rows contradict themselves or each other:
    more hash ids than the prompt has blocks, one session's turn given twice, or a session's
    later turn stamped before an earlier one."""
    seen: dict[tuple[int, int], TraceRecord] = {}
    for r in records:
        max_ids = -(-r.input_length // hash_block_tokens)
        if len(r.hash_ids) > max_ids:
            raise KvsimConfigError(
                f"{path}:{r.line}: {len(r.hash_ids)} hash_ids describe more than "
                f"input_length={r.input_length} tokens hold ({max_ids} blocks of "
                f"hash_block_tokens={hash_block_tokens})"
            )
        if r.session_id is not None and r.turn is not None:
            key = (r.session_id, r.turn)
            if key in seen:
                raise KvsimConfigError(
                    f"{path}:{r.line}: session_id={r.session_id} turn={r.turn} is also on "
                    f"line {seen[key].line}"
                )
            seen[key] = r
    by_session: dict[int, list[TraceRecord]] = {}
    for (session_id, _), r in seen.items():
        by_session.setdefault(session_id, []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r.turn or 0)
        for before, after in itertools.pairwise(turns):
            if after.timestamp_s < before.timestamp_s:
                raise KvsimConfigError(
                    f"{path}:{after.line}: session_id={after.session_id} turn={after.turn} "
                    f"has timestamp before turn={before.turn} (line {before.line})"
                )
    return records


def _jsonl_rows(lines: Iterator[str], path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for line_num, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text, parse_constant=_refuse_constant)
        except (json.JSONDecodeError, ValueError, RecursionError) as e:
            reason = e.msg if isinstance(e, json.JSONDecodeError) else str(e)
            raise KvsimConfigError(f"{path}:{line_num}: not valid JSON ({reason})") from None
        if not isinstance(row, dict):
            raise KvsimConfigError(
                f"{path}:{line_num}: expected a JSON object, got {short_repr(text.strip())}"
            )
        yield line_num, row


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _csv_rows(lines: Iterator[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.DictReader(lines)
    for row in reader:
        # Empty cells mean "absent", as a missing JSON key does. Header names are stripped:
        # "timestamp, input_length" is as good as "timestamp,input_length".
        yield (
            reader.line_num,
            {
                k.strip(): v
                for k, v in row.items()
                if isinstance(k, str) and v not in (None, "") and not isinstance(v, list)
            },
        )


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
        known = ", ".join(sorted(short_repr(k, 30) for k in list(row)[:8]))
        raise KvsimConfigError(f"{where}: missing field {field!r} (the row has: {known})")
    return row[field]


def _bad(where: str, field: str, value: Any, expected: str) -> KvsimConfigError:
    return KvsimConfigError(f"{where}: field {field!r} = {short_repr(value)} is not {expected}")


def _float(value: Any, field: str, where: str) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or number < 0:
        raise _bad(where, field, value, "a finite number >= 0")
    return number


# Largest integer any trace field may hold: token counts are bounded by MAX_TOKENS below,
# ids and priorities by 2**62.
_MAX_INT = 1 << 62
_MAX_INT_FIELDS = {"input_length": MAX_TOKENS, "output_length": MAX_TOKENS}


def _int(value: Any, field: str, where: str, minimum: int | None) -> int:
    maximum = _MAX_INT_FIELDS.get(field, _MAX_INT)
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, bool):
        raise _bad(where, field, value, expected)
    if isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if len(text) > 30:
            raise _bad(where, field, value, expected)
        try:
            number = int(text)
        except ValueError:
            raise _bad(where, field, value, expected) from None
    else:
        raise _bad(where, field, value, expected)
    if minimum is not None and number < minimum:
        raise _bad(where, field, value, expected)
    if abs(number) > maximum:
        raise _bad(where, field, value, f"an integer of at most {maximum:,}")
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
        except (json.JSONDecodeError, RecursionError):
            raise _bad(where, "hash_ids", value, "a list of integers >= 0") from None
    if not isinstance(items, list) or len(items) > MAX_TOKENS:
        raise _bad(where, "hash_ids", value, "a list of integers >= 0")
    return tuple(_int(item, "hash_ids", where, minimum=0) for item in items)


TraceReplay = Literal["open_loop", "closed_loop"]


class TraceWorkload(KvsimModel):
    """Replay a recorded trace: each row at its (scaled) timestamp, or (``closed_loop``) a
    session's turns each its recorded gap after the previous one, once that one finished."""

    kind: Literal["trace"] = "trace"
    path: str = Field(
        max_length=4096, description="Trace file (.jsonl or .csv; other suffixes need format)."
    )
    format: TraceFormat | None = Field(None, description="File format; None: from the suffix.")
    timestamp_unit: TimestampUnit = Field(
        "s", description="Unit of the timestamp field (Mooncake traces use ms)."
    )
    time_scale: float = Field(
        1.0, ge=1e-6, le=1e6, description="Multiplies timestamps (0.5 replays twice as fast)."
    )
    hash_block_tokens: int = Field(
        512, gt=0, le=MAX_TOKENS, description="Prompt tokens per hash id (Mooncake)."
    )
    on_too_long: Literal["error", "skip"] = Field(
        "error", description="Rows whose input + output exceed max_model_len: raise or skip."
    )
    until_s: float | None = Field(
        None,
        gt=0,
        le=MAX_SECONDS,
        description="Replay only the rows whose scaled timestamp is before this (a window "
        "of a long trace, e.g. its first 15 minutes); none: every row.",
    )
    vocab_size: int = Field(
        DEFAULT_VOCAB_SIZE,
        gt=MIN_TOKEN_ID,
        le=MAX_VOCAB_SIZE,
        description="Token ids are drawn below this.",
    )
    replay: TraceReplay = Field(
        "open_loop",
        description="open_loop: every row arrives at its scaled timestamp. closed_loop: a "
        "session's first turn (rows with session_id and turn) arrives at its timestamp, each "
        "later one its recorded gap after the previous turn was sent and not before that turn "
        "finished (an agent waits for the answer); rows without both arrive open loop.",
    )

    @model_validator(mode="after")
    def _check_format(self) -> TraceWorkload:
        trace_format(self.path, self.format)  # the suffix (a stat only when it has none)
        return self

    def records(self) -> list[TraceRecord]:
        """The trace's rows (read once, on first use)."""
        records = stashed(self, "_records")
        if records is None:
            records = load_trace(self.path, self.format, self.timestamp_unit)
            check_records(records, self.path, self.hash_block_tokens)
            stash(self, "_records", records)
        return records

    def replayed(self) -> list[TraceRecord]:
        """The rows within ``until_s``, in timestamp order."""
        records = sorted(self.records(), key=lambda r: r.timestamp_s)
        if self.until_s is not None:
            records = [r for r in records if r.timestamp_s * self.time_scale < self.until_s]
        return records

    def too_long(self, max_model_len: int) -> list[TraceRecord]:
        """The replayed rows whose input + output exceed ``max_model_len`` (an error, or
        dropped with ``on_too_long: skip``)."""
        return [r for r in self.replayed() if r.input_length + r.output_length > max_model_len]

    def expected_num_requests(self) -> int | None:
        """The number of rows replayed (a run leaves out those too long for its engine's
        max_model_len with ``on_too_long: skip``: its :class:`WorkloadRun` says how many)."""
        return len(self.replayed())

    def start(self, sink: RequestSink, rng: np.random.Generator) -> WorkloadRun:
        """Read the trace and spawn one process that submits its rows in timestamp order."""
        records = self.replayed()
        too_long = self.too_long(sink.max_model_len)
        if too_long and self.on_too_long == "error":
            r = too_long[0]
            raise KvsimConfigError(
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
        send = _Sender(sink, blocks, TokenSource(token_rng, self.vocab_size))
        rows = list(enumerate(records))  # request ids follow the timestamp order either way
        sessions: dict[int, list[tuple[int, TraceRecord]]] = {}
        if self.replay == "closed_loop":
            for i, r in rows:
                if r.session_id is not None and r.turn is not None:
                    sessions.setdefault(r.session_id, []).append((i, r))
            if not sessions:
                raise KvsimConfigError(
                    f"{self.path}: workload.replay = 'closed_loop', but no replayed row has "
                    "both session_id and turn, so no turn waits on another; add them, or "
                    "replay it open_loop"
                )
            rows = [(i, r) for i, r in rows if r.session_id is None or r.turn is None]
        sink.env.process(self._open_loop(send, rows))
        for turns in sessions.values():
            turns.sort(key=lambda row: row[1].turn or 0)
            sink.env.process(self._session(send, turns))
        return WorkloadRun(len(records), trace_rows_skipped=len(too_long))

    def _open_loop(
        self, send: _Sender, rows: list[tuple[int, TraceRecord]]
    ) -> Generator[Any, Any, None]:
        env = send.sink.env
        for i, record in rows:
            arrival_s = record.timestamp_s * self.time_scale
            if arrival_s > env.now:
                yield env.timeout(arrival_s - env.now)
            send(i, record)

    def _session(
        self, send: _Sender, turns: list[tuple[int, TraceRecord]]
    ) -> Generator[Any, Any, None]:
        """One session's turns in order: each its recorded gap after the previous turn was
        sent, once that turn has finished (closed_loop)."""
        env = send.sink.env
        answered: simpy.Event | None = None  # the previous turn's
        recorded_s = 0.0  # the previous turn's timestamp
        for i, record in turns:
            arrival_s = record.timestamp_s * self.time_scale
            if answered is not None:  # now is when the previous turn was sent
                arrival_s = env.now + (record.timestamp_s - recorded_s) * self.time_scale
                yield answered
            if arrival_s > env.now:
                yield env.timeout(arrival_s - env.now)
            answered, recorded_s = send(i, record), record.timestamp_s


@dataclass(frozen=True, slots=True)
class _Sender:
    """Builds a trace row's request (its hash-id blocks, then unique tokens) and submits it."""

    sink: RequestSink
    blocks: HashIdTokens
    tokens: TokenSource

    def __call__(self, i: int, record: TraceRecord) -> simpy.Event:
        sink, tokens = self.sink, self.tokens
        shared = self.blocks.tokens(record.hash_ids, record.input_length)
        unique = tokens.take_array(record.input_length - len(shared))
        request = Request(
            f"req-{i}",
            tokens.as_list(np.concatenate((shared, unique))),
            max_tokens=record.output_length,
            block_size=sink.block_size,
            arrival_time_s=sink.env.now,
            priority=record.priority or 0,
            output_token_ids=tokens.take(record.output_length),
        )
        meta = RequestMeta(
            session_id=record.session_id,
            turn=record.turn,
            priority_class="default" if record.priority is None else f"p{record.priority}",
        )
        return sink.submit(request, meta)
