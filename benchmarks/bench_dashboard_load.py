"""How long the Run explorer takes to load a 100k-request run directory (target: under 5 s).

    python benchmarks/bench_dashboard_load.py [--requests 100000] [--keep DIR]

Synthesizes a run directory (``tests/dashboard/synth.py``: 100k requests, ~32M per-token
times, 2M steps, a 30k-block map of 120 snapshots), then times, each in a fresh state:
``build_view`` alone (reading and reducing the files) and the Run explorer page's first
render through AppTest (cold cache: load + charts), then a warm rerun. Not a test: timings
depend on the machine, so nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# The synthetic run builder lives with the dashboard tests; run this file from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.dashboard.synth import synthesize_run, write_block_map

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--keep", type=Path, help="Write (or reuse) the run directory here.")
    args = parser.parse_args()

    base = args.keep or Path(tempfile.mkdtemp(prefix="kvsim-bench-"))
    run = base / f"synthetic-{args.requests}"
    if not run.exists():
        started = time.perf_counter()
        synthesize_run(run, num_requests=args.requests)
        end_s = json.loads((run / "summary.json").read_text())["duration_s"]
        write_block_map(run, end_s, 30_000, 120, np.random.default_rng(1))
        print(f"synthesized {run} in {time.perf_counter() - started:.1f} s")
    size_mb = sum(f.stat().st_size for f in run.iterdir()) / 1e6
    print(f"run directory: {size_mb:,.0f} MB on disk")

    from dashboard.loaders import build_view

    started = time.perf_counter()
    view = build_view(run)
    print(
        f"build_view: {time.perf_counter() - started:.2f} s "
        f"({len(view.requests):,} requests; {view.timeline.note()})"
    )

    from streamlit.testing.v1 import AppTest

    os.environ["KVSIM_RUNS_DIR"] = str(base)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.switch_page("views/run_explorer.py")
    started = time.perf_counter()
    at.run()
    cold = time.perf_counter() - started
    assert not at.exception and not at.error, (at.exception, at.error)
    started = time.perf_counter()
    at.run()
    warm = time.perf_counter() - started
    print(f"Run explorer first render (cold cache): {cold:.2f} s; rerun (warm): {warm:.2f} s")
    if args.keep is None:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
