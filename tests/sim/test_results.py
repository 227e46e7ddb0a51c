"""Run directories: atomic claims, cleanup after killed runs, listing."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from sim import results
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
    partial_dir,
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
    assert (out / CLAIM).read_text() == f"{os.getpid()}\n{socket.gethostname()}\n"
    with pytest.raises(KvsimConfigError, match="already exists, claimed by a kvsim run in"):
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


def host_tag(host: str) -> str:
    return hashlib.sha256(host.encode()).hexdigest()[:8]


def test_leftovers_of_another_host_are_never_removed(tmp_path: Path) -> None:
    """On shared storage (NFS, a Ray sweep) a pid says nothing about another host's run."""
    pid = dead_pid()
    theirs = tmp_path / f".r.partial-{pid}@{host_tag('another-host')}"
    theirs.mkdir()
    their_claim = tmp_path / "theirs"
    their_claim.mkdir()
    (their_claim / CLAIM).write_text(f"{pid}\nanother-host\n")
    ours = partial_dir(tmp_path / "r", pid)
    ours.mkdir()
    assert ours.name == f".r.partial-{pid}@{host_tag(socket.gethostname())}"
    our_claim = tmp_path / "ours"
    our_claim.mkdir()
    (our_claim / CLAIM).write_text(f"{pid}\n{socket.gethostname()}\n")
    old = tmp_path / f".o.partial-{pid}"  # kvsim before hosts were recorded: this host's
    old.mkdir()
    removed = clean_stale(tmp_path)
    assert sorted(p.name for p in removed) == sorted([ours.name, "ours", old.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([theirs.name, "theirs"])
    with pytest.raises(KvsimConfigError, match=f"pid {pid} on host another-host"):
        claim_run_dir(their_claim)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / CLAIM).write_text(f"{os.getpid()}\nanother-host\n")
    release_claim(tmp_path / "mine")  # our pid, but another host's claim: not ours
    assert (tmp_path / "mine" / CLAIM).exists()


def test_a_claim_that_cannot_be_removed_keeps_its_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder holding the claim made read-only mid-run: an empty folder without its
    marker would block every rerun, since no run may remove it."""
    out = claim_run_dir(tmp_path / "run")
    rename, rmdir = os.rename, os.rmdir

    def read_only(op):  # type: ignore[no-untyped-def]
        def guarded(src, *args, **kwargs):  # type: ignore[no-untyped-def]
            if Path(src) == out:
                raise OSError(errno.EROFS, "Read-only file system", str(src))
            return op(src, *args, **kwargs)

        return guarded

    monkeypatch.setattr(os, "rename", read_only(rename))
    monkeypatch.setattr(os, "rmdir", read_only(rmdir))
    release_claim(out)
    assert os.listdir(out) == [CLAIM]  # still a claim, which a later run cleans up
    monkeypatch.undo()
    release_claim(out)
    assert sorted(os.listdir(tmp_path)) == []


def test_a_run_whose_rename_fails_keeps_its_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = claim_run_dir(tmp_path / "run")
    rename = os.rename

    def refused(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(dst) == out:
            raise OSError(errno.EACCES, "Permission denied", str(dst))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "rename", refused)
    with pytest.raises(OSError, match="Permission denied"):
        write(out)
    assert os.listdir(out) == [CLAIM]
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no partial left either
    monkeypatch.undo()
    release_claim(out)
    assert not out.exists()


def test_a_long_run_name_is_written(tmp_path: Path) -> None:
    """A 250-character name is valid; its hidden partial sibling is cut to fit."""
    out = claim_run_dir(tmp_path / ("r" * 250))
    assert len(partial_dir(out, 4194304).name.encode()) <= 255
    write(out)
    assert list_runs(tmp_path) == [out]
    assert sorted(os.listdir(tmp_path)) == [out.name]


def test_an_unwritable_folder_is_found_by_a_real_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: True)  # as for root
    with pytest.raises(KvsimConfigError, match="its folder /proc/sys is not writable"):
        check_out_free(Path("/proc/sys/kvsim.json"), "--out")
    check_out_free(tmp_path / "new" / "out.json")
    assert os.listdir(tmp_path / "new") == []
    assert results.this_host() == socket.gethostname()
