"""validate/gpu_operators.py: Vidur-format operator tables measured with torch.

Marked ``vllm`` because it needs torch, which only the vLLM environment has. The GPU path's
kernel attribution is checked on made-up profiler events; the whole script runs on a CPU with
a tiny layer, alone, as it runs on a GPU box.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.validate.standalone import run_alone
from validate.vidur_tables import read_tables

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).resolve().parents[2] / "validate" / "gpu_operators.py"


@pytest.fixture(scope="module")
def ops() -> Any:
    """The module, imported when a test runs (the fast lane has no torch)."""
    from validate import gpu_operators

    return gpu_operators


class _Event:
    """What the script reads of a kineto event."""

    def __init__(self, name: str, on_gpu: bool, start: int, duration: int) -> None:
        import torch

        kind = torch.autograd.DeviceType
        self._name, self._start, self._duration = name, start, duration
        self._device = kind.CUDA if on_gpu else kind.CPU

    def name(self) -> str:
        return self._name

    def device_type(self) -> Any:
        return self._device

    def start_ns(self) -> int:
        return self._start

    def end_ns(self) -> int:
        return self._start + self._duration

    def duration_ns(self) -> int:
        return self._duration


def _timeline() -> list[_Event]:
    return [
        _Event("kvop|8|mlp_up_proj|0", False, 0, 50),  # the CPU side of the range
        _Event("aten::mm", False, 5, 40),
        _Event("warm-up gemm", True, 90, 10),  # before any range: no operator's
        _Event("kvop|8|mlp_up_proj|0", True, 100, 30),  # the GPU side: spans its kernels
        _Event("void gemm<128, 8>(Params)", True, 100, 20),
        _Event("void splitKreduce_kernel<32>(P)", True, 125, 5),
        _Event("kvop|8|mlp_up_proj|1", True, 140, 22),
        _Event("void gemm<128, 8>(Params)", True, 140, 22),
        _Event("kvop|8|add|0", True, 170, 3),
        _Event("triton_poi_fused_add_0", True, 170, 3),
    ]


def test_gpu_kernels_are_attributed_to_the_range_that_spans_them(ops: Any) -> None:
    times, kernels = ops.attribute(_timeline(), on_cuda=True)
    assert times == {(8, "mlp_up_proj"): [25e-6, 22e-6], (8, "add"): [3e-6]}  # ms
    assert kernels == {
        (8, "mlp_up_proj"): "gemm+splitKreduce_kernel",
        (8, "add"): "triton_poi_fused_add_0",
    }


def test_without_gpu_side_ranges_the_attribution_says_so(ops: Any) -> None:
    """(the script then falls back to torch's slower event tree)"""
    cpu_only = [event for event in _timeline() if not event.name().startswith("kvop|")]
    assert ops.attribute(cpu_only, on_cuda=True) is None


def test_on_a_cpu_a_range_is_its_own_time(ops: Any) -> None:
    times, kernels = ops.attribute(_timeline(), on_cuda=False)
    assert times == {(8, "mlp_up_proj"): [50e-6]}
    assert kernels == {}


def test_kernel_names_lose_templates_and_signatures(ops: Any) -> None:
    assert ops.kernel_name("void cublasLt::splitKreduce_kernel<32, 16>(P)") == (
        "cublasLt::splitKreduce_kernel"
    )
    assert ops.kernel_name("nvjet_sm90_hsh_128x8_64x12_4x1_v_bz_TNT") == (
        "nvjet_sm90_hsh_128x8_64x12_4x1_v_bz_TNT"
    )
    assert ops.kernel_name("Memset (Device)") == "Memset"


def test_the_token_grid_is_vidurs(ops: Any) -> None:
    counts = ops.vidur_token_counts()
    assert counts[:5] == [1, 2, 4, 8, 16]
    assert counts[-3:] == [4032, 4064, 4096]
    assert len(counts) == 227
    assert ops.vidur_token_counts(100)[-1] == 96


def test_the_script_runs_alone_and_writes_tables_kvsim_reads(tmp_path: Path) -> None:
    """Copied alone into an empty folder (what goes onto a GPU box), run on a CPU with a tiny
    layer: imports nothing of kvsim, writes a Vidur-format table per model that
    ``validate.vidur_tables`` reads, the GEMMs' kernel list and the run's metadata."""
    out = tmp_path / "out"
    argv = ["--out", str(out), "--device", "cpu", "--models", "test/tiny", "--tp", "1,2"]
    argv += ["--max-tokens", "8", "--repeats", "2", "--warmup", "1", "--gpu-name", "tinygpu"]
    last, stderr = run_alone(tmp_path, ("gpu_operators.py",), argv)
    assert last == "exit 0 kvsim []", stderr
    tables = read_tables(out, "tinygpu")
    layers = tables.layers
    assert sorted(layers["num_tokens"].unique()) == [1, 2, 4, 8]
    assert sorted(layers["num_tensor_parallel_workers"].unique()) == [1, 2]
    assert len(layers) == 8
    assert (layers[["attn_pre_proj", "mlp_up_proj", "input_layernorm", "emb"]] > 0).all().all()
    kernels = (out / "gemm_kernels.csv").read_text().splitlines()
    assert kernels[0] == "model,tp,num_tokens,op,median_ms,kernels"
    assert len(kernels) == 1 + 8 * 4  # a row per GEMM point
    assert '"elementwise": "eager"' in (out / "meta.json").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "--device 'tpu' must be 'cuda' or 'cpu'"),
        (["--device", "cpu", "--tp", "1,x"], "--tp '1,x': a comma list of TP degrees"),
        (["--device", "cpu", "--tp", "0"], "--tp 0: must be 1 or more"),
        (["--device", "cpu", "--max-tokens", "0"], "--max-tokens 0: must be 1 or more"),
        (["--device", "cpu", "--repeats", "0"], "--repeats 0 / --warmup 2: need 1+ / 0+"),
        (["--device", "cpu", "--models", "x/y"], "--models: unknown 'x/y'"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    tmp_path: Path, argv: list[str], message: str
) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path / "x"), *argv],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert message in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "x").exists()
