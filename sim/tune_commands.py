"""``kvsim tune``: Optuna searches the engine knobs (:mod:`sim.tune`) for the best config
under the SLOs, prints it and exports it (registered on the ``kvsim`` app by :mod:`sim.cli`)."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from sim.console import console, err_console, fail, note
from sim.errors import KvsimConfigError
from sim.rollout_commands import (
    ExportFormatOption,
    ExportOutOption,
    ScenarioArgument,
    SetOption,
    SloOption,
    check_export_options,
    check_parent,
    slo_overrides,
    write_document,
)

if TYPE_CHECKING:
    from sim.scenario import Scenario


def with_engine(spec: Scenario, engine: dict[str, Any], label: str | None = None) -> Scenario:
    """``spec`` with these engine fields (a tuned config, a policy reset), checked again."""
    from sim.scenario import parse_scenario

    document = spec.model_dump(mode="json")
    return parse_scenario(
        {**document, "engine": {**document["engine"], **engine}}, label or spec.name
    )


def tune_cmd(
    scenario: ScenarioArgument = None,
    objective: Annotated[
        str, typer.Option(help="goodput, cost-per-million-tokens or max-sessions.")
    ] = "goodput",
    slo: SloOption = None,
    budget: Annotated[int, typer.Option(help="Optuna trials (configs tried).")] = 30,
    gpu_hour_usd: Annotated[
        float, typer.Option(help="Price of one GPU-hour, for cost-per-million-tokens.")
    ] = 1.0,
    set_: SetOption = None,
    out: Annotated[
        Path | None, typer.Option(help="Write tune.json (every trial, best, Pareto front).")
    ] = None,
    export_format: ExportFormatOption = None,
    export_out: ExportOutOption = None,
    memory_policies: Annotated[
        str | None,
        typer.Option(
            help="Also search a memory policy per trial: 'exportable' (vLLM's own engine or "
            "a CPU offload tier, vLLM's --kv-offloading-size, of 32-192 GiB) or 'all' (also "
            "the what-ifs vLLM 0.32 lacks: swap preemption, KV retention; the best of those "
            "cannot be exported). Default: vLLM's engine knobs only."
        ),
    ] = None,
) -> None:
    """Search vLLM's engine knobs (Optuna) for the best config under the SLOs."""
    from sim.export import export
    from sim.runner import simulate
    from sim.scenario import DEFAULT_SCENARIO, check_runnable, load_scenario
    from sim.tune import OBJECTIVES, POLICY_RESET, overrides, trial_engine, tune

    source = scenario or DEFAULT_SCENARIO
    try:
        try:
            import optuna  # noqa: F401
        except ImportError:
            raise KvsimConfigError(
                "kvsim tune needs Optuna, an optional extra: pip install 'kvsim[tune]'"
            ) from None
        if objective not in OBJECTIVES:
            raise KvsimConfigError(
                f"--objective {objective!r}: expected one of {', '.join(OBJECTIVES)}"
            )
        if out is not None and out.exists():
            raise FileExistsError(f"--out {out}: already exists; kvsim never overwrites")
        if not math.isfinite(gpu_hour_usd) or gpu_hour_usd <= 0:
            raise KvsimConfigError(f"--gpu-hour-usd {gpu_hour_usd}: must be a positive number")
        if memory_policies not in (None, "exportable", "all"):
            raise KvsimConfigError(
                f"--memory-policies {memory_policies!r}: expected exportable or all"
            )
        if memory_policies == "all" and export_format is not None:
            raise KvsimConfigError(
                "--memory-policies all with --export-format: the best config could be a "
                "what-if vLLM 0.32 cannot run (swap, retention); use --memory-policies "
                "exportable to export"
            )
        spec = load_scenario(source, [*(set_ or []), *slo_overrides(slo)])
        check_runnable(spec, str(source))
        # With the policy searched, a trial's own replaces the scenario's: what is checked
        # for export is the scenario's engine with it reset (every policy offered exports).
        exported = spec if memory_policies is None else with_engine(spec, POLICY_RESET)
        check_export_options(export_format, export_out, exported)
        check_parent(out, "--out")

        def progress(trial: object) -> None:
            t = trial  # a sim.tune.Trial
            if t.state == "ok":
                what = f"{objective} {t.objective:.4g}{capacity_unit(t.metrics)}"
            elif t.state == "infeasible":  # its objective may be missing
                what = f"infeasible: {t.error or 'misses an SLO'}"
            else:
                what = f"not run: {t.error}"
            which = f" ({t.baseline})" if t.baseline else ""
            err_console.print(f"  trial {t.number}{which}: {what}", highlight=False)

        result = tune(
            spec,
            objective,
            budget,
            lambda s: simulate(s).summary,
            gpu_hour_usd=gpu_hour_usd,
            on_trial=progress,
            memory_policies=memory_policies,
            deployable=export_format is not None,
        )
    except (KvsimConfigError, FileExistsError, ValueError) as exc:
        raise fail(str(exc)) from None
    ran = sum(t.state != "invalid" for t in result.trials)
    console.print(
        f"{len(result.trials)} trials ({ran} simulated configs, {result.simulations} "
        f"simulations) for {objective} ({result.direction})",
        highlight=False,
    )
    best = result.best
    base_engine = spec.engine.model_dump(mode="json")
    best_spec = (
        None
        if best is None
        else with_engine(spec, trial_engine(base_engine, best), f"{spec.name} (tuned)")
    )
    try:
        if out is not None:  # every trial, also when none was feasible
            document = {
                "scenario": spec.name,
                "objective": objective,
                "direction": result.direction,
                "slos": spec.slos.model_dump(),
                "simulations": result.simulations,
                # What the scenario and the best config model that vLLM 0.32 does not run.
                "what_if": spec.what_ifs(),
                "best_what_if": None if best_spec is None else best_spec.what_ifs(),
                "best": None if best is None else best.__dict__,
                "pareto": [t.number for t in result.pareto],
                "trials": [t.__dict__ for t in result.trials],
            }
            written = write_document(out, "tune.json", document)
            console.print(f"written to {written}", highlight=False)
    except OSError as exc:
        raise fail(
            f"the search finished, but tune.json could not be written to {out}: {exc}"
        ) from None
    if best is None:
        raise fail("no trial met every SLO with every request finished; relax --slo or the load")
    assert best_spec is not None
    policy = "" if best.policy is None else f" (memory policy: {best.policy})"
    which = f" ({best.baseline})" if best.baseline else ""
    console.print(
        f"best: trial {best.number}{which}, {objective} = {best.objective:.4g}"
        f"{capacity_unit(best.metrics)}{policy}; "
        + " ".join(f"--set {shlex.quote(o)}" for o in overrides(base_engine, best)),
        highlight=False,
    )
    if best.metrics.get("capacity_at_ceiling"):
        note(
            f"every load the capacity search tried held, up to its ceiling "
            f"({best.objective:g} {best.metrics['capacity_unit']}): that is the search's "
            "bound, not this config's, and trials there tie; raise the load or tighten "
            "the SLOs to tell configs apart"
        )
    if what_if := best_spec.what_ifs():
        note(
            f"the best config is a what-if, not vLLM 0.32's own behaviour: {'; '.join(what_if)}",
            "cyan",
        )
    front = Table(title="Pareto front (feasible trials): throughput vs p99 TTFT and ITL")
    for column in ("trial", "tok/s", "TTFT p99 s", "ITL p99 s", objective):
        front.add_column(column, justify="right")
    for t in result.pareto:
        m = t.metrics
        front.add_row(
            str(t.number),
            f"{m['output_throughput_tok_s']:,.0f}",
            f"{m['ttft_p99_s']:.3g}",
            f"{m['itl_p99_s']:.3g}",
            f"{t.objective:.4g}",
        )
    console.print(front)
    if export_format is not None and export_out is not None:
        try:
            for file in export(best_spec, export_format, export_out):
                console.print(f"wrote {file}", highlight=False)
        except (KvsimConfigError, OSError) as exc:
            raise fail(f"the search finished, but the export failed: {exc}") from None


def capacity_unit(metrics: dict[str, object]) -> str:
    """` UNIT` after a max-sessions trial's objective (the load the capacity search
    turned: sessions at once, sessions/s, requests/s), '' for the other objectives."""
    unit = metrics.get("capacity_unit")
    return f" {unit}" if unit else ""
