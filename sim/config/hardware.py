"""One GPU's capacities: HBM size and bandwidth, dense bf16 compute, host and peer links."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from sim.config.limits import (
    MAX_BANDWIDTH_BYTES_PER_S,
    MAX_FLOPS_PER_S,
    MAX_HBM_BYTES,
    MIN_RATE_BYTES_PER_S,
    KvsimModel,
)
from sim.errors import KvsimConfigError

MIB = 1 << 20
GIB = 1 << 30


class Hardware(KvsimModel):
    """Datasheet figures of one GPU; the cost model derates them by fitted efficiencies."""

    name: str = Field(max_length=200, description="Name shown in reports, e.g. 'H100-SXM-80GB'.")
    source: str = Field("user-supplied", description="Where the figures come from.")
    hbm_bytes: int = Field(
        ge=MIB,
        le=MAX_HBM_BYTES,
        description="HBM capacity as the CUDA runtime reports it (torch total_memory), "
        "the base vLLM multiplies by gpu_memory_utilization.",
    )
    hbm_bandwidth_bytes_per_s: float = Field(
        ge=MIN_RATE_BYTES_PER_S, le=MAX_BANDWIDTH_BYTES_PER_S, description="Peak HBM bandwidth."
    )
    bf16_flops_per_s: float = Field(
        ge=MIN_RATE_BYTES_PER_S,
        le=MAX_FLOPS_PER_S,
        description="Peak dense (no sparsity) bf16 FLOP/s.",
    )
    pcie_bandwidth_bytes_per_s: float = Field(
        ge=MIN_RATE_BYTES_PER_S,
        le=MAX_BANDWIDTH_BYTES_PER_S,
        description="Host link bandwidth in one direction (swap and CPU offload).",
    )
    nvlink_bandwidth_bytes_per_s: float = Field(
        ge=0,
        le=MAX_BANDWIDTH_BYTES_PER_S,
        description="NVLink bandwidth per GPU in one direction; 0 means no NVLink, so "
        "tensor-parallel all-reduce goes over PCIe.",
    )

    host_memory_bytes: int | None = Field(
        None,
        ge=0,
        le=MAX_HBM_BYTES * 64,
        description="Host RAM per GPU (the server's memory over its GPUs), the bound on swap "
        "space and a CPU offload tier; None: unknown, not checked.",
    )
    sm_count: int | None = Field(
        None,
        ge=1,
        le=10_000,
        description="Streaming multiprocessors; the kernel cost model sizes its waves by it "
        "(None: unknown, the roofline prices steps).",
    )

    @model_validator(mode="after")
    def _check_nvlink(self) -> Hardware:
        nvlink = self.nvlink_bandwidth_bytes_per_s
        if 0 < nvlink < MIN_RATE_BYTES_PER_S:
            raise ValueError(
                f"nvlink_bandwidth_bytes_per_s={nvlink:g} must be 0 (no NVLink) or at least "
                f"{MIN_RATE_BYTES_PER_S:g}"
            )
        return self

    @property
    def allreduce_bandwidth_bytes_per_s(self) -> float:
        """Link a tensor-parallel all-reduce uses: NVLink if present, else PCIe."""
        if self.nvlink_bandwidth_bytes_per_s > 0:
            return self.nvlink_bandwidth_bytes_per_s
        return self.pcie_bandwidth_bytes_per_s


# PCIe x16, one direction, after encoding overhead is about 64 GB/s for Gen5, 32 GB/s for Gen4.
_PCIE_GEN5 = 64e9
_PCIE_GEN4 = 32e9

# hbm_bytes is what torch.cuda.get_device_properties().total_memory reports (published
# readouts, in MiB), a little below the marketing size because ECC and the driver keep some;
# it varies by a few MiB with the driver version.
HARDWARE_PRESETS: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        Hardware(
            name="H100-SXM-80GB",
            host_memory_bytes=256 * GIB,  # DGX H100: 2 TB over 8 GPUs
            sm_count=132,
            source="NVIDIA H100 SXM datasheet; torch total_memory 81089 MiB (79.19 GiB)",
            hbm_bytes=81_089 * MIB,
            hbm_bandwidth_bytes_per_s=3.35e12,
            bf16_flops_per_s=989e12,
            pcie_bandwidth_bytes_per_s=_PCIE_GEN5,
            nvlink_bandwidth_bytes_per_s=450e9,
        ),
        Hardware(
            name="H200-141GB",
            host_memory_bytes=256 * GIB,  # DGX H200: 2 TB over 8 GPUs
            sm_count=132,
            # Measured on one H200 (validate/profiles/h200-llama-3.1-8b.json): 4.25 TB/s
            # device copy, 792-799 TFLOP/s bf16 matmul, 55.4 GB/s pinned host<->device each
            # way, total_memory 143155 MiB: the datasheet figures at efficiencies at or above
            # the cost model's defaults, so they stay; the profile carries the kernel costs.
            source="NVIDIA H200 SXM datasheet; torch total_memory 143156 MiB (139.80 GiB); "
            "checked on an H200: 4.25 TB/s copy, ~795 TFLOP/s bf16 matmul, 55.4 GB/s pinned "
            "PCIe each way",
            hbm_bytes=143_156 * MIB,
            hbm_bandwidth_bytes_per_s=4.8e12,
            bf16_flops_per_s=989e12,
            pcie_bandwidth_bytes_per_s=_PCIE_GEN5,
            nvlink_bandwidth_bytes_per_s=450e9,
        ),
        Hardware(
            name="A100-80GB",
            host_memory_bytes=128 * GIB,  # DGX A100: 1 TB over 8 GPUs
            sm_count=108,
            source="NVIDIA A100 SXM4 80GB datasheet; torch total_memory 81050 MiB (79.15 GiB)",
            hbm_bytes=81_050 * MIB,
            hbm_bandwidth_bytes_per_s=2.039e12,
            bf16_flops_per_s=312e12,
            pcie_bandwidth_bytes_per_s=_PCIE_GEN4,
            nvlink_bandwidth_bytes_per_s=300e9,
        ),
        Hardware(
            name="L40S-48GB",
            sm_count=142,
            source="NVIDIA L40S datasheet (no NVLink); torch total_memory 45589 MiB (44.52 GiB)",
            hbm_bytes=45_589 * MIB,
            hbm_bandwidth_bytes_per_s=0.864e12,
            bf16_flops_per_s=362e12,
            pcie_bandwidth_bytes_per_s=_PCIE_GEN4,
            nvlink_bandwidth_bytes_per_s=0.0,
        ),
        Hardware(
            name="B200",
            host_memory_bytes=512 * GIB,  # DGX B200: 4 TB over 8 GPUs
            sm_count=148,
            source="NVIDIA DGX B200 datasheet; torch total_memory 182642 MiB (178.36 GiB)",
            hbm_bytes=182_642 * MIB,
            hbm_bandwidth_bytes_per_s=8.0e12,
            bf16_flops_per_s=2250e12,
            # B200 hosts are PCIe Gen6-capable, but Gen5 hosts are the common case.
            pcie_bandwidth_bytes_per_s=_PCIE_GEN5,
            nvlink_bandwidth_bytes_per_s=900e9,
        ),
    )
}


def resolve_hardware(name_or_obj: str | dict[str, Any] | Hardware) -> Hardware:
    """A preset (case-insensitive name), an inline dict validated as Hardware, or a Hardware."""
    if isinstance(name_or_obj, Hardware):
        return name_or_obj
    if isinstance(name_or_obj, dict):
        return Hardware.model_validate(name_or_obj)
    by_lower_name = {key.lower(): hw for key, hw in HARDWARE_PRESETS.items()}
    preset = by_lower_name.get(str(name_or_obj).lower())
    if preset is None:
        raise KvsimConfigError(
            f"hardware {str(name_or_obj)!r} is not a preset; known: "
            f"{', '.join(HARDWARE_PRESETS)} (or give an inline mapping of Hardware fields)"
        )
    return preset
