"""Fit :class:`sim.gpu_kernels.KernelParams` to a GPU's operator measurements.

Every fit minimizes the log of predicted / measured time (relative error, so 5 us kernels
count as much as 5 ms ones) with a soft-L1 loss (a few noisy points do not drag the fit) using
``scipy.optimize.least_squares``. The GEMM fit pools the layers of every model in the tables,
each (TP degree, regime) cell weighing the same while its errors are small (the soft-L1
loss applies after the weights), from a few starting points (the kernel
choice makes its loss rugged); each element-wise kind and each all-reduce TP degree is fitted
on its own.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from sim.config.hardware import Hardware
from sim.errors import KvsimConfigError
from sim.gpu_kernels import (
    AllReduceFit,
    ElementwiseFit,
    GemmFit,
    KernelParams,
    LayerShape,
    OperatorTimer,
    elementwise_time_s,
    gemm_time_s,
)
from validate.vidur_tables import (
    ELEMENTWISE_OPS,
    EMBEDDING_OP,
    GEMM_OPS,
    OperatorTables,
    layer_shape,
)

# Token counts from which a row is in the next regime: decode 1-256, 257-511, prefill
# 512-4096, beyond.
REGIME_EDGES = (257, 512, 4097)

# Relative residuals beyond ~5% weigh linearly, not quadratically.
_F_SCALE = 0.05


def _robust_fit(
    residuals: Callable[[np.ndarray], np.ndarray],
    x0: list[float],
    lower: list[float],
    upper: list[float],
) -> np.ndarray:
    result = least_squares(
        residuals, x0=x0, bounds=(lower, upper), loss="soft_l1", f_scale=_F_SCALE
    )
    return np.asarray(result.x)


def sm_count_of(hardware: Hardware) -> int:
    """``hardware.sm_count``, which the kernel model needs; a config error without it."""
    if hardware.sm_count is None:
        raise KvsimConfigError(
            f"hardware {hardware.name!r} has no sm_count: the kernel model needs the GPU's "
            "streaming multiprocessor count (e.g. 132 for an H100 SXM)"
        )
    return hardware.sm_count


def _shapes(layers: pd.DataFrame) -> list[LayerShape]:
    return [layer_shape(row) for _, row in layers.iterrows()]


def gemm_samples(layers: pd.DataFrame) -> pd.DataFrame:
    """One row per measured GEMM: ``m``, ``k``, ``n``, ``time_s``."""
    shapes = _shapes(layers)
    m = layers["num_tokens"].to_numpy(dtype=float)
    parts = []
    for op in GEMM_OPS:
        kn = np.array([shape.gemms()[op] for shape in shapes], dtype=float)
        parts.append(
            pd.DataFrame(
                {
                    "m": m,
                    "k": kn[:, 0],
                    "n": kn[:, 1],
                    "time_s": layers[op].to_numpy(),
                    "row": np.arange(len(layers)),
                }
            )
        )
    return pd.concat(parts, ignore_index=True).dropna()


def _gemm_fit(theta: np.ndarray) -> GemmFit:
    floor, inv_bw, inv_compute, full_ctas, exponent, overlap, tile_bw, spread = theta[:8]
    slowdown, throttle_time = theta[8:] if len(theta) > 8 else (0.0, np.log(1e-3))
    return GemmFit(
        throttle_slowdown=float(slowdown),
        throttle_time_s=float(np.exp(throttle_time)),
        selection_spread=float(np.exp(spread)),
        tile_bandwidth_factor=float(np.exp(tile_bw)),
        floor_s=float(np.exp(floor)),
        bandwidth_efficiency=float(np.exp(-inv_bw)),
        compute_efficiency=float(np.exp(-inv_compute)),
        full_ctas_per_sm=float(np.exp(full_ctas)),
        occupancy_exponent=float(exponent),
        overlap_exponent=float(np.exp(overlap)),
    )


def fit_gemm(
    samples: pd.DataFrame,
    hardware: Hardware,
    layer_s: np.ndarray | None = None,
    other_s: np.ndarray | None = None,
    weights: np.ndarray | None = None,
    throttle: bool = True,
) -> GemmFit:
    """The GEMM parameters that best price ``samples`` on ``hardware``: each GEMM's time, or
    with ``layer_s`` each layer's (its GEMMs, by the samples' ``row``, plus ``other_s``),
    its residual scaled by ``weights`` when given; ``throttle=False`` leaves the power cap
    out (the model before it)."""
    sm_count = sm_count_of(hardware)
    m, k, n = (samples[c].to_numpy(dtype=float) for c in ("m", "k", "n"))
    measured = samples["time_s"].to_numpy(dtype=float)
    rows = samples["row"].to_numpy(dtype=int) if layer_s is not None else None
    flops, bw = hardware.bf16_flops_per_s, hardware.hbm_bandwidth_bytes_per_s

    def residuals(theta: np.ndarray) -> np.ndarray:
        fit = _gemm_fit(theta)
        sustained = None
        if rows is not None and fit.throttle_slowdown > 0:
            # The power cap's run: the layer pass's GEMMs (sim.gpu_kernels.layer_gemms_time_s).
            cool = fit.model_copy(update={"throttle_slowdown": 0.0})
            cool_s = gemm_time_s(m, k, n, cool, sm_count, flops, bw)
            sustained = np.bincount(rows, cool_s, minlength=len(layer_s))[rows]
        predicted = gemm_time_s(m, k, n, fit, sm_count, flops, bw, sustained_s=sustained)
        if layer_s is None:
            return np.log(predicted / measured)
        total = np.bincount(rows, predicted, minlength=len(layer_s)) + other_s
        keep = ~np.isnan(layer_s)
        if weights is None:
            return np.log(total[keep] / layer_s[keep])
        return weights[keep] * np.log(total[keep] / layer_s[keep])

    lower = [np.log(1e-8), 0.0, 0.0, -3.0, 0.0, 0.0, 0.0, np.log(1e-3), 0.0, np.log(1e-5)]
    upper = [np.log(1e-4), 3.0, 3.0, 3.0, 2.0, np.log(20.0), np.log(100.0), np.log(0.3), 1.0, 0.0]
    # The kernel choice (a minimum over tiles) makes the loss rugged: start from a few
    # points and keep the best fit.
    size = len(lower) if throttle else 8
    fits = [
        least_squares(
            residuals,
            x0=x0[:size],
            bounds=(lower[:size], upper[:size]),
            loss="soft_l1",
            f_scale=_F_SCALE,
        )
        for x0 in _GEMM_STARTS
    ]
    return _gemm_fit(min(fits, key=lambda fit: fit.cost).x)


_GEMM_STARTS = (
    [np.log(4e-6), 0.1, 0.3, 0.0, 0.5, np.log(4.0), np.log(5.0), np.log(0.05), 0.1, np.log(1e-3)],
    [np.log(2e-6), 0.2, 0.2, 1.0, 1.0, np.log(3.0), np.log(20.0), np.log(0.01), 0.05, np.log(3e-4)],
    [np.log(5e-6), 0.05, 0.1, -1.0, 0.2, np.log(10.0), np.log(3.0), np.log(0.2), 0.2, np.log(3e-3)],
)


def elementwise_samples(layers: pd.DataFrame) -> pd.DataFrame:
    """One row per measured element-wise operator: ``kind``, ``bytes``, ``time_s``."""
    shapes = _shapes(layers)
    m = layers["num_tokens"].to_numpy(dtype=float)
    parts = []
    for op in (*ELEMENTWISE_OPS, EMBEDDING_OP):
        if op not in layers.columns:
            continue
        if op == EMBEDDING_OP:
            kind = "embedding"
            per_token = np.array([2 * s.dtype_bytes * s.hidden for s in shapes], dtype=float)
        else:
            kind = shapes[0].elementwise_bytes()[op][0]
            per_token = np.array([s.elementwise_bytes()[op][1] for s in shapes], dtype=float)
        parts.append(
            pd.DataFrame({"kind": kind, "bytes": m * per_token, "time_s": layers[op].to_numpy()})
        )
    return pd.concat(parts, ignore_index=True).dropna()


def fit_elementwise(samples: pd.DataFrame, hardware: Hardware) -> dict[str, ElementwiseFit]:
    """Floor and bandwidth of each element-wise kind in ``samples``."""
    bw = hardware.hbm_bandwidth_bytes_per_s
    fits = {}
    for kind, rows in samples.groupby("kind"):
        nbytes = rows["bytes"].to_numpy(dtype=float)
        measured = rows["time_s"].to_numpy(dtype=float)

        def residuals(theta: np.ndarray, nbytes=nbytes, measured=measured) -> np.ndarray:
            fit = ElementwiseFit(
                floor_s=float(np.exp(theta[0])), bandwidth_efficiency=float(np.exp(-theta[1]))
            )
            return np.log(elementwise_time_s(nbytes, fit, bw) / measured)

        theta = _robust_fit(
            residuals, [np.log(3e-6), 0.5], [np.log(1e-8), 0.0], [np.log(1e-4), 5.0]
        )
        fits[str(kind)] = ElementwiseFit(
            floor_s=float(np.exp(theta[0])), bandwidth_efficiency=float(np.exp(-theta[1]))
        )
    return fits


def fit_allreduce(samples: pd.DataFrame) -> list[AllReduceFit]:
    """Latency and bandwidth per TP degree of all-reduce ``samples``."""
    fits = []
    for tp, rows in samples.groupby("tensor_parallel_size"):
        nbytes = rows["bytes"].to_numpy(dtype=float)
        measured = rows["time_s"].to_numpy(dtype=float)

        def residuals(theta: np.ndarray, nbytes=nbytes, measured=measured) -> np.ndarray:
            return np.log((np.exp(theta[0]) + nbytes / np.exp(theta[1])) / measured)

        theta = _robust_fit(
            residuals,
            [np.log(2e-5), np.log(1e11)],
            [np.log(1e-8), np.log(1e8)],
            [np.log(1e-2), np.log(1e14)],
        )
        fits.append(
            AllReduceFit(
                tensor_parallel_size=int(tp),
                latency_s=float(np.exp(theta[0])),
                bandwidth_bytes_per_s=float(np.exp(theta[1])),
            )
        )
    return fits


def fit_kernel_params(
    tables: OperatorTables, hardware: Hardware, throttle: bool = True
) -> KernelParams:
    """Every kernel parameter of one GPU from its operator and all-reduce tables
    (``throttle``: as in :func:`fit_gemm`)."""
    if tables.layers.empty:
        raise KvsimConfigError(f"no operator measurements for GPU {tables.gpu!r}")
    layers = tables.layers.reset_index(drop=True)
    elementwise = fit_elementwise(elementwise_samples(layers), hardware)
    other_s = _elementwise_layer_s(layers, _by_shape(layers), elementwise, hardware)
    return KernelParams(
        gemm=fit_gemm(
            gemm_samples(layers),
            hardware,
            measured_layer_s(layers),
            other_s,
            _cell_weights(layers),
            throttle,
        ),
        elementwise=elementwise,
        allreduce=fit_allreduce(tables.allreduce),
    )


def _cell_weights(layers: pd.DataFrame) -> np.ndarray:
    """A weight per row so that each (TP degree, regime) cell weighs the same in the GEMM fit
    (in the loss's quadratic range; beyond it soft-L1 grows like the weight, so a cell's
    outliers weigh as the square root of its size): the tables sample prefill token counts
    far more densely than decode ones."""
    regime = np.digitize(layers["num_tokens"].to_numpy(), REGIME_EDGES)
    cell = pd.Series(list(zip(layers["num_tensor_parallel_workers"], regime, strict=True)))
    counts = cell.map(cell.value_counts()).to_numpy(dtype=float)
    weights = 1 / np.sqrt(counts)  # residuals are squared
    return weights / np.sqrt(np.mean(weights**2))


def _by_shape(layers: pd.DataFrame) -> dict[LayerShape, np.ndarray]:
    """The positions of ``layers``' rows, grouped by layer shape."""
    groups: dict[LayerShape, list[int]] = {}
    for i, shape in enumerate(_shapes(layers)):
        groups.setdefault(shape, []).append(i)
    return {shape: np.array(rows) for shape, rows in groups.items()}


