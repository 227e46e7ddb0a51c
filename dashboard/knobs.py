"""The What-if page's knobs: which apply to a scenario document, their current values, and
the ``--set``-style overrides that turn edited values into a new scenario (pure, no Streamlit).

Overrides go through :func:`sim.scenario.apply_override` on the raw YAML document and are then
validated by :func:`sim.scenario.parse_scenario`, exactly like ``kvsim run --set``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.config.engine import EngineConfig
from sim.config.hardware import HARDWARE_PRESETS
from sim.config.model import MODEL_PRESETS
from sim.config.retention import READS, RetentionConfig
from sim.scenario import Scenario, apply_override, parse_scenario

RATED_ARRIVALS = ("poisson", "gamma")


@dataclass(frozen=True)
class Knob:
    """One editable field: dotted path into the scenario document, widget kind and range."""

    path: str
    label: str
    kind: str  # select | int | float | bool
    default: Any
    options: tuple[Any, ...] = ()
    min_value: float | None = None
    max_value: float | None = None
    step: float | None = None
    help: str | None = None
    # Set only together with another knob's value: (that knob's path, the values it needs),
    # e.g. swap_space_gib only with preemption_mode=swap. A ``required`` field is written
    # whenever that value is picked and the document does not hold it yet; the field is
    # cleared (set to ``cleared``) when another value is picked.
    only_with: tuple[str, tuple[Any, ...]] | None = None
    in_document: bool = True
    cleared: Any = None  # what clears the field (its unset value)
    required: bool = False  # the only_with value needs this field (no default to fall back on)
    zero_unsets: bool = False  # a float whose 0 means "unset" (e.g. no CPU offload tier)


def get_path(document: dict[str, Any], path: str, default: Any = None) -> Any:
    node: Any = document
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def _engine_default(name: str) -> Any:
    return EngineConfig.model_fields[name].default


def _engine_knob(document: dict[str, Any], name: str, label: str, kind: str, **kw) -> Knob:
    field = EngineConfig.model_fields[name]
    value = get_path(document, f"engine.{name}", _engine_default(name))
    return Knob(f"engine.{name}", label, kind, value, help=field.description, **kw)


# What a newly picked swap space starts at in the form (vLLM V0's --swap-space default was 4).
SWAP_SPACE_GIB_SHOWN = 4.0


def policy_knobs(document: dict[str, Any]) -> list[Knob]:
    """The memory-policy what-ifs: allocator, preemption mode and the swap space it needs,
    the CPU offload tier, KV retention."""
    allocators = ("paged", "static", "orca_max", "orca_pow2", "orca_oracle")
    swap_space = get_path(document, "engine.swap_space_gib")
    return [
        _engine_knob(document, "allocator", "KV allocator (what-if)", "select", options=allocators),
        _engine_knob(
            document, "preemption_mode", "preemption (swap: what-if)", "select",
            options=("recompute", "swap"),
        ),
        Knob(
            "engine.swap_space_gib", "swap space (GiB)", "float",
            SWAP_SPACE_GIB_SHOWN if swap_space is None else swap_space,
            min_value=0.001, step=1.0,
            help=EngineConfig.model_fields["swap_space_gib"].description,
            only_with=("engine.preemption_mode", ("swap",)), in_document=swap_space is not None,
            required=True,
        ),
        Knob(
            "engine.kv_offload_gib", "CPU offload tier (GiB, 0 = none; what-if)", "float",
            float(get_path(document, "engine.kv_offload_gib") or 0.0), min_value=0.0, step=8.0,
            help=EngineConfig.model_fields["kv_offload_gib"].description, zero_unsets=True,
        ),
        *_retention_knobs(document),
    ]  # fmt: skip


def _retention_knobs(document: dict[str, Any]) -> list[Knob]:
    """KV retention during tool waits: the policy and the setting each policy reads (every
    field has a default, so a knob left alone writes nothing)."""
    fields = RetentionConfig.model_fields

    def knob(name: str, label: str, kind: str, **kw: Any) -> Knob:
        path = f"engine.kv_retention.{name}"
        value = get_path(document, path, fields[name].default)
        if name != "policy":  # written only with a policy that reads it (READS)
            policies = tuple(p for p, reads in READS.items() if name in reads)
            kw |= {
                "only_with": ("engine.kv_retention.policy", policies),
                "in_document": get_path(document, path) is not None,
                "cleared": fields[name].default,
            }
        return Knob(path, label, kind, value, help=fields[name].description, **kw)

    return [
        knob("policy", "KV retention (what-if)", "select",
             options=("none", "ttl", "tool_latency", "free_floor")),
        knob("ttl_s", "retention TTL (s; ttl, free_floor)", "float", min_value=0.0, step=5.0),
        knob("quantile", "tool-latency quantile (tool_latency)", "float",
             min_value=0.01, max_value=0.99, step=0.05),
        knob("free_floor", "free-block floor (free_floor)", "float",
             min_value=0.0, max_value=0.99, step=0.05),
    ]  # fmt: skip


def _select(value: Any, presets: list[str]) -> tuple[Any, ...]:
    return tuple(presets if value in presets else [value, *presets])


def knobs_for(document: dict[str, Any]) -> list[Knob]:
    """The knobs that apply to this document (workload knobs depend on its kind)."""
    model = document.get("model")
    hardware = document.get("hardware")
    knobs = []
    if isinstance(model, str):
        knobs.append(Knob("model", "model", "select", model, _select(model, list(MODEL_PRESETS))))
    if isinstance(hardware, str):
        options = _select(hardware, list(HARDWARE_PRESETS))
        knobs.append(Knob("hardware", "GPU", "select", hardware, options))
    knobs += [
        _engine_knob(document, "tensor_parallel_size", "tensor parallel size", "int", min_value=1),
        _engine_knob(
            document, "block_size", "block size (tokens)", "select",
            options=_select(get_path(document, "engine.block_size", 16), [16, 32, 64, 128]),
        ),
        _engine_knob(
            document, "gpu_memory_utilization", "gpu_memory_utilization", "float",
            min_value=0.05, max_value=1.0, step=0.01,
        ),
        _engine_knob(
            document, "max_num_batched_tokens", "max_num_batched_tokens", "int", min_value=1,
            step=256,
        ),
        _engine_knob(document, "max_num_seqs", "max_num_seqs", "int", min_value=1, step=8),
        _engine_knob(document, "enable_prefix_caching", "prefix caching", "bool"),
        _engine_knob(
            document, "scheduling_policy", "scheduling policy", "select",
            options=("fcfs", "priority"),
        ),
    ]  # fmt: skip
    knobs += policy_knobs(document)
    workload = document.get("workload") or {}
    kind = workload.get("kind") if isinstance(workload, dict) else None
    count, arrival = {
        "agent_sessions": ("sessions", "session_arrival"),
        "open_loop": ("num_requests", "arrival"),
    }.get(kind, (None, None))
    if count is not None:
        label = "agent sessions" if count == "sessions" else "requests"
        value = get_path(document, f"workload.{count}", 1)
        knobs.append(Knob(f"workload.{count}", label, "int", value, min_value=1, step=10))
    if arrival is not None and get_path(document, f"workload.{arrival}.kind") in RATED_ARRIVALS:
        rate = get_path(document, f"workload.{arrival}.rate_per_s", 1.0)
        unit = "sessions" if count == "sessions" else "requests"
        knobs.append(
            Knob(
                f"workload.{arrival}.rate_per_s",
                f"arrival rate ({unit}/s)",
                "float",
                float(rate),
                min_value=0.001,
                step=0.05,
                help="Mean arrivals per second of the scenario's arrival process.",
            )
        )
    # A value of the wrong type in the file gets no widget: validation reports it on run.
    return [k for k in knobs if _fits(k)]


def _fits(knob: Knob) -> bool:
    value = knob.default
    if knob.kind == "bool":
        return isinstance(value, bool)
    if knob.kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if knob.kind == "float":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return value in knob.options


def yaml_value(value: Any) -> str:
    """A value as the right-hand side of ``--set`` (parsed as YAML; JSON scalars are YAML)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return json.dumps(value) if isinstance(value, str) else str(value)


