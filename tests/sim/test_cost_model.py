import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from sim.config.hardware import HARDWARE_PRESETS
from sim.config.model import MODEL_PRESETS
from sim.cost_model import (
    CalibrationProfile,
    CostModel,
    CostParams,
    fit_cost_params,
    load_cost_params,
    save_profile,
    steps_since_prefill,
)
from sim.errors import KvsimConfigError
from sim.scheduler.output import BatchShape

LLAMA_8B = MODEL_PRESETS["Llama-3.1-8B"]
LLAMA_70B = MODEL_PRESETS["Llama-3.1-70B"]
H100 = HARDWARE_PRESETS["H100-SXM-80GB"]
H200 = HARDWARE_PRESETS["H200-141GB"]
DEFAULTS = CostParams()


def make_cost_model(model=LLAMA_8B, hardware=H100, tp=1, **params) -> CostModel:
    return CostModel(model, hardware, tp, CostParams(**params))


def weight_read_bytes(model) -> float:
    """Weights minus the untied embedding table (its gather reads only T rows)."""
    return (model.num_params - model.vocab_size * model.hidden_size) * model.dtype_bytes


def test_single_decode_at_short_context_is_weight_bandwidth_bound():
    cost = make_cost_model()
    context_tokens = 128
    bw_s = H100.hbm_bandwidth_bytes_per_s * DEFAULTS.bandwidth_efficiency
    kv_bytes = LLAMA_8B.kv_bytes_per_token() * (context_tokens + 1)
    expected_s = (
        (weight_read_bytes(LLAMA_8B) + kv_bytes) / bw_s
        + DEFAULTS.step_overhead_s
        + DEFAULTS.per_request_overhead_s
    )
    assert cost.decode_time_s(1, context_tokens) == pytest.approx(expected_s, rel=1e-9)
    # The design's back-of-envelope: 16 GB of weights over 80% of 3.35 TB/s is about 6 ms.
    envelope_s = 16e9 / bw_s + DEFAULTS.step_overhead_s
    assert cost.decode_time_s(1, context_tokens) == pytest.approx(envelope_s, rel=0.1)
    linear_flop_s, attention_flop_s, byte_s, *_ = cost.features(
        BatchShape(num_decode_reqs=1, decode_context_tokens=context_tokens)
    )
    assert linear_flop_s + attention_flop_s < byte_s / 100


def test_long_prefill_is_compute_bound():
    cost = make_cost_model()
    n = 8192
    m = LLAMA_8B
    vocab_matrix = m.vocab_size * m.hidden_size
    linear_flops = 2 * (m.num_params - 2 * vocab_matrix) * n + 2 * vocab_matrix
    attention_flops = 4 * m.num_hidden_layers * m.num_attention_heads * m.head_dim * n * n / 2
    expected_s = (
        linear_flops / (H100.bf16_flops_per_s * DEFAULTS.compute_efficiency)
        + attention_flops / (H100.bf16_flops_per_s * DEFAULTS.attention_compute_efficiency)
        + DEFAULTS.step_overhead_s
        + DEFAULTS.per_request_overhead_s
    )
    assert cost.prefill_time_s(n) == pytest.approx(expected_s, rel=1e-9)
    linear_flop_s, _, byte_s, *_ = cost.features(
        BatchShape(num_prefill_tokens=n, num_prefill_reqs=1, prefill_attention_pairs=n * n / 2)
    )
    assert linear_flop_s > 5 * byte_s


def test_prefill_chunk_reads_its_context_kv():
    # 16 tokens after 100k cached: memory bound, and the cached context is read once.
    cost = make_cost_model()
    n, context_tokens = 16, 100_000
    bw_s = H100.hbm_bandwidth_bytes_per_s * DEFAULTS.bandwidth_efficiency
    kv_bytes = LLAMA_8B.kv_bytes_per_token() * (context_tokens + n)
    expected_s = (
        (weight_read_bytes(LLAMA_8B) + kv_bytes) / bw_s
        + DEFAULTS.step_overhead_s
        + DEFAULTS.per_request_overhead_s
    )
    assert cost.prefill_time_s(n, context_tokens) == pytest.approx(expected_s, rel=1e-9)