def _elementwise_layer_s(
    layers: pd.DataFrame,
    by_shape: dict[LayerShape, np.ndarray],
    elementwise: dict[str, ElementwiseFit],
    hardware: Hardware,
) -> np.ndarray:
    """Each row's predicted time of the layer's element-wise operators that it measured."""
    bw = hardware.hbm_bandwidth_bytes_per_s
    m = layers["num_tokens"].to_numpy(dtype=float)
    total = np.zeros(len(layers))
    for shape, rows in by_shape.items():
        for op, (kind, per_token) in shape.elementwise_bytes().items():
            if op not in layers.columns:
                continue
            measured = ~np.isnan(layers[op].to_numpy(dtype=float)[rows])
            time_s = elementwise_time_s(m[rows] * per_token, elementwise[kind], bw)
            total[rows] += np.where(measured, time_s, 0.0)
    return total


def measured_layer_s(layers: pd.DataFrame) -> np.ndarray:
    """Each row's measured non-attention layer time: the sum of the operators it has."""
    ops = [op for op in (*GEMM_OPS, *ELEMENTWISE_OPS) if op in layers.columns]
    total = layers[ops].sum(axis=1).to_numpy(dtype=float, copy=True)
    total[layers[list(GEMM_OPS)].isna().any(axis=1).to_numpy()] = np.nan  # not a whole layer
    return total


