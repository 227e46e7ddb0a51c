"""Fuzz ``kvsim run`` with mutated scenarios, model configs and trace files.

Each case starts from a small valid scenario (agent sessions, open loop or a trace; a preset
model or a config.json), mutates one of its files (wrong types, missing and extra keys,
non-finite and extreme numbers, huge strings, truncated and binary files, other encodings,
byte-order marks, duplicate keys, YAML aliases and alias bombs) and runs the CLI in-process.
The only allowed outcomes: a complete run, or exit status 2 with one paragraph that names the
file (and, for a mutated value, the field). No traceback, no hang (each case has a wall-clock
limit), and nothing left behind but the inputs and a complete run directory.

``KVSIM_FUZZ_EXAMPLES`` sets the number of cases (default 500, about a minute on 2 cores); the test
session's summary prints how many ran and how they ended.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from sim.cli import app

EXAMPLES = int(os.environ.get("KVSIM_FUZZ_EXAMPLES", "500"))
# Wall-clock seconds one case may take: the base scenarios simulate in well under a second.
CASE_TIMEOUT_S = 60
# Read by tests/sim/conftest.py for the session summary.
STATS: dict[str, int] = {"cases": 0, "complete": 0, "refused": 0, "broken": 0}

TINY_MODEL = json.loads(
    (Path(__file__).resolve().parents[2] / "validate/models/tiny-llama/config.json").read_text()
)
HARDWARE = {
    "name": "small-gpu",
    "hbm_bytes": 4 << 30,
    "hbm_bandwidth_bytes_per_s": 2.0e12,
    "bf16_flops_per_s": 3.0e14,
    "pcie_bandwidth_bytes_per_s": 3.2e10,
    "nvlink_bandwidth_bytes_per_s": 0,
}
ENGINE = {"block_size": 16, "max_model_len": 4096, "max_num_seqs": 8, "max_num_batched_tokens": 512}
WORKLOADS: dict[str, dict[str, Any]] = {
    "agent_sessions": {
        "kind": "agent_sessions",
        "sessions": 3,
        "session_arrival": {"kind": "poisson", "rate_per_s": 2.0},
        "turns": {"kind": "uniform", "low": 1, "high": 3},
        "system_prompt_tokens": 64,
        "tool_schema_tokens": 32,
        "user_message_tokens": {"kind": "lognormal", "median": 20, "sigma": 0.5, "max": 200},
        "tool_result_tokens": {"kind": "fixed", "value": 16},
        "output_tokens": {"kind": "empirical", "values": [4, 8, 12]},
        "tool_latency": {"kind": "lognormal", "median_s": 0.5, "p95_s": 2.0},
        "priority_classes": [
            {"name": "interactive", "priority": 0, "weight": 0.5},
            {"name": "batch", "priority": 1, "weight": 0.5},
        ],
        "max_context_tokens": 2048,
    },
    "open_loop": {
        "kind": "open_loop",
        "num_requests": 6,
        "arrival": {"kind": "gamma", "rate_per_s": 4.0, "cv": 2.0},
        "prompt_tokens": {"kind": "fixed", "value": 48},
        "output_tokens": {"kind": "uniform", "low": 2, "high": 6},
        "shared_prefix_tokens": 32,
    },
    "trace": {"kind": "trace", "path": "trace.csv", "hash_block_tokens": 16},
}
TRACE_ROWS = [
    {"timestamp": 0.0, "input_length": 40, "output_length": 4, "session_id": 1, "turn": 0},
    {"timestamp": 0.5, "input_length": 60, "output_length": 3, "hash_ids": "[1, 2]"},
    {"timestamp": 1.0, "input_length": 80, "output_length": 2, "session_id": 1, "turn": 1},
]

# Values that break a field: other types, non-finite and extreme numbers, huge strings.
WRONG_VALUES = st.sampled_from(
    [
        None,
        True,
        "",
        "many",
        "1e3",
        [],
        [1, 2],
        {},
        {"kind": "nope"},
        0,
        -1,
        1 << 63,
        10**30,
        1e308,
        -1e308,
        1e-308,
        math.inf,
        -math.inf,
        math.nan,
        0.5,
        "x" * 100_000,
    ]
)
EXTRA_KEYS = st.sampled_from(["bogus", "kind", "value", "path", "name", "0", "__class__"])
ALIAS_BOMB = (
    'lol0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    + "".join(f"lol{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 9))
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a nested dict/list (the node itself included)."""
    paths = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            paths += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            paths += _paths(value, (*prefix, i))
    return paths


def _parent(root: Any, path: tuple[Any, ...]) -> Any:
    node = root
    for key in path[:-1]:
        node = node[key]
    return node


