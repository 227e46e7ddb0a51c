"""Scenario files: one YAML document describing a what-if, validated before anything runs.

Parsing reads the file and nothing else: presets are resolved by name, a model given as a
path is resolved relative to the scenario file, and every unknown key is an error naming
its path. ``--set a.b=value`` overrides are applied to the raw document before validation,
so they are checked exactly like the file itself.

Beyond each field's own bounds (:mod:`sim.config.limits`), a scenario is refused when vLLM
0.32 would refuse its engine arguments, with vLLM's reason: a ``block_size`` its CUDA
attention backend cannot page, ``max_num_batched_tokens`` below ``max_num_seqs``, a
``long_prefill_token_threshold`` above ``max_model_len``, or a ``max_model_len`` above the
model's ``max_position_embeddings``. :func:`check_runnable` then does the checks that read
data files or size the KV cache, so that a run fails before it simulates, not after.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from sim.config.engine import EngineConfig
from sim.config.hardware import GIB, Hardware, resolve_hardware
from sim.config.limits import MAX_SECONDS, MAX_SEED, KvsimModel
from sim.config.loading import is_file, load_yaml, read_text
from sim.config.model import ModelGeometry, resolve_model
from sim.config.sizing import (
    KVSizing,
    num_cpu_blocks,
    num_offload_blocks,
    offload_chunk_bytes,
    oversized_override_line,
    size_kv_cache,
)
from sim.errors import KvsimConfigError, format_validation_error, short_repr
from sim.fleet.config import FleetConfig, fleet_what_if
from sim.workload import AgentSessionsWorkload, WorkloadConfig
from sim.workload.distributions import BurstArrivals, EmpiricalLength, shortest
from sim.workload.trace import TraceWorkload

# A scenario's name becomes a directory name: no path separators, no leading dot.
NAME_PATTERN = r"^\w[\w.+-]{0,99}$"
# vLLM's CUDA attention backend (FlashAttention) pages KV in multiples of 16 tokens
# (``get_supported_kernel_block_sizes``: ``MultipleOf(16)``); its CPU backend in multiples of 32.
CUDA_BLOCK_SIZE_MULTIPLE = 16

SCENARIO_DIR = Path(__file__).resolve().parents[1] / "scenarios"
DEFAULT_SCENARIO = SCENARIO_DIR / "coding-agents-8b-h100.yaml"


class Slos(KvsimModel):
    """Latency objectives; a request meets them when each of its latencies is under the bound."""

    ttft_p99_s: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="p99 time to first token bound."
    )
    itl_p99_s: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="p99 inter-token latency bound."
    )
    e2e_p99_s: float | None = Field(
        None, gt=0, le=MAX_SECONDS, description="p99 end-to-end latency bound."
    )


class Limits(KvsimModel):
    """When a run stops even if the workload is not done."""

    max_duration_s: float = Field(
        4 * 3600.0, gt=0, le=MAX_SECONDS, description="Simulated seconds after which the run stops."
    )


class Scenario(KvsimModel):
    """A complete what-if: model, GPU, engine settings, traffic, objectives."""

    name: str = Field(
        pattern=NAME_PATTERN,
        description="Short identifier, used in run directory names: letters, digits, "
        "'_', '.', '+', '-', at most 100, starting with a letter, digit or '_'.",
    )
    description: str = Field("", description="The question this scenario answers.")
    seed: int = Field(0, ge=0, le=MAX_SEED, description="Seed of the run's random generator.")
    model: ModelGeometry = Field(description="Preset name or path to a config.json.")
    hardware: Hardware = Field(description="Preset name or an inline hardware description.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="vLLM settings.")
    workload: WorkloadConfig = Field(description="The traffic (kind: open_loop, ...).")
    slos: Slos = Field(default_factory=Slos, description="Latency objectives for goodput.")
    limits: Limits = Field(default_factory=Limits, description="Run limits.")
    fleet: FleetConfig | None = Field(
        None,
        description="Replicas of this engine behind a router (a what-if); none: one engine.",
    )

    def engine_what_ifs(self) -> list[str]:
        """What one engine of this scenario models that vLLM 0.32 does not run as
        configured, one line each (a summary's ``what_if``): the what-if memory policies and
        a pinned block count beyond the GPU's memory; empty for the vLLM-exact engine."""
        lines = self.engine.what_if_policies()
        if (line := oversized_override_line(self.model, self.hardware, self.engine)) is not None:
            lines.append(line)
        return lines

    def what_ifs(self) -> list[str]:
        """:meth:`engine_what_ifs` and a fleet's router: what a run of this scenario models
        that vLLM 0.32 does not run. The outputs of a search over it (capacity, tune) say
        them."""
        lines = self.engine_what_ifs()
        if self.fleet is not None:
            lines.append(fleet_what_if(self.fleet.replicas, self.fleet.router.kind))
        return lines

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

    @model_validator(mode="after")
    def _check_as_vllm_does(self) -> Scenario:
        """Refuse what vLLM 0.32 refuses at startup, with vLLM's reason."""
        e = self.engine
        if e.block_size % CUDA_BLOCK_SIZE_MULTIPLE:
            raise ValueError(
                f"engine.block_size={e.block_size}: vLLM's CUDA attention backend "
                f"(FlashAttention) only pages KV in multiples of {CUDA_BLOCK_SIZE_MULTIPLE} "
                f'tokens ("No common block size for {e.block_size}"); use 16, 32, 64 or 128'
            )
        if e.max_num_batched_tokens < e.max_num_seqs:
            raise ValueError(
                f"engine.max_num_batched_tokens ({e.max_num_batched_tokens}) must be greater "
                f"than or equal to engine.max_num_seqs ({e.max_num_seqs}), as vLLM requires"
            )
        if e.long_prefill_token_threshold > e.max_model_len:
            raise ValueError(
                f"engine.long_prefill_token_threshold ({e.long_prefill_token_threshold}) "
                f"cannot be greater than engine.max_model_len ({e.max_model_len}), as vLLM "
                "requires"
            )
        limit = self.model.max_position_embeddings
        if limit is not None and e.max_model_len > limit:
            raise ValueError(
                f"engine.max_model_len ({e.max_model_len}) is greater than the derived "
                f"max_model_len (max_position_embeddings={limit} in model {self.model.name}'s "
                "config.json); vLLM refuses it (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, which "
                f"garbles positions past {limit}): lower engine.max_model_len"
            )
        host = self.hardware.host_memory_bytes
        # swap_space_gib is per GPU (V0's --swap-space), kv_offload_gib the engine's.
        for field, gpus in (("swap_space_gib", 1), ("kv_offload_gib", e.tensor_parallel_size)):
            gib = getattr(e, field)
            if host is not None and gib is not None and gib * GIB > host * gpus:
                raise ValueError(
                    f"engine.{field}={gib:g} GiB is more host memory than hardware "
                    f"{self.hardware.name} has for {gpus} GPU(s) ({host * gpus / GIB:g} GiB, "
                    f"host_memory_bytes per GPU): lower engine.{field} or set the "
                    "hardware's host_memory_bytes"
                )
        self.model.check_tensor_parallel(e.tensor_parallel_size)
        return self

    @model_validator(mode="after")
    def _check_memory_policies(self) -> Scenario:
        """Refuse a what-if memory policy that would do nothing here: a CPU swap pool or
        offload store too small for one KV block of this model, KV retention on a workload
        without sessions."""
        e = self.engine
        if e.swap_space_gib is not None or e.kv_offload_gib is not None:
            tp = e.tensor_parallel_size
            bytes_per_block = self.model.kv_bytes_per_token(tp) * e.block_size
            block = f"a {e.block_size}-token block of {self.model.name}"
            if e.swap_space_gib is not None and not num_cpu_blocks(
                e.swap_space_gib, bytes_per_block
            ):
                raise ValueError(
                    f"engine.swap_space_gib={e.swap_space_gib:g} holds 0 KV blocks of "
                    f"{_mib(bytes_per_block)} (one GPU's share of {block}): every preemption "
                    f"would fall back to recompute; set at least {bytes_per_block / GIB!r} GiB "
                    "or use engine.preemption_mode=recompute"
                )
            if e.kv_offload_gib is not None and not num_offload_blocks(
                e.kv_offload_gib, bytes_per_block, tp
            ):
                chunk = offload_chunk_bytes(bytes_per_block, tp)
                raise ValueError(
                    f"engine.kv_offload_gib={e.kv_offload_gib:g} holds 0 KV blocks of "
                    f"{_mib(chunk)} ({block} on {tp} GPU(s), in 4 KiB pages): the store would "
                    f"hold nothing; set at least {chunk / GIB!r} GiB or remove "
                    "engine.kv_offload_gib"
                )
        policy = e.kv_retention.policy
        if policy != "none" and not isinstance(self.workload, AgentSessionsWorkload):
            raise ValueError(
                f"engine.kv_retention.policy={policy} keeps a session's blocks for its next "
                f"turn, but workload.kind={self.workload.kind} has no sessions (only "
                "agent_sessions tells the engine; a trace's session_id and turn do not): it "
                "would retain nothing; use agent_sessions or engine.kv_retention.policy=none"
            )
        return self


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 20):.4g} MiB"


