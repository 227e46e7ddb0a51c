"""Run directories: atomic claims, cleanup after killed runs, listing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim.errors import KvsimConfigError
from sim.results import (
    CLAIM,
    check_out_free,
    check_summary,
    claim_new_run_dir,
    claim_run_dir,
    clean_stale,
    list_runs,
    load_run,
    release_claim,
    write_run,
)
from sim.runner import simulate
from sim.scenario import DEFAULT_SCENARIO, load_scenario


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def write(path: Path) -> Path:
    return write_run(path, {"source": "sim"}, pd.DataFrame({"a": [1]}), pd.DataFrame(), "x: 1\n")


def test_claim_is_atomic_and_exclusive(tmp_path: Path) -> None:
    out = claim_run_dir(tmp_path / "a" / "run")
    assert sorted(os.listdir(out)) == [CLAIM]
    assert (out / CLAIM).read_text() == f"{os.getpid()}\n"
    with pytest.raises(KvsimConfigError, match="already exists; kvsim never overwrites"):
        claim_run_dir(out)
    write(out)  # the claimant writes into its own claim
    assert sorted(os.listdir(out)) == [
        "requests.parquet",
        "scenario.yaml",
        "steps.parquet",
        "summary.json",
    ]
    with pytest.raises(FileExistsError):
        write(out)


def test_new_run_dirs_are_claimed_one_after_another(tmp_path: Path) -> None:
    first = claim_new_run_dir(tmp_path, "s")
    second = claim_new_run_dir(tmp_path, "s")
    assert (first.name, second.name) == ("s-1", "s-2")


def test_unwritable_out_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KvsimConfigError, match="--out /proc/kvsim/x: cannot create it"):
        claim_run_dir(Path("/proc/kvsim/x"))
    (tmp_path / "file").write_text("")
    with pytest.raises(KvsimConfigError, match="is not a directory"):
        claim_run_dir(tmp_path / "file" / "run")
    with pytest.raises(KvsimConfigError, match=r"-o /proc/kvsim/p\.json: cannot create it"):
        check_out_free(Path("/proc/kvsim/p.json"), "-o")
    with pytest.raises(KvsimConfigError, match="already exists"):
        check_out_free(tmp_path / "file")


def test_release_removes_only_an_empty_own_claim(tmp_path: Path) -> None:
    out = claim_run_dir(tmp_path / "run")
    release_claim(out)
    assert not out.exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / CLAIM).write_text("1\n")  # someone else's
    release_claim(other)
    assert other.exists()


def test_stale_leftovers_are_removed_live_ones_kept(tmp_path: Path) -> None:
    live_claim = claim_run_dir(tmp_path / "live")  # (claiming cleans too: claim first)
    pid = dead_pid()
    (tmp_path / f".r.partial-{pid}").mkdir()
    (tmp_path / f".r.partial-{os.getpid()}").mkdir()  # a live writer
    dead_claim = tmp_path / "dead"
    dead_claim.mkdir()
    (dead_claim / CLAIM).write_text(f"{pid}\n")
    done = tmp_path / "done"
    done.mkdir()
    (done / "summary.json").write_text("{}")
    removed = clean_stale(tmp_path)
    assert sorted(p.name for p in removed) == [f".r.partial-{pid}", "dead"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".r.partial-{os.getpid()}", "live", "done"]
    )
    assert list_runs(tmp_path) == [done]  # hidden and in-progress folders are never runs
    assert live_claim.exists()


def test_list_runs_ignores_hidden_partial_even_with_a_summary(tmp_path: Path) -> None:
    partial = tmp_path / f".run.partial-{dead_pid()}"
    partial.mkdir()
    (partial / "summary.json").write_text("{}")
    assert list_runs(tmp_path) == []
    assert list_runs(tmp_path / "missing") == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_finished": "143"}, "num_finished = '143': expected a count"),
        ({"num_requests": -1}, "num_requests = -1: expected a count"),
        ({"duration_s": "long"}, "duration_s = 'long': expected a number of seconds"),
        ({"complete": "yes"}, "complete = 'yes': expected true/false"),
        ({"metrics": []}, "metrics = []: expected an object"),
        (
            {"metrics": {"vllm:time_to_first_token_seconds": {"p99": "slow"}}},
            "metrics.vllm:time_to_first_token_seconds.p99 = 'slow': expected a number or null",
        ),
        ({"slos": [1]}, "slos = [1]: expected an object of SLOs"),
        ({"metrics": None}, "summary.json has no metrics: not a kvsim run summary"),
        ({"truncated_at_limit": True, "num_unfinished": None}, "truncated_at_limit without"),
        ({"requests_clipped": "6"}, "requests_clipped = '6': expected a count"),
        ({"what_if": "swap"}, "what_if = 'swap': expected a list of text"),
        ({"fleet": {"replicas": "4"}}, "expected replicas, a count"),
    ],
)
def test_a_summary_without_kvsims_types_is_refused_naming_the_field(
    tmp_path: Path, change: dict, message: str
) -> None:
    result = simulate(load_scenario(DEFAULT_SCENARIO, ["workload.sessions=2"]))
    run = result.write(tmp_path / "run")
    summary = {**result.summary, **change}
    summary = {k: v for k, v in summary.items() if v is not None}
    with pytest.raises(ValueError, match=re.escape(message)):
        check_summary(summary)
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=rf"{re.escape(str(run))}: cannot read run files: "):
        load_run(run)
    check_summary(result.summary)  # what kvsim writes passes
