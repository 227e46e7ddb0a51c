"""Stands in for validate.replay_worker (same arguments): the scenario it is handed is
simulated, priced by known parameters (tests.validate.fake_vllm), and written as a measured
run, with the progress a replay reports."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

from sim.scenario import parse_scenario
from tests.validate.fake_vllm import fake_replay
from validate.progress import STARTING, WARMING_UP, ProgressFile

# Long enough after the last progress for the command (polling every 0.05 s) to see it.
LINGER_S = 0.5


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario_yaml", type=Path)
    parser.add_argument("device")
    parser.add_argument("model")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--progress", type=Path)
    args = parser.parse_args()
    scenario = parse_scenario(yaml.safe_load(args.scenario_yaml.read_text()), "scenario")
    progress = ProgressFile(args.progress, scenario.limits.max_duration_s, every_s=0.0)
    progress.phase(STARTING)
    progress.phase(WARMING_UP)
    run = fake_replay(scenario, args.out_dir)
    summary = run.summary
    progress.report(summary["duration_s"], summary["num_requests"], summary["num_finished"])
    time.sleep(LINGER_S)
    return 0


if __name__ == "__main__":
    sys.exit(main())
