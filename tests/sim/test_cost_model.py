import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from sim.config.hardware import HARDWARE_PRESETS
from sim.config.model import MODEL_PRESETS
from sim.cost_model import (
    COST_TERMS,
    IDLE_GAP_UNIT_S,
    LINEAR_FLOPS,
    STEP,
    CostModel,
    CostParams,
    idle_gap_feature,
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
    f = cost.features(BatchShape(num_decode_reqs=1, decode_context_tokens=context_tokens))
    assert f["linear_flop_s"] + f["attention_flop_s"] < f["byte_s"] / 100


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
    f = cost.features(
        BatchShape(num_prefill_tokens=n, num_prefill_reqs=1, prefill_attention_pairs=n * n / 2)
    )
    assert f["linear_flop_s"] > 5 * f["byte_s"]


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
    expected_f1 = (weight_read_bytes(LLAMA_8B) + kv * (3000 + 512)) / bytes_per_s
    expected_f2 = (weight_read_bytes(LLAMA_8B) + kv * (6000 + 1024)) / bytes_per_s
    assert f1["byte_s"] == pytest.approx(expected_f1)
    assert f2["byte_s"] == pytest.approx(expected_f2)


def test_empty_batch_costs_nothing():
    cost = make_cost_model(tp=1)
    assert cost.step_time_s(BatchShape()) == 0.0
    features = cost.features(BatchShape(), after_idle=True, steps_since_prefill=1)
    assert features == {term.name: 0.0 for term in COST_TERMS}
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


def test_cost_terms_price_every_step_time_parameter_once():
    params = [term.param for term in COST_TERMS]
    assert len(set(params)) == len(params) == len({term.name for term in COST_TERMS})
    # Every other field either is not a step-time coefficient or is folded by the fit.
    others = set(CostParams.model_fields) - set(params)
    assert others == {
        "mode",
        "kernels",
        "allreduce_latency_s",
        "kv_transfer_efficiency",
        "kernel_build_min_tokens",
    }
    assert [t.name for t in COST_TERMS if not t.fitted] == ["tokens"]


def test_cost_term_param_value_inverts_price():
    efficiency, overhead = LINEAR_FLOPS, STEP
    assert efficiency.efficiency and not overhead.efficiency
    params = CostParams(compute_efficiency=0.25, step_overhead_s=3e-3)
    assert efficiency.price(2.0, params) == 8.0
    assert efficiency.param_value(efficiency.price(1.0, params)) == 0.25
    assert overhead.price(2.0, params) == 6e-3
    assert overhead.param_value(overhead.price(1.0, params)) == 3e-3


step_params = st.builds(
    CostParams,
    mode=st.just("additive"),
    compute_efficiency=st.floats(0.05, 1.0),
    attention_compute_efficiency=st.floats(0.05, 1.0),
    bandwidth_efficiency=st.floats(0.05, 1.0),
    step_overhead_s=st.floats(0.0, 1e-2),
    per_token_overhead_s=st.floats(0.0, 1e-5),
    per_request_overhead_s=st.floats(0.0, 1e-4),
    prefill_step_overhead_s=st.floats(0.0, 1e-2),
    idle_wakeup_s=st.floats(0.0, 1e-2),
    idle_wakeup_log_s=st.floats(0.0, 5e-3),
    post_prefill_decode_s=st.floats(0.0, 1e-2),
    kernel_build_s=st.floats(0.0, 1e-2),
    kernel_build_per_token_s=st.floats(0.0, 1e-4),
    kernel_build_min_tokens=st.integers(0, 256),
    allreduce_latency_s=st.floats(0.0, 1e-4),
    shared_kv_bandwidth_efficiency=st.none() | st.floats(0.05, 4.0),
)


@pytest.mark.parametrize("model, hardware, tp", [(LLAMA_8B, H100, 1), (LLAMA_70B, H200, 4)])
@given(
    counts=shape_counts,
    after_idle=st.booleans(),
    since_prefill=st.integers(-1, 50),
    idle_s=st.floats(0.0, 600.0),
    kernel_build=st.booleans(),
    params=step_params,
    shared_share=st.floats(0.0, 1.0),
)
def test_additive_step_time_is_the_priced_sum_of_the_named_features(
    model,
    hardware,
    tp,
    counts,
    after_idle,
    since_prefill,
    idle_s,
    kernel_build,
    params,
    shared_share,
):
    """One definition: COST_TERMS prices the features; the hot loop's folding agrees."""
    shape = make_shape(*counts)
    shape.shared_kv_tokens = int(shared_share * shape.decode_context_tokens)
    cost = CostModel(model, hardware, tp, params)
    context = (after_idle, since_prefill, idle_s, kernel_build)
    features = cost.features(shape, *context)
    assert list(features) == [term.name for term in COST_TERMS]
    expected_s = sum(term.price(features[term.name], params) for term in COST_TERMS)
    expected_s += cost.allreduce_time_s(shape)
    assert cost.step_time_s(shape, *context) == pytest.approx(expected_s, rel=1e-12, abs=0.0)


@given(counts=shape_counts, after_idle=st.booleans(), since_prefill=st.integers(-1, 50))
def test_additive_mode_is_never_below_roofline(counts, after_idle, since_prefill):
    shape = make_shape(*counts)
    overheads = {
        "prefill_step_overhead_s": 3e-4,
        "idle_wakeup_s": 2e-3,
        "post_prefill_decode_s": 7e-4,
    }
    roofline = make_cost_model(mode="roofline", tp=1, **overheads)
    additive = make_cost_model(mode="additive", tp=1, **overheads)
    context = (after_idle, since_prefill)
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


def test_a_wake_up_grows_with_the_log_of_the_idle_gap():
    decodes = make_shape(0, 0, 8, 1024)
    cost = make_cost_model()
    # Default 0: the gap changes nothing, as before the term existed.
    assert cost.step_time_s(decodes, True, 0, 30.0) == cost.step_time_s(decodes, True)
    waking = make_cost_model(idle_wakeup_s=1e-3, idle_wakeup_log_s=2e-3)
    base_s = cost.step_time_s(decodes)
    for idle_s in (0.0, 0.01, 0.09, 1.0, 30.0):
        extra_s = waking.step_time_s(decodes, True, 0, idle_s) - base_s
        assert extra_s == pytest.approx(1e-3 + 2e-3 * math.log1p(idle_s / IDLE_GAP_UNIT_S))
        # A step that did not follow an idle engine pays no wake-up, whatever idle_s says.
        assert waking.step_time_s(decodes, False, 0, idle_s) == pytest.approx(base_s)
    # Ten times the gap, about the same extra again (a logarithm).
    one_s, ten_s = (waking.step_time_s(decodes, True, 0, g) - base_s for g in (1.0, 10.0))
    assert ten_s - one_s == pytest.approx(2e-3 * math.log(1001 / 101))
    assert idle_gap_feature(0.0) == 0.0
    with pytest.raises(ValueError, match="idle_s=-1"):
        idle_gap_feature(-1.0)


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


def test_a_first_step_of_its_token_count_pays_for_its_kernels_above_the_minimum():
    cost = make_cost_model()
    # Default 0: nothing changes, and the engine need not track token counts.
    assert cost.kernel_build_min_tokens is None
    big, small = make_shape(200, 1, 8, 1024), make_shape(40, 1, 8, 1024)
    assert cost.step_time_s(big, kernel_build=True) == cost.step_time_s(big)
    building = make_cost_model(kernel_build_s=3e-3, kernel_build_per_token_s=2e-5)
    assert building.kernel_build_min_tokens == 64
    assert building.step_time_s(big, kernel_build=True) == pytest.approx(
        cost.step_time_s(big) + 3e-3 + 2e-5 * 208
    )
    assert building.step_time_s(big) == pytest.approx(cost.step_time_s(big))
    # 48 tokens: at or under the minimum, a first step builds nothing.
    assert building.step_time_s(small, kernel_build=True) == pytest.approx(cost.step_time_s(small))
    assert building.features(small, kernel_build=True)["kernel_build"] == 0.0
    assert building.features(big, kernel_build=True)["kernel_build_tokens"] == 208.0


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


def test_shared_block_rereads_are_priced_apart_only_when_fitted():
    """Without ``shared_kv_bandwidth_efficiency`` a shared block's re-read is any KV read
    (the step time does not move, to the bit); with it, at a higher bandwidth, the re-read
    part of the KV read costs less, and never below the step without those tokens' reads."""
    shape = BatchShape(num_decode_reqs=8, decode_context_tokens=8 * 2000)
    shared = BatchShape(num_decode_reqs=8, decode_context_tokens=8 * 2000, shared_kv_tokens=7 * 512)
    for mode in ("roofline", "additive"):
        plain = make_cost_model(mode=mode, tp=1)
        assert plain.step_time_s(shared) == plain.step_time_s(shape)
    params = CostParams(mode="additive", shared_kv_bandwidth_efficiency=2.0)
    cost = CostModel(LLAMA_8B, H100, 1, params)
    base = CostModel(
        LLAMA_8B, H100, 1, params.model_copy(update={"shared_kv_bandwidth_efficiency": None})
    )
    saved_s = base.step_time_s(shared) - cost.step_time_s(shared)
    kv_s_per_token = LLAMA_8B.kv_bytes_per_token(1) / H100.hbm_bandwidth_bytes_per_s
    assert saved_s == pytest.approx(7 * 512 * kv_s_per_token * (1 / 0.8 - 1 / 2.0), rel=1e-9)