def test_equal_chunks_price_like_their_total_context():
    cost = make_cost_model(mode="additive")
    chunk = BatchShape(
        num_prefill_tokens=512, num_prefill_reqs=1, prefill_attention_pairs=512 * (3000 + 256)
    )
    two_chunks = BatchShape(
        num_prefill_tokens=1024,
        num_prefill_reqs=2,
        prefill_attention_pairs=512 * (1000 + 256) + 512 * (5000 + 256),
    )
    f1, f2 = cost.features(chunk), cost.features(two_chunks)
    bytes_per_s = H100.hbm_bandwidth_bytes_per_s
    kv = LLAMA_8B.kv_bytes_per_token()
    assert f1[2] == pytest.approx((weight_read_bytes(LLAMA_8B) + kv * (3000 + 512)) / bytes_per_s)
    assert f2[2] == pytest.approx((weight_read_bytes(LLAMA_8B) + kv * (6000 + 1024)) / bytes_per_s)


def test_empty_batch_costs_nothing():
    cost = make_cost_model(tp=1)
    assert cost.step_time_s(BatchShape()) == 0.0
    assert cost.features(BatchShape(), after_idle=True, steps_since_prefill=1) == (0.0,) * 9
    assert CostModel(LLAMA_70B, H200, 4).step_time_s(BatchShape()) == 0.0
    assert cost.prefill_time_s(0) == 0.0
    assert cost.decode_time_s(0, 4096) == 0.0


shape_counts = st.tuples(
    st.integers(0, 8192), st.integers(0, 16), st.integers(0, 512), st.integers(0, 4096)
)


def make_shape(prefill_tokens, prefill_reqs, decode_reqs, context_tokens) -> BatchShape:
    prefill_reqs = min(max(prefill_reqs, 1 if prefill_tokens else 0), prefill_tokens)
    chunk = prefill_tokens / prefill_reqs if prefill_reqs else 0.0
    return BatchShape(
        num_prefill_tokens=prefill_tokens,
        num_prefill_reqs=prefill_reqs,
        prefill_attention_pairs=prefill_tokens * (context_tokens + chunk / 2),
        num_decode_reqs=decode_reqs,
        decode_context_tokens=decode_reqs * context_tokens,
    )


@pytest.mark.parametrize("mode", ["roofline", "additive"])
@given(counts=shape_counts, extra=st.integers(1, 4096), which=st.integers(0, 2))
def test_step_time_is_monotone_in_tokens_requests_and_context(mode, counts, extra, which):
    cost = make_cost_model(mode=mode, tp=1)
    prefill_tokens, prefill_reqs, decode_reqs, context_tokens = counts
    more = [prefill_tokens, decode_reqs, context_tokens]
    more[which] += extra
    before = cost.step_time_s(make_shape(prefill_tokens, prefill_reqs, decode_reqs, context_tokens))
    after = cost.step_time_s(make_shape(more[0], prefill_reqs, more[1], more[2]))
    assert after >= before


@given(counts=shape_counts, after_idle=st.booleans(), since_prefill=st.integers(-1, 50))
def test_additive_mode_is_the_sum_of_features_and_never_below_roofline(
    counts, after_idle, since_prefill
):
    shape = make_shape(*counts)
    overheads = {
        "prefill_step_overhead_s": 3e-4,
        "idle_wakeup_s": 2e-3,
        "post_prefill_decode_s": 7e-4,
    }
    roofline = make_cost_model(mode="roofline", tp=1, **overheads)
    additive = make_cost_model(mode="additive", tp=1, **overheads)
    weights = (
        1 / DEFAULTS.compute_efficiency,
        1 / DEFAULTS.attention_compute_efficiency,
        1 / DEFAULTS.bandwidth_efficiency,
        DEFAULTS.step_overhead_s,
        DEFAULTS.per_token_overhead_s,
        DEFAULTS.per_request_overhead_s,
        3e-4,
        2e-3,
        7e-4,
    )
    context = (after_idle, since_prefill)
    features = additive.features(shape, *context)
    expected_s = sum(w * f for w, f in zip(weights, features, strict=True))
    assert additive.step_time_s(shape, *context) == pytest.approx(expected_s, rel=1e-12)
    assert roofline.step_time_s(shape, *context) <= additive.step_time_s(shape, *context)