def predicted_layer_s(layers: pd.DataFrame, params: KernelParams, hardware: Hardware) -> np.ndarray:
    """Each row's predicted layer time over the same operators as :func:`measured_layer_s`
    (a model without a post-attention norm, like phi-2, has none predicted either)."""
    sm_count = sm_count_of(hardware)
    m = layers["num_tokens"].to_numpy(dtype=float)
    by_shape = _by_shape(layers)
    total = _elementwise_layer_s(layers, by_shape, params.elementwise, hardware)
    for shape, rows in by_shape.items():
        timer = OperatorTimer(
            shape,
            1,
            params,
            sm_count,
            hardware.bf16_flops_per_s,
            hardware.hbm_bandwidth_bytes_per_s,
        )
        total[rows] += timer.gemms_time_s(m[rows])
    return total


def roofline_layer_s(
    layers: pd.DataFrame,
    hardware: Hardware,
    compute_efficiency: float,
    bandwidth_efficiency: float,
) -> np.ndarray:
    """Each row's layer time as the cost model's roofline prices it: ``max(2 * W * T / (F *
    compute_efficiency), 2 * W / (BW * bandwidth_efficiency))`` with ``W`` the layer's GEMM
    weights per GPU (activations and element-wise operators are free in the roofline)."""
    weights = np.array(
        [sum(k * n for k, n in layer_shape(row).gemms().values()) for _, row in layers.iterrows()],
        dtype=float,
    )
    tokens = layers["num_tokens"].to_numpy(dtype=float)
    compute_s = 2 * weights * tokens / (hardware.bf16_flops_per_s * compute_efficiency)
    memory_s = 2 * weights / (hardware.hbm_bandwidth_bytes_per_s * bandwidth_efficiency)
    return np.maximum(compute_s, memory_s)


def fit_roofline(layers: pd.DataFrame, hardware: Hardware) -> tuple[float, float]:
    """The roofline's (compute_efficiency, bandwidth_efficiency) that best price the TP1 rows
    of ``layers`` (the roofline has no floors, which dominate small TP shards)."""
    layers = layers[layers["num_tensor_parallel_workers"] == 1]
    measured = measured_layer_s(layers)
    keep = ~np.isnan(measured)
    layers, measured = layers[keep], measured[keep]

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.log(roofline_layer_s(layers, hardware, *np.exp(-theta)) / measured)

    theta = _robust_fit(residuals, [0.5, 0.2], [0.0, 0.0], [5.0, 5.0])
    compute, bandwidth = np.exp(-theta)
    return float(compute), float(bandwidth)