def apply_override(document: dict[str, Any], assignment: str) -> None:
    """Apply one ``dotted.path=value`` override in place; the value is parsed as YAML."""
    path, sep, raw = assignment.partition("=")
    if not sep or not path.strip():
        raise KvsimConfigError(
            f"--set {assignment!r}: expected KEY=VALUE, e.g. engine.max_num_seqs=128"
        )
    keys = [key.strip() for key in path.strip().split(".")]
    if not all(keys):
        raise KvsimConfigError(f"--set {short_repr(assignment)}: empty key in {path.strip()!r}")
    node: Any = document
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise KvsimConfigError(
                f"--set {short_repr(assignment)}: {short_repr(key)} is not a section"
            )
        node = child
    node[keys[-1]] = load_yaml(raw, f"--set {short_repr(assignment)}: value")


def _anchor(value: Any, base_dir: Path) -> Any:
    if isinstance(value, str) and "\x00" not in value and not Path(value).is_absolute():
        try:
            candidate = (base_dir / value).resolve()
            if candidate.exists():
                return str(candidate)
        except (OSError, ValueError, RuntimeError):
            return value
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
    except RecursionError:
        raise KvsimConfigError(f"{source}: nested too deeply to be a scenario") from None


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override and validate a scenario file. Raises KvsimConfigError on bad input."""
    path = Path(path)
    if not is_file(path):
        shipped = [*sorted(SCENARIO_DIR.glob("*.yaml")), *sorted(SCENARIO_DIR.glob("fleet/*.yaml"))]
        known = ", ".join(p.relative_to(SCENARIO_DIR).as_posix() for p in shipped)
        raise KvsimConfigError(
            f"scenario {short_repr(str(path))} is not a file; the shipped scenarios, in "
            f"{SCENARIO_DIR}: {known}"
        )
    document = load_yaml(read_text(path, "scenario"), str(path))
    if document is None:
        document = {}
    for assignment in overrides:
        if not isinstance(document, dict):
            break
        apply_override(document, assignment)
    return parse_scenario(document, str(path), base_dir=path.parent)


def _empirical_lengths(node: Any) -> list[EmpiricalLength]:
    """Every EmpiricalLength inside a workload config."""
    if isinstance(node, EmpiricalLength):
        return [node]
    if isinstance(node, BaseModel):
        return [
            d for name in type(node).model_fields for d in _empirical_lengths(getattr(node, name))
        ]
    if isinstance(node, list | tuple):
        return [d for item in node for d in _empirical_lengths(item)]
    return []


def check_runnable(scenario: Scenario, source: str | None = None) -> KVSizing:
    """Everything that can be checked before simulating, beyond parsing: the KV sizing, the
    data files the workload reads (traces, empirical lengths), and that some request can
    arrive before ``limits.max_duration_s``. Returns the sizing; raises KvsimConfigError whose
    message starts with ``source`` (the scenario file), else the scenario's name."""
    where = source or f"scenario {scenario.name!r}"
    try:
        return _check_runnable(scenario, where)
    except ValueError as exc:
        message = str(exc)
        if not message.startswith(where):
            message = f"{where}: {message}"
        raise KvsimConfigError(message) from None


