"""The ``kvsim`` command line."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sim.console import console, count_progress, err_console, fail, note
from sim.errors import KvsimConfigError

app = typer.Typer(
    name="kvsim",
    help="Simulate vLLM's KV cache and scheduler under agent-fleet traffic.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def run(
    scenario: Annotated[
        Path | None, typer.Argument(help="Scenario YAML; default: the coding-agent fleet.")
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field, e.g. --set engine.max_num_seqs=128."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", help="Run directory (default: a new one in runs/).")
    ] = None,
    calibration: Annotated[
        Path | None, typer.Option(help="Calibration profile JSON from `kvsim calibrate`.")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
    kv_waste: Annotated[
        bool,
        typer.Option(
            "--kv-waste",
            help="Add the KV waste breakdown (kv_waste_breakdown in summary.json) for the "
            "paged allocator too (always there for engine.allocator static / orca_*); runs "
            "every step through the scheduler.",
        ),
    ] = False,
    samples: Annotated[
        int,
        typer.Option(
            help="Also run the scenario N more times at the step speeds the calibration's "
            "measured runs ran at (each step with its own jitter, and latencies and "
            "throughput times the fit's model error held out on its calibration scenarios, "
            "where the profile records them), and report each metric's median and p10-p90 "
            "band (samples.json; needs --calibration from kvsim calibrate).",
            min=0,
        ),
    ] = 0,
    vary_seed: Annotated[
        bool,
        typer.Option("--vary-seed", help="With --samples: sample i also uses seed + i."),
    ] = False,
) -> None:
    """Simulate a scenario; write its run directory and print the summary."""
    from sim.config.calibration import hardware_warning, load_profile
    from sim.config.sizing import kv_cache_summary
    from sim.report import (
        band_table,
        partial_lines,
        step_time_source,
        summary_table,
        what_if_line,
    )
    from sim.results import claim_new_run_dir, claim_run_dir, release_claim
    from sim.runner import simulate
    from sim.scenario import DEFAULT_SCENARIO, check_runnable, load_scenario
    from sim.step_record import shapes_of_steps
    from sim.uncertainty import (
        SAMPLES,
        BandRow,
        band_records,
        band_rows,
        run_samples,
        sample_factors,
        truncation_warning,
    )

    out_dir: Path | None = None
    try:
        # Everything that can fail is checked before simulating: the scenario, the files it
        # reads, the KV sizing, the profile, and the run directory, claimed atomically.
        scenario = scenario or DEFAULT_SCENARIO
        spec = load_scenario(scenario, set_ or [])
        check_runnable(spec, str(scenario))
        profile = load_profile(calibration) if calibration is not None else None
        if vary_seed and not samples:
            raise KvsimConfigError("--vary-seed varies the seeds of --samples; give --samples N")
        if samples:
            sample_factors(profile, samples)  # a profile without measured runs: say so now
        warnings = (
            [
                profile.budget_warning(spec.engine.max_num_batched_tokens),
                hardware_warning(profile, spec.hardware.name),
            ]
            if profile
            else []
        )
        for warning in filter(None, warnings):
            note(warning)
        out_dir = claim_run_dir(out) if out else claim_new_run_dir(Path("runs"), spec.name)
        started = time.perf_counter()
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            console=err_console,
            disable=quiet or not err_console.is_terminal,
            transient=True,
        ) as bar:
            task = bar.add_task(f"simulating {spec.name}", total=None, status="")

            def progress(now_s: float, finished: int, expected: int | None) -> None:
                bar.update(
                    task,
                    total=expected,
                    completed=finished,
                    status=f"sim t={now_s:,.0f} s, {finished:,} requests done",
                )

            result = simulate(spec, profile, progress, kv_waste=kv_waste)
        wall_s = time.perf_counter() - started
        if result.summary["num_requests"] == 0:
            raise KvsimConfigError(
                f"{scenario}: no request arrived before limits.max_duration_s="
                f"{spec.limits.max_duration_s:,.6g} s; raise it, or make the workload's "
                "arrivals earlier"
            )
        band: list[BandRow] = []
        band_warning = None
        writers = []
        if samples:
            with count_progress(quiet, transient=True) as bar:
                task = bar.add_task("sampling step speeds", total=samples)
                factors, summaries = run_samples(
                    spec,
                    profile,
                    samples,
                    vary_seed,
                    on_done=lambda k: bar.update(task, completed=k),
                    on_serial=note,
                )
            band = band_rows(result.summary, summaries, profile)
            band_warning = truncation_warning(result.summary, summaries)
            record = band_records(band, factors, summaries, profile)
            writers.append(lambda d: (d / SAMPLES).write_text(json.dumps(record, indent=2) + "\n"))
        result.write(out_dir, writers)
    except (KvsimConfigError, FileExistsError, ValueError) as exc:
        if out_dir is not None:
            release_claim(out_dir)
        raise fail(str(exc)) from None
    except OSError as exc:
        if out_dir is not None:
            release_claim(out_dir)
        where = f"--out {out_dir}: cannot write the run" if out_dir else "cannot read an input"
        raise fail(f"{where} ({exc})") from None
    except KeyboardInterrupt:
        if out_dir is not None:
            release_claim(out_dir)
        note("interrupted: nothing written", "red")
        raise typer.Exit(130) from None
    except BaseException:
        if out_dir is not None:
            release_claim(out_dir)
        raise
    console.print(summary_table(result.summary))
    for partial in partial_lines(result.summary):
        note(partial)
    if what_if := what_if_line(result.summary):
        note(what_if, "cyan")
    per_replica = " per replica" if spec.fleet is not None else ""
    console.print(f"KV cache: {kv_cache_summary(result.sizing)}{per_replica}", highlight=False)
    console.print(step_time_source(result.summary), highlight=False)
    coverage = (
        profile.coverage(shapes_of_steps(result.steps), spec.engine.max_num_batched_tokens)
        if profile
        else None
    )
    if coverage is not None:
        console.print(f"shape coverage: {coverage.line()}", highlight=False)
        if warning := coverage.warning():
            note(warning)
    if band:
        console.print(band_table(band, samples, vary_seed))
        if band_warning:
            note(band_warning)
    sim_s = result.summary["duration_s"]
    console.print(
        f"simulated {sim_s:,.1f} s and {result.summary['num_requests']:,} requests in "
        f"{wall_s:,.1f} s wall ({sim_s / wall_s:,.0f} simulated s per wall s); run written to "
        f"{out_dir}",
        highlight=False,
    )


@app.command()
def scenarios() -> None:
    """List the shipped scenarios, the folder they are in and the question each answers."""
    from sim.scenario import SCENARIO_DIR, load_scenario

    # The scenarios of the README's table: one engine, then fleets (calibration, validation,
    # claims and benchmark scenarios live in their own folders and serve those commands).
    paths = [*sorted(SCENARIO_DIR.glob("*.yaml")), *sorted(SCENARIO_DIR.glob("fleet/*.yaml"))]
    if not paths:
        # An install that left scenarios/ out (it ships beside sim/ in the wheel).
        raise fail(
            f"no shipped scenarios in {SCENARIO_DIR} (no *.yaml there or in its fleet/ folder): "
            "this kvsim was installed without its scenarios/ folder, which a wheel of kvsim "
            "ships beside sim/; reinstall it (in a checkout: pip install -e .), or pass a "
            "scenario YAML of your own to kvsim run"
        )
    # Where they are: an installed kvsim's are in site-packages, not ./scenarios.
    console.print(
        f"the shipped scenarios, in {SCENARIO_DIR}:", markup=False, highlight=False, soft_wrap=True
    )
    for path in paths:
        name = path.relative_to(SCENARIO_DIR).as_posix()
        try:
            spec = load_scenario(path)
            console.print(
                f"[bold]{escape(name)}[/bold]: {escape(spec.description)}", highlight=False
            )
        except KvsimConfigError as exc:
            console.print(f"[red]{escape(name)}[/red]: {escape(str(exc))}", highlight=False)


@app.command()
def dashboard(
    host: Annotated[str, typer.Option(help="Address to bind (local only by default).")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="Port to serve on.")] = 8501,
    runs_dir: Annotated[Path, typer.Option(help="Where run directories are read and saved.")] = (
        Path("runs")
    ),
    headless: Annotated[
        bool, typer.Option(help="Do not open a browser (one opens only where there is a display).")
    ] = False,
) -> None:
    """Open the Streamlit dashboard: what-ifs, run explorer, sim-vs-real comparison."""
    from dashboard.launch import check_options, launch

    try:
        check_options(host, port, runs_dir)
    except KvsimConfigError as exc:
        raise fail(str(exc)) from None
    raise typer.Exit(launch(host=host, port=port, runs_dir=runs_dir, headless=headless))


def _register_rollout_commands() -> None:
    from sim import rollout_commands, tune_commands

    app.command("sweep")(rollout_commands.sweep)
    app.command("capacity")(rollout_commands.capacity)
    app.command("tune")(tune_commands.tune_cmd)
    app.command("export")(rollout_commands.export_cmd)


def _register_validation_commands() -> None:
    # validate/ imports vLLM lazily, inside the commands: registering them costs nothing.
    from validate import commands

    app.command("validate")(commands.validate_cmd)
    app.command("replay")(commands.replay_cmd)
    app.command("calibrate")(commands.calibrate_cmd)
    app.command("compare")(commands.compare_cmd)


def _register_report_commands() -> None:
    from sim.claims.cli import report_app

    app.add_typer(report_app, name="report")


_register_validation_commands()
_register_rollout_commands()
_register_report_commands()


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
