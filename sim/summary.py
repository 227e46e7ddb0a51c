"""``summary.json`` of a run: one builder for simulated and measured runs.

The simulator (``sim/runner.py``) and the real-vLLM replay (``validate/runner.py``) differ only
in who produced the run (``provenance``: source, versions, hardware, calibration or allocator,
error) and how its KV cache was sized; the counts and every metric come from here, so a new
metric lands in both at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pandas as pd

from sim.config.sizing import num_cpu_blocks
from sim.metrics import summarize, swap_summary
from sim.scenario import Scenario
from sim.workload.base import WorkloadRun
from sim.workload.open_loop import OpenLoopWorkload
from sim.workload.trace import TraceWorkload


def build_summary(
    provenance: Mapping[str, Any],
    scenario: Scenario,
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    *,
    workload_run: WorkloadRun,
    complete: bool,
    truncated_at_limit: bool,
    duration_s: float,
    kv_cache: Mapping[str, Any],
    num_usable_blocks: int,
) -> dict[str, Any]:
    """The summary of a run of ``scenario`` over ``duration_s`` seconds.

    ``workload_run`` is what the workload's ``start`` returned for this run. ``kv_cache`` is
    written as is and must hold ``block_size``; ``num_usable_blocks`` (the null block
    excluded) is what KV usage is a share of.
    """
    num_finished = int(requests["finish_s"].notna().sum())
    skipped = workload_run.trace_rows_skipped
    clipped = workload_run.requests_clipped
    # A cut open-loop or trace run: the requests its workload planned that never arrived (an
    # agent session's count is not known in advance: it ends when its context no longer fits).
    not_arrived = 0
    if truncated_at_limit and isinstance(scenario.workload, OpenLoopWorkload | TraceWorkload):
        not_arrived = max(0, (workload_run.planned_requests or 0) - len(requests))
    # Only what-if runs carry the key, so the vLLM-exact engine's summaries stay as they were.
    what_if = scenario.engine_what_ifs()
    engine = scenario.engine
    swap = None
    if engine.preemption_mode == "swap" and engine.swap_space_gib is not None:
        swap = swap_summary(
            steps,
            duration_s,
            cpu_blocks=num_cpu_blocks(engine.swap_space_gib, kv_cache["bytes_per_block"]),
            replicas=scenario.fleet.replicas if scenario.fleet is not None else 1,
        )
    return {
        **provenance,
        **({"what_if": what_if} if what_if else {}),
        "scenario": scenario.name,
        "seed": scenario.seed,
        "model": scenario.model.name,
        "complete": complete,
        "truncated_at_limit": truncated_at_limit,
        "duration_s": duration_s,
        "num_requests": len(requests),
        "num_finished": num_finished,
        "num_unfinished": len(requests) - num_finished,
        **({"num_not_arrived": not_arrived} if not_arrived else {}),
        **({"sessions": _sessions(workload_run)} if workload_run.sessions_planned else {}),
        # What did not fit max_model_len (only where some did not): trace rows dropped,
        # open-loop requests cut to fit.
        **({"trace_rows_skipped": skipped} if skipped else {}),
        **({"requests_clipped": clipped} if clipped else {}),
        "kv_cache": dict(kv_cache),
        **summarize(
            requests,
            steps,
            duration_s=duration_s,
            num_usable_blocks=num_usable_blocks,
            block_size=kv_cache["block_size"],
            slos=scenario.slos.model_dump(),
            open_sessions=workload_run.open_sessions,
        ),
        # Swap preemption only (a what-if): the swap columns summed up.
        **({"swap": swap} if swap is not None else {}),
    }


def _sessions(run: WorkloadRun) -> dict[str, int]:
    """An agent-session run's sessions: planned, started by the run's end, ended by then
    (all their turns done, or their context past the cap), and those cut by the cap with
    the turns they did not send."""
    started = run.sessions_started
    return {
        "planned": int(run.sessions_planned or 0),
        "started": started,
        "ended": started - len(run.open_sessions),
        "cut_by_context": run.sessions_cut_by_context,
        "turns_not_sent": run.turns_not_sent,
        "context_cap_tokens": int(run.context_cap_tokens or 0),
    }