def _check_first_turn_fits(workload: AgentSessionsWorkload, max_model_len: int, where: str) -> None:
    """Refuse sessions that could never send a turn: the shared prefix, the shortest user
    message and the shortest turn past the context cap (a plain turn's output, or a fan-out
    turn's shortest sub-call: task and output, whichever the workload may draw)."""
    shared = workload.system_prompt_tokens + workload.tool_schema_tokens
    cap = min(max_model_len, workload.max_context_tokens or max_model_len)
    message = shortest(workload.user_message_tokens)
    fanout = workload.fanout
    turns: dict[str, int] = {}  # what a first turn may add past the message, by kind
    if fanout is None or fanout.probability < 1:
        turns["output_tokens"] = shortest(workload.output_tokens)
    if fanout is not None and fanout.probability > 0:
        turns["fanout.task_tokens + fanout.output_tokens"] = shortest(
            fanout.task_tokens
        ) + shortest(fanout.output_tokens)
    name, least = min(turns.items(), key=lambda item: item[1])
    if shared + message + least > cap:
        raise KvsimConfigError(
            f"{where}: workload.system_prompt_tokens + tool_schema_tokens + the shortest "
            f"user_message_tokens + {name} = {shared:,} + {message:,} + {least:,} = "
            f"{shared + message + least:,} tokens do not fit the context cap of {cap:,} "
            f"(engine.max_model_len={max_model_len}"
            + (
                f", workload.max_context_tokens={workload.max_context_tokens}"
                if workload.max_context_tokens is not None
                else ""
            )
            + "): every session would end before its first turn"
        )


