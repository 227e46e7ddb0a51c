"""The least-squares fit of the cost model's parameters (validate/fit.py)."""

import numpy as np
import pytest

from sim.config.hardware import HARDWARE_PRESETS
from sim.config.model import MODEL_PRESETS
from sim.cost_model import COST_TERMS, CostModel, CostParams
from sim.kernel_builds import kernel_build_steps
from sim.scheduler.output import BatchShape
from validate.fit import FITTED_TERMS, fit_cost_params, steps_since_prefill

LLAMA_8B = MODEL_PRESETS["Llama-3.1-8B"]
LLAMA_70B = MODEL_PRESETS["Llama-3.1-70B"]
H100 = HARDWARE_PRESETS["H100-SXM-80GB"]
H200 = HARDWARE_PRESETS["H200-141GB"]


def make_shape(
    prefill_tokens: int, prefill_reqs: int, decode_reqs: int, context: int
) -> BatchShape:
    return BatchShape(
        num_prefill_tokens=prefill_tokens,
        num_prefill_reqs=prefill_reqs,
        prefill_attention_pairs=prefill_tokens * (context + prefill_tokens / prefill_reqs / 2)
        if prefill_reqs
        else 0.0,
        num_decode_reqs=decode_reqs,
        decode_context_tokens=decode_reqs * context,
    )


def test_steps_since_prefill_counts_from_the_last_prefill_step():
    prefill, decode = make_shape(64, 1, 0, 0), make_shape(0, 0, 2, 100)
    mixed = make_shape(32, 1, 2, 100)
    shapes = [decode, prefill, decode, decode, mixed, decode, prefill, prefill, decode]
    assert steps_since_prefill(shapes) == [0, 0, 1, 2, 0, 1, 0, 0, 1]
    assert steps_since_prefill([]) == []


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
    idle_wakeup_log_s=1.5e-3,
    post_prefill_decode_s=8e-4,
    kernel_build_s=3e-3,
    kernel_build_per_token_s=1.5e-5,
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
    # Idle gaps from 1 ms to ~20 s, spread over the after-idle steps.
    idle_s = [1e-3 * 1.6 ** (i % 22) if idle else 0.0 for i, idle in enumerate(after_idle)]
    builds = kernel_build_steps((s.num_tokens for s in shapes), 64, 2048)
    assert 30 < sum(builds) < len(shapes) - 30  # first steps of a token count, and repeats
    steps = list(zip(shapes, after_idle, since, idle_s, builds, strict=True))
    durations_s = [truth.step_time_s(*step) for step in steps]
    params, quality = fit_cost_params(
        shapes,
        durations_s,
        LLAMA_8B,
        H100,
        1,
        after_idle=after_idle,
        since_prefill=since,
        idle_s=idle_s,
        kernel_builds=builds,
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
        "idle_wakeup_log_s",
        "post_prefill_decode_s",
        "kernel_build_s",
        "kernel_build_per_token_s",
    ):
        assert getattr(params, field) == pytest.approx(getattr(TRUE_PARAMS, field), rel=0.01)


def test_fit_holds_fixed_params_and_fits_the_rest_around_them():
    """A held parameter comes back as given; with its true value the others are recovered,
    with a wrong one they absorb what they can (the steps' other terms still fit)."""
    truth = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    shapes = synthetic_shapes(seed=7, num_steps=300)
    durations_s = [truth.step_time_s(s) for s in shapes]
    true_attention = TRUE_PARAMS.attention_compute_efficiency
    held = {"attention_compute_efficiency": true_attention}
    params, quality = fit_cost_params(shapes, durations_s, LLAMA_8B, H100, fixed=held)
    assert params.attention_compute_efficiency == true_attention
    assert quality["r2"] > 0.999
    for field in ("compute_efficiency", "bandwidth_efficiency", "step_overhead_s"):
        assert getattr(params, field) == pytest.approx(getattr(TRUE_PARAMS, field), rel=0.01)
    wrong = {"attention_compute_efficiency": 4 * true_attention}
    params, _ = fit_cost_params(shapes, durations_s, LLAMA_8B, H100, fixed=wrong)
    assert params.attention_compute_efficiency == 4 * true_attention
    assert params.compute_efficiency != pytest.approx(TRUE_PARAMS.compute_efficiency, rel=0.01)
    with pytest.raises(ValueError, match="per_token_overhead_s"):
        fit_cost_params(shapes, durations_s, LLAMA_8B, H100, fixed={"per_token_overhead_s": 0.0})


def test_fit_without_idle_or_prefill_positions_prices_neither():
    truth = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    shapes = synthetic_shapes(seed=5, num_steps=120)
    params, _ = fit_cost_params(shapes, [truth.step_time_s(s) for s in shapes], LLAMA_8B, H100)
    assert params.idle_wakeup_s == params.idle_wakeup_log_s == 0.0
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
    with pytest.raises(ValueError, match="10 shapes but 3 idle_s"):
        fit_cost_params(shapes, [1e-2] * 10, LLAMA_8B, H100, 1, idle_s=[0.1] * 3)


