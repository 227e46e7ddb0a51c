"""The fidelity bar over validation sessions: kvsim within 10% of the replays' median on TTFT,
ITL and E2E p50 and output throughput, and that median inside kvsim's p10-p90 band.

    python benchmarks/bench_sessions.py DIR [DIR ...]

Each ``DIR`` is a session written by ``benchmarks/bench_validation.py --out DIR`` (or a refit
of one, ``--refit SESSION --out DIR``). Reads their ``val-*/report.json`` only: no vLLM, no
simulation, a second. Prints one table, a row per validation scenario and a column per
session: kvsim's relative error on the four figures (bold past 10%) and how many of the four
medians lie inside kvsim's band. Then per session, and over all of them, how many figures
hold each test and whether the session meets the bar: every figure within 10% and inside
the band (a session without a band, ``--samples 0``, cannot). The verdict counts sessions,
not scenarios: a scenario that passes in one session and fails in another fails the bar.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from validate.compare import BAR_FIGURES, BOUND


@dataclass(frozen=True)
class ScenarioResult:
    errors: tuple[float | None, ...]  # relative error per figure, None where missing
    inside: tuple[bool | None, ...]  # the replays' median inside the band, None without one

    @property
    def within(self) -> int:
        return sum(e is not None and abs(e) <= BOUND for e in self.errors)

    @property
    def in_band(self) -> int:
        return sum(i is True for i in self.inside)


def scenario_result(report: dict[str, Any]) -> ScenarioResult:
    """The four figures' errors and band verdicts of one validation report."""
    metrics = {m["metric"]: m for m in report["metrics"]}
    band = {b["metric"]: b for b in report.get("band") or []}
    return ScenarioResult(
        errors=tuple(metrics.get(f, {}).get("relative_error") for f in BAR_FIGURES),
        inside=tuple(band.get(f, {}).get("inside") for f in BAR_FIGURES),
    )


def load_session(directory: Path) -> dict[str, ScenarioResult]:
    """Validation scenario name (without ``val-``) -> its result; ValueError when the folder
    holds no reports."""
    reports = sorted(directory.glob("val-*/report.json"))
    if not reports:
        raise ValueError(
            f"{directory}: no val-*/report.json (not a bench_validation.py --out directory)"
        )
    return {
        path.parent.name.removeprefix("val-"): scenario_result(json.loads(path.read_text()))
        for path in reports
    }


def _error(e: float | None) -> str:
    if e is None:
        return "n/a"
    return f"[bold]{100 * e:+.1f}[/]" if abs(e) > BOUND else f"{100 * e:+.1f}"


def _cell(result: ScenarioResult | None) -> str:
    if result is None:
        return "-"
    errors = " / ".join(_error(e) for e in result.errors)
    band = (
        "no band"
        if all(i is None for i in result.inside)
        else f"{result.in_band}/{len(BAR_FIGURES)} in band"
    )
    return f"{errors}%\n{band}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sessions", type=Path, nargs="+", metavar="DIR")
    args = parser.parse_args()
    console = Console(width=max(120, Console().width))
    try:
        sessions = {str(d): load_session(d) for d in args.sessions}
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        sys.exit(2)
    names = sorted({name for results in sessions.values() for name in results})
    table = Table(title=f"{' / '.join(BAR_FIGURES)}: kvsim vs the replays' median")
    table.add_column("scenario")
    for d in sessions:
        table.add_column(d, justify="right")
    for name in names:
        table.add_row(name, *(_cell(results.get(name)) for results in sessions.values()))
    console.print(table)
    total_within = total_band = total = met = 0
    for d, results in sessions.items():
        # A scenario missing from a session counts as its four figures missing.
        rows = [results.get(name) for name in names]
        within = sum(r.within for r in rows if r is not None)
        in_band = sum(r.in_band for r in rows if r is not None)
        figures = len(BAR_FIGURES) * len(names)
        meets = within == figures and in_band == figures
        met += meets
        total_within += within
        total_band += in_band
        total += figures
        console.print(
            f"{d}: within {100 * BOUND:.0f}% {within} of {figures}, in the band {in_band} of "
            f"{figures}: {'meets' if meets else 'misses'} the bar"
        )
    console.print(
        f"over {len(sessions)} sessions: within {100 * BOUND:.0f}% {total_within} of {total}, "
        f"in the band {total_band} of {total}; {met} of {len(sessions)} sessions meet the bar"
    )


if __name__ == "__main__":
    main()
