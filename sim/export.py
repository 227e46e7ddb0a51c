"""A scenario's engine config as the files an operator deploys.

Three formats, all built from one mapping of kvsim's engine fields to vLLM's engine
arguments (:func:`engine_args`, the same names and meaning as vLLM's ``EngineArgs``):

- ``vllm-args``: the ``vllm serve MODEL --flag value ...`` command line;
- ``vllm-yaml``: a YAML file for ``vllm serve MODEL --config FILE`` (keys are the long
  option names, as vLLM's ``FlexibleArgumentParser.load_config_file`` reads them);
- ``triton``: a Triton Inference Server model repository for the vLLM backend:
  ``<name>/config.pbtxt`` (``backend: "vllm"``, the decoupled transaction policy that
  token streaming needs, Triton's batching off) and ``<name>/1/model.json`` (the engine
  arguments, which the backend passes to ``AsyncEngineArgs(**model_json)``).

Every engine setting the simulation used is written out, also where it equals vLLM's
default, so the deployed engine runs the config that was simulated; that includes the
model's ``dtype`` (vLLM's ``auto`` would run a float32 checkpoint in 16 bits) and
``async_scheduling`` off, the synchronous scheduler kvsim models (vLLM 0.32 turns async
scheduling on by default on CUDA). The model is the preset's hub
repository (same geometry; pass ``model=`` for your own checkpoint), or the folder of a
local ``config.json``. What the results depend on but no engine argument carries (a fleet's
replicas and router, the per-request priorities of the priority policy) goes in comments
(:func:`deployment_notes`); the engine config itself is refused where vLLM could not start
it (a ``num_gpu_blocks_override`` beyond the GPU's memory).
"""

from __future__ import annotations

import json
import shlex
import textwrap
from pathlib import Path
from typing import Any, Literal

import yaml

from sim.config.sizing import size_deployable_kv_cache
from sim.console import note
from sim.errors import KvsimConfigError
from sim.files import write_atomic, write_new_folder
from sim.scenario import Scenario

ExportFormat = Literal["vllm-args", "vllm-yaml", "triton"]
FORMATS: tuple[str, ...] = ("vllm-args", "vllm-yaml", "triton")

# Comment lines of the exported files are wrapped at this width.
NOTE_WIDTH = 88

# The hub repository of each model preset (sim.config.model.MODEL_PRESETS): the base model
# whose config.json the preset's geometry was copied from.
PRESET_REPOS: dict[str, str] = {
    "Llama-3.1-8B": "meta-llama/Llama-3.1-8B",
    "Llama-3.1-70B": "meta-llama/Llama-3.1-70B",
    "Qwen2.5-7B": "Qwen/Qwen2.5-7B",
    "Qwen2.5-32B": "Qwen/Qwen2.5-32B",
    "Mistral-7B": "mistralai/Mistral-7B-v0.3",
    "Llama-2-13B": "meta-llama/Llama-2-13b-hf",
}


def served_model(scenario: Scenario, model: str | None = None) -> str:
    """What ``vllm serve`` loads: ``model`` if given, the local config's folder, or the
    preset's hub repository."""
    if model is not None and not model.strip():
        raise KvsimConfigError("--model '': give the hub name or path vLLM should load")
    if model:
        return model
    if scenario.model.source_path:
        return str(Path(scenario.model.source_path).parent)
    repo = PRESET_REPOS.get(scenario.model.name)
    if repo is None:
        raise KvsimConfigError(
            f"scenario {scenario.name!r}: model {scenario.model.name!r} has no known hub "
            "repository; pass --model with the name or path vLLM should load"
        )
    return repo