def test_prefill_steps_and_wake_ups_pay_their_overhead_once():
    two_chunks, decodes = make_shape(512, 2, 8, 1024), make_shape(0, 0, 8, 1024)
    cost = make_cost_model()
    # Defaults: no such overheads, datasheet runs are unchanged.
    assert cost.step_time_s(two_chunks, after_idle=True) == cost.step_time_s(two_chunks)
    slower = make_cost_model(prefill_step_overhead_s=1e-3, idle_wakeup_s=5e-3)
    assert slower.step_time_s(two_chunks) == pytest.approx(cost.step_time_s(two_chunks) + 1e-3)
    assert slower.step_time_s(two_chunks, after_idle=True) == pytest.approx(
        cost.step_time_s(two_chunks) + 6e-3
    )
    assert slower.step_time_s(decodes) == pytest.approx(cost.step_time_s(decodes))


def test_decode_steps_after_a_prefill_pay_one_over_n_of_the_refill():
    two_chunks, decodes = make_shape(512, 2, 8, 1024), make_shape(0, 0, 8, 1024)
    cost = make_cost_model()
    refill = make_cost_model(post_prefill_decode_s=9e-4)
    assert cost.step_time_s(decodes, steps_since_prefill=1) == cost.step_time_s(decodes)
    steady_s = refill.step_time_s(decodes)
    for n in (1, 2, 3, 10):
        assert refill.step_time_s(decodes, steps_since_prefill=n) == pytest.approx(
            steady_s + 9e-4 / n
        )
    # Not before the first prefill, and never on a step that prefills itself.
    assert refill.step_time_s(decodes, steps_since_prefill=0) == steady_s
    assert refill.step_time_s(decodes, steps_since_prefill=-1) == steady_s
    assert refill.step_time_s(two_chunks, steps_since_prefill=1) == cost.step_time_s(two_chunks)


def test_steps_since_prefill_counts_from_the_last_prefill_step():
    prefill, decode = make_shape(64, 1, 0, 0), make_shape(0, 0, 2, 100)
    mixed = make_shape(32, 1, 2, 100)
    shapes = [decode, prefill, decode, decode, mixed, decode, prefill, prefill, decode]
    assert steps_since_prefill(shapes) == [0, 0, 1, 2, 0, 1, 0, 0, 1]
    assert steps_since_prefill([]) == []


def test_allreduce_time_follows_the_ring_formula():
    assert make_cost_model(tp=1).allreduce_time_s(BatchShape(num_decode_reqs=8)) == 0.0
    cost = CostModel(LLAMA_70B, H200, 4)
    t = 8192
    per_allreduce_bytes = t * LLAMA_70B.hidden_size * 2 * 2 * 3 / 4
    expected_s = (
        2
        * LLAMA_70B.num_hidden_layers
        * (DEFAULTS.allreduce_latency_s + per_allreduce_bytes / H200.nvlink_bandwidth_bytes_per_s)
    )
    shape = BatchShape(num_prefill_tokens=t, num_prefill_reqs=1)
    assert cost.allreduce_time_s(shape) == pytest.approx(expected_s, rel=1e-12)


def test_more_tensor_parallelism_speeds_up_a_big_prefill():
    tp2 = CostModel(LLAMA_70B, H200, 2).prefill_time_s(8192)
    tp4 = CostModel(LLAMA_70B, H200, 4).prefill_time_s(8192)
    assert tp4 < tp2
    # All-reduce and overheads keep it short of a perfect 2x.
    assert tp4 > tp2 / 2


def test_cost_model_rejects_impossible_tensor_parallelism():
    with pytest.raises(KvsimConfigError, match="tensor_parallel_size=3"):
        CostModel(LLAMA_8B, H100, 3)