@st.composite
def mutate_tree(draw: st.DrawFn, tree: Any) -> tuple[Any, tuple[Any, ...] | None]:
    """One structural mutation of a JSON-like tree; returns it and the mutated path."""
    tree = json.loads(json.dumps(tree))
    paths = [p for p in _paths(tree) if p]
    path = draw(st.sampled_from(paths))
    parent = _parent(tree, path)
    action = draw(st.sampled_from(["replace", "replace", "replace", "delete", "extra"]))
    if action == "replace":
        parent[path[-1]] = draw(WRONG_VALUES)
    elif action == "delete":
        del parent[path[-1]]
        if isinstance(parent, list):
            return tree, path[:-1]
    else:
        key = draw(EXTRA_KEYS)
        if isinstance(parent[path[-1]], dict):
            parent[path[-1]][key] = draw(WRONG_VALUES)
            path = (*path, key)
        elif isinstance(parent, dict):
            parent[key] = draw(WRONG_VALUES)
            path = (*path[:-1], key)
        else:
            parent[path[-1]] = draw(WRONG_VALUES)
    return tree, path


@st.composite
def mutate_bytes(draw: st.DrawFn, data: bytes) -> bytes:
    """A file-level mutation: truncation, binary junk, other encodings, BOM."""
    action = draw(
        st.sampled_from(["truncate", "junk", "nul", "latin1", "utf16", "bom", "empty", "huge"])
    )
    text = data.decode()
    if action == "truncate":
        return data[: draw(st.integers(0, max(0, len(data) - 1)))]
    if action == "junk":
        at = draw(st.integers(0, len(data)))
        return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]
    if action == "nul":
        return b"\x00" + data
    if action == "latin1":
        return (text + "# caf\u00e9\n").encode("latin-1")
    if action == "utf16":
        return text.encode("utf-16")
    if action == "bom":
        return b"\xef\xbb\xbf" + data
    if action == "empty":
        return b""
    return data + b"#" * (11 << 20)  # past the 10 MiB limit on config files


@st.composite
def cases(draw: st.DrawFn) -> dict[str, Any]:
    """A scenario, its model config and trace, one of them mutated."""
    kind = draw(st.sampled_from(sorted(WORKLOADS)))
    use_config = draw(st.booleans())
    scenario: dict[str, Any] = {
        "name": "fuzz",
        "seed": draw(st.integers(0, 3)),
        "model": "config.json" if use_config else "Llama-3.1-8B",
        "hardware": HARDWARE if use_config else "H100-SXM-80GB",
        "engine": dict(ENGINE),
        "workload": WORKLOADS[kind],
        "slos": {"ttft_p99_s": 1.0},
        "limits": {"max_duration_s": 60},
    }
    trace_format = draw(st.sampled_from(["csv", "jsonl"]))
    if kind == "trace":
        scenario["workload"] = dict(WORKLOADS["trace"], path=f"trace.{trace_format}")
    targets = ["scenario", "scenario-text", "set"]
    if use_config:
        targets.append("model")
    if kind == "trace":
        targets.append("trace")
    if kind == "agent_sessions":
        targets.append("lengths")
    target = draw(st.sampled_from(targets))
    lengths = b"# output lengths\n4\n8\n12\n"
    args: list[str] = []
    mutated_path: tuple[Any, ...] | None = None
    model: dict[str, Any] | Any = dict(TINY_MODEL)
    rows: list[dict[str, Any]] = [dict(r) for r in TRACE_ROWS]
    raw: dict[str, bytes] = {}
    if target == "scenario":
        scenario, mutated_path = draw(mutate_tree(scenario))
    elif target == "model":
        how = draw(st.sampled_from(["tree", "tree", "whole", "bytes"]))
        if how == "tree":
            model, mutated_path = draw(mutate_tree(model))
        elif how == "whole":
            model = draw(st.sampled_from([42, "llama", [1, 2], None, True, 1.5]))
        else:
            raw["config.json"] = draw(mutate_bytes(json.dumps(model).encode()))
    elif target == "trace":
        how = draw(st.sampled_from(["tree", "tree", "bytes"]))
        if how == "tree":
            rows, mutated_path = draw(mutate_tree(rows))
            mutated_path = mutated_path[1:] if mutated_path else mutated_path
        else:
            raw[f"trace.{trace_format}"] = draw(mutate_bytes(_trace_bytes(rows, trace_format)))
    elif target == "lengths":
        scenario["workload"] = dict(
            scenario["workload"], output_tokens={"kind": "empirical", "path": "lengths.txt"}
        )
        how = draw(st.sampled_from(["bytes", "line"]))
        if how == "bytes":
            lengths = draw(mutate_bytes(lengths))
        else:
            bad = draw(WRONG_VALUES)
            lengths += (json.dumps(bad) if not isinstance(bad, str) else bad).encode() + b"\n"
    elif target == "set":
        paths = [p for p in _paths(scenario) if p and all(isinstance(k, str) for k in p)]
        mutated_path = draw(st.sampled_from(paths))
        value = draw(WRONG_VALUES)
        rendered = yaml.safe_dump(value, default_flow_style=True, width=10**9)
        rendered = rendered.removesuffix("\n...\n").strip()
        args = ["--set", ".".join(mutated_path) + "=" + rendered]
    text = yaml.safe_dump(scenario, sort_keys=False, allow_unicode=True)
    if target == "scenario-text":
        how = draw(st.sampled_from(["bytes", "duplicate", "alias", "bomb"]))
        if how == "bytes":
            raw["scenario.yaml"] = draw(mutate_bytes(text.encode()))
        elif how == "duplicate":
            lines = text.splitlines(keepends=True)
            raw["scenario.yaml"] = "".join([*lines, draw(st.sampled_from(lines))]).encode()
        elif how == "alias":
            # Anchors and aliases: legal YAML, expands to a valid (small) document or to a
            # clear error.
            raw["scenario.yaml"] = (
                text.replace("engine:\n", "engine: &eng\n", 1) + "extra_engine: *eng\n"
            ).encode()
        else:
            raw["scenario.yaml"] = (ALIAS_BOMB + text).encode()
    return {
        "kind": kind,
        "target": target,
        "path": mutated_path,
        "files": {
            "scenario.yaml": raw.get("scenario.yaml", text.encode()),
            "config.json": raw.get("config.json", json.dumps(model).encode()),
            f"trace.{trace_format}": raw.get(
                f"trace.{trace_format}", _trace_bytes(rows, trace_format)
            ),
            "lengths.txt": lengths,
        },
        "args": args,
        "trace_name": f"trace.{trace_format}",
    }