def engine_args(scenario: Scenario) -> dict[str, Any]:
    """The scenario's engine settings as vLLM ``EngineArgs`` fields (same names, same
    meaning), in a stable order; the one mapping of the exports and of ``kvsim replay``.
    ``dtype`` is the model's, the one kvsim sized weights and KV in (the KV cache follows
    it: vLLM's ``kv_cache_dtype`` auto); ``num_gpu_blocks_override`` only when the scenario
    pins the block count; a CPU offload tier as ``kv_offloading_size`` (vLLM's native
    backend). A what-if memory policy vLLM 0.32 lacks (swap, a non-paged allocator,
    retention) is refused: vLLM 0.32 would run without it and the deployment would not be
    the simulated one."""
    e = scenario.engine
    if what_if := e.policies_vllm_lacks():
        raise KvsimConfigError(
            f"scenario {scenario.name!r}: engine: {'; '.join(what_if)}: vLLM 0.32 has no such "
            "policy, so an export would deploy a different engine than the one simulated; "
            "drop the policy to export"
        )
    args: dict[str, Any] = {
        # vLLM's default "auto" runs a float32 checkpoint in bfloat16/float16 on a GPU,
        # while kvsim sized its weights and KV at 4 bytes.
        "dtype": scenario.model.dtype,
        "block_size": e.block_size,
        "gpu_memory_utilization": e.gpu_memory_utilization,
        "tensor_parallel_size": e.tensor_parallel_size,
        "max_model_len": e.max_model_len,
        "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens,
        "enable_chunked_prefill": e.enable_chunked_prefill,
        "long_prefill_token_threshold": e.long_prefill_token_threshold,
        "enable_prefix_caching": e.enable_prefix_caching,
        "scheduling_policy": e.scheduling_policy,
        "watermark": e.watermark,
        # kvsim simulates (and validates against) vLLM's synchronous scheduler; vLLM 0.32
        # turns async scheduling on by default on CUDA, which overlaps steps differently.
        "async_scheduling": False,
    }
    if e.num_gpu_blocks_override is not None:
        args["num_gpu_blocks_override"] = e.num_gpu_blocks_override
    if e.kv_offload_gib is not None:
        args["kv_offloading_size"] = e.kv_offload_gib
        args["kv_offloading_backend"] = "native"
    return args


def check_deployable(scenario: Scenario) -> None:
    """Refuse (``KvsimConfigError``) a config vLLM could not start on the simulated GPU: the
    weights do not fit, or a ``num_gpu_blocks_override`` needs more memory than is left for
    the KV cache (:func:`~sim.config.sizing.size_deployable_kv_cache`). Every export format
    checks it; a CPU replay does not need it (``kvsim replay`` gives vLLM's CPU backend the
    KV space the blocks need)."""
    try:
        size_deployable_kv_cache(scenario.model, scenario.hardware, scenario.engine)
    except ValueError as exc:
        raise KvsimConfigError(f"scenario {scenario.name!r}: {exc}") from None


def deployed_engine_args(scenario: Scenario) -> dict[str, Any]:
    """:func:`engine_args` of a config vLLM can start (:func:`check_deployable`)."""
    args = engine_args(scenario)
    check_deployable(scenario)
    return args


def _provenance(scenario: Scenario) -> str:
    e = scenario.engine
    line = (
        f"vLLM engine config from kvsim scenario {scenario.name!r}, simulated on "
        f"{e.tensor_parallel_size} x {scenario.hardware.name}"
    )
    if scenario.fleet is not None:
        replicas = scenario.fleet.replicas
        line += f" per replica, {replicas} replica{'s' if replicas != 1 else ''}"
    return line


def _priority_classes(scenario: Scenario) -> str:
    """The priorities the simulated clients sent, as a phrase."""
    workload = scenario.workload
    classes = getattr(workload, "priority_classes", None)
    if classes is None:  # a trace: each row's own priority column
        return f"each row's priority in the trace {Path(workload.path).name} (rows without: 0)"
    total = sum(c.weight for c in classes)
    unit = "sessions" if workload.kind == "agent_sessions" else "requests"
    shares = [
        f"{c.priority} for {c.name} ({c.weight / total:.0%}{f' of the {unit}' if i == 0 else ''})"
        for i, c in enumerate(classes)
    ]
    return ", ".join(shares)