def test_fit_regresses_on_every_fitted_term_and_zeroes_the_others():
    assert [t.name for t in FITTED_TERMS] == [t.name for t in COST_TERMS if t.fitted]
    truth = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    shapes = synthetic_shapes(seed=9, num_steps=80)
    base = CostParams(per_token_overhead_s=1e-6, kv_transfer_efficiency=0.5)
    params, _ = fit_cost_params(
        shapes, [truth.step_time_s(s) for s in shapes], LLAMA_8B, H100, base=base
    )
    assert params.per_token_overhead_s == 0.0  # an unfitted term
    assert params.kv_transfer_efficiency == 0.5  # not a step-time term: from base


def test_median_loss_prices_each_shape_at_its_median_step():
    # A shared machine's step times spread around the batch's cost, lognormally. The median
    # fit prices the shapes at their median step (what ITL p50 reads); the squared loss
    # relative to the measured time prices them ~exp(-1.5 sigma^2) below it, pulled down by
    # the fast steps (-6% at sigma 0.2).
    truth = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    shapes = synthetic_shapes(seed=4, num_steps=40)
    rng = np.random.default_rng(0)
    noise = np.exp(rng.normal(0.0, 0.2, size=(len(shapes), 51)))
    repeated = [s for s in shapes for _ in range(noise.shape[1])]
    durations_s = [truth.step_time_s(s) * f for s, f in zip(repeated, noise.ravel(), strict=True)]
    median_params, _ = fit_cost_params(
        repeated, durations_s, LLAMA_8B, H100, relative=True, loss="median"
    )
    squares_params, _ = fit_cost_params(repeated, durations_s, LLAMA_8B, H100, relative=True)
    median_noise = float(np.median(noise))  # the median step / the batch's cost
    ratios = {}
    for name, params in (("median", median_params), ("squares", squares_params)):
        fitted = CostModel(LLAMA_8B, H100, 1, params)
        ratios[name] = np.median([fitted.step_time_s(s) / truth.step_time_s(s) for s in shapes])
    assert ratios["median"] == pytest.approx(median_noise, rel=0.02)
    assert ratios["squares"] < 0.96 * median_noise


def test_median_loss_recovers_noise_free_params_and_rejects_unknown_losses():
    truth = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    shapes = synthetic_shapes(seed=8, num_steps=120)
    durations_s = [truth.step_time_s(s) for s in shapes]
    params, quality = fit_cost_params(shapes, durations_s, LLAMA_8B, H100, loss="median")
    assert quality["mape"] < 0.1
    assert params.compute_efficiency == pytest.approx(TRUE_PARAMS.compute_efficiency, rel=0.01)
    with pytest.raises(ValueError, match="loss='mean'"):
        fit_cost_params(shapes, durations_s, LLAMA_8B, H100, loss="mean")  # type: ignore[arg-type]


def test_fit_prices_shared_block_rereads_apart_only_when_asked_and_measured():
    """Decodes that share a prefix re-read its blocks. Asked to (``shared_kv``), on steps that
    share a varying part of their context, the fit recovers the re-reads' own bandwidth; by
    default, or when no step shares a block, the parameter stays None and the re-reads count
    as any KV read (exactly what the cost model then prices)."""
    shapes = synthetic_shapes(seed=13, num_steps=300)
    rng = np.random.default_rng(13)
    for shape in shapes:
        shape.shared_kv_tokens = int(rng.uniform(0.0, 0.6) * shape.decode_context_tokens)
    shared_params = TRUE_PARAMS.model_copy(update={"shared_kv_bandwidth_efficiency": 2.5})
    truth = CostModel(LLAMA_8B, H100, 1, shared_params)
    durations_s = [truth.step_time_s(s) for s in shapes]
    params, quality = fit_cost_params(shapes, durations_s, LLAMA_8B, H100, shared_kv=True)
    assert quality["r2"] > 0.999
    assert params.shared_kv_bandwidth_efficiency == pytest.approx(2.5, rel=0.01)
    assert params.bandwidth_efficiency == pytest.approx(0.75, rel=0.01)

    plain = CostModel(LLAMA_8B, H100, 1, TRUE_PARAMS)
    durations_s = [plain.step_time_s(s) for s in shapes]
    params, quality = fit_cost_params(shapes, durations_s, LLAMA_8B, H100)
    assert params.shared_kv_bandwidth_efficiency is None
    assert params.bandwidth_efficiency == pytest.approx(0.75, rel=0.01)
    assert quality["r2"] > 0.999
    held = {"bandwidth_efficiency": 0.75}
    params, _ = fit_cost_params(shapes, durations_s, LLAMA_8B, H100, fixed=held)
    assert params.shared_kv_bandwidth_efficiency is None
    assert params.compute_efficiency == pytest.approx(0.55, rel=0.01)

    for shape in shapes:
        shape.shared_kv_tokens = 0
    durations_s = [plain.step_time_s(s) for s in shapes]
    params, _ = fit_cost_params(shapes, durations_s, LLAMA_8B, H100, shared_kv=True)
    assert params.shared_kv_bandwidth_efficiency is None
    assert params.bandwidth_efficiency == pytest.approx(0.75, rel=0.01)
