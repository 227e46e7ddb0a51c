"""The ``kvsim`` command line."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sim.console import console, err_console, fail
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
) -> None:
    """Simulate a scenario; write its run directory and print the summary."""
    from sim.config.sizing import kv_cache_summary
    from sim.cost_model import load_cost_params
    from sim.report import summary_table
    from sim.results import claim_new_run_dir, claim_run_dir, release_claim
    from sim.runner import simulate
    from sim.scenario import DEFAULT_SCENARIO, check_runnable, load_scenario

    out_dir: Path | None = None
    try:
        # Everything that can fail is checked before simulating: the scenario, the files it
        # reads, the KV sizing, the profile, and the run directory, claimed atomically.
        scenario = scenario or DEFAULT_SCENARIO
        spec = load_scenario(scenario, set_ or [])
        check_runnable(spec, str(scenario))
        profile = load_cost_params(calibration) if calibration is not None else None
        warning = profile.budget_warning(spec.engine.max_num_batched_tokens) if profile else None
        if warning:
            err_console.print(f"[yellow]{warning}[/yellow]", highlight=False)
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

            result = simulate(spec, profile, progress)
        wall_s = time.perf_counter() - started
        if result.summary["num_requests"] == 0:
            raise KvsimConfigError(
                f"{scenario}: no request arrived before limits.max_duration_s="
                f"{spec.limits.max_duration_s:,.6g} s; raise it, or make the workload's "
                "arrivals earlier"
            )
        result.write(out_dir)
    except (KvsimConfigError, FileExistsError, ValueError) as exc:
        if out_dir is not None:
            release_claim(out_dir)
        raise fail(str(exc)) from None
    except OSError as exc:
        if out_dir is not None:
            release_claim(out_dir)
        where = f"--out {out_dir}: cannot write the run" if out_dir else "cannot read an input"
        raise fail(f"{where} ({exc})") from None
    except BaseException:
        if out_dir is not None:
            release_claim(out_dir)
        raise
    console.print(summary_table(result.summary))
    console.print(f"KV cache: {kv_cache_summary(result.sizing)}", highlight=False)
    sim_s = result.summary["duration_s"]
    console.print(
        f"simulated {sim_s:,.1f} s and {result.summary['num_requests']:,} requests in "
        f"{wall_s:,.1f} s wall ({sim_s / wall_s:,.0f} simulated s per wall s); run written to "
        f"{out_dir}",
        highlight=False,
    )


@app.command()
def scenarios() -> None:
    """List the shipped scenarios and the question each answers."""
    from sim.scenario import SCENARIO_DIR, load_scenario

    for path in sorted(SCENARIO_DIR.glob("*.yaml")):
        try:
            spec = load_scenario(path)
            console.print(f"[bold]{path.name}[/bold]: {spec.description}", highlight=False)
        except KvsimConfigError as exc:
            console.print(f"[red]{path.name}[/red]: {exc}", highlight=False)


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


@app.command("export")
def export_cmd(
    source: Annotated[
        Path, typer.Argument(help="A run directory (its scenario.yaml) or a scenario YAML.")
    ],
    format_: Annotated[
        str, typer.Option("--format", help="vllm-args, vllm-yaml or triton.")
    ] = "vllm-args",
    out: Annotated[
        Path | None,
        typer.Option(
            help="File to write (vllm-args, vllm-yaml) or model repository folder (triton); "
            "default: print vllm-args/vllm-yaml to stdout."
        ),
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(help="Model vLLM loads (hub name or path); default: the scenario's."),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field first, e.g. --set engine.max_num_seqs=128."),
    ] = None,
) -> None:
    """Export a scenario's engine config for rollout: vllm serve args or YAML, or Triton."""
    from sim.export import FORMATS, export, serve_command, serve_yaml
    from sim.scenario import check_runnable, load_scenario

    try:
        if format_ not in FORMATS:
            raise KvsimConfigError(f"--format {format_!r}: expected one of {', '.join(FORMATS)}")
        path = source / "scenario.yaml" if source.is_dir() else source
        if source.is_dir() and not path.is_file():
            raise KvsimConfigError(f"{source}: a folder without scenario.yaml (not a run)")
        spec = load_scenario(path, set_ or [])
        check_runnable(spec, str(path))
        if out is None:
            if format_ == "triton":
                raise KvsimConfigError("--format triton writes a model repository: give --out")
            text = serve_command(spec, model) if format_ == "vllm-args" else serve_yaml(spec, model)
            console.out(text.rstrip("\n"), highlight=False)
            return
        written = export(spec, format_, out, model)
    except (KvsimConfigError, FileExistsError, ValueError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"--out {out}: cannot write the export ({exc})") from None
    for file in written:
        console.print(f"wrote {file}", highlight=False)


