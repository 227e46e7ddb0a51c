"""Shared pytest hooks: print what the vLLM conformance suite and the validation checked."""

from __future__ import annotations

import sys


def _print_conformance(terminalreporter) -> None:
    module = sys.modules.get("tests.validate.test_conformance")
    stats = getattr(module, "STATS", None)
    if not stats or not stats["streams"]:
        return
    terminalreporter.write_line(
        f"vLLM conformance against vllm {stats['vllm']}: {stats['streams']} streams, "
        f"{stats['steps']} steps, {stats['preempting']} streams with preemption, "
        f"{stats['prefix_hits']} with prefix hits, {stats['fcfs']} fcfs / "
        f"{stats['priority']} priority, {stats['caching']} with prefix caching, "
        f"{stats['divergences']} divergences"
    )


def _print_validation(terminalreporter) -> None:
    module = sys.modules.get("tests.validate.test_validation_bound")
    report = getattr(module, "REPORT", None)
    if not report:
        return
    fit = report.get("fit", {})
    terminalreporter.write_line(
        f"kvsim vs vLLM {report['vllm_version']} on this machine, scenario {report['scenario']}, "
        f"median of {len(report['real_runs'])} replays "
        f"(profile fitted on the calibration scenarios only: r2 {fit.get('r2', float('nan')):.3f}, "
        f"{fit.get('outlier_frac', 0) * 100:.1f}% stalled steps dropped):"
    )
    for row in report["metrics"]:
        err = row["relative_error"]
        value, reference = row["value"], row["reference"]
        runs = ", ".join(f"{v:.6g}" for v in row["reference_runs"])
        terminalreporter.write_line(
            f"  {row['metric']:<24} kvsim {value if value is None else f'{value:.6g}':<12} "
            f"vLLM {reference if reference is None else f'{reference:.6g}':<12} "
            f"error {'-' if err is None else f'{err * 100:+.1f}%':<8} runs [{runs}]"
        )
    ratios = report.get("step_time_vs_sim") or []
    shown = ", ".join("-" if r is None else f"{r:.3f}" for r in ratios)
    terminalreporter.write_line(f"  vLLM step time / kvsim's, per replay: [{shown}]")


def pytest_terminal_summary(terminalreporter) -> None:
    _print_conformance(terminalreporter)
    _print_validation(terminalreporter)
