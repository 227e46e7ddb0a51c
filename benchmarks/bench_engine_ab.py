"""Does an engine setting change how fast vLLM runs the same batch shapes? An interleaved A/B.

    python benchmarks/bench_engine_ab.py SCENARIO --vary engine.max_num_seqs=32 \
        [--vary engine.scheduling_policy=fcfs ...] --profile PROFILE --out DIR [--rounds 5] \
        [--device cpu|cuda] [--model PATH]
    python benchmarks/bench_engine_ab.py --out DIR --profile PROFILE     # tables only

The cost model prices a step by its batch shape; a setting that changes the time of the same
shapes (buffers sized by ``max_num_seqs``, the scheduling policy's bookkeeping, the pool's
size) is a model error no calibration on other settings can show. This replays ``SCENARIO``
and one variant per ``--vary`` (each a ``load_scenario`` override: ``key=value``) on vLLM,
``--rounds`` rounds, every variant once per round in a fresh process, the order rotated from
round to round, into ``DIR/<variant>/real-<round>`` (a scenario and its variants share a
seed: the same workload). It prints each replay's median measured / priced step against
``PROFILE`` and, per variant, the median over rounds of its ratio to the base's replay of the
same round (the machine's drift from round to round cancels). Without ``SCENARIO`` it reads
the replays already in ``DIR``. On the 2-core validation machines one process runs the same
batches 5-10% faster or slower than the next: five rounds resolve a difference of ~3%, not 1%.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sim.config.calibration import load_profile
from sim.config.loading import load_yaml
from sim.errors import KvsimConfigError
from sim.results import load_run
from sim.scenario import load_scenario, parse_scenario
from validate.calibrate import step_time_ratio
from validate.suite import replay_dirs

# The folder of the unchanged scenario's replays.
BASE = "base"


def variant_name(override: str) -> str:
    """A folder name for the variant ``key=value``: its last key part and value."""
    key, _, value = override.partition("=")
    return f"{key.rsplit('.', 1)[-1]}={value}"


def replay_variants(
    scenario_path: Path,
    overrides: list[str],
    out: Path,
    rounds: int,
    console: Console,
    device: str = "cpu",
    model: str | None = None,
) -> None:
    """Every variant once per round, in a fresh process, the order rotated by round."""
    from validate.runner import run_real

    variants = {BASE: load_scenario(scenario_path)}
    for override in overrides:
        name = variant_name(override)
        if name in variants:
            raise KvsimConfigError(f"--vary {override}: a second variant named {name}")
        variants[name] = load_scenario(scenario_path, [override])
    names = list(variants)
    for round_no in range(1, rounds + 1):
        shift = (round_no - 1) % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            run_real(variants[name], device, model, out / name / f"real-{round_no}")
            console.print(
                f"[dim]{time.strftime('%H:%M:%S')} round {round_no}/{rounds}: {name} "
                f"({time.perf_counter() - started:.0f} s)[/dim]"
            )


def step_ratios(out: Path, profile_path: Path) -> dict[str, dict[int, float]]:
    """Variant -> round -> the replay's median measured / priced step."""
    profile = load_profile(profile_path)
    ratios: dict[str, dict[int, float]] = {}
    for variant_dir in sorted(p for p in out.iterdir() if p.is_dir()):
        for run_dir in replay_dirs(variant_dir):
            run = load_run(run_dir)
            scenario = parse_scenario(load_yaml(run.scenario_yaml, str(run_dir)), str(run_dir))
            params = profile.params_for(scenario.engine.max_num_batched_tokens)
            ratio = step_time_ratio(run, scenario, params)
            if ratio is not None:
                ratios.setdefault(variant_dir.name, {})[int(run_dir.name[5:])] = ratio
    return ratios


def ab_table(ratios: dict[str, dict[int, float]]) -> Table:
    """Per variant: each round's median step ratio, their median, and the median over
    rounds of the ratio to the base's replay of the same round."""
    if BASE not in ratios:
        raise KvsimConfigError(f"no {BASE}/real-* replays to compare the variants with")
    base = ratios[BASE]
    rounds = sorted({r for by_round in ratios.values() for r in by_round})
    table = Table(title="median measured / priced step per replay, and against the base")
    table.add_column("variant")
    for r in rounds:
        table.add_column(f"round {r}", justify="right")
    table.add_column("median", justify="right")
    table.add_column("vs base (paired)", justify="right")
    for name, by_round in sorted(ratios.items(), key=lambda item: item[0] != BASE):
        paired = [by_round[r] / base[r] for r in by_round if r in base]
        table.add_row(
            name,
            *(f"{by_round[r]:.3f}" if r in by_round else "-" for r in rounds),
            f"{statistics.median(by_round.values()):.3f}",
            f"{statistics.median(paired):.3f} ({sum(p > 1 for p in paired)}/{len(paired)} > 1)"
            if paired
            else "-",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", type=Path, nargs="?", default=None)
    parser.add_argument("--vary", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--profile", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    console = Console()
    try:
        if args.scenario is not None:
            if not args.vary:
                parser.error("--vary KEY=VALUE: at least one variant to compare with the base")
            if args.out.exists():
                parser.error(f"--out {args.out} exists; the replays go into a new folder")
            replay_variants(
                args.scenario, args.vary, args.out, args.rounds, console, args.device, args.model
            )
        elif not args.out.is_dir():
            parser.error(f"--out {args.out}: no such folder of replays (pass SCENARIO to make it)")
        console.print(ab_table(step_ratios(args.out, args.profile)))
    except KvsimConfigError as error:
        sys.exit(str(error))


if __name__ == "__main__":
    main()