@app.command()
def sweep(
    scenario: Annotated[Path, typer.Argument(help="Scenario YAML to sweep.")],
    grid: Annotated[
        list[str],
        typer.Option(
            help="FIELD=V1,V2,... (repeatable): the sweep runs the cross product of all grids."
        ),
    ],
    out: Annotated[
        Path, typer.Option(help="Sweep folder; re-running the same command there resumes.")
    ],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field in every point, e.g. --set seed=7."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(help="Worker processes (default: every local core).")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Run a scenario over a grid of overrides in parallel; resumable; one results table."""
    from rich.progress import MofNCompleteColumn, TimeRemainingColumn

    from sim.sweep import RESULTS_FILE, default_workers, plan_sweep, run_sweep

    plan = None
    try:
        plan = plan_sweep(scenario, grid, set_ or [], out)
        pending = plan.pending()
        total = len(plan.points)
        with Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=err_console,
            disable=quiet or not err_console.is_terminal,
        ) as bar:
            task = bar.add_task(
                f"sweep {scenario.name}", total=total, completed=total - len(pending), failed=""
            )
            failures: list[str] = []

            def finished(point: object, error: str | None) -> None:
                if error is not None:
                    failures.append(error)
                failed = f"[red]{len(failures)} failed[/red]" if failures else ""
                bar.update(task, advance=1, failed=failed)

            table = run_sweep(plan, workers or default_workers(), finished)
    except KeyboardInterrupt:
        if plan is not None:
            total = len(plan.points)
            err_console.print(
                f"interrupted: {total - len(plan.pending())} of {total} points done and kept "
                f"in {out}; run the same command again to finish the rest",
                highlight=False,
            )
        raise typer.Exit(130) from None
    except (KvsimConfigError, ValueError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"--out {out}: cannot write the sweep ({exc})") from None
    failed = table[table["status"] == "failed"]
    console.print(
        f"{len(table) - len(failed)} of {len(table)} points ran"
        + (f", {len(failed)} failed (see the error column)" if len(failed) else "")
        + f"; results: {out / RESULTS_FILE}",
        highlight=False,
    )


@app.command()
def capacity(
    scenario: Annotated[
        Path | None, typer.Argument(help="Scenario YAML; default: the coding-agent fleet.")
    ] = None,
    slo: Annotated[
        list[str] | None,
        typer.Option(help="An SLO bound, e.g. --slo ttft_p99_s=2 (default: the scenario's)."),
    ] = None,
    knob: Annotated[
        str | None,
        typer.Option(help="Load field to search (default: sessions, or the arrival rate)."),
    ] = None,
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Override a field first, e.g. --set engine.max_num_seqs=128."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Write capacity.json (answer and curve) here.")
    ] = None,
) -> None:
    """The heaviest load (agents, or arrival rate) one deployment holds within its SLOs."""
    import json

    from rich.table import Table

    from sim.capacity import Knob, default_knob, find_capacity
    from sim.runner import simulate
    from sim.scenario import DEFAULT_SCENARIO, check_runnable, load_scenario

    source = scenario or DEFAULT_SCENARIO
    try:
        overrides = [*(set_ or []), *(f"slos.{bound}" for bound in slo or [])]
        spec = load_scenario(source, overrides)
        check_runnable(spec, str(source))
        if not spec.slos.model_dump(exclude_none=True):
            raise KvsimConfigError(
                f"{source}: no SLO to hold; give one, e.g. --slo ttft_p99_s=2 --slo itl_p99_s=0.1"
            )
        the_knob = default_knob(spec)
        if knob is not None:
            the_knob = Knob(knob, False, knob, 1e-9, 1e9)
        if out is not None and out.exists():
            raise FileExistsError(f"--out {out}: already exists; kvsim never overwrites")

        def progress(point: object) -> None:
            p = point  # a sim.capacity.LoadPoint
            verdict = "holds" if p.holds else "fails: " + "; ".join(p.failed)
            err_console.print(f"  {the_knob.field}={p.load:g}: {verdict}", highlight=False)

        err_console.print(f"searching {the_knob.field} ({the_knob.unit}) of {spec.name}...")
        result = find_capacity(spec, lambda s: simulate(s).summary, the_knob, progress)
    except (KvsimConfigError, FileExistsError, ValueError) as exc:
        raise fail(str(exc)) from None
    table = Table(title=f"{spec.name}: latency vs {the_knob.field}")
    for column in ("load", "holds", "TTFT p50 s", "TTFT p99 s", "ITL p99 s", "E2E p99 s",
                   "tok/s", "preempt", "peak sessions"):  # fmt: skip
        table.add_column(column, justify="right")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    for p in result.curve:
        table.add_row(
            f"{p.load:g}", "yes" if p.holds else "[red]no[/red]", ms(p.ttft_p50_s),
            ms(p.ttft_p99_s), ms(p.itl_p99_s), ms(p.e2e_p99_s),
            "-" if p.output_throughput_tok_s is None else f"{p.output_throughput_tok_s:,.0f}",
            str(p.preemptions), str(p.peak_concurrent_sessions),
        )  # fmt: skip
    console.print(table)
    bounds = ", ".join(f"{k} <= {v:g}" for k, v in spec.slos.model_dump(exclude_none=True).items())
    if result.first_failing is None:
        answer = f"holds at {result.capacity:g} {the_knob.unit}, the most tried"
    else:
        answer = (
            f"capacity: {result.capacity:g} {the_knob.unit} ({the_knob.field}); "
            f"{result.first_failing:g} fails"
        )
    console.print(f"{answer}, with {bounds} and every request finished", highlight=False)
    if result.knee is not None:
        console.print(f"knee of the p99 TTFT curve: {result.knee:g}", highlight=False)
    console.print(f"{len(result.curve)} simulations", highlight=False)
    if out is not None:
        out.mkdir(parents=True)
        document = {"scenario": spec.name, "slos": spec.slos.model_dump(), **result.to_json()}
        (out / "capacity.json").write_text(json.dumps(document, indent=2) + "\n")
        console.print(f"written to {out / 'capacity.json'}", highlight=False)


def _register_validation_commands() -> None:
    # validate/ imports vLLM lazily, inside the commands: registering them costs nothing.
    from validate import commands

    app.command("validate")(commands.validate_cmd)
    app.command("replay")(commands.replay_cmd)
    app.command("calibrate")(commands.calibrate_cmd)
    app.command("compare")(commands.compare_cmd)


_register_validation_commands()


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