def _fleet_note(scenario: Scenario) -> list[str]:
    if (fleet := scenario.fleet) is None:
        return []
    router = fleet.router.model_dump(mode="json")
    kind = router.pop("kind")
    settings = ", ".join(
        f"{name}={'none' if value is None else value}" for name, value in router.items()
    )
    replicas = f"{fleet.replicas} replica{'s' if fleet.replicas != 1 else ''}"
    return [
        f"kvsim simulated {replicas} of this engine behind a {kind} router "
        f"({settings}), a what-if: vLLM 0.32 serves one engine, and the router was kvsim's "
        f"model of one. This is one replica's engine config: run {fleet.replicas} engines "
        f"with it and deploy a {kind} router in front of them yourself (e.g. llm-d or vLLM "
        "production-stack); the simulated results depend on that router."
    ]


def deployment_notes(scenario: Scenario) -> list[str]:
    """What the simulated results depend on that no engine argument carries, one paragraph
    each (none for one engine under FCFS): a fleet's replica count and router (vLLM serves
    one engine; the router is the user's to deploy), and, under the priority policy, the
    per-request priority the clients must send (for ``vllm serve``; Triton's backend sends
    none: :func:`triton_warnings`)."""
    notes = _fleet_note(scenario)
    if scenario.engine.scheduling_policy == "priority":
        notes.append(
            "scheduling_policy priority: clients must send each request's priority (the "
            "'priority' field of vLLM's OpenAI-compatible API; a lower value is served "
            f"first, default 0), as simulated: {_priority_classes(scenario)}. Requests "
            "sent without one all run at priority 0, first come first served."
        )
    return notes


def triton_warnings(scenario: Scenario) -> list[str]:
    """Where a Triton deployment cannot run what was simulated, one paragraph each: the
    priority policy, as Triton's vLLM backend passes no per-request priority."""
    if scenario.engine.scheduling_policy != "priority":
        return []
    return [
        "scheduling_policy priority, but Triton's vLLM backend passes no per-request "
        "priority to the engine (it calls generate without one), so every request runs at "
        "priority 0 and the engine serves them first come first served: the priority "
        f"classes kvsim simulated ({_priority_classes(scenario)}) do not apply, nor do its "
        "results for them. Deploy with vllm serve (--format vllm-args or vllm-yaml) to "
        "keep them."
    ]


def _comments(paragraphs: list[str]) -> str:
    """``paragraphs`` as ``#`` comment lines, wrapped, each line ending in a newline."""
    lines = [
        "# " + line
        for text in paragraphs
        for line in textwrap.wrap(text, NOTE_WIDTH - 2, break_on_hyphens=False)
    ]
    return "".join(line + "\n" for line in lines)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def serve_argv(scenario: Scenario, model: str | None = None) -> list[str]:
    """``vllm serve`` and its arguments, one list item per shell word."""
    argv = ["vllm", "serve", served_model(scenario, model)]
    for name, value in deployed_engine_args(scenario).items():
        if isinstance(value, bool):
            # vLLM declares these with argparse.BooleanOptionalAction: --x / --no-x.
            argv.append(_flag(name) if value else "--no-" + _flag(name)[2:])
        else:
            argv += [_flag(name), str(value)]
    return argv


def serve_command(scenario: Scenario, model: str | None = None) -> str:
    """The ``vllm serve`` command line, quoted for a POSIX shell, after the
    :func:`deployment_notes` as ``#`` comment lines when there are any."""
    argv = serve_argv(scenario, model)
    return _comments(deployment_notes(scenario)) + shlex.join(argv)