def test_kv_transfer_time_uses_derated_pcie():
    cost = make_cost_model(kv_transfer_efficiency=0.5)
    bytes_per_block = 16 * LLAMA_8B.kv_bytes_per_token()
    assert cost.kv_transfer_time_s(1000, bytes_per_block) == pytest.approx(
        1000 * bytes_per_block / (64e9 * 0.5)
    )
    assert cost.kv_transfer_time_s(0, bytes_per_block) == 0.0
    with pytest.raises(ValueError, match="num_blocks=-1"):
        cost.kv_transfer_time_s(-1, bytes_per_block)


def test_cost_params_reject_unknown_keys_and_bad_values():
    with pytest.raises(ValidationError):
        CostParams(compute_eff=0.5)
    with pytest.raises(ValidationError):
        CostParams(bandwidth_efficiency=0)
    with pytest.raises(ValidationError):
        CostParams(mode="max")


TRUE_PARAMS = CostParams(
    mode="additive",
    compute_efficiency=0.55,
    attention_compute_efficiency=0.35,
    bandwidth_efficiency=0.75,
    step_overhead_s=2e-3,
    per_token_overhead_s=0.0,
    per_request_overhead_s=2e-5,
    prefill_step_overhead_s=4e-4,
    idle_wakeup_s=3e-3,
    post_prefill_decode_s=8e-4,
    allreduce_latency_s=0.0,
)


def synthetic_shapes(seed: int, num_steps: int) -> list[BatchShape]:
    """Decode-only, prefill-only and mixed steps over a range of contexts; runs of 1 to ~10
    decode-only steps between prefills."""
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(num_steps):
        kind = int(rng.choice(3, p=(0.6, 0.2, 0.2)))
        decode_reqs = int(rng.integers(1, 256)) if kind != 1 else 0
        prefill_reqs = int(rng.integers(1, 4)) if kind != 0 else 0
        shape = BatchShape(
            num_decode_reqs=decode_reqs,
            decode_context_tokens=decode_reqs * int(rng.integers(16, 8192)),
        )
        for _ in range(prefill_reqs):
            chunk = int(rng.integers(16, 4096))
            context = int(rng.integers(0, 16384))
            shape.num_prefill_reqs += 1
            shape.num_prefill_tokens += chunk
            shape.prefill_attention_pairs += chunk * (context + chunk / 2)
        shapes.append(shape)
    return shapes


def test_fit_recovers_additive_params_from_noise_free_steps():
    truth = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    shapes = [*synthetic_shapes(seed=7, num_steps=300), BatchShape()]
    after_idle = [i % 7 == 0 for i in range(len(shapes))]
    since = steps_since_prefill(shapes)
    durations_s = [truth.step_time_s(*step) for step in zip(shapes, after_idle, since, strict=True)]
    params, quality = fit_cost_params(
        shapes, durations_s, LLAMA_8B, H100, 1, after_idle=after_idle, since_prefill=since
    )
    assert params.mode == "additive"
    assert quality["r2"] > 0.999
    assert quality["mape"] < 0.1
    assert quality["num_steps"] == 300
    for field in (
        "compute_efficiency",
        "attention_compute_efficiency",
        "bandwidth_efficiency",
        "step_overhead_s",
        "per_request_overhead_s",
        "prefill_step_overhead_s",
        "idle_wakeup_s",
        "post_prefill_decode_s",
    ):
        assert getattr(params, field) == pytest.approx(getattr(TRUE_PARAMS, field), rel=0.01)


def test_fit_without_idle_or_prefill_positions_prices_neither():
    truth = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    shapes = synthetic_shapes(seed=5, num_steps=120)
    params, _ = fit_cost_params(shapes, [truth.step_time_s(s) for s in shapes], LLAMA_8B, H100)
    assert params.idle_wakeup_s == 0.0
    assert params.post_prefill_decode_s == 0.0
    assert params.prefill_step_overhead_s == pytest.approx(4e-4, rel=0.01)


