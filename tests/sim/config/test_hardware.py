import pytest
from pydantic import ValidationError

from sim.config.hardware import GIB, HARDWARE_PRESETS, Hardware, resolve_hardware

INLINE = {
    "name": "my-gpu",
    "hbm_bytes": 24 * GIB,
    "hbm_bandwidth_bytes_per_s": 1e12,
    "bf16_flops_per_s": 100e12,
    "pcie_bandwidth_bytes_per_s": 32e9,
    "nvlink_bandwidth_bytes_per_s": 0,
}


def test_presets_carry_torch_reported_capacity():
    assert set(HARDWARE_PRESETS) == {
        "H100-SXM-80GB",
        "H200-141GB",
        "A100-80GB",
        "L40S-48GB",
        "B200",
    }
    assert HARDWARE_PRESETS["H100-SXM-80GB"].hbm_bytes == 85_027_979_264
    assert HARDWARE_PRESETS["H200-141GB"].hbm_bytes == 150_109_945_856
    for hw in HARDWARE_PRESETS.values():
        assert hw.source


def test_preset_datasheet_figures():
    h100 = HARDWARE_PRESETS["H100-SXM-80GB"]
    assert h100.hbm_bandwidth_bytes_per_s == 3.35e12
    assert h100.bf16_flops_per_s == 989e12
    assert h100.pcie_bandwidth_bytes_per_s == 64e9
    assert h100.nvlink_bandwidth_bytes_per_s == 450e9
    assert HARDWARE_PRESETS["H200-141GB"].hbm_bandwidth_bytes_per_s == 4.8e12
    assert HARDWARE_PRESETS["A100-80GB"].pcie_bandwidth_bytes_per_s == 32e9
    assert HARDWARE_PRESETS["B200"].nvlink_bandwidth_bytes_per_s == 900e9


def test_allreduce_uses_pcie_without_nvlink():
    assert HARDWARE_PRESETS["L40S-48GB"].allreduce_bandwidth_bytes_per_s == 32e9
    assert HARDWARE_PRESETS["H100-SXM-80GB"].allreduce_bandwidth_bytes_per_s == 450e9


def test_resolve_hardware_by_name_is_case_insensitive():
    assert resolve_hardware("h200-141gb") is HARDWARE_PRESETS["H200-141GB"]


def test_resolve_hardware_inline_dict():
    hw = resolve_hardware(INLINE)
    assert hw == Hardware(**INLINE)
    assert hw.source == "user-supplied"


def test_inline_hardware_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValidationError):
        resolve_hardware(INLINE | {"hbm_gb": 24})
    with pytest.raises(ValidationError):
        resolve_hardware(INLINE | {"hbm_bytes": 0})


def test_unknown_hardware_lists_presets():
    with pytest.raises(ValueError) as info:
        resolve_hardware("TPU-v5")
    message = str(info.value)
    assert "'TPU-v5'" in message
    for name in HARDWARE_PRESETS:
        assert name in message
