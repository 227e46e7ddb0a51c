"""Rich tables for the terminal: the summary a run ends with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table

from sim.fleet.config import fleet_what_if
from sim.metrics import KV_USAGE, LATENCIES, PREEMPTIONS

if TYPE_CHECKING:
    from sim.uncertainty import BandRow


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.1f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _num(value: float | None, fmt: str = ",.1f") -> str:
    return "-" if value is None else format(value, fmt)


def truncation_line(summary: dict[str, Any], subject: str = "the run") -> str | None:
    """What a run cut at ``limits.max_duration_s`` leaves out of its figures, or None for a
    run that drained its workload: its E2E, TPOT and queue times, request throughput and
    goodput count the finished requests only, its TTFT, ITL and output throughput the
    tokens produced by then, its SLO attainment the unfinished as misses; what is left out
    is the slowest part."""
    if not summary.get("truncated_at_limit"):
        return None
    unfinished, total = summary["num_unfinished"], summary["num_requests"]
    not_arrived = summary.get("num_not_arrived", 0)
    later = f" and {not_arrived:,} more not yet arrived" if not_arrived else ""
    sessions = summary.get("sessions") or {}
    if (not_started := sessions.get("planned", 0) - sessions.get("started", 0)) > 0:
        later += f" ({not_started:,} of its {sessions['planned']:,} sessions not yet started)"
    left_out = (
        f" with {unfinished:,} of its {total:,} requests unfinished{later}: its latencies, "
        "throughput and SLO verdicts leave out what those had still to do (their ends, any "
        "first token yet to come), the slowest part of the run"
        if unfinished
        else f" with {not_arrived:,} of its workload's requests not yet arrived: they are not "
        "in its figures"
        if not_arrived
        else ": what would have arrived after it is not in its figures"
    )
    return (
        f"{subject} hit limits.max_duration_s ({summary['duration_s']:,.6g} s) before its "
        f"workload ended{left_out}; raise limits.max_duration_s to see the whole workload"
    )


def too_long_line(summary: dict[str, Any], subject: str = "the run") -> str | None:
    """What a run changed of its workload to fit ``max_model_len``, or None: the trace rows
    ``on_too_long: skip`` dropped, or the open-loop requests whose prompt (then output) was
    cut; either way the longest requests are not in its figures as the workload had them."""
    if skipped := summary.get("trace_rows_skipped"):
        total = summary["num_requests"] + summary.get("num_not_arrived", 0) + skipped
        return (
            f"{subject} skipped {skipped:,} of its trace's {total:,} rows, longer than "
            "max_model_len (workload.on_too_long: skip): its figures leave out the longest "
            "prompts"
        )
    if clipped := summary.get("requests_clipped"):
        return (
            f"{subject} cut {clipped:,} of its {summary['num_requests']:,} requests to fit "
            "max_model_len (the prompt's unique part first, then the output): its figures "
            "have them shorter than the workload drew them"
        )
    return None


def context_cap_line(summary: dict[str, Any], subject: str = "the run") -> str | None:
    """Agent sessions that ended before their last turn because their context outgrew
    max_model_len (or the workload's max_context_tokens), or None: the turns they did not
    send, the longest contexts, are not in the run's figures."""
    sessions = summary.get("sessions") or {}
    if not (cut := sessions.get("cut_by_context")):
        return None
    cap = sessions.get("context_cap_tokens")
    return (
        f"{subject}: {cut:,} of its {sessions['started']:,} agent sessions ended before their "
        f"last turn, the next one past the context cap of {cap:,} tokens (engine.max_model_len "
        f"or workload.max_context_tokens), {sessions['turns_not_sent']:,} turns not sent: its "
        "figures leave out those longest contexts"
    )


def partial_lines(summary: dict[str, Any], subject: str = "the run") -> list[str]:
    """Every reason a run's figures are not the whole workload's, one line each: a failed or
    cut run (:func:`partial_run_line`), a workload changed to fit (:func:`too_long_line`,
    :func:`context_cap_line`)."""
    lines = (
        partial_run_line(summary, subject),
        too_long_line(summary, subject),
        context_cap_line(summary, subject),
    )
    return [line for line in lines if line]


def what_if_lines(summary: dict[str, Any]) -> list[str]:
    """What a run modelled that vLLM 0.32 does not run as configured, one line each: the
    memory policies under ``what_if`` and a fleet's router (``fleet``); empty for a run of
    the vLLM-exact engine (a replay on vLLM has neither)."""
    lines = [str(line) for line in summary.get("what_if") or []]
    fleet = summary.get("fleet")
    if isinstance(fleet, dict) and "replicas" in fleet:
        router = fleet.get("router")
        kind = router.get("kind", "?") if isinstance(router, dict) else "?"
        lines.append(fleet_what_if(int(fleet["replicas"]), str(kind)))
    return lines


def what_if_line(summary: dict[str, Any], subject: str = "the run") -> str | None:
    """One line saying a run is a what-if and of what, or None for the vLLM-exact engine."""
    lines = what_if_lines(summary)
    if not lines:
        return None
    return f"{subject} is a what-if, not vLLM 0.32's own behaviour: " + "; ".join(lines)


def partial_run_line(summary: dict[str, Any], subject: str = "the run") -> str | None:
    """Why a run's figures are partial, or None: a replay that vLLM failed in mid-run
    (``complete: false``), a run cut at the time limit (:func:`truncation_line`), or a
    ``vllm bench serve`` result with failed requests."""
    unfinished = summary.get("num_unfinished", 0)
    if summary.get("source") == "vllm-bench" and unfinished:
        total = summary["num_requests"]
        return (
            f"{subject} has {unfinished:,} of its {total:,} requests failed in the benchmark "
            f"client: its latencies, throughput and SLO verdicts cover the "
            f"{total - unfinished:,} that finished only"
        )
    if summary.get("complete", True):
        return truncation_line(summary, subject)
    return f"{subject} is incomplete: vLLM failed mid-run ({summary.get('error')})" + (
        f"; its figures leave out its {unfinished:,} unfinished requests" if unfinished else ""
    )


def latency_table(summary: dict[str, Any]) -> Table:
    """p50/p90/p99/mean of TTFT, ITL, TPOT, E2E and queue time."""
    m = summary["metrics"]
    title = (
        f"{summary['scenario']}: {summary['model']} on {summary['hardware']} "
        f"[{summary['source']}] {summary['num_finished']:,}/{summary['num_requests']:,} "
        f"requests in {summary['duration_s']:,.1f} s"
    )
    table = Table(title=escape(title), title_justify="left")  # "[sim]" is text, not markup
    for col in ("latency", "p50", "p90", "p99", "mean"):
        table.add_column(col, justify="left" if col == "latency" else "right")
    for name, key in LATENCIES:
        s = m.get(key)
        if s is None:  # a run directory written before kvsim reported TPOT
            continue
        table.add_row(name, _ms(s["p50"]), _ms(s["p90"]), _ms(s["p99"]), _ms(s["mean"]))
    return table


def capacity_table(summary: dict[str, Any]) -> Table:
    """KV cache, preemption, prefix cache, throughput and SLO verdicts."""
    m = summary["metrics"]
    kv = m[KV_USAGE]
    p = m[PREEMPTIONS]
    table = Table(show_header=True)
    table.add_column(
        "engine (a fleet: steps of all replicas pooled)" if summary.get("fleet") else "engine"
    )
    table.add_column("value", justify="right")
    rows = [
        (
            "KV cache usage mean / p95 / peak",
            f"{_pct(kv['mean'])} / {_pct(kv['p95'])} / {_pct(kv['peak'])}",
        ),
        ("KV slots allocated but empty", _pct(m["kv_waste"]["unused_slot_frac_of_allocated"])),
        (
            "preemptions (requests hit, max per request)",
            f"{p['total']:,} ({p['requests_preempted']:,}, {p['per_request_max']})",
        ),
        ("prefix cache hit rate", _pct(m["prefix_cache_hit_rate"])),
        ("output throughput", f"{_num(m['output_throughput_tok_s'])} tok/s"),
        ("request throughput", f"{_num(m['request_throughput_req_s'], '.2f')} req/s"),
        (
            "goodput (finished within every SLO)",
            f"{_num(m['goodput_req_s'], '.2f')} req/s "
            f"({_pct(m['slo_attainment'])} of its requests)",
        ),
        ("peak concurrent sessions", f"{m['peak_concurrent_sessions']:,}"),
    ]
    for row in rows:
        table.add_row(*row)
    classes = m.get("by_priority_class", {})
    if len(classes) > 1:
        for name, stats in classes.items():
            table.add_row(
                f"TTFT p50 / p99 of {name} ({stats['count']:,} requests)",
                f"{_ms(stats['ttft_s']['p50'])} / {_ms(stats['ttft_s']['p99'])}",
            )
    for key, verdict in (summary.get("slos") or {}).items():
        mark = "[green]PASS[/green]" if verdict["pass"] else "[red]FAIL[/red]"
        table.add_row(f"SLO {key} <= {_ms(verdict['target'])}", f"{_ms(verdict['value'])} {mark}")
    return table


def fleet_table(summary: dict[str, Any]) -> Table:
    """One row per replica of a fleet run, and the load imbalance in the title."""
    fleet = summary["fleet"]
    router = fleet["router"]
    imbalance = fleet["load_imbalance"]
    title = (
        f"fleet (what-if): {fleet['replicas']} replicas, router {router['kind']}; load "
        f"imbalance (max / mean) requests {_num(imbalance['requests'], '.2f')}, busy time "
        f"{_num(imbalance['busy_time'], '.2f')}"
    )
    table = Table(title=escape(title), title_justify="left")  # "[sim]" is text, not markup
    for col in (
        "replica",
        "requests",
        "busy",
        "KV mean / peak",
        "prefix hits",
        "preempt",
        "TTFT p50 / p99",
    ):
        table.add_column(col, justify="left" if col == "replica" else "right")
    for r in fleet["per_replica"]:
        kv = r["kv_cache_usage"]
        table.add_row(
            str(r["replica"]),
            f"{r['num_requests']:,}",
            _pct(r["busy_frac"]),
            f"{_pct(kv['mean'])} / {_pct(kv['peak'])}",
            _pct(r["prefix_cache_hit_rate"]),
            f"{r['preemptions']:,}",
            f"{_ms(r['ttft_s']['p50'])} / {_ms(r['ttft_s']['p99'])}",
        )
    return table


def summary_table(summary: dict[str, Any]) -> Group:
    """The tables `kvsim run` prints (with one row per replica for a fleet)."""
    tables: list[Table] = [latency_table(summary), capacity_table(summary)]
    if summary.get("fleet"):
        tables.append(fleet_table(summary))
    return Group(*tables)


def step_time_source(summary: dict[str, Any]) -> str:
    """One line on what priced the run's steps: a calibration profile (its source, what it was
    fitted on) or the datasheet roofline."""
    profile = summary.get("calibration")
    hardware = summary.get("hardware", "?")
    if not profile:
        return (
            f"step times: datasheet roofline ({hardware} has no shipped kernel fit; "
            "`kvsim calibrate` fits a profile)"
        )
    source = profile.get("source", "vllm")
    if source == "vidur-operator-tables":
        return (
            f"step times: {profile.get('hardware', hardware)} kernel fit on public operator "
            "measurements (Vidur), attention from first principles"
        )
    if source == "torch-operator-tables":
        return (
            f"step times: {profile.get('hardware', hardware)} kernel fit on operator "
            "measurements with torch kernels (validate/gpu_operators.py), attention from "
            "first principles"
        )
    return (
        f"step times: calibration profile ({source}) fitted on {profile.get('model', '?')} / "
        f"{profile.get('hardware', '?')}"
    )


def format_value(value: float | None, unit: str) -> str:
    """A metric value in its unit: "s" as ms, "frac" as a percentage, else a number."""
    if unit == "s":
        return _ms(value)
    if unit == "frac":
        return _pct(value)
    return _num(value, ",.1f" if unit else ",.0f")


def band_table(
    rows: Sequence[BandRow],
    num_samples: int,
    vary_seed: bool,
    references: dict[str, float | None] | None = None,
    reference_label: str = "vLLM",
) -> Table:
    """The run's metrics (at the profile as fitted) beside the median and p10-p90 band of
    ``kvsim run --samples`` (sim/uncertainty.py); with ``references`` (by metric), also the
    measured value and whether it lies in the band."""
    what = "step speeds and workload seeds" if vary_seed else "step speeds"
    title = f"uncertainty: {num_samples} samples at the {what} of the calibration's runs"
    if any(r.model_error for r in rows):
        title += (
            ", latencies and throughput times the fit's model error held out on the "
            "calibration scenarios"
        )
    table = Table(title=title, title_justify="left")
    columns = ["metric", "this run", "median", "p10", "p90"]
    if references is not None:
        columns += [reference_label, "in band"]
    for col in columns:
        table.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        cells = [r.metric, *(format_value(v, r.unit) for v in (r.point, r.median, r.low, r.high))]
        if references is not None:
            reference = references.get(r.metric)
            inside = r.contains(reference)
            cells += [
                format_value(reference, r.unit),
                "-" if inside is None else "yes" if inside else "no",
            ]
        table.add_row(*cells)
    return table
