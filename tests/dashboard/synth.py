"""Synthesize large run directories (no simulation) for load-time checks of the dashboard.

The files follow the results schema (``sim.recorder.REQUEST_COLUMNS`` / ``STEP_COLUMNS``)
and are built with vectorized numpy, so a 100k-request run takes seconds to write.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sim.recorder import REQUEST_COLUMNS, STEP_COLUMNS

CLASSES = ("interactive", "background")

# A hand-written ``fleet`` section of summary.json (two replicas, one with few figures).
FLEET_SECTION: dict = {
    "replicas": 2,
    "router": {"kind": "session_affinity", "load_factor": 1.25, "view_delay_s": 0.0},
    "load_imbalance": {"requests": 1.2, "output_tokens": 1.1, "busy_time": None},
    "per_replica": [
        {
            "replica": 0,
            "num_requests": 12,
            "num_finished": 11,
            "output_tokens": 3000,
            "busy_frac": 0.5,
            "kv_cache_usage": {"mean": 0.25, "p95": 0.5, "peak": 0.75},
            "prefix_cache_hit_rate": 0.8,
            "preemptions": 2,
            "ttft_s": {"p50": 0.05, "p99": 0.5},
        },
        {"replica": 1, "num_requests": 8, "prefix_cache_hit_rate": None, "ttft_s": {}},
    ],
}


def synthesize_run(
    out_dir: Path,
    num_requests: int = 100_000,
    turns_per_session: int = 10,
    steps_per_request: int = 20,
    num_blocks: int = 4096,
    block_map_snapshots: int = 0,
    seed: int = 0,
) -> Path:
    """Write a plausible run directory with ``num_requests`` requests; returns ``out_dir``.

    Per-token times are real arrays (lognormal output lengths, median 250 tokens), so the
    ``token_times_s`` list column is as large as a simulated run's. With
    ``block_map_snapshots > 0`` a ``block_map.npz`` is written too.
    """
    rng = np.random.default_rng(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    n = num_requests
    session = np.arange(n) // turns_per_session
    turn = np.arange(n) % turns_per_session
    num_sessions = int(session.max()) + 1
    session_start = np.sort(rng.uniform(0, n / 2.0, num_sessions))
    queue = rng.exponential(0.02, n)
    prefill = rng.exponential(0.08, n)
    out_tokens = np.clip(rng.lognormal(np.log(250), 0.7, n), 16, 1500).astype(np.int64)
    itl = rng.uniform(0.015, 0.03, n)
    tool = rng.lognormal(np.log(1.5), 1.0, n)
    # A session's turns run back to back: arrival(k+1) = finish(k) + tool wait.
    turn_span = queue + prefill + out_tokens * itl + tool
    offsets_in_session = np.zeros(n)
    for t in range(1, turns_per_session):
        idx = np.nonzero(turn == t)[0]
        offsets_in_session[idx] = offsets_in_session[idx - 1] + turn_span[idx - 1]
    arrival = session_start[session] + offsets_in_session
    first_scheduled = arrival + queue
    first_token = first_scheduled + prefill
    # Token k of a request comes out at first_token + k * itl (with a little jitter).
    counts = out_tokens
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    row = np.repeat(np.arange(n), counts)
    k = np.arange(offsets[-1]) - offsets[row]
    gaps = np.where(k == 0, 0.0, itl[row] * rng.uniform(0.9, 1.1, offsets[-1]))
    elapsed = np.cumsum(gaps)
    values = first_token[row] + elapsed - elapsed[offsets[:-1]][row]
    finish = values[offsets[1:] - 1]
    klass = np.array(CLASSES)[session % 2]
    columns = {
        "request_id": pa.array([f"s{s}-t{t}" for s, t in zip(session, turn, strict=True)]),
        "session_id": session,
        "turn": turn,
        "subcall": np.full(n, -1),
        "priority_class": pa.array(klass.tolist()),
        "priority": session % 2,
        "arrival_s": arrival,
        "first_scheduled_s": first_scheduled,
        "first_token_s": first_token,
        "finish_s": finish,
        "prompt_tokens": 3500 + turn * 2000,
        "output_tokens": out_tokens,
        "cached_tokens": 3488 + turn * 1900,
        "num_preemptions": (rng.random(n) < 0.01).astype(np.int64),
        "ttft_s": first_token - arrival,
        "e2e_s": finish - arrival,
        "queue_s": queue,
        "mean_itl_s": (finish - first_token) / np.maximum(out_tokens - 1, 1),
        "token_times_s": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values),
    }
    assert list(columns) == REQUEST_COLUMNS
    pq.write_table(pa.table(columns), out_dir / "requests.parquet")

    m = n * steps_per_request
    end_s = float(finish.max())
    duration = np.full(m, end_s / m)
    start = np.arange(m) * duration
    phase = start / end_s
    usage = np.clip(0.5 + 0.45 * np.sin(phase * 40) + rng.normal(0, 0.02, m), 0, 1)
    steps = {
        "step": np.arange(m),
        "start_s": start,
        "duration_s": duration,
        "num_prefill_tokens": rng.integers(0, 8192, m),
        "num_decode_tokens": rng.integers(0, 256, m),
        "num_prefill_reqs": rng.integers(0, 4, m),
        "decode_context_tokens": rng.integers(0, 1_000_000, m),
        "prefill_attention_pairs": rng.random(m) * 1e7,
        "num_requests_running": (usage * 200).astype(np.int64),
        "num_requests_waiting": np.maximum(0, (usage - 0.8) * 300).astype(np.int64),
        "kv_cache_usage_perc": usage,
        "num_free_blocks": ((1 - usage) * (num_blocks - 1)).astype(np.int64),
        "num_preemptions": ((usage > 0.93) & (rng.random(m) < 0.05)).astype(np.int64),
        "prefix_cache_queries": rng.integers(0, 8192, m),
        "prefix_cache_hits": rng.integers(0, 4096, m),
        "resumed_prefix_cache_hits": np.zeros(m, dtype=np.int64),
        "kv_unused_slots": rng.integers(0, 4000, m),
        "shared_kv_tokens": rng.integers(0, 2048, m),
    }
    assert list(steps) == STEP_COLUMNS
    pq.write_table(pa.table(steps), out_dir / "steps.parquet")

    summary = _summary(n, columns, end_s, num_blocks)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    (out_dir / "scenario.yaml").write_text(f"name: synthetic-{n}\n")
    if block_map_snapshots:
        write_block_map(out_dir, end_s, num_blocks, block_map_snapshots, rng)
    return out_dir


def write_block_map(
    out_dir: Path, end_s: float, num_blocks: int, snapshots: int, rng: np.random.Generator
) -> None:
    """A ``block_map.npz`` in the format the run explorer reads (see dashboard/loaders.py)."""
    times = np.linspace(0.0, end_s, snapshots)
    fill = 0.5 + 0.45 * np.sin(times / end_s * 40)
    index = np.arange(num_blocks)[None, :] / num_blocks
    states = np.zeros((snapshots, num_blocks), dtype=np.uint8)
    used = index < fill[:, None]
    states[used] = 2 + (rng.random(used.sum()) < 0.3)
    cached = (~used) & (index < fill[:, None] + 0.1)
    states[cached] = 1
    states[:, 0] = 0  # the null block
    np.savez(out_dir / "block_map.npz", times_s=times, states=states, classes=np.array(CLASSES))


def _summary(n: int, columns: dict, end_s: float, num_blocks: int) -> dict:
    def stats(values: np.ndarray) -> dict:
        p50, p90, p99 = np.percentile(values, [50, 90, 99])
        return {"p50": p50, "p90": p90, "p99": p99, "mean": values.mean(), "count": len(values)}

    ttft, e2e = columns["ttft_s"], columns["e2e_s"]
    metrics = {
        "vllm:time_to_first_token_seconds": stats(ttft),
        "vllm:inter_token_latency_seconds": stats(columns["mean_itl_s"]),
        "vllm:e2e_request_latency_seconds": stats(e2e),
        "vllm:request_queue_time_seconds": stats(columns["queue_s"]),
        "vllm:kv_cache_usage_perc": {"mean": 0.5, "p95": 0.93, "peak": 0.99},
        "vllm:num_preemptions": {
            "total": int(columns["num_preemptions"].sum()),
            "requests_preempted": int(columns["num_preemptions"].sum()),
            "per_request_mean": float(columns["num_preemptions"].mean()),
            "per_request_max": 1,
        },
        "vllm:prefix_cache_queries": 1000,
        "vllm:prefix_cache_hits": 900,
        "prefix_cache_hit_rate": 0.9,
        "vllm:num_requests_running": {"mean": 100.0, "peak": 200},
        "vllm:num_requests_waiting": {"peak": 50},
        "output_throughput_tok_s": float(columns["output_tokens"].sum() / end_s),
        "request_throughput_req_s": n / end_s,
        "goodput_req_s": n / end_s,
        "slo_attainment": 1.0,
        "kv_waste": {"unused_slots_mean": 100.0, "unused_slot_frac_of_allocated": 0.01},
        "peak_concurrent_sessions": 100,
        "by_priority_class": {},
        "num_steps": 0,
    }
    metrics = json.loads(json.dumps(metrics, default=float))
    return {
        "source": "synthetic",
        "scenario": f"synthetic-{n}",
        "model": "Llama-3.1-8B",
        "hardware": "H100-SXM-80GB",
        "seed": 0,
        "complete": True,
        "truncated_at_limit": False,
        "duration_s": end_s,
        "num_requests": n,
        "num_finished": n,
        "num_unfinished": 0,
        "kv_cache": {"block_size": 16, "num_gpu_blocks": num_blocks},
        "metrics": metrics,
        "slos": {
            "ttft_p99_s": {"target": 2.0, "value": float(np.percentile(ttft, 99)), "pass": True}
        },
    }


def synthesize_fleet_run(
    out_dir: Path,
    replicas: int = 3,
    num_requests: int = 600,
    steps_per_request: int = 4,
    seed: int = 0,
) -> Path:
    """A fleet run directory: ``synthesize_run``'s files as if ``replicas`` replicas served
    them behind a session-affinity router, the way ``sim.fleet.outputs`` writes a fleet run.

    Request ``i`` goes to replica ``session % replicas``, except every session's last turn,
    which spills to the next replica. Steps go to the replicas in turn (step ``j`` of the
    merged table to replica ``j % replicas``, counting its own ``step`` from 1), so the
    table stays ordered by start time then replica. ``summary.json`` gets the ``fleet``
    section of :func:`sim.fleet.outputs.fleet_section`.
    """
    import pandas as pd

    from sim.fleet.config import FleetConfig
    from sim.fleet.outputs import REPLICA, fleet_section

    synthesize_run(
        out_dir, num_requests=num_requests, steps_per_request=steps_per_request, seed=seed
    )
    requests = pd.read_parquet(out_dir / "requests.parquet")
    spill = requests["turn"] == requests["turn"].max()
    requests[REPLICA] = ((requests["session_id"] + spill) % replicas).astype(np.int64)
    steps = pd.read_parquet(out_dir / "steps.parquet")
    index = np.arange(len(steps))
    steps[REPLICA] = (index % replicas).astype(np.int64)
    steps["step"] = index // replicas + 1
    requests.to_parquet(out_dir / "requests.parquet", index=False)
    steps.to_parquet(out_dir / "steps.parquet", index=False)
    summary = json.loads((out_dir / "summary.json").read_text())
    config = FleetConfig.model_validate(
        {"replicas": replicas, "router": {"kind": "session_affinity"}}
    )
    section = fleet_section(config, requests, steps, summary["duration_s"])
    summary["fleet"] = json.loads(json.dumps(section, default=float))
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    return out_dir
