"""``kvsim report claims``: the claims report (registered on the ``kvsim`` app by sim.cli)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from sim.console import console, count_progress, err_console, fail
from sim.errors import KvsimConfigError

report_app = typer.Typer(
    help="Reports that run many simulations and write Markdown.", no_args_is_help=True
)


@report_app.command("claims")
def claims(
    out: Annotated[
        Path, typer.Option(help="Folder for claims.md, its PNG plots and claims.json (new).")
    ],
    scenario: Annotated[
        Path | None,
        typer.Option(help="Agent scenario with SLOs (default: the shipped claims scenario)."),
    ] = None,
    workers: Annotated[
        int | None, typer.Option(min=1, help="Worker processes (default: every local core).")
    ] = None,
    quiet: Annotated[bool, typer.Option(help="No progress bar.")] = False,
) -> None:
    """Measure public claims about KV memory policies; write a Markdown report with plots.

    Waste, agents per GPU, utilization, recompute vs swap: on one agent scenario.
    """
    from sim.claims.render import check_png_export, write_report
    from sim.claims.study import Task, run_study
    from sim.cores import default_workers
    from sim.scenario import SCENARIO_DIR

    source = scenario or SCENARIO_DIR / "claims" / "agents-8b-h100.yaml"
    try:
        if out.exists():
            raise KvsimConfigError(f"--out {out}: already exists; kvsim never overwrites")
        if not out.parent.is_dir():
            raise KvsimConfigError(f"--out {out}: the folder {out.parent} does not exist")
        try:  # a real write: access() says yes to root, e.g. under /proc
            with tempfile.TemporaryFile(dir=out.parent):
                pass
        except OSError as exc:
            raise KvsimConfigError(
                f"--out {out}: the folder {out.parent} is not writable ({exc.strerror or exc})"
            ) from None
        check_png_export()
        with count_progress(quiet) as bar:
            task = bar.add_task("claims", total=None)

            def phase(name: str, num_tasks: int) -> None:
                bar.reset(task, total=num_tasks, description=f"claims: {name}")

            def done(item: Task, result: dict[str, Any]) -> None:
                what = f"{item.group}/{item.key}"
                if "error" in result:
                    err_console.print(f"  {what}: {result['error']}", highlight=False)
                bar.update(task, advance=1, description=f"claims: {what} done")

            study = run_study(source, workers or default_workers(), done, phase)
    except (KvsimConfigError, ValueError) as exc:
        raise fail(str(exc)) from None
    except OSError as exc:  # a file the scenario names, worker processes that cannot start
        raise fail(f"the claims study of {source} stopped: {exc}") from None
    try:
        report = write_report(study, out)
    except (KvsimConfigError, ValueError) as exc:  # the plots (kaleido)
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(
            f"the study finished, but the report could not be written to {out}: {exc}"
        ) from None
    console.print(f"report: {report}", highlight=False)