def _check_runnable(scenario: Scenario, where: str) -> KVSizing:
    sizing = size_kv_cache(scenario.model, scenario.hardware, scenario.engine)
    workload = scenario.workload
    limit_s = scenario.limits.max_duration_s
    for dist in _empirical_lengths(workload):
        dist.observed()
    first_arrival_s: float | None = None
    what = ""
    if isinstance(workload, TraceWorkload):
        records = workload.replayed()  # never empty: the earliest row arrives at t = 0
        too_long = workload.too_long(scenario.engine.max_model_len)
        if too_long and workload.on_too_long == "error":
            r = too_long[0]
            raise KvsimConfigError(
                f"{workload.path}:{r.line}: input_length {r.input_length} + output_length "
                f"{r.output_length} exceeds engine.max_model_len={scenario.engine.max_model_len} "
                f"({len(too_long)} such rows; workload.on_too_long='skip' drops them)"
            )
        if len(too_long) == len(records):
            raise KvsimConfigError(
                f"{workload.path}: every row exceeds engine.max_model_len="
                f"{scenario.engine.max_model_len}, so workload.on_too_long='skip' leaves none"
            )
    else:
        prefix = getattr(workload, "shared_prefix_tokens", 0)
        if prefix + 2 > scenario.engine.max_model_len:
            raise KvsimConfigError(
                f"{where}: workload.shared_prefix_tokens={prefix} leaves no room for a prompt "
                f"token and an output token within engine.max_model_len="
                f"{scenario.engine.max_model_len}"
            )
        if isinstance(workload, AgentSessionsWorkload):
            _check_first_turn_fits(workload, scenario.engine.max_model_len, where)
        arrival = getattr(workload, "arrival", None) or getattr(workload, "session_arrival", None)
        if isinstance(arrival, BurstArrivals):
            first_arrival_s = arrival.at_s
            what = "the burst's at_s"
    if first_arrival_s is not None and first_arrival_s > limit_s:
        raise KvsimConfigError(
            f"{where}: {what} is {first_arrival_s:,.6g} s, after limits.max_duration_s="
            f"{limit_s:,.6g} s: no request would arrive before the run ends"
        )
    return sizing


def scenario_to_yaml(scenario: Scenario) -> str:
    """The scenario as resolved (presets expanded), as written next to a run's results."""
    document = scenario.model_dump(mode="json")
    if document["fleet"] is None:
        del document["fleet"]  # one engine: the file reads as before fleets existed
    # vLLM's own memory policies are left out: the file reads as before the what-ifs existed.
    engine = document["engine"]
    if engine["kv_retention"]["policy"] == "none":
        del engine["kv_retention"]
    for field, default in VLLM_MEMORY_POLICY:
        if engine[field] == default:
            del engine[field]
    return yaml.safe_dump(document, sort_keys=False)


# Engine fields of the what-if memory policies, at vLLM 0.32's own behaviour.
VLLM_MEMORY_POLICY = (
    ("allocator", "paged"),
    ("preemption_mode", "recompute"),
    ("swap_space_gib", None),
    ("kv_offload_gib", None),
)
