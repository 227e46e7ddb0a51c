"""The GPU kernel cost model (sim/gpu_kernels.py) and cost mode "operators"."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

from sim.config.calibration import shipped_profile
from sim.config.hardware import HARDWARE_PRESETS, Hardware, resolve_hardware
from sim.config.model import resolve_model
from sim.cost_model import CostModel, CostParams
from sim.errors import KvsimConfigError
from sim.gpu_kernels import (
    AllReduceFit,
    ElementwiseFit,
    GemmFit,
    KernelParams,
    LayerShape,
    OperatorTimer,
    gemm_time_s,
    throttled_share,
)
from sim.scheduler.output import BatchShape

H100 = resolve_hardware("H100-SXM-80GB")
LLAMA2_7B_LAYER = LayerShape(4096, 32, 32, 128, 11008, True, 32000, 1)


def h100_kernels() -> KernelParams:
    profile = shipped_profile(H100)
    assert profile is not None and profile.params.kernels is not None
    return profile.params.kernels


def timer(shape: LayerShape, layers: int = 32) -> OperatorTimer:
    return OperatorTimer(
        shape, layers, h100_kernels(), 132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s
    )


def test_shipped_fits_exist_for_the_measured_gpus_only() -> None:
    sources = {
        "H100-SXM-80GB": "vidur-operator-tables",
        "A100-80GB": "vidur-operator-tables",
        "H200-141GB": "torch-operator-tables",
    }
    for name, source in sources.items():
        profile = shipped_profile(resolve_hardware(name))
        assert profile is not None and profile.hardware == name
        assert profile.source == source
        assert profile.params.mode == "operators" and profile.params.kernels is not None
    for name in ("L40S-48GB", "B200"):
        assert shipped_profile(resolve_hardware(name)) is None
    assert all(hw.sm_count for hw in HARDWARE_PRESETS.values())


def test_a_7b_layer_stack_on_h100_rises_in_a_wave_step_past_128_tokens() -> None:
    """Vidur's H100 tables show the 7B stack jumping between 128 and 136 tokens (tile and
    wave quantization); the fitted model reproduces it from the shapes, flat on either side."""
    stack = timer(LLAMA2_7B_LAYER)
    t120, t128, t136, t144 = 32 * stack.layer_time_s(np.array([120, 128, 136, 144]))
    assert t128 / t120 - 1 < 0.01
    assert t136 / t128 - 1 > 0.10
    assert t144 / t136 - 1 < 0.01


def test_decode_is_slower_than_the_weight_read_and_tiny_kernels_cost_their_floor() -> None:
    kernels = h100_kernels()
    stack = timer(LLAMA2_7B_LAYER)
    weights = sum(k * n for k, n in LLAMA2_7B_LAYER.gemms().values()) * 2
    weight_read_s = weights / H100.hbm_bandwidth_bytes_per_s
    one_token = float(stack.layer_time_s(np.array([1]))[0])
    assert weight_read_s < one_token < 2 * weight_read_s
    tiny = gemm_time_s(
        np.array([1.0]),
        64,
        64,
        kernels.gemm,
        132,
        H100.bf16_flops_per_s,
        H100.hbm_bandwidth_bytes_per_s,
    )
    assert tiny[0] == pytest.approx(kernels.gemm.floor_s, rel=0.05)


def test_achieved_bandwidth_falls_with_the_shard_size() -> None:
    bw = H100.hbm_bandwidth_bytes_per_s

    def achieved(fit: GemmFit, k: int, n: int) -> float:
        time_s = gemm_time_s(np.array([1.0]), k, n, fit, 132, H100.bf16_flops_per_s, bw)
        return 2 * k * n / float(time_s[0])

    shards = [(4096, 22016), (4096, 11008), (4096, 2752)]  # gate+up of 7B at TP 1, 2, 8
    fitted = [achieved(h100_kernels().gemm, k, n) for k, n in shards]
    assert fitted[0] > fitted[1] > fitted[2] and fitted[2] < 0.7 * fitted[0]
    # Beyond the per-kernel floor, a GEMM too small to fill the SMs even split eight ways
    # (512 x 512: 64 thread blocks on 132 SMs) reads at a lower bandwidth; with the
    # occupancy exponent at 0 it would not.
    synthetic = GemmFit(
        floor_s=0.0,
        compute_efficiency=0.8,
        bandwidth_efficiency=0.9,
        full_ctas_per_sm=1.0,
        occupancy_exponent=1.0,
        overlap_exponent=4.0,
    )
    assert achieved(synthetic, 512, 512) < 0.6 * achieved(synthetic, 4096, 22016)
    flat = synthetic.model_copy(update={"occupancy_exponent": 0.0})
    assert achieved(flat, 512, 512) == pytest.approx(achieved(flat, 4096, 22016), rel=0.1)


def test_allreduce_uses_the_nearest_measured_degree_and_costs_latency_at_one_token() -> None:
    fits = [
        AllReduceFit(tensor_parallel_size=tp, latency_s=tp * 1e-5, bandwidth_bytes_per_s=1e11)
        for tp in (2, 4, 8)
    ]
    params = h100_kernels().model_copy(update={"allreduce": fits})
    assert params.allreduce_fit(2).tensor_parallel_size == 2
    assert params.allreduce_fit(16).tensor_parallel_size == 8
    assert params.allreduce_fit(3).tensor_parallel_size == 4  # nearest in log2
    assert params.model_copy(update={"allreduce": []}).allreduce_fit(2) is None
    tp4 = OperatorTimer(
        LLAMA2_7B_LAYER._replace(tp=4),
        32,
        params,
        132,
        H100.bf16_flops_per_s,
        H100.hbm_bandwidth_bytes_per_s,
    )
    assert tp4.allreduce_time_s(np.array([1]))[0] == pytest.approx(4e-5 + 8192 / 1e11)
    assert timer(LLAMA2_7B_LAYER).allreduce_time_s(np.array([1]))[0] == 0


def test_operator_mode_prices_a_model_absent_from_the_tables() -> None:
    """Llama-3.1-8B is not in Vidur's tables: its steps come from its shapes."""
    model = resolve_model("Llama-3.1-8B")
    params = shipped_profile(H100).params
    cost = CostModel(model, H100, 1, params)
    roofline = CostModel(
        model, H100, 1, CostParams(compute_efficiency=0.6, bandwidth_efficiency=0.8)
    )
    decode = cost.decode_time_s(1, 1000)
    assert np.isfinite(decode) and decode > roofline.decode_time_s(1, 1000)
    # Attention still scales with the context read from first principles.
    assert cost.decode_time_s(64, 8000) > cost.decode_time_s(64, 1000)
    prefill = cost.prefill_time_s(4096)
    assert prefill > 5 * decode
    tp2 = CostModel(model, H100, 2, params)
    shape = BatchShape(num_decode_reqs=8, decode_context_tokens=8000)
    assert tp2.allreduce_time_s(shape) > 2 * model.num_hidden_layers * 20e-6
    assert tp2.step_time_s(shape) < cost.step_time_s(shape)


