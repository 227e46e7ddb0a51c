"""GPU kernel times of a decoder's non-attention operators, from shapes and fitted parameters.

The roofline prices a decode step at its weight-read time; measured GPUs are slower there, and
not smoothly (Vidur's H100/A100 operator profiles, ``benchmarks/bench_gpu_cost_model.py``).
This module prices each operator of a decoder layer from its shape, the GPU's datasheet figures
and SM count, and a handful of parameters fitted per GPU (``validate/kernel_fit.py``):

GEMMs (QKV, attention output, gate+up, down, lm_head), ``M`` tokens x ``K`` -> ``N``, per GPU
of a ``tp``-way group. A GEMM library picks, per shape, the fastest of a few kernels; each
kernel ``(tile_m, tile_n, split_k)`` of :data:`KERNEL_CONFIGS` runs
``ctas = ceil(M / tile_m) * ceil(N / tile_n) * split_k`` thread blocks in
``waves = ceil(ctas / sm_count)`` waves::

    compute_s = waves * sm_count * 2 * tile_m * tile_n * (K / split_k) / (F * compute_efficiency)
    memory_s  = bytes / (BW * bandwidth_efficiency) / min(1, ctas / (sm_count * full_ctas))^g
    tile_s    = ctas * (tile_m + tile_n) * (K / split_k) * dtype_bytes
                / (BW * tile_bandwidth_factor)
    compute_s = compute_s * (1 + throttle_slowdown * (1 - (1 - exp(-x)) / x)),
                x = the run's unthrottled compute / throttle_time_s   (the power cap, below)
    kernel_s  = (compute_s^p + memory_s^p + tile_s^p)^(1/p)   (a soft max: p large -> max)
    gemm_s    = floor_s + sum over kernels of w * kernel_s / sum of w,
                w = exp(-(kernel_s / fastest kernel_s - 1) / selection_spread)

The library's heuristic does not always pick the fastest kernel (Vidur's H100 tables show
GEMMs that run one more wave than the best tile would need): ``selection_spread`` weighs
every candidate by ``exp(-(kernel_s / fastest - 1) / spread)``, a soft choice with no
cutoff (0: the fastest alone; at 0.3 a kernel 30% slower still weighs 0.37).
``bytes`` are the weights, the input and the output (split-K also writes and reads back fp32
partial sums). Wave quantization gives the steps (one more token can add a whole wave); the
occupancy term lowers the bandwidth of a GEMM so small that even split eight ways it leaves
SMs idle; ``tile_s`` charges each thread block for streaming its input tiles (mostly from L2),
which favours large tiles for large GEMMs; ``floor_s`` is the launch and tail of one kernel,
and what mostly makes small TP shards read at a lower bandwidth.

The power cap: a GPU that keeps its tensor cores busy reaches its board power limit and
lowers its clock, so sustained compute runs slower per FLOP than a burst (an H200 measured
with ``validate/gpu_power.py`` ran back-to-back GEMMs at full clock for ~40 ms of compute, then
16-18% slower; Vidur's H100 tables run the 34B and 72B models' prefill GEMMs at 666-678
TFLOP/s where the 7B and phi-2's, whose layer passes are shorter, reach 701-708). A
first-order model: over a run of ``x`` time constants (``throttle_time_s``) of compute the
clock sags towards ``1 / (1 + throttle_slowdown)`` of its burst rate, a share
``1 - (1 - exp(-x)) / x`` of the run's compute being throttled. The run is one layer pass's
GEMMs when pricing the operator tables (they time one layer at a time, pass after pass) and
every layer of a step in a simulation (a step runs them back to back): :func:`layer_gemms_time_s`.
Only the compute term is slowed: weight-bound GEMMs (decodes) are left alone.
``throttle_slowdown`` 0 (the default, and fits made with ``--no-power-cap``) is no throttle;
the shipped fits have the term (since 2026-12-07).

Element-wise operators (norms, RoPE, activation, residual add, embedding gather) cost a floor
plus their bytes at a fitted bandwidth. A tensor-parallel all-reduce of ``bytes`` costs
``latency_s + bytes / bandwidth`` fitted per TP degree from NCCL measurements (the nearest
fitted degree serves one that was not measured).

Attention is not here: no attention measurements were given, so the cost model keeps pricing it
from first principles (KV bytes read per decode, FLOPs per prefill).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from sim.config.model import ModelGeometry

# (tile_m, tile_n, split_k) candidates: CUTLASS/cuBLAS-like tiles, split-K for skinny GEMMs.
KERNEL_CONFIGS: tuple[tuple[int, int, int], ...] = (
    (64, 64, 1),
    (64, 128, 1),
    (128, 128, 1),
    (128, 256, 1),
    (256, 128, 1),
    (64, 128, 2),
    (64, 128, 4),
    (64, 64, 4),
    (64, 64, 8),
)

# Element-wise operator kinds, and the Vidur table columns each is fitted on.
ELEMENTWISE_KINDS = ("layernorm", "rope", "activation", "residual_add", "embedding")


class GemmFit(BaseModel):
    """Fitted parameters of the GEMM model (see module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    floor_s: float = Field(ge=0, description="Launch and tail of one GEMM kernel.")
    compute_efficiency: float = Field(gt=0, description="Fraction of peak FLOP/s per wave.")
    bandwidth_efficiency: float = Field(gt=0, description="Fraction of peak HBM bandwidth.")
    full_ctas_per_sm: float = Field(
        gt=0, description="Thread blocks per SM from which the kernel reaches full bandwidth."
    )
    occupancy_exponent: float = Field(
        ge=0, description="How fast bandwidth falls below full occupancy (0: it does not)."
    )
    overlap_exponent: float = Field(
        ge=1, description="p of the soft max of compute and memory time (large: a hard max)."
    )
    tile_bandwidth_factor: float = Field(
        1e9,
        gt=0,
        description="Bandwidth, in multiples of HBM's, at which thread blocks stream their "
        "input tiles (mostly from L2): small tiles re-read the inputs more often.",
    )
    selection_spread: float = Field(
        0.0,
        ge=0,
        description="How far the library's kernel choice strays from the fastest: the time "
        "is the average of the kernels weighted by exp(-(time / fastest - 1) / spread) "
        "(0: the fastest).",
    )
    throttle_slowdown: float = Field(
        0.0,
        ge=0,
        description="Power cap: how much slower per FLOP sustained compute runs than a short "
        "burst (0: no throttle).",
    )
    throttle_time_s: float = Field(
        1e-3,
        gt=0,
        description="Power cap: seconds of compute over which the clock sags to its "
        "throttled rate (a first-order time constant).",
    )


class ElementwiseFit(BaseModel):
    """An element-wise operator: ``floor_s + bytes / (BW * bandwidth_efficiency)``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    floor_s: float = Field(ge=0, description="Launch and tail of the kernel.")
    bandwidth_efficiency: float = Field(gt=0, description="Fraction of peak HBM bandwidth.")


class AllReduceFit(BaseModel):
    """One tensor-parallel all-reduce of ``bytes``: ``latency_s + bytes / bandwidth``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensor_parallel_size: int = Field(ge=2, description="GPUs in the all-reduce.")
    latency_s: float = Field(ge=0, description="Time of an empty all-reduce.")
    bandwidth_bytes_per_s: float = Field(gt=0, description="Message bytes per second.")


class KernelParams(BaseModel):
    """Kernel-level parameters of one GPU, fitted on operator measurements."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gemm: GemmFit
    elementwise: dict[str, ElementwiseFit] = Field(
        description=f"By kind: {', '.join(ELEMENTWISE_KINDS)}."
    )
    allreduce: list[AllReduceFit] = Field(
        default_factory=list, description="By TP degree; empty: no all-reduce measurements."
    )

    @model_validator(mode="after")
    def _every_kind_once(self) -> KernelParams:
        kinds = set(self.elementwise)
        if kinds != set(ELEMENTWISE_KINDS):
            missing = ", ".join(k for k in ELEMENTWISE_KINDS if k not in kinds) or "none"
            extra = ", ".join(sorted(kinds - set(ELEMENTWISE_KINDS))) or "none"
            raise ValueError(
                f"elementwise must fit each of {', '.join(ELEMENTWISE_KINDS)} "
                f"(missing: {missing}; unknown: {extra})"
            )
        degrees = [fit.tensor_parallel_size for fit in self.allreduce]
        if len(set(degrees)) != len(degrees):
            raise ValueError(f"allreduce has a TP degree twice: {degrees}")
        return self

    def allreduce_fit(self, tensor_parallel_size: int) -> AllReduceFit | None:
        """The fit measured at the TP degree nearest ``tensor_parallel_size`` in log2 (ties:
        the larger), or None without measurements."""
        if not self.allreduce:
            return None
        return min(
            self.allreduce,
            key=lambda fit: (
                abs(math.log2(fit.tensor_parallel_size / tensor_parallel_size)),
                -fit.tensor_parallel_size,
            ),
        )


class LayerShape(NamedTuple):
    """Per-GPU operator shapes of one dense decoder layer under ``tp``-way TP."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    gated: bool
    vocab: int
    tp: int
    dtype_bytes: int = 2

    @classmethod
    def from_model(cls, model: ModelGeometry, tp: int) -> LayerShape:
        """The layer shape of ``model`` (a dense, gated-MLP decoder) on ``tp`` GPUs."""
        return cls(
            hidden=model.hidden_size,
            q_heads=model.num_attention_heads,
            kv_heads=model.num_key_value_heads,
            head_dim=model.head_dim,
            intermediate=model.intermediate_size,
            gated=True,
            vocab=model.vocab_size,
            tp=tp,
            dtype_bytes=model.dtype_bytes,
        )

    def gemms(self) -> dict[str, tuple[int, int]]:
        """(K, N) of each GEMM of the layer, by Vidur's operator name."""
        tp, hd = self.tp, self.head_dim
        kv_heads = max(1, self.kv_heads // tp)
        up = (2 if self.gated else 1) * self.intermediate // tp
        return {
            "attn_pre_proj": (self.hidden, (self.q_heads // tp + 2 * kv_heads) * hd),
            "attn_post_proj": (self.q_heads // tp * hd, self.hidden),
            "mlp_up_proj": (self.hidden, up),
            "mlp_down_proj": (self.intermediate // tp, self.hidden),
        }

    def elementwise_bytes(self) -> dict[str, tuple[str, float]]:
        """(kind, bytes per token) of each element-wise operator, by Vidur's operator name."""
        b, h, tp = self.dtype_bytes, self.hidden, self.tp
        qk = (self.q_heads // tp + max(1, self.kv_heads // tp)) * self.head_dim
        act_in = (2 if self.gated else 1) * self.intermediate // tp
        return {
            "input_layernorm": ("layernorm", 2 * b * h),
            "post_attention_layernorm": ("layernorm", 2 * b * h),
            "attn_rope": ("rope", 2 * b * qk),
            "mlp_act": ("activation", b * (act_in + self.intermediate // tp)),
            "add": ("residual_add", 3 * b * h),
        }


def gemm_time_s(
    m: np.ndarray,
    k: np.ndarray | float,
    n: np.ndarray | float,
    fit: GemmFit,
    sm_count: int,
    flops_per_s: float,
    bandwidth_bytes_per_s: float,
    dtype_bytes: int = 2,
    sustained_s: np.ndarray | None = None,
) -> np.ndarray:
    """Seconds of ``m`` x ``k`` -> ``n`` GEMMs, elementwise over the arrays (see module
    docstring). ``sustained_s``: the unthrottled time of the run the GEMM is part of, for the
    power cap (default: the kernel alone, e.g. the lm_head)."""
    m = np.asarray(m, dtype=float)
    k = np.asarray(k, dtype=float)
    n = np.asarray(n, dtype=float)
    p = fit.overlap_exponent
    best = np.full(np.broadcast(m, k, n).shape, np.inf)
    times: list[np.ndarray] = []
    for tile_m, tile_n, split_k in KERNEL_CONFIGS:
        # Split-K writes and reads back fp32 partial sums before the final output.
        partial_bytes = 2 * 4 * split_k if split_k > 1 else 0
        nbytes = dtype_bytes * (k * n + m * k + m * n) + partial_bytes * m * n
        ctas = np.ceil(m / tile_m) * np.ceil(n / tile_n) * split_k
        waves = np.ceil(ctas / sm_count)
        compute_s = waves * sm_count * 2.0 * tile_m * tile_n * (k / split_k) / flops_per_s
        compute_s = compute_s / fit.compute_efficiency
        if fit.throttle_slowdown > 0:
            run_s = compute_s if sustained_s is None else sustained_s
            compute_s = compute_s * (
                1.0 + fit.throttle_slowdown * throttled_share(run_s / fit.throttle_time_s)
            )
        occupancy = np.minimum(1.0, ctas / (sm_count * fit.full_ctas_per_sm))
        memory_s = nbytes / (bandwidth_bytes_per_s * fit.bandwidth_efficiency)
        with np.errstate(divide="ignore"):  # no thread block (m or n is 0): infinite
            memory_s = memory_s / occupancy**fit.occupancy_exponent
        tile_bytes = dtype_bytes * ctas * (tile_m + tile_n) * (k / split_k)
        tile_s = tile_bytes / (bandwidth_bytes_per_s * fit.tile_bandwidth_factor)
        kernel_s = (compute_s**p + memory_s**p + tile_s**p) ** (1.0 / p)
        best = np.minimum(best, kernel_s)
        times.append(kernel_s)
    if fit.selection_spread <= 0:
        return fit.floor_s + best
    stacked = np.stack(times)
    with np.errstate(invalid="ignore"):  # inf / inf where no kernel runs (m or n is 0)
        weights = np.exp(-(stacked / best - 1.0) / fit.selection_spread)
        average = (weights * stacked).sum(axis=0) / weights.sum(axis=0)
    return fit.floor_s + np.where(np.isfinite(best), average, best)


def layer_gemms_time_s(
    m: np.ndarray,
    gemms: list[tuple[int, int]],
    fit: GemmFit,
    sm_count: int,
    flops_per_s: float,
    bandwidth_bytes_per_s: float,
    dtype_bytes: int = 2,
    run_layers: int = 1,
) -> np.ndarray:
    """Seconds of one layer's GEMMs (``(K, N)`` each) per token count ``m``, in a run of
    ``run_layers`` such layers back to back: under a power cap the run's GEMMs share one
    throttle, its length their unthrottled time."""
    hw = (sm_count, flops_per_s, bandwidth_bytes_per_s, dtype_bytes)
    sustained = None
    if fit.throttle_slowdown > 0:
        cool = fit.model_copy(update={"throttle_slowdown": 0.0})
        sustained = run_layers * sum(gemm_time_s(m, k, n, cool, *hw) for k, n in gemms)
    total = np.zeros(np.shape(m))
    for k, n in gemms:
        total = total + gemm_time_s(m, k, n, fit, *hw, sustained_s=sustained)
    return total


def throttled_share(x: np.ndarray) -> np.ndarray:
    """The share of a run of ``x`` time constants of compute spent throttled, where the
    throttle approaches exponentially: ``1 - (1 - exp(-x)) / x`` (0 at x = 0, 1 as x grows)."""
    x = np.asarray(x, dtype=float)
    ramp = np.divide(-np.expm1(-x), x, out=np.ones(x.shape), where=x > 0)
    return 1.0 - ramp


def elementwise_time_s(
    nbytes: np.ndarray, fit: ElementwiseFit, bandwidth_bytes_per_s: float
) -> np.ndarray:
    """Seconds of an element-wise operator moving ``nbytes``."""
    return fit.floor_s + np.asarray(nbytes, dtype=float) / (
        bandwidth_bytes_per_s * fit.bandwidth_efficiency
    )


def allreduce_time_s(nbytes: np.ndarray, fit: AllReduceFit) -> np.ndarray:
    """Seconds of one all-reduce of ``nbytes`` per GPU."""
    return fit.latency_s + np.asarray(nbytes, dtype=float) / fit.bandwidth_bytes_per_s


class OperatorTimer:
    """Non-attention seconds of a whole step (embedding, every layer's operators and
    all-reduces, lm_head) for a model on one GPU type; cached per token count."""

    def __init__(
        self,
        shape: LayerShape,
        num_layers: int,
        params: KernelParams,
        sm_count: int,
        flops_per_s: float,
        bandwidth_bytes_per_s: float,
    ) -> None:
        self.shape, self.num_layers, self.params = shape, num_layers, params
        self._hw = (sm_count, flops_per_s, bandwidth_bytes_per_s)
        self._allreduce = params.allreduce_fit(shape.tp) if shape.tp > 1 else None
        self._body_cache: dict[int, float] = {}
        self._lm_head_cache: dict[int, float] = {}

    @property
    def prices_allreduce(self) -> bool:
        """Whether the fit has all-reduce measurements for this TP (False without TP)."""
        return self._allreduce is not None

    def gemms_time_s(self, num_tokens: np.ndarray, run_layers: int = 1) -> np.ndarray:
        """Seconds of one layer's four GEMMs per token count, in a run of ``run_layers``
        layers back to back (the power cap's run: one pass, as the operator tables time a
        layer, or a whole step)."""
        return layer_gemms_time_s(
            np.asarray(num_tokens, dtype=float),
            list(self.shape.gemms().values()),
            self.params.gemm,
            *self._hw,
            self.shape.dtype_bytes,
            run_layers,
        )

    def layer_time_s(self, num_tokens: np.ndarray, run_layers: int = 1) -> np.ndarray:
        """Seconds of one layer's non-attention operators (no all-reduce) per token count
        (``run_layers``: as in :meth:`gemms_time_s`)."""
        _, _, bw = self._hw
        m = np.asarray(num_tokens, dtype=float)
        total = self.gemms_time_s(m, run_layers)
        for kind, per_token in self.shape.elementwise_bytes().values():
            total += elementwise_time_s(m * per_token, self.params.elementwise[kind], bw)
        return total

    def allreduce_time_s(self, num_tokens: np.ndarray) -> np.ndarray:
        """Seconds of one all-reduce of the activations of ``num_tokens`` (0 without TP)."""
        m = np.asarray(num_tokens, dtype=float)
        if self._allreduce is None:
            return np.zeros(m.shape)
        return allreduce_time_s(m * self.shape.hidden * self.shape.dtype_bytes, self._allreduce)

    def body_times_s(self, num_tokens: np.ndarray) -> np.ndarray:
        """Embedding plus all layers (operators and two all-reduces each) per token count."""
        m = np.asarray(num_tokens, dtype=float)
        _, _, bw = self._hw
        embedding = elementwise_time_s(
            m * 2 * self.shape.dtype_bytes * self.shape.hidden,
            self.params.elementwise["embedding"],
            bw,
        )
        layer = self.layer_time_s(m, run_layers=self.num_layers)  # a step: every layer in a run
        return embedding + self.num_layers * (layer + 2 * self.allreduce_time_s(m))

    def lm_head_times_s(self, num_rows: np.ndarray) -> np.ndarray:
        """The lm_head GEMM per row count (vLLM computes logits for every request)."""
        sm_count, flops, bw = self._hw
        return gemm_time_s(
            np.asarray(num_rows, dtype=float),
            self.shape.hidden,
            self.shape.vocab / self.shape.tp,
            self.params.gemm,
            sm_count,
            flops,
            bw,
            self.shape.dtype_bytes,
        )

    def body_time_s(self, num_tokens: int) -> float:
        """:meth:`body_times_s` of one step, priced a chunk of token counts at a time."""
        cached = self._body_cache.get(num_tokens)
        if cached is None:
            _fill(self._body_cache, num_tokens, self.body_times_s)
            cached = self._body_cache[num_tokens]
        return cached

    def lm_head_time_s(self, num_rows: int) -> float:
        """:meth:`lm_head_times_s` of one step, priced a chunk of row counts at a time."""
        cached = self._lm_head_cache.get(num_rows)
        if cached is None:
            _fill(self._lm_head_cache, num_rows, self.lm_head_times_s)
            cached = self._lm_head_cache[num_rows]
        return cached


# Token counts priced together on a cache miss: one vectorized call instead of one per count.
_CHUNK = 256


def _fill(cache: dict[int, float], key: int, price: Callable[[np.ndarray], np.ndarray]) -> None:
    start = key - key % _CHUNK
    counts = np.arange(max(start, 1), start + _CHUNK)  # 0 tokens: not a step
    for count, time_s in zip(counts.tolist(), price(counts).tolist(), strict=True):
        cache[count] = time_s
