"""How fast the simulator runs scenarios end to end: the fast path against the step-by-step
reference, side by side in one process so machine noise hits both alike.

    python benchmarks/bench_runner.py                       # every shipped scenario
    python benchmarks/bench_runner.py scenarios/agent-burst.yaml --repeat 3
    python benchmarks/bench_runner.py --large               # + the 100k-request benchmark
    python benchmarks/bench_runner.py --mooncake PATH       # + the Mooncake trace benchmark
    python benchmarks/bench_runner.py --fleet               # + the 100k requests on 16 replicas
    python benchmarks/bench_runner.py --against ff8e847     # this tree vs an earlier commit

For each shipped scenario (``scenarios/*.yaml``) it runs the step-by-step path
(``simulate(..., exact_reference=True)``) and the fast path (the default), best of N
repeats each, checks that both wrote the same ``summary.json``, ``steps.parquet`` and
``requests.parquet`` bytes, and reports both wall and CPU times (CPU: this process only,
the steadier figure on a shared machine), the speed-ups and simulated seconds per wall
second. The benchmark scenarios under ``scenarios/benchmarks/`` (too large for the
reference) run the fast path once each, in a fresh process, reporting wall and CPU time,
simulated seconds per wall second and the peak resident memory of that process (``--fleet``:
the 100k-request scenario on a fleet of 16 replicas behind session affinity). The Mooncake trace's
path is given here, at run time (``--set workload.path=...``): kvsim does not ship it.
``--against REF`` runs each scenario's default path in fresh processes, alternately in this
tree and in a temporary git worktree of commit REF (best of ``--repeat`` each), and reports
both step counts, both CPU times and the speed-up: progress measured against an earlier
main, with the machine's noise shared by both. Step counts that differ mean the two trees
simulate the scenario differently (a cost-model change), so that row compares different
runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sim.results import REQUESTS, STEPS, SUMMARY
from sim.runner import SimulationResult, simulate
from sim.scenario import SCENARIO_DIR, load_scenario

BENCHMARK_DIR = SCENARIO_DIR / "benchmarks"
LARGE = BENCHMARK_DIR / "agents-100k-8b-h100.yaml"
MOONCAKE = BENCHMARK_DIR / "mooncake-conversation-8b-h200.yaml"
FLEET_REPLICAS = 16


def output_bytes(result: SimulationResult) -> list[bytes]:
    """The bytes of the run directory's summary.json, steps.parquet and requests.parquet."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = result.write(Path(tmp) / "run")
        return [(run_dir / name).read_bytes() for name in (SUMMARY, STEPS, REQUESTS)]


def best_times_s(run: Any, repeat: int) -> tuple[float, float, SimulationResult]:
    """Best wall and best CPU seconds (this process) over ``repeat`` runs, and a result. CPU
    time counts only this process, so it is the steadier figure on a shared machine."""
    best_wall = best_cpu = float("inf")
    result = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        result = run()
        best_cpu = min(best_cpu, time.process_time() - cpu)
        best_wall = min(best_wall, time.perf_counter() - wall)
    assert result is not None
    return best_wall, best_cpu, result


def compare(paths: list[Path], repeat: int, console: Console) -> None:
    table = Table(title=f"fast path vs step-by-step reference (best of {repeat}, same process)")
    for col in (
        "scenario",
        "requests",
        "steps",
        "sim s",
        "reference s (cpu)",
        "fast s (cpu)",
        "speed-up (cpu)",
        "sim s / wall s",
        "identical",
    ):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for path in paths:
        scenario = load_scenario(path)
        ref_s, ref_cpu, ref = best_times_s(
            lambda s=scenario: simulate(s, exact_reference=True), repeat
        )
        fast_s, fast_cpu, fast = best_times_s(lambda s=scenario: simulate(s), repeat)
        same = output_bytes(ref) == output_bytes(fast)
        s = fast.summary
        table.add_row(
            scenario.name,
            f"{s['num_requests']:,}",
            f"{s['metrics']['num_steps']:,}",
            f"{s['duration_s']:,.0f}",
            f"{ref_s:.2f} ({ref_cpu:.2f})",
            f"{fast_s:.2f} ({fast_cpu:.2f})",
            f"{ref_s / fast_s:.1f}x ({ref_cpu / fast_cpu:.1f}x)",
            f"{s['duration_s'] / fast_s:,.0f}",
            "yes" if same else "NO",
        )
    console.print(table)


def run_one(path: Path, overrides: list[str]) -> dict[str, Any]:
    """Run the fast path once here and report wall time and this process's peak RSS."""
    scenario = load_scenario(path, overrides)
    started, cpu = time.perf_counter(), time.process_time()
    result = simulate(scenario)
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    s = result.summary
    return {
        "scenario": scenario.name,
        "replicas": scenario.fleet.replicas if scenario.fleet else None,
        "requests": s["num_requests"],
        "finished": s["num_finished"],
        "steps": s["metrics"]["num_steps"],
        "sim_s": s["duration_s"],
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "peak_rss_bytes": peak,
    }


