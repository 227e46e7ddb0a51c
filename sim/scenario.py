"""Scenario files: one YAML document describing a what-if, validated before anything runs.

Parsing reads the file and nothing else: presets are resolved by name, a model given as a
path is resolved relative to the scenario file, and every unknown key is an error naming
its path. ``--set a.b=value`` overrides are applied to the raw document before validation,
so they are checked exactly like the file itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sim.config.engine import EngineConfig
from sim.config.hardware import Hardware, resolve_hardware
from sim.config.model import ModelGeometry, resolve_model
from sim.errors import KvsimConfigError, format_validation_error
from sim.workload import WorkloadConfig

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"
DEFAULT_SCENARIO = SCENARIO_DIR / "coding-agents-8b-h100.yaml"


class Slos(BaseModel):
    """Latency objectives; a request meets them when each of its latencies is under the bound."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_p99_s: float | None = Field(None, gt=0, description="p99 time to first token bound.")
    itl_p99_s: float | None = Field(None, gt=0, description="p99 inter-token latency bound.")
    e2e_p99_s: float | None = Field(None, gt=0, description="p99 end-to-end latency bound.")


class Limits(BaseModel):
    """When a run stops even if the workload is not done."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_duration_s: float = Field(
        4 * 3600.0, gt=0, description="Simulated seconds after which the run stops."
    )


class Scenario(BaseModel):
    """A complete what-if: model, GPU, engine settings, traffic, objectives."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="Short identifier, used in run directory names.")
    description: str = Field("", description="The question this scenario answers.")
    seed: int = Field(0, description="Seed of the run's random generator.")
    model: ModelGeometry = Field(description="Preset name or path to a config.json.")
    hardware: Hardware = Field(description="Preset name or an inline hardware description.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM settings.")
    workload: WorkloadConfig = Field(description="The traffic (kind: open_loop, ...).")
    slos: Slos = Field(default_factory=Slos, description="Latency objectives for goodput.")
    limits: Limits = Field(default_factory=Limits, description="Run limits.")

    @field_validator("model", mode="before")
    @classmethod
    def _resolve_model(cls, value: Any) -> Any:
        if isinstance(value, str):
            return resolve_model(value)
        return value

    @field_validator("hardware", mode="before")
    @classmethod
    def _resolve_hardware(cls, value: Any) -> Any:
        if isinstance(value, str):
            return resolve_hardware(value)
        return value


def apply_override(document: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.path=value`` override in place; the value is parsed as YAML."""
    path, sep, raw = assignment.partition("=")
    if not sep or not path.strip():
        raise KvsimConfigError(
            f"--set {assignment!r}: expected KEY=VALUE, e.g. engine.max_num_seqs=128"
        )
    keys = path.strip().split(".")
    node: Any = document
    for key in keys[:-1]:
        child = node.get(key) if isinstance(node, dict) else None
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise KvsimConfigError(f"--set {assignment!r}: {key!r} is not a section")
        node = child
    try:
        node[keys[-1]] = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise KvsimConfigError(f"--set {assignment!r}: value is not valid YAML ({exc})") from None


def _anchor(value: Any, base_dir: Path) -> Any:
    if isinstance(value, str) and not Path(value).is_absolute():
        candidate = (base_dir / value).resolve()
        if candidate.exists():
            return str(candidate)
    return value


def _anchor_paths(document: dict[str, Any], base_dir: Path) -> None:
    """Resolve relative file paths (model config.json, traces, empirical lengths) against
    the scenario's folder, so a scenario runs the same from any working directory."""
    model = document.get("model")
    if isinstance(model, str) and ("/" in model or model.endswith(".json")):
        document["model"] = _anchor(model, base_dir)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: _anchor(v, base_dir) if k == "path" else walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    if "workload" in document:
        document["workload"] = walk(document["workload"])


def parse_scenario(document: dict[str, Any], source: str, base_dir: Path | None = None) -> Scenario:
    """Validate a scenario document; ``base_dir`` anchors relative model and data paths."""
    if not isinstance(document, dict):
        raise KvsimConfigError(
            f"{source}: a scenario is a YAML mapping, got {type(document).__name__}"
        )
    document = dict(document)
    if base_dir is not None:
        _anchor_paths(document, base_dir)
    try:
        return Scenario.model_validate(document)
    except ValidationError as exc:
        raise KvsimConfigError(format_validation_error(exc, source)) from None
    except ValueError as exc:  # raised by preset resolution outside pydantic's wrapping
        raise KvsimConfigError(f"{source}: {exc}") from None


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override and validate a scenario file. Raises KvsimConfigError on bad input."""
    path = Path(path)
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in SCENARIO_DIR.glob("*.yaml")))
        raise KvsimConfigError(f"scenario {str(path)!r} is not a file; shipped scenarios: {known}")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise KvsimConfigError(f"{path}: not valid YAML: {exc}") from None
    if document is None:
        document = {}
    for assignment in overrides:
        if not isinstance(document, dict):
            break
        apply_override(document, assignment)
    return parse_scenario(document, str(path), base_dir=path.parent)


def scenario_to_yaml(scenario: Scenario) -> str:
    """The scenario as resolved (presets expanded), as written next to a run's results."""
    return yaml.safe_dump(scenario.model_dump(mode="json"), sort_keys=False)
