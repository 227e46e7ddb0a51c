"""One real-vLLM replay in its own process: ``python -m validate.replay_worker ...``.

vLLM keeps process-wide state (distributed groups, compiled kernels, the CPU thread binding),
so two engines in one process interfere; each replay therefore runs here, in a fresh
interpreter. Exit status: 0 when the run directory was written (complete or not, see its
summary), 3 when vLLM could not start (the last stderr line says why).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario_yaml", type=Path, help="resolved scenario (scenario.yaml)")
    parser.add_argument("device", choices=["cpu", "cuda"])
    parser.add_argument("model", help="model folder or hub name")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--progress", type=Path, help="file to write progress to (validate.progress)"
    )
    args = parser.parse_args()

    from sim.results import write_run
    from sim.scenario import parse_scenario, scenario_to_yaml
    from validate.progress import STARTING, WARMING_UP, ProgressFile
    from validate.replay import build_engine, replay, warm_up
    from validate.runner import measured_summary

    scenario = parse_scenario(yaml.safe_load(args.scenario_yaml.read_text()), "scenario")
    progress = (
        ProgressFile(args.progress, scenario.limits.max_duration_s) if args.progress else None
    )
    try:
        if progress is not None:
            progress.phase(STARTING)
        engine = build_engine(scenario, args.device, args.model)
        if progress is not None:
            progress.phase(WARMING_UP)
        warm_up(engine, scenario)
    except Exception as exc:  # vLLM raises many types on a bad model path, OOM, bad args
        message = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"vLLM could not start {args.model!r} on {args.device}: {message}", file=sys.stderr)
        return 3
    result = replay(
        scenario, args.device, args.model, engine, progress.report if progress else None
    )
    recorder = result.recorder
    write_run(
        args.out_dir,
        measured_summary(scenario, result),
        recorder.requests_frame(),
        recorder.steps_frame(),
        scenario_to_yaml(scenario),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