def benchmark(runs: list[tuple[Path, list[str]]], console: Console) -> None:
    table = Table(title="benchmark scenarios (fast path, one fresh process each)")
    columns = (
        "scenario",
        "requests",
        "steps",
        "sim s",
        "wall s",
        "cpu s",
        "sim s / wall s",
        "peak RSS",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "scenario" else "right")
    for path, overrides in runs:
        command = [sys.executable, __file__, "--one", str(path)]
        for assignment in overrides:
            command += ["--set", assignment]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        r = json.loads(done.stdout.strip().splitlines()[-1])
        table.add_row(
            r["scenario"] + (f" ({r['replicas']} replicas)" if r["replicas"] else ""),
            f"{r['requests']:,} ({r['finished']:,} finished)",
            f"{r['steps']:,}",
            f"{r['sim_s']:,.0f}",
            f"{r['wall_s']:.1f}",
            f"{r['cpu_s']:.1f}",
            f"{r['sim_s'] / r['wall_s']:,.0f}",
            f"{r['peak_rss_bytes'] / 2**30:.2f} GiB",
        )
    console.print(table)


def against(paths: list[Path], ref: str, repeat: int, console: Console) -> None:
    """This tree's default path vs commit ``ref``'s, alternating fresh processes."""
    here = Path(__file__).resolve().parent.parent
    commit = subprocess.run(
        ["git", "-C", str(here), "rev-parse", "--short", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    table = Table(title=f"this tree vs {commit} (default path, best of {repeat}, CPU s)")
    for col in ("scenario", f"{commit} steps", "steps", f"{commit} s", "this tree s", "speed-up"):
        table.add_column(col, justify="left" if col == "scenario" else "right")
    differ = False
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        try:
            subprocess.run(
                ["git", "-C", str(here), "worktree", "add", "--detach", str(tree), commit],
                capture_output=True,
                check=True,
            )
            for path in paths:
                best = {here: math.inf, tree: math.inf}
                steps = {here: 0, tree: 0}
                for i in range(repeat):
                    # Each tree goes first in every other round.
                    for root in (tree, here) if i % 2 == 0 else (here, tree):
                        r = _run_in(root, path.resolve())
                        best[root] = min(best[root], r["cpu_s"])
                        steps[root] = r["steps"]
                same = steps[tree] == steps[here]
                differ |= not same
                table.add_row(
                    path.stem,
                    f"{steps[tree]:,}",
                    f"{steps[here]:,}" + ("" if same else " (differs)"),
                    f"{best[tree]:.2f}",
                    f"{best[here]:.2f}",
                    f"{best[tree] / best[here]:.2f}x",
                )
        finally:
            subprocess.run(
                ["git", "-C", str(here), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
            )
            subprocess.run(["git", "-C", str(here), "worktree", "prune"], capture_output=True)
    console.print(table)
    if differ:
        console.print(
            f"[yellow]Step counts differ: {commit} simulates these scenarios differently (a "
            "cost-model or scheduler change), so those rows compare different runs.[/yellow]"
        )


def _run_in(root: Path, path: Path) -> dict[str, Any]:
    """Run a scenario once in a fresh process on the kvsim sources under ``root``."""
    code = (
        "import json, sys, time\n"
        "from sim.runner import simulate\n"
        "from sim.scenario import load_scenario\n"
        "scenario = load_scenario(sys.argv[1])\n"
        "cpu = time.process_time()\n"
        "result = simulate(scenario)\n"
        "cpu = time.process_time() - cpu\n"
        "print(json.dumps({'cpu_s': cpu, 'steps': len(result.steps)}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        cwd=root,
        env=env,
    )
    if done.returncode:
        raise SystemExit(f"{path.name} failed on the sources in {root}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenarios", nargs="*", type=Path)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--large", action="store_true", help=f"also run {LARGE.name}")
    parser.add_argument("--mooncake", type=Path, help=f"run {MOONCAKE.name} on this trace")
    parser.add_argument(
        "--fleet",
        action="store_true",
        help=f"also run {LARGE.name} on a fleet of {FLEET_REPLICAS} replicas (session affinity)",
    )
    parser.add_argument("--against", metavar="REF", help="compare with this git commit")
    parser.add_argument("--one", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.set)))
        return
    console = Console(width=150)
    console.print(f"machine: {machine()}")
    paths = args.scenarios or sorted(SCENARIO_DIR.glob("*.yaml"))
    if args.against:
        if args.large or args.mooncake or args.fleet:
            parser.error(
                "--against compares shipped scenarios only (no --large, --mooncake, --fleet)"
            )
        against(paths, args.against, args.repeat, console)
        return
    compare(paths, args.repeat, console)
    runs: list[tuple[Path, list[str]]] = []
    if args.large:
        runs.append((LARGE, []))
    if args.fleet:
        runs.append(
            (LARGE, [f"fleet.replicas={FLEET_REPLICAS}", "fleet.router.kind=session_affinity"])
        )
    if args.mooncake is not None:
        runs.append((MOONCAKE, [f"workload.path={args.mooncake.resolve()}"]))
    if runs:
        benchmark(runs, console)


if __name__ == "__main__":
    main()