def _trace_bytes(rows: Any, fmt: str) -> bytes:
    if fmt == "jsonl" or not isinstance(rows, list):
        if not isinstance(rows, list):
            return (json.dumps(rows) + "\n").encode()
        return "".join(json.dumps(r) + "\n" for r in rows).encode()
    columns = ["timestamp", "input_length", "output_length", "session_id", "turn", "hash_ids"]
    keys = list(dict.fromkeys(columns + [k for r in rows if isinstance(r, dict) for k in r]))
    lines = [",".join(str(k) for k in keys)]
    for r in rows:
        if not isinstance(r, dict):
            lines.append(str(r))
            continue
        cells = []
        for key in keys:
            value = r.get(key, "")
            text = json.dumps(value) if isinstance(value, list | dict) else str(value)
            cells.append('"' + text.replace('"', '""') + '"' if "," in text else text)
        lines.append(",".join(cells))
    return ("\n".join(lines) + "\n").encode()


class CaseTimeout(Exception):
    """A case ran past CASE_TIMEOUT_S: a hang."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"no result after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


RUNNER = CliRunner()
FIELD_NAMED_EXCEPTIONS = ("not valid YAML", "not valid JSON", "no such file", "binary", "UTF")


def _check_case(case: dict[str, Any], folder: Path) -> None:
    for name, data in case["files"].items():
        (folder / name).write_bytes(data)
    inputs = sorted(case["files"])
    out = folder / "out"
    cwd = os.getcwd()
    os.chdir(folder)  # a run without --out would write runs/ here, not in the checkout
    try:
        with time_limit(CASE_TIMEOUT_S):
            result = RUNNER.invoke(
                app, ["run", "scenario.yaml", *case["args"], "--out", str(out), "--quiet"]
            )
    finally:
        os.chdir(cwd)
    output = result.output
    described = f"case {case['target']} {case['kind']} path={case['path']}: {output[-3000:]}"
    assert not isinstance(result.exception, CaseTimeout), f"hang: {described}"
    assert result.exit_code in (0, 2), (
        f"exit {result.exit_code} ({result.exception!r}): {described}"
    )
    assert "Traceback" not in output, described
    left = sorted(p.name for p in folder.iterdir())
    if result.exit_code == 0:
        STATS["complete"] += 1
        assert left == sorted([*inputs, "out"]), described
        summary = json.loads((out / "summary.json").read_text())
        assert summary["complete"] is True and summary["num_requests"] > 0, described
        return
    STATS["refused"] += 1
    assert left == inputs, f"left behind {left}: {described}"
    message = " ".join(output.split())
    assert message.startswith("error: "), described
    assert "\n" not in output.strip(), f"more than one paragraph: {described}"
    assert len(message) < 3000, f"unbounded message: {described}"
    named = {
        "scenario": "scenario.yaml",
        "scenario-text": "scenario.yaml",
        "set": "scenario.yaml",
        "lengths": "lengths.txt",
    }
    expected_file = named.get(case["target"], "config.json")
    if case["target"] == "trace":
        expected_file = case["trace_name"]
    assert expected_file in message, f"names no file {expected_file}: {described}"
    path = case["path"]
    if path and not any(e in message for e in FIELD_NAMED_EXCEPTIONS):
        keys = [str(k) for k in path if isinstance(k, str)]
        if keys:
            assert any(k in message for k in keys), f"names no field of {path}: {described}"


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
def test_mutated_inputs_run_completely_or_fail_with_one_paragraph(case: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="kvsim-fuzz-") as folder:
        STATS["cases"] += 1
        try:
            _check_case(case, Path(folder))
        except BaseException:
            STATS["broken"] += 1
            raise