def test_operator_mode_needs_kernels_and_an_sm_count() -> None:
    with pytest.raises(pydantic.ValidationError, match="needs kernels"):
        CostParams(mode="operators")
    no_sms = Hardware.model_validate({**H100.model_dump(), "name": "mystery", "sm_count": None})
    with pytest.raises(KvsimConfigError, match="sm_count"):
        CostModel(resolve_model("Llama-3.1-8B"), no_sms, 1, shipped_profile(H100).params)


def test_moe_models_keep_the_roofline_in_operator_mode() -> None:
    dense = resolve_model("Llama-3.1-8B")
    moe = dense.model_copy(update={"num_active_params": dense.num_params // 4})
    params = shipped_profile(H100).params
    roofline = params.model_copy(update={"mode": "roofline"})
    shape = BatchShape(num_decode_reqs=4, decode_context_tokens=4000)
    assert CostModel(moe, H100, 1, params).step_time_s(shape) == CostModel(
        moe, H100, 1, roofline
    ).step_time_s(shape)


def test_kernel_params_reject_impossible_values() -> None:
    with pytest.raises(pydantic.ValidationError):
        GemmFit(
            floor_s=-1,
            compute_efficiency=0.5,
            bandwidth_efficiency=0.5,
            full_ctas_per_sm=1,
            occupancy_exponent=1,
            overlap_exponent=2,
        )
    with pytest.raises(pydantic.ValidationError):
        ElementwiseFit(floor_s=1e-6, bandwidth_efficiency=0)


def test_a_run_says_what_priced_its_steps() -> None:
    from sim.report import step_time_source
    from sim.runner import simulate
    from sim.scenario import parse_scenario

    def run(hardware: str, **engine: object) -> dict:
        scenario = parse_scenario(
            {
                "name": "source",
                "model": "Llama-3.1-8B",
                "hardware": hardware,
                "engine": {"max_model_len": 4096, **engine},
                "workload": {
                    "kind": "open_loop",
                    "num_requests": 3,
                    "arrival": {"kind": "poisson", "rate_per_s": 1.0},
                    "prompt_tokens": {"kind": "fixed", "value": 64},
                    "output_tokens": {"kind": "fixed", "value": 4},
                },
            },
            "source",
        )
        return simulate(scenario).summary

    h100 = run("H100-SXM-80GB")
    assert h100["calibration"]["source"] == "vidur-operator-tables"
    assert "H100-SXM-80GB kernel fit" in step_time_source(h100)
    h200 = run("H200-141GB")
    assert h200["calibration"]["source"] == "torch-operator-tables"
    assert step_time_source(h200).startswith(
        "step times: H200-141GB kernel fit on operator measurements with torch kernels"
    )
    l40s = run("L40S-48GB")
    assert l40s["calibration"] is None
    assert "datasheet roofline (L40S-48GB" in step_time_source(l40s)
    measured = {**l40s, "calibration": {"source": "vllm", "model": "tiny", "hardware": "cpu"}}
    assert (
        step_time_source(measured) == "step times: calibration profile (vllm) fitted on tiny / cpu"
    )


def test_layer_shape_from_a_model() -> None:
    model = resolve_model("Llama-3.1-8B")
    assert LayerShape.from_model(model, 2) == LayerShape(
        4096, 32, 8, 128, 14336, True, 128256, 2, 2
    )


def test_gqa_kv_heads_are_replicated_when_tp_exceeds_them() -> None:
    shape = LayerShape(8192, 64, 8, 128, 28672, True, 128256, 16)
    k, n = shape.gemms()["attn_pre_proj"]
    assert (k, n) == (8192, (64 // 16 + 2 * 1) * 128)


def test_operator_step_time_is_kernels_plus_attention_plus_overheads() -> None:
    model = resolve_model("Llama-3.1-8B")
    params = shipped_profile(H100).params
    cost = CostModel(model, H100, 1, params)
    timer = OperatorTimer(
        LayerShape.from_model(model, 1),
        32,
        params.kernels,
        132,
        H100.bf16_flops_per_s,
        H100.hbm_bandwidth_bytes_per_s,
    )
    shape = BatchShape(num_decode_reqs=16, decode_context_tokens=16 * 4000)
    kv_read_s = (
        model.kv_bytes_per_token(1)
        * (16 * 4000 + 16)
        / (H100.hbm_bandwidth_bytes_per_s * params.bandwidth_efficiency)
    )
    attention_flops_s = (
        4
        * 32
        * 32
        * 128
        * 16
        * 4000
        / (H100.bf16_flops_per_s * params.attention_compute_efficiency)
    )
    expected = (
        timer.body_time_s(16)
        + timer.lm_head_time_s(16)
        + max(kv_read_s, attention_flops_s)
        + params.step_overhead_s
        + 16 * params.per_request_overhead_s
    )
    assert cost.step_time_s(shape) == pytest.approx(expected, rel=1e-12)


def test_tp_without_allreduce_measurements_keeps_the_roofline_allreduce() -> None:
    model = resolve_model("Llama-3.1-8B")
    params = shipped_profile(H100).params
    kernels = params.kernels.model_copy(update={"allreduce": []})
    bare = params.model_copy(update={"kernels": kernels})
    roofline = CostModel(model, H100, 2, CostParams())
    shape = BatchShape(num_decode_reqs=8, decode_context_tokens=8000)
    assert CostModel(model, H100, 2, bare).allreduce_time_s(shape) == pytest.approx(
        roofline.allreduce_time_s(shape)
    )
    assert roofline.allreduce_time_s(shape) > 0


def test_the_shipped_fit_is_for_the_preset_itself_and_dense_models() -> None:
    tweaked = H100.model_copy(update={"hbm_bytes": H100.hbm_bytes // 2})
    assert shipped_profile(tweaked) is None
    dense = resolve_model("Llama-3.1-8B")
    moe = dense.model_copy(update={"num_active_params": dense.num_params // 4})
    assert shipped_profile(H100, dense) is not None
    assert shipped_profile(H100, moe) is None


def test_shipped_fits_leave_the_non_kernel_parameters_at_their_defaults() -> None:
    for name in ("H100-SXM-80GB", "A100-80GB", "H200-141GB"):
        params = shipped_profile(resolve_hardware(name)).params
        assert params.model_dump(exclude={"mode", "kernels"}) == CostParams().model_dump(
            exclude={"mode", "kernels"}
        )


def test_kernel_params_need_every_elementwise_kind() -> None:
    kernels = h100_kernels().model_dump()
    del kernels["elementwise"]["embedding"]
    with pytest.raises(pydantic.ValidationError, match="missing: embedding"):
        KernelParams.model_validate(kernels)


# A GEMM fit with round figures, no floor and no spread (the fastest kernel alone).
SIMPLE_GEMM = GemmFit(
    floor_s=0.0,
    compute_efficiency=0.8,
    bandwidth_efficiency=0.9,
    full_ctas_per_sm=1.0,
    occupancy_exponent=0.5,
    overlap_exponent=4.0,
)


def test_selection_spread_averages_the_kernels_near_the_fastest() -> None:
    """Spread 0 prices the fastest kernel; a spread weighs in slower kernels, more the wider
    it is."""
    fastest_only = SIMPLE_GEMM
    m = np.array([1.0, 136.0, 640.0, 4096.0])

    def price(fit: GemmFit) -> np.ndarray:
        return gemm_time_s(
            m, 8192, 8192, fit, 132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s
        )

    fastest = price(fastest_only)
    narrow = price(fastest_only.model_copy(update={"selection_spread": 0.05}))
    wide = price(fastest_only.model_copy(update={"selection_spread": 0.3}))
    assert np.all(fastest <= narrow) and np.all(narrow <= wide)
    assert wide[2] > 1.01 * fastest[2]
    # An unbounded spread is the plain mean of the kernels: weighing the fast ones more stays
    # below it.
    mean = price(fastest_only.model_copy(update={"selection_spread": 1e9}))
    assert np.all(wide <= mean * (1 + 1e-12)) and np.all(mean > wide)


def test_selection_spread_keeps_an_empty_gemm_infinite_not_nan() -> None:
    """With no token (m = 0) no kernel runs at full occupancy: every candidate is infinite,
    with or without a spread (the fit and the prices never see a NaN)."""
    fit = SIMPLE_GEMM.model_copy(update={"selection_spread": 0.2})
    m = np.array([0.0, 1.0])
    spread = gemm_time_s(
        m, 4096, 4096, fit, 132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s
    )
    fastest = gemm_time_s(
        m, 4096, 4096, SIMPLE_GEMM, 132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s
    )
    assert not np.isnan(spread).any()
    assert spread[0] == fastest[0] == np.inf
    assert np.isfinite(spread[1]) and spread[1] >= fastest[1]


def test_throttled_share_ramps_from_none_to_all() -> None:
    x = np.array([0.0, 1e-9, 1e-3, 1.0, 10.0, 1e6])
    share = throttled_share(x)
    assert share[0] == 0.0 and not np.isnan(share).any()
    assert share[1] == pytest.approx(0.5e-9, rel=1e-3) and share[2] == pytest.approx(5e-4, rel=1e-3)
    assert share[3] == pytest.approx(np.exp(-1.0), rel=1e-9)  # 1 - (1 - 1/e) / 1
    assert np.all(np.diff(share) > 0) and share[-1] == pytest.approx(1.0, abs=1e-5)


def test_the_power_cap_slows_long_compute_bound_gemms_not_decodes() -> None:
    """A throttle slows a long compute-bound GEMM towards 1 + slowdown times its unthrottled
    time, a short one by less, and leaves a memory-bound decode GEMM as it was."""
    throttled = SIMPLE_GEMM.model_copy(update={"throttle_slowdown": 0.15, "throttle_time_s": 2e-4})
    m = np.array([1.0, 16.0, 512.0, 4096.0])

    def price(fit: GemmFit) -> np.ndarray:
        return gemm_time_s(
            m, 8192, 49152, fit, 132, H100.bf16_flops_per_s, H100.hbm_bandwidth_bytes_per_s
        )

    ratio = price(throttled) / price(SIMPLE_GEMM)
    assert ratio[0] == pytest.approx(1.0, abs=1e-3) and ratio[1] == pytest.approx(1.0, abs=1e-3)
    assert 1.0 < ratio[2] < ratio[3] < 1.15
    assert ratio[3] > 1.13  # ~5 ms of compute: 25 time constants, nearly all throttled
    # The default (and every fit made before the term) has no throttle.
    assert SIMPLE_GEMM.throttle_slowdown == 0.0


def test_a_step_runs_its_layers_as_one_power_cap_run() -> None:
    """The operator tables time one layer pass at a time; a step runs every layer back to back,
    so its compute-bound GEMMs are priced further into the throttle than one pass is (the
    shipped H200 fit's), and a decode (weight-bound) is not slowed."""
    h200 = resolve_hardware("H200-141GB")
    params = shipped_profile(h200).params.kernels
    assert params is not None
    slowdown = params.gemm.throttle_slowdown
    assert 0.1 < slowdown < 1.0

    def timer_with(throttle: float) -> OperatorTimer:
        gemm = params.gemm.model_copy(update={"throttle_slowdown": throttle})
        kernels = params.model_copy(update={"gemm": gemm})
        hw = (132, h200.bf16_flops_per_s, h200.hbm_bandwidth_bytes_per_s)
        return OperatorTimer(LLAMA2_7B_LAYER, 32, kernels, *hw)

    step, cool_step = timer_with(slowdown), timer_with(0.0)
    m = np.array([1.0, 4096.0])
    one_pass = step.gemms_time_s(m)
    in_a_step = step.gemms_time_s(m, run_layers=32)
    cool = cool_step.gemms_time_s(m)
    assert in_a_step[0] == pytest.approx(cool[0], rel=2e-3)
    assert cool[1] < one_pass[1] < in_a_step[1] < (1 + slowdown) * cool[1]
    assert in_a_step[1] > 1.1 * cool[1]
    # A step's body prices its layers in the step's run: what is left is the embedding.
    embedding = step.body_times_s(m) - 32 * step.layer_time_s(m, run_layers=32)
    assert embedding == pytest.approx(
        cool_step.body_times_s(m) - 32 * cool_step.layer_time_s(m), abs=1e-10
    )