def test_fit_folds_allreduce_latency_into_step_overhead():
    truth_params = TRUE_PARAMS.model_copy(update={"allreduce_latency_s": 1e-5})
    truth = CostModel(LLAMA_70B, H200, 4, truth_params)
    shapes = synthetic_shapes(seed=11, num_steps=200)
    params, quality = fit_cost_params(
        shapes, [truth.step_time_s(s) for s in shapes], LLAMA_70B, H200, 4
    )
    assert quality["r2"] > 0.999
    assert params.allreduce_latency_s == 0.0
    folded_s = TRUE_PARAMS.step_overhead_s + 2 * LLAMA_70B.num_hidden_layers * 1e-5
    assert params.step_overhead_s == pytest.approx(folded_s, rel=0.01)
    assert params.compute_efficiency == pytest.approx(0.55, rel=0.01)


def test_fit_keeps_coefficients_non_negative():
    # Durations that fall with batch size pull unconstrained coefficients below zero.
    shapes = synthetic_shapes(seed=3, num_steps=60)
    durations_s = [0.05 / (1 + s.num_tokens / 1000) for s in shapes]
    params, _ = fit_cost_params(shapes, durations_s, LLAMA_8B, H100, 1)
    assert params.step_overhead_s >= 0
    assert params.per_request_overhead_s >= 0
    assert min(params.compute_efficiency, params.bandwidth_efficiency) > 0


def test_fit_rejects_bad_input():
    shapes = synthetic_shapes(seed=1, num_steps=10)
    with pytest.raises(ValueError, match="10 shapes but 9 durations"):
        fit_cost_params(shapes, [1e-2] * 9, LLAMA_8B, H100, 1)
    with pytest.raises(ValueError, match="3 non-empty steps"):
        fit_cost_params(shapes[:3], [1e-2] * 3, LLAMA_8B, H100, 1)
    with pytest.raises(ValueError, match=r"duration_s=0\.0"):
        fit_cost_params(shapes, [0.0] * 10, LLAMA_8B, H100, 1)
    with pytest.raises(ValueError, match="10 shapes but 2 after_idle"):
        fit_cost_params(shapes, [1e-2] * 10, LLAMA_8B, H100, 1, after_idle=[True, False])
    with pytest.raises(ValueError, match="10 shapes but 1 since_prefill"):
        fit_cost_params(shapes, [1e-2] * 10, LLAMA_8B, H100, 1, since_prefill=[1])


def make_profile() -> CalibrationProfile:
    return CalibrationProfile(
        params=TRUE_PARAMS,
        hardware="H100-SXM-80GB",
        model="Llama-3.1-8B",
        vllm_version="0.33.0",
        fit={"r2": 0.98, "mape": 4.2, "max_abs_pct_error": 17.0},
        num_steps=1234,
        created_by="kvsim calibrate runs/h100",
    )


def test_profile_save_load_roundtrip(tmp_path):
    path = tmp_path / "profile.json"
    save_profile(make_profile(), path)
    assert load_cost_params(path) == make_profile()


def test_budget_warning_names_the_field_and_the_calibrated_budgets():
    old = make_profile()  # written before profiles recorded their budgets: no claim either way
    assert old.max_num_batched_tokens == [] and old.budget_warning(384) is None
    profile = old.model_copy(update={"max_num_batched_tokens": [512, 2048]})
    assert profile.budget_warning(512) is None and profile.budget_warning(2048) is None
    warning = profile.budget_warning(384)
    assert warning is not None
    assert "engine.max_num_batched_tokens=384" in warning and "512, 2048" in warning


def test_malformed_profile_names_file_and_field(tmp_path):
    raw = json.loads(make_profile().model_dump_json())
    path = tmp_path / "bad.json"

    raw["params"]["compute_eff"] = 0.5
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"bad\.json: params\.compute_eff"):
        load_cost_params(path)

    raw["params"].pop("compute_eff")
    raw["num_steps"] = "many"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"bad\.json: num_steps = 'many'"):
        load_cost_params(path)

    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"bad\.json"):
        load_cost_params(path)