def serve_yaml(scenario: Scenario, model: str | None = None) -> str:
    """A config file for ``vllm serve --config``; the model is named in its first line."""
    keys = {name.replace("_", "-"): value for name, value in deployed_engine_args(scenario).items()}
    head = (
        f"# {_provenance(scenario)}\n"
        f"# usage: vllm serve {shlex.quote(served_model(scenario, model))} --config THIS_FILE\n"
    )
    return head + _comments(deployment_notes(scenario)) + yaml.safe_dump(keys, sort_keys=False)


def triton_model_json(scenario: Scenario, model: str | None = None) -> dict[str, Any]:
    """``model.json`` of Triton's vLLM backend: ``AsyncEngineArgs`` keyword arguments."""
    return {"model": served_model(scenario, model), **deployed_engine_args(scenario)}


def triton_config_pbtxt(name: str, scenario: Scenario) -> str:
    """``config.pbtxt`` for Triton's vLLM backend. One instance of kind KIND_MODEL: the
    engine places itself on its ``tensor_parallel_size`` GPUs (KIND_GPU is single-GPU).
    A fleet's note (:func:`deployment_notes`) and the :func:`triton_warnings` open it as
    comments (``model.json`` is JSON: no comments)."""
    warnings = ["WARNING: " + text for text in triton_warnings(scenario)]
    return _comments([*warnings, *_fleet_note(scenario)]) + (
        f'name: "{name}"\n'
        'backend: "vllm"\n'
        "# vLLM batches on its own: Triton's batching is off.\n"
        "max_batch_size: 0\n"
        "# Token streaming needs the decoupled transaction policy.\n"
        "model_transaction_policy {\n  decoupled: true\n}\n"
        'input [\n  { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },\n'
        '  { name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true },\n'
        '  { name: "sampling_parameters" data_type: TYPE_STRING dims: [ 1 ] optional: true }\n'
        "]\n"
        'output [\n  { name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }\n]\n'
        f"# tensor_parallel_size={scenario.engine.tensor_parallel_size}: the engine takes "
        "its GPUs itself.\n"
        "instance_group [\n  {\n    count: 1\n    kind: KIND_MODEL\n  }\n]\n"
    )


def triton_model_name(scenario: Scenario) -> str:
    """A Triton model name from the scenario's name: letters, digits, ``-`` and ``_``."""
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in scenario.name).strip("_")
    return name or "kvsim_model"


def export(scenario: Scenario, fmt: str, out: Path, model: str | None = None) -> list[Path]:
    """Write ``scenario``'s engine config to ``out`` in ``fmt``; returns the files written.

    ``vllm-args`` and ``vllm-yaml`` write one file at ``out``; ``triton`` writes a model
    repository under the folder ``out`` and prints its :func:`triton_warnings` to stderr.
    Never overwrites: an existing ``out`` is an error.
    """
    if fmt not in FORMATS:
        raise KvsimConfigError(f"--format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if out.exists():
        raise FileExistsError(f"--out {out}: already exists; kvsim never overwrites an export")
    if fmt == "vllm-yaml" and out.suffix not in (".yaml", ".yml"):
        raise KvsimConfigError(
            f"--out {out}: vllm serve --config reads only .yaml or .yml files; name it so"
        )
    # Each output appears whole or not at all (written aside, renamed into place): a failed
    # write leaves nothing that would block the rerun.
    if fmt == "vllm-args":
        text = f"#!/bin/sh\n# {_provenance(scenario)}\n"
        # A script: executable.
        return [write_atomic(out, text + serve_command(scenario, model) + "\n", executable=True)]
    if fmt == "vllm-yaml":
        return [write_atomic(out, serve_yaml(scenario, model))]
    name = triton_model_name(scenario)
    # Built before anything is written: a refused config leaves no half repository.
    files = {
        f"{name}/config.pbtxt": triton_config_pbtxt(name, scenario),
        f"{name}/1/model.json": json.dumps(triton_model_json(scenario, model), indent=2) + "\n",
    }
    written = write_new_folder(out, files)
    for warning in triton_warnings(scenario):
        note(f"warning: {warning}")
    return written