def build_overrides(knobs: list[Knob], values: dict[str, Any]) -> list[str]:
    """``path=value`` for every knob whose edited value differs from the document's."""
    out = []
    for knob in knobs:
        if knob.path not in values:
            continue
        value = values[knob.path]
        if knob.only_with is not None:
            path, needs = knob.only_with
            if values.get(path) not in needs:
                # e.g. no swap space while preempting by recompute: drop the file's value.
                if knob.in_document and knob.default != knob.cleared:
                    out.append(f"{knob.path}={yaml_value(knob.cleared)}")
                continue
            if knob.required and not knob.in_document:
                out.append(f"{knob.path}={yaml_value(value)}")
                continue
        if value != knob.default:
            written = None if knob.zero_unsets and value == 0 else value
            out.append(f"{knob.path}={yaml_value(written)}")
    return out


def scenario_from(
    document: dict[str, Any], overrides: list[str], source: str, base_dir: Path | None
) -> Scenario:
    """Apply the overrides to a copy of the raw document and validate it (KvsimConfigError)."""
    doc = copy.deepcopy(document)
    for assignment in overrides:
        apply_override(doc, assignment)
    return parse_scenario(doc, source, base_dir=base_dir)


def question(text: str) -> str:
    """The leading comment block of a scenario file (its question), without the ``#``."""
    lines = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    text = " ".join(lines).removeprefix("Question:").strip()
    return text[:1].upper() + text[1:]
