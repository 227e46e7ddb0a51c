"""Import ``vllm bench serve --save-result --save-detailed`` JSON as a run directory.

The benchmark client records per request its start time, TTFT, inter-token latencies,
latency and token counts; kvsim rebuilds each request's token times from them. It has no
per-step view of the engine, so ``steps.parquet`` is empty and KV/preemption metrics are
absent (None) in the summary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from sim.metrics import summarize
from sim.recorder import REQUEST_COLUMNS, STEP_COLUMNS
from sim.results import RunData

REQUIRED = ("start_times", "ttfts", "itls", "latencies", "input_lens", "output_lens")
# What a failed request (non-empty error string) leaves unread: vllm bench writes its defaults
# there (0, 0.0, []), and null is accepted too.
UNREAD_WHEN_FAILED = ("ttfts", "itls", "latencies", "output_lens")


def _is_number(x: Any) -> bool:
    """A finite JSON number (not a bool: json reads ``true`` as one); an integer too large
    for a float is not one."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _show(x: Any) -> str:
    """``x`` as JSON, cut short for an error message."""
    text = json.dumps(x)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_entry(path: Path, key: str, i: int, x: Any) -> None:
    """Raise ValueError naming the file, field, index and value unless entry ``i`` of ``key``
    has that field's type: a list of numbers or null (itls), a count (the lengths) or a
    number of seconds."""
    where = f"{path}: field {key!r} entry {i} is {_show(x)}"
    if key == "itls":
        if x is not None and not isinstance(x, list):
            raise ValueError(f"{where}, expected a list of inter-token latencies")
        for j, gap in enumerate(x or []):
            if not _is_number(gap):
                raise ValueError(
                    f"{path}: field 'itls' entry {i} item {j} is {_show(gap)}, expected a number"
                )
    elif key in ("input_lens", "output_lens"):
        if not (_is_number(x) and x >= 0 and float(x).is_integer()):
            raise ValueError(f"{where}, expected a token count")
    elif not _is_number(x):
        raise ValueError(f"{where}, expected a number of seconds")


def _validated(path: Path, raw: Any) -> tuple[int, list[str | None]]:
    """The number of requests and their errors (None or "" for a success), after checking
    every list's length and every entry the import reads; errors name the file, the field,
    the index and the value."""
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a vllm bench result is a JSON object, not {type(raw).__name__}")
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise ValueError(
            f"{path}: lacks {', '.join(missing)}; save it with "
            "`vllm bench serve --save-result --save-detailed`"
        )
    # errors may be absent or null (every request succeeded); the others must be lists.
    present = [*REQUIRED, *(["errors"] if raw.get("errors") is not None else [])]
    for key in present:
        if not isinstance(raw[key], list):
            raise ValueError(f"{path}: field {key!r} is {_show(raw[key])}, expected a list")
    n = len(raw["start_times"])
    for key in present:
        if len(raw[key]) != n:
            raise ValueError(f"{path}: field {key!r} has {len(raw[key])} entries, expected {n}")
    errors = raw.get("errors") or [""] * n
    for i, error in enumerate(errors):
        if error is not None and not isinstance(error, str):
            raise ValueError(
                f"{path}: field 'errors' entry {i} is {_show(error)}, expected a string"
            )
    for key in REQUIRED:
        for i, x in enumerate(raw[key]):
            if errors[i] and key in UNREAD_WHEN_FAILED and (x is None or x == []):
                continue
            _check_entry(path, key, i, x)
    duration = raw.get("duration")
    if duration is not None and not (_is_number(duration) and duration >= 0):
        raise ValueError(
            f"{path}: field 'duration' is {_show(duration)}, expected a number of seconds"
        )
    return n, errors


def load_vllm_bench(path: str | Path) -> RunData:
    """Read a detailed ``vllm bench serve`` result; errors name the file and the field (and
    the index and value of a bad entry)."""
    path = Path(path)
    try:
        raw: Any = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read vllm bench result: {exc}") from None
    n, errors = _validated(path, raw)
    t0 = min(raw["start_times"]) if n else 0.0
    rows = []
    for i in range(n):
        arrival = float(raw["start_times"][i]) - t0
        ok = not errors[i]
        ttft = float(raw["ttfts"][i]) if ok else math.nan
        gaps = [float(g) for g in (raw["itls"][i] or [])] if ok else []
        times = (arrival + ttft + np.concatenate([[0.0], np.cumsum(gaps)])).tolist() if ok else []
        latency = float(raw["latencies"][i]) if ok else math.nan
        rows.append(
            (
                f"req-{i}",
                -1,
                -1,
                -1,
                "default",
                0,
                arrival,
                math.nan,
                arrival + ttft,
                arrival + latency,
                int(raw["input_lens"][i]),
                int(raw["output_lens"][i]) if ok else 0,
                0,
                0,
                ttft,
                latency,
                math.nan,
                float(np.mean(gaps)) if gaps else math.nan,
                times,
            )
        )
    requests = pd.DataFrame.from_records(rows, columns=REQUEST_COLUMNS)
    steps = pd.DataFrame({name: pd.Series(dtype=float) for name in STEP_COLUMNS})
    duration_s = float(raw.get("duration") or (requests["finish_s"].max() if n else 0.0))
    metrics = summarize(
        requests, steps, duration_s=duration_s, num_usable_blocks=1, block_size=1, slos={}
    )
    for key in ("vllm:kv_cache_usage_perc", "vllm:num_preemptions", "kv_waste"):
        metrics["metrics"][key] = None  # not observable from the client side
    summary = {
        "source": "vllm-bench",
        "scenario": path.stem,
        "model": str(raw.get("model_id", "?")),
        "hardware": "?",
        "complete": True,
        "duration_s": duration_s,
        "num_requests": n,
        "num_finished": int(requests["finish_s"].notna().sum()),
        "num_unfinished": int(requests["finish_s"].isna().sum()),
        **metrics,
    }
    return RunData(path, summary, requests, steps, "")
