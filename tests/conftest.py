"""Shared pytest hooks: print what the vLLM conformance suite checked."""

from __future__ import annotations

import sys


def pytest_terminal_summary(terminalreporter) -> None:
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
