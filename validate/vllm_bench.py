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


def load_vllm_bench(path: str | Path) -> RunData:
    """Read a detailed ``vllm bench serve`` result; errors name the file and the field."""
    path = Path(path)
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read vllm bench result: {exc}") from None
    missing = [key for key in REQUIRED if key not in raw]
    if missing:
        raise ValueError(
            f"{path}: lacks {', '.join(missing)}; save it with "
            "`vllm bench serve --save-result --save-detailed`"
        )
    n = len(raw["start_times"])
    for key in REQUIRED:
        if len(raw[key]) != n:
            raise ValueError(f"{path}: field {key!r} has {len(raw[key])} entries, expected {n}")
    errors = raw.get("errors") or [""] * n
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
