"""``kvsim sweep``, ``capacity`` and ``export``: from "which config" to the files an operator
deploys, and the options they share with ``kvsim tune`` (:mod:`sim.tune_commands`);
registered on the ``kvsim`` app by :mod:`sim.cli`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from sim.console import console, err_console, fail, note
from sim.errors import KvsimConfigError
from sim.files import probe_folder, reason, write_new_folder
from sim.fleet.config import ROUTING_WHAT_IF

if TYPE_CHECKING:
    from sim.capacity import CapacityResult, Knob, LoadPoint, ReplicaSearch
    from sim.scenario import Scenario

# Options several rollout commands take, declared once.
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a field first, e.g. --set engine.max_num_seqs=128."),
]
ScenarioArgument = Annotated[
    Path | None, typer.Argument(help="Scenario YAML; default: the coding-agent fleet.")
]
SloOption = Annotated[
    list[str] | None,
    typer.Option(help="An SLO bound, e.g. --slo ttft_p99_s=2 (default: the scenario's)."),
]
ExportFormatOption = Annotated[
    str | None,
    typer.Option(help="Also export the chosen config: vllm-args, vllm-yaml or triton."),
]
ExportOutOption = Annotated[Path | None, typer.Option(help="Where --export-format writes.")]


# The what-if line of `kvsim capacity --replicas`.
SEARCHED_FLEETS = f"fleets of replicas behind a simulated router {ROUTING_WHAT_IF}"


def slo_overrides(slo: list[str] | None) -> list[str]:
    """``--slo NAME=SECONDS`` as ``--set slos.NAME=SECONDS`` overrides; one without ``=`` is
    refused naming --slo (the --set parser would name --set)."""
    for bound in slo or []:
        if "=" not in bound:
            raise KvsimConfigError(
                f"--slo {bound!r}: expected NAME=SECONDS, e.g. --slo ttft_p99_s=2"
            )
    return [f"slos.{bound}" for bound in slo or []]


def check_export_options(
    export_format: str | None, export_out: Path | None, spec: Scenario | None = None
) -> None:
    """``--export-format`` and ``--export-out`` (of tune and capacity) before any work:
    the format, the destination, and that ``spec`` can be exported at all."""
    from sim.export import FORMATS, check_deployable, engine_args, served_model

    if (export_format is None) != (export_out is None):
        raise KvsimConfigError("--export-format and --export-out go together")
    if export_format is not None and export_format not in FORMATS:
        raise KvsimConfigError(
            f"--export-format {export_format!r}: expected one of {', '.join(FORMATS)}"
        )
    if export_out is not None and export_out.exists():
        raise FileExistsError(f"--export-out {export_out}: already exists; kvsim never overwrites")
    check_parent(export_out, "--export-out")
    if export_format is not None and spec is not None:
        engine_args(spec)
        check_deployable(spec)
        served_model(spec)


def check_parent(path: Path | None, option: str) -> None:
    """The folder ``path`` goes in can be written, checked before a long search with a real
    write (``os.access`` says yes to root, even under ``/proc``): a hidden file created and
    removed in it, or in its nearest existing ancestor when it is still to be created (the
    check creates no folder: ``--export-out`` may go inside ``--out``)."""
    if path is None:
        return
    try:
        parent = path.resolve().parent
        probe_folder(parent)
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a symlink loop
        where = path.parent if isinstance(exc, RuntimeError) else parent
        raise KvsimConfigError(
            f"{option} {path}: {where} is not a writable folder ({reason(exc)})"
        ) from None


def write_document(out: Path, name: str, document: dict[str, Any]) -> Path:
    """``document`` as ``out/name`` (JSON) in the new folder ``out``, which appears only
    once complete: a failed write leaves no folder to block the rerun."""
    (file,) = write_new_folder(out, {name: json.dumps(document, indent=2) + "\n"})
    return file


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
    set_: SetOption = None,
) -> None:
    """Export a scenario's engine config for rollout: vllm serve args or YAML, or Triton."""
    from sim.export import FORMATS, export, serve_command, serve_yaml
    from sim.scenario import load_scenario

    try:
        if format_ not in FORMATS:
            raise KvsimConfigError(f"--format {format_!r}: expected one of {', '.join(FORMATS)}")
        path = source / "scenario.yaml" if source.is_dir() else source
        if source.is_dir() and not path.is_file():
            raise KvsimConfigError(f"{source}: a folder without scenario.yaml (not a run)")
        # Not check_runnable: an export needs the engine, model and GPU, not the workload
        # (a trace need not be here); the formats refuse a config vLLM could not start.
        spec = load_scenario(path, set_ or [])
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
    ray: Annotated[
        str | None,
        typer.Option(
            help="Run the points on Ray: local (a Ray instance for this sweep), auto (the "
            "cluster `ray start` runs here) or HOST:PORT / ray://HOST:PORT."
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Run a scenario over a grid of overrides in parallel; resumable; one results table."""
    from sim.cores import default_workers
    from sim.sweep import (
        RESULTS_FILE,
        check_runner,
        plan_sweep,
        run_sweep,
        unfinished_points,
    )

    plan = None
    try:
        check_runner(workers, ray)  # before the folder exists: a refusal leaves nothing
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

            table = run_sweep(
                plan, default_workers() if workers is None else workers, finished, ray
            )
    except KeyboardInterrupt:
        if plan is not None:
            total = len(plan.points)
            err_console.print(
                f"interrupted: {total - len(plan.pending())} of {total} points done and kept "
                f"in {out}; run the same command again to finish the rest",
                highlight=False,
            )
        else:
            err_console.print(
                "interrupted before any point ran; run the same command again to start the sweep",
                highlight=False,
            )
        raise typer.Exit(130) from None
    except (KvsimConfigError, ValueError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:  # the sweep's folder, or a point's run in it
        raise fail(
            f"cannot write the sweep in {out}: {exc}; the finished points are kept and the "
            "rest stay pending: make room (or fix the folder) and run the same command again "
            "to resume"
        ) from None
    except MemoryError:
        raise fail(
            f"out of memory running the sweep in {out}; the finished points are kept and the "
            "rest stay pending: run the same command again, with fewer --workers, to resume "
            "(a point that runs out of memory with --workers 1 needs more than this machine "
            "has: leave its value out of the grid)"
        ) from None
    ok = table["status"] == "ok"
    ran, failed = int(ok.sum()), int((table["status"] == "failed").sum())
    pending = len(table) - ran - failed
    cut = int(unfinished_points(table).sum())
    what_ifs = int(table["what_if"].notna().sum()) if "what_if" in table.columns else 0
    console.print(
        f"{ran} of {len(table)} points ran"
        + (
            f" ({cut} hit limits.max_duration_s with requests unfinished: their latencies "
            "leave those out, see num_finished and num_not_arrived)"
            if cut
            else ""
        )
        + (
            f", {what_ifs} of them what-ifs vLLM 0.32 does not run as configured (see the "
            "what_if column)"
            if what_ifs
            else ""
        )
        + (f", {failed} failed (see the error column)" if failed else "")
        + (f", {pending} have no result (their run directory is missing)" if pending else "")
        + f"; results: {out / RESULTS_FILE}",
        highlight=False,
    )


def capacity(
    scenario: ScenarioArgument = None,
    slo: SloOption = None,
    knob: Annotated[
        str | None,
        typer.Option(help="Load field to search (default: sessions, or the arrival rate)."),
    ] = None,
    set_: SetOption = None,
    out: Annotated[
        Path | None, typer.Option(help="Write capacity.json (answer and curve) here.")
    ] = None,
    export_format: ExportFormatOption = None,
    export_out: ExportOutOption = None,
    replicas: Annotated[
        bool,
        typer.Option(
            "--replicas",
            help="Search the fewest fleet replicas that hold the scenario's own load instead.",
        ),
    ] = False,
    router: Annotated[
        list[str] | None,
        typer.Option(
            help="With --replicas: a router kind to search for (repeatable; default the "
            "scenario's router, or round_robin).",
        ),
    ] = None,
    max_replicas: Annotated[
        int | None,
        typer.Option(min=1, max=1024, help="With --replicas: try at most this many (64)."),
    ] = None,
) -> None:
    """The heaviest load one deployment holds within its SLOs, or the fewest replicas.

    The load: the scenario's agents (sessions) or its arrival rate.

    With --replicas: the fewest fleet replicas (GPUs) that hold the scenario's load, per router.
    """
    from sim.capacity import default_knob, find_capacity, knob_for
    from sim.runner import simulate
    from sim.scenario import DEFAULT_SCENARIO, check_runnable, load_scenario

    source = scenario or DEFAULT_SCENARIO
    try:
        overrides = [*(set_ or []), *slo_overrides(slo)]
        spec = load_scenario(source, overrides)
        check_runnable(spec, str(source))
        if not spec.slos.model_dump(exclude_none=True):
            raise KvsimConfigError(
                f"{source}: no SLO to hold; give one, e.g. --slo ttft_p99_s=2 --slo itl_p99_s=0.1"
            )
        if replicas and knob is not None:
            raise KvsimConfigError(
                "--replicas searches the replica count and --knob a load: give one search"
            )
        if not replicas and (router or max_replicas is not None):
            raise KvsimConfigError("--router and --max-replicas go with --replicas")
        the_knob: Knob | None = None
        if not replicas:
            the_knob = knob_for(spec, knob) if knob is not None else default_knob(spec)
        if out is not None and out.exists():
            raise FileExistsError(f"--out {out}: already exists; kvsim never overwrites")
        check_parent(out, "--out")
        check_export_options(export_format, export_out, spec)
        if the_knob is None:
            results = _search_replicas(spec, router or [None], max_replicas)
            document = {"replica_search": [r.to_json() for r in results]}
        else:
            knob_field = the_knob.field

            def progress(p: LoadPoint) -> None:
                verdict = "holds" if p.holds else "fails: " + "; ".join(p.failed)
                err_console.print(f"  {knob_field}={p.load:g}: {verdict}", highlight=False)

            err_console.print(f"searching {the_knob.field} ({the_knob.unit}) of {spec.name}...")
            result = find_capacity(spec, lambda s: simulate(s).summary, the_knob, progress)
            document = result.to_json()
    except (KvsimConfigError, FileExistsError, ValueError) as exc:
        raise fail(str(exc)) from None
    if the_knob is None:
        _print_replicas(spec, results)
        # Every point of the search is a fleet behind a router that is kvsim's model.
        what_if = [*spec.engine.what_if_policies(), SEARCHED_FLEETS]
    else:
        _print_capacity(spec, the_knob, result)
        what_if = spec.what_ifs()
    if what_if:
        note(f"a what-if, not vLLM 0.32's own behaviour: {'; '.join(what_if)}", "cyan")
    document = {
        "scenario": spec.name,
        "slos": spec.slos.model_dump(),
        "what_if": what_if,
        **document,
    }
    if the_knob is None and all(r.fewest is None for r in results):
        # As a load search that nothing holds: the curve is written, the command fails.
        _write_results(out, document, spec, None, None)
        raise fail(
            "no router tried holds the SLOs with every request finished, with up to "
            f"{max(p.load for r in results for p in r.curve):g} replicas (the search stops at "
            "--max-replicas or at the workload's request count)"
            + ("; nothing exported" if export_format is not None else "")
        )
    exported = spec if the_knob is not None else sized_fleet(spec, results)
    _write_results(out, document, exported, export_format, export_out)


def sized_fleet(spec: Scenario, results: list[ReplicaSearch]) -> Scenario:
    """The fleet ``kvsim capacity --replicas`` found: the router that held with the fewest
    replicas (the first such, in the order asked), at that count (one engine, no fleet,
    when one replica holds); one must have held."""
    from sim.fleet.config import router_section
    from sim.scenario import parse_scenario

    best = min((r for r in results if r.fewest is not None), key=lambda r: r.fewest or 0)
    document = spec.model_dump(mode="json")
    fleet = document.get("fleet") or {"replicas": 1, "router": {"kind": "round_robin"}}
    document["fleet"] = (
        None  # one engine needs no router
        if best.fewest == 1
        else {"replicas": best.fewest, "router": router_section(fleet["router"], best.router)}
    )
    return parse_scenario(document, spec.name)


def _print_capacity(spec: Scenario, the_knob: Knob, result: CapacityResult) -> None:
    """The curve and the answer of a load search."""
    table = Table(title=escape(f"{spec.name}: latency vs {the_knob.field}"))
    for column in ("load", "holds", "TTFT p50 s", "TTFT p99 s", "ITL p99 s", "E2E p99 s",
                   "tok/s", "preempt", "peak sessions"):  # fmt: skip
        table.add_column(column, justify="right")

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.3g}"

    for p in result.curve:
        table.add_row(
            f"{p.load:g}", "yes" if p.holds else "[red]no[/red]", secs(p.ttft_p50_s),
            secs(p.ttft_p99_s), secs(p.itl_p99_s), secs(p.e2e_p99_s),
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


def _write_results(
    out: Path | None,
    document: dict[str, Any],
    spec: Scenario,
    export_format: str | None,
    export_out: Path | None,
) -> None:
    """Write capacity.json into ``out`` and the export, once a search has finished."""
    from sim.export import export

    if out is not None:
        try:
            written = write_document(out, "capacity.json", document)
        except OSError as exc:
            raise fail(
                f"the search finished, but its results could not be written to {out}: {exc}"
            ) from None
        console.print(f"written to {written}", highlight=False)
    if export_format is not None and export_out is not None:
        try:
            # The deployment is the scenario's own engine config (one replica's, for a fleet,
            # with the replica count and router the search found in its notes).
            for file in export(spec, export_format, export_out):
                console.print(f"wrote {file}", highlight=False)
        except (KvsimConfigError, OSError) as exc:
            raise fail(
                f"the search finished, but the export to {export_out} failed: {exc}"
            ) from None


def _search_replicas(
    spec: Scenario, routers: list[str | None], max_replicas: int | None
) -> list[ReplicaSearch]:
    """``kvsim capacity --replicas``: the fewest replicas per router, each simulation
    printed as it finishes."""
    from sim.capacity import DEFAULT_MAX_REPLICAS, find_min_replicas
    from sim.fleet.config import ROUTER_KINDS
    from sim.runner import simulate

    for kind in routers:
        if kind is not None and kind not in ROUTER_KINDS:
            raise KvsimConfigError(f"--router {kind!r}: expected one of {', '.join(ROUTER_KINDS)}")
    results = []
    for kind in routers:
        label = kind or (spec.fleet.router.kind if spec.fleet else "round_robin")

        def progress(point: LoadPoint, label: str = label) -> None:
            verdict = "holds" if point.holds else "fails: " + "; ".join(point.failed)
            err_console.print(f"  {label}, {point.load:g} replicas: {verdict}", highlight=False)

        err_console.print(f"searching the replica count of {spec.name} behind {label}...")
        results.append(
            find_min_replicas(
                spec,
                lambda s: simulate(s).summary,
                kind,
                progress,
                max_replicas or DEFAULT_MAX_REPLICAS,
            )
        )
    return results


def _print_replicas(spec: Scenario, results: list[ReplicaSearch]) -> None:
    """The table of ``kvsim capacity --replicas``: the answer per router."""
    table = Table(title=escape(f"{spec.name}: fewest replicas within the SLOs, per router"))
    for column in ("router", "fewest replicas", "there: TTFT p99 s", "ITL p99 s",
                   "prefix hits", "simulations"):  # fmt: skip
        table.add_column(column, justify="left" if column == "router" else "right")
    for result in results:
        best = next((p for p in result.curve if p.load == result.fewest), None)
        table.add_row(
            result.router,
            "none tried holds" if result.fewest is None else str(result.fewest),
            "-" if best is None or best.ttft_p99_s is None else f"{best.ttft_p99_s:.3g}",
            "-" if best is None or best.itl_p99_s is None else f"{best.itl_p99_s:.3g}",
            "-" if best is None or best.prefix_cache_hit_rate is None
            else f"{best.prefix_cache_hit_rate * 100:.1f}%",
            str(len(result.curve)),
        )  # fmt: skip
    console.print(table)
    bounds = ", ".join(f"{k} <= {v:g}" for k, v in spec.slos.model_dump(exclude_none=True).items())
    console.print(f"SLOs: {bounds}, and every request finished", highlight=False)
