"""`kvsim sweep`: the cross product of a grid, in worker processes, resumable after a kill,
one results table; bad grids are one clear error."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from sim import files
from sim import sweep as sweep_module
from sim.cli import app
from sim.errors import KvsimConfigError
from sim.runner import SimulationResult, simulate
from sim.scenario import SCENARIO_DIR, load_scenario
from sim.sweep import (
    POINTS_DIR,
    RESULTS_FILE,
    SWEEP_FILE,
    parse_grid,
    plan_sweep,
    ray_failure,
    run_point,
    run_sweep,
    sweep_lock,
    unfinished_points,
    write_results,
)
from tests.sim.test_interrupts import start_kvsim, wait_gone, worker_pids

runner = CliRunner()
SCENARIO = SCENARIO_DIR / "agent-burst.yaml"
SMALL = ["workload.sessions=6", "workload.turns.value=3"]
GRID = ["engine.max_num_seqs=8,16", "engine.max_num_batched_tokens=8,2048"]


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, " ".join(result.output.split())


def sweep_args(out: Path, *extra: str) -> list[str]:
    args = ["sweep", str(SCENARIO), "--out", str(out), "--quiet"]
    for grid in GRID:
        args += ["--grid", grid]
    for assignment in SMALL:
        args += ["--set", assignment]
    return [*args, *extra]


def one_grid_args(out: Path, grid: str) -> list[str]:
    """A one-worker sweep of ``grid`` alone over the small scenario."""
    args = ["sweep", str(SCENARIO), "--out", str(out), "--quiet", "--workers", "1"]
    args += ["--grid", grid]
    for assignment in SMALL:
        args += ["--set", assignment]
    return args


def test_every_point_matches_its_own_simulation_and_an_impossible_one_is_recorded(
    tmp_path: Path,
) -> None:
    out = tmp_path / "sweep"
    code, text = run(*sweep_args(out, "--workers", "2"))
    assert code == 0, text
    assert "3 of 4 points ran, 1 failed" in text
    table = pd.read_parquet(out / RESULTS_FILE)
    assert list(table["point"]) == ["p0000", "p0001", "p0002", "p0003"]
    assert list(table["engine.max_num_seqs"]) == [8, 8, 16, 16]
    assert list(table["engine.max_num_batched_tokens"]) == [8, 2048, 8, 2048]
    assert list(table["status"]) == ["ok", "ok", "failed", "ok"]
    failed = table.iloc[2]
    assert "engine.max_num_batched_tokens (8) must be greater than or equal to" in failed.error
    for _, row in table[table["status"] == "ok"].iterrows():
        overrides = [
            f"engine.max_num_seqs={row['engine.max_num_seqs']}",
            f"engine.max_num_batched_tokens={row['engine.max_num_batched_tokens']}",
        ]
        summary = simulate(load_scenario(SCENARIO, [*SMALL, *overrides])).summary
        ttft = summary["metrics"]["vllm:time_to_first_token_seconds"]
        assert row["ttft_p99_s"] == ttft["p99"]
        assert row["num_finished"] == summary["num_finished"]
        assert row["preemptions"] == summary["metrics"]["vllm:num_preemptions"]["total"]
        assert row["slo_pass"] == all(v["pass"] for v in summary["slos"].values())
        assert json.loads((Path(row["run_dir"]) / "summary.json").read_text()) == summary


def test_the_sweep_says_which_points_hit_the_time_limit(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    code, text = run(*sweep_args(out, "--workers", "1", "--set", "limits.max_duration_s=1"))
    assert code == 0, text
    table = pd.read_parquet(out / RESULTS_FILE)
    ok = table[table["status"] == "ok"]
    cut = int((ok["num_finished"] < ok["num_requests"]).sum())
    assert cut > 0
    assert f"3 of 4 points ran ({cut} hit limits.max_duration_s with requests unfinished" in text
    code, text = run(*sweep_args(tmp_path / "whole"))
    assert code == 0 and "hit limits.max_duration_s" not in text


def test_the_table_and_closing_line_say_which_points_are_what_ifs(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    code, text = run(*one_grid_args(out, "engine.allocator=paged,static"))
    assert code == 0, text
    assert "2 of 2 points ran, 1 of them what-ifs vLLM 0.32 does not run" in text
    table = pd.read_parquet(out / RESULTS_FILE)
    paged, static = table.iloc[0], table.iloc[1]
    assert pd.isna(paged["what_if"])
    assert "static" in static["what_if"]


def test_a_killed_sweep_resumes_without_running_a_finished_point_again(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    cmd = [sys.executable, "-c", "from sim.cli import app; app()", *sweep_args(out)]
    cmd += ["--workers", "1", "--set", "workload.sessions=20"]
    proc = subprocess.Popen(cmd, start_new_session=True, cwd=Path(__file__).parents[2])
    first = out / POINTS_DIR / "p0000"
    deadline = time.monotonic() + 120
    while not first.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its worker, mid-run
    proc.wait()
    assert first.is_dir()
    done = {p.name: p.stat().st_ino for p in (out / POINTS_DIR).iterdir()}
    plan = plan_sweep(SCENARIO, GRID, [*SMALL, "workload.sessions=20"], out)
    pending = {p.id for p in plan.pending()}
    assert pending and "p0000" not in pending
    ran: list[str] = []
    table = run_sweep(plan, 2, lambda point, error: ran.append(point.id))
    assert sorted(ran) == sorted(pending)  # only what was not done, each once
    for name, inode in done.items():
        if not name.startswith("."):
            assert (out / POINTS_DIR / name).stat().st_ino == inode  # never rewritten
    assert not list((out / POINTS_DIR).glob(".tmp-*"))
    assert list(table["status"]) == ["ok", "ok", "failed", "ok"]
    # Running the finished sweep again runs nothing and gives the same table.
    ran.clear()
    again = run_sweep(plan_sweep(SCENARIO, GRID, [*SMALL, "workload.sessions=20"], out), 2)
    pd.testing.assert_frame_equal(again, table)


LONG_GRID = ["engine.max_num_seqs=8,16,24,32", "engine.max_num_batched_tokens=1024,2048"]


def start_sweep(out: Path, workers: int) -> subprocess.Popen[str]:
    """``kvsim sweep`` of 8 points (a few seconds each) in its own process group."""
    args = ["sweep", str(SCENARIO), "--out", str(out), "--quiet", "--workers", str(workers)]
    for grid in LONG_GRID:
        args += ["--grid", grid]
    for assignment in ("workload.sessions=20", "workload.turns.value=3"):
        args += ["--set", assignment]
    return start_kvsim(*args)


def wait_for(path: Path, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 120
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), proc.communicate()[0]


def test_sigint_stops_at_once_keeps_finished_points_and_says_how_to_resume(
    tmp_path: Path,
) -> None:
    out = tmp_path / "sweep"
    proc = start_sweep(out, workers=2)
    wait_for(out / POINTS_DIR / "p0000", proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the sweep and its workers
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "run the same command again to finish the rest" in " ".join(output.split())
    assert "Traceback" not in output
    # It stopped: the points queued behind the running ones never ran.
    table = pd.read_parquet(out / RESULTS_FILE)
    assert table.loc[0, "status"] == "ok"
    assert (table["status"] == "pending").sum() >= 4


def test_a_sweep_killed_alone_leaves_no_worker_and_resumes_at_once(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    proc = start_sweep(out, workers=2)
    wait_for(out / POINTS_DIR / "p0000", proc)
    proc.kill()  # SIGKILL to the sweep process only (an OOM kill, a CI timeout)
    proc.communicate()
    # Its workers die with it (PR_SET_PDEATHSIG), releasing the folder's lock.
    plan = plan_sweep(SCENARIO, LONG_GRID, ["workload.sessions=20", "workload.turns.value=3"], out)
    deadline = time.monotonic() + 30
    while True:
        try:
            with sweep_lock(out):
                break
        except KvsimConfigError:
            assert time.monotonic() < deadline, "the killed sweep's workers kept the lock"
            time.sleep(0.2)
    done = {p.name: p.stat().st_ino for p in (out / POINTS_DIR).iterdir() if p.is_dir()
            and not p.name.startswith(".")}  # fmt: skip
    ran: list[str] = []
    table = run_sweep(plan, 2, lambda point, error: ran.append(point.id))
    assert sorted(ran) == sorted(p.id for p in plan.points if p.id not in done)
    for name, inode in done.items():
        assert (out / POINTS_DIR / name).stat().st_ino == inode
    assert (table["status"] == "ok").all()


def test_another_sweep_in_the_same_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    plan_sweep(SCENARIO, GRID, SMALL, out)
    code, text = run(
        "sweep", str(SCENARIO), "--out", str(out), "--grid", "engine.max_num_seqs=8,32"
    )
    assert code == 2 and "holds another sweep" in text
    with (
        sweep_lock(out),
        pytest.raises(
            KvsimConfigError, match=rf"another kvsim sweep \(pid {os.getpid()}\) is running"
        ),
    ):
        run_sweep(plan_sweep(SCENARIO, GRID, SMALL, out), 1)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    code, text = run("sweep", str(SCENARIO), "--out", str(other), "--grid", GRID[0])
    assert code == 2 and "is not a sweep folder" in text
    assert json.loads((out / SWEEP_FILE).read_text())["grid"] == {
        "engine.max_num_seqs": ["8", "16"],
        "engine.max_num_batched_tokens": ["8", "2048"],
    }


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ("engine.max_num_seqs", "--grid 'engine.max_num_seqs': expected FIELD=V1,V2,..."),
        ("engine.max_num_seqs=8,,16", "an empty value in the list"),
        ("engine.max_num_seqs=8,8", "a value is listed twice"),
        ("engine.bogus=1,2", "--grid engine.bogus: value '1' makes every point it is in"),
        ("engine.max_num_seqs=8,many", "value 'many' makes every point it is in impossible"),
        ("engine.enable_prefix_caching=true,maybe", "value 'maybe'"),
    ],
)
def test_a_bad_grid_is_one_clear_error(tmp_path: Path, grid: str, message: str) -> None:
    code, text = run("sweep", str(SCENARIO), "--out", str(tmp_path / "s"), "--grid", grid)
    assert code == 2 and message in text and "Traceback" not in text
    assert not (tmp_path / "s").exists()


def test_grid_parsing() -> None:
    assert parse_grid(["a.b=1, 2", "c=x"]) == (("a.b", ("1", "2")), ("c", ("x",)))
    with pytest.raises(KvsimConfigError, match="given twice"):
        parse_grid(["a=1", "a=2"])
    with pytest.raises(KvsimConfigError, match="no --grid given"):
        parse_grid([])


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_same_sweep_on_a_local_ray_cluster_gives_the_same_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray_bin = Path(sys.executable).with_name("ray")
    port = free_port()
    # A throwaway cluster on loopback: no token (Ray enables token auth once a token exists
    # in ~/.ray, which an earlier `--ray local` run leaves behind).
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    env = dict(os.environ)
    start = [str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=2"]
    start += ["--include-dashboard=false", "--disable-usage-stats"]
    subprocess.run(start, check=True, env=env, capture_output=True, timeout=180)
    try:
        code, text = run(*sweep_args(tmp_path / "ray", "--ray", f"127.0.0.1:{port}"))
        assert code == 0, text
    finally:
        subprocess.run([str(ray_bin), "stop", "--force"], env=env, capture_output=True, timeout=180)
    code, text = run(*sweep_args(tmp_path / "local", "--workers", "2"))
    assert code == 0, text
    on_ray = pd.read_parquet(tmp_path / "ray" / RESULTS_FILE).drop(columns="run_dir")
    local = pd.read_parquet(tmp_path / "local" / RESULTS_FILE).drop(columns="run_dir")
    pd.testing.assert_frame_equal(on_ray, local)


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("127.0.0.1:1", "--ray 127.0.0.1:1: no Ray cluster answers there"),
        ("nowhere", "--ray 'nowhere': expected local, auto, HOST:PORT or ray://HOST:PORT"),
    ],
)
def test_an_unreachable_ray_address_is_one_clear_error(
    tmp_path: Path, address: str, message: str
) -> None:
    code, text = run(*sweep_args(tmp_path / "s", "--ray", address))
    assert code == 2 and message in text and "Traceback" not in text
    assert not (tmp_path / "s").exists()  # refused before the folder: the fix can rerun there


def test_a_grid_of_mixed_yaml_types_still_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "mixed"
    code, text = run(*one_grid_args(out, "engine.enable_prefix_caching=true,0"))
    assert code == 0, text
    table = pd.read_parquet(out / RESULTS_FILE)
    assert list(table["engine.enable_prefix_caching"]) == ["True", "0"]
    assert list(table["status"]) == ["ok", "ok"]


def test_zero_workers_is_refused(tmp_path: Path) -> None:
    code, text = run(*sweep_args(tmp_path / "s", "--workers", "0"))
    assert code == 2 and "--workers 0: must be at least 1" in text
    assert not (tmp_path / "s").exists()


def test_a_point_whose_cut_run_left_requests_unsent_is_unfinished() -> None:
    table = pd.DataFrame(
        {
            "status": ["ok", "ok", "ok", "failed"],
            "num_requests": [10, 10, 6, 0],
            "num_finished": [10, 9, 6, 0],
            "num_not_arrived": [None, None, 4, None],  # an open-loop run cut before 4 arrived
        }
    )
    assert list(unfinished_points(table)) == [False, True, True, False]
    # Tables written before the column existed.
    assert list(unfinished_points(table.drop(columns="num_not_arrived"))) == [
        False, True, False, False,
    ]  # fmt: skip


def file_too_large(*args: object, **kwargs: object) -> None:
    raise OSError(errno.EFBIG, "File too large", "steps.parquet")


def test_a_point_that_cannot_be_written_is_no_result_of_the_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sweep"
    plan = plan_sweep(SCENARIO, ["engine.max_num_seqs=8"], SMALL, out)
    monkeypatch.setattr(SimulationResult, "write", file_too_large)
    with pytest.raises(OSError, match="File too large"):
        run_point(plan.scenario, plan.sets, plan.points[0], plan.out)
    assert os.listdir(out / POINTS_DIR) == []  # no error file, no leftover: still pending
    assert [p.id for p in plan.pending()] == ["p0000"]


def test_a_written_points_name_is_flushed_after_its_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The points folder is synced once the point's own name is in it: a power loss after
    the sweep moved on cannot take a finished point back (it would run again on resume)."""
    out = tmp_path / "sweep"
    plan = plan_sweep(SCENARIO, ["engine.max_num_seqs=8"], SMALL, out)
    listings: list[set[str]] = []
    monkeypatch.setattr(
        sweep_module, "sync_folder", lambda folder: listings.append(set(os.listdir(folder)))
    )
    assert run_point(plan.scenario, plan.sets, plan.points[0], plan.out) is None
    assert listings == [{"p0000"}]


def limit_file_size() -> None:
    """In the child: files of at most 4 KiB (``ulimit -f``): sweep.json fits, a run does not."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_a_sweep_that_cannot_write_a_point_stops_and_resumes_it(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    args = one_grid_args(out, "engine.max_num_seqs=8,16")
    limited = subprocess.run(
        [sys.executable, "-c", "from sim.cli import app; app()", *args],
        preexec_fn=limit_file_size,
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = " ".join((limited.stdout + limited.stderr).split())
    assert limited.returncode == 2, text
    assert f"cannot write the sweep in {out}: [Errno 27] File too large" in text
    assert "run the same command again to resume" in text and "Traceback" not in text
    assert os.listdir(out / POINTS_DIR) == []  # recorded as nothing: both points pending
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    code, text = run(*args)  # the same command, room made: it resumes
    assert code == 0 and "2 of 2 points ran" in text, text


def test_a_table_that_cannot_be_written_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sweep"
    plan = plan_sweep(SCENARIO, ["engine.max_num_seqs=8"], SMALL, out)

    def half_written(self: pd.DataFrame, path: Path, **kwargs: object) -> None:
        Path(path).write_bytes(b"PAR1")
        raise OSError(errno.EFBIG, "File too large")

    monkeypatch.setattr(pd.DataFrame, "to_parquet", half_written)
    with pytest.raises(OSError, match="File too large"):
        write_results(plan)
    assert sorted(os.listdir(out)) == [POINTS_DIR, SWEEP_FILE]
    (out / f".{RESULTS_FILE}.999.tmp").write_bytes(b"PAR1")  # a killed sweep's
    (out / POINTS_DIR / ".p0000.error.json.999-0.tmp").write_text("{")
    sweep_module._remove_leftovers(out)
    assert sorted(os.listdir(out)) == [POINTS_DIR, SWEEP_FILE]
    assert os.listdir(out / POINTS_DIR) == []


class FakeRayTaskError(Exception):
    """What ``ray.get`` raises for a task that raised: the task's exception as ``cause``."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::run_point() failed\nTraceback ...\n{cause}")
        self.cause = cause


def test_a_ray_task_that_cannot_write_or_whose_worker_died_stops_the_sweep(
    tmp_path: Path,
) -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    assert ray_failure(FakeRayTaskError(full), tmp_path) is full
    memory = MemoryError()
    assert ray_failure(FakeRayTaskError(memory), tmp_path) is memory
    died = ray_failure(RuntimeError("The worker died unexpectedly\nmore"), tmp_path)
    assert isinstance(died, KvsimConfigError)
    assert str(died) == (
        f"a Ray task failed (The worker died unexpectedly); the finished points are kept in "
        f"{tmp_path}: re-run the same command to resume"
    )


def test_ctrl_c_while_the_workers_start_prints_no_traceback(tmp_path: Path) -> None:
    """A terminal's Ctrl-C reaches the workers too; those still importing must not print
    tracebacks (they start with SIGINT blocked; the sweep terminates them)."""
    out = tmp_path / "sweep"
    proc = start_sweep(out, workers=2)
    deadline = time.monotonic() + 120
    while len(workers := worker_pids(proc.pid)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "run the same command again to finish the rest" in " ".join(output.split())
    assert wait_gone(workers) == []


def test_a_sweep_json_that_cannot_be_written_leaves_no_folder_to_refuse_the_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sweep"
    with monkeypatch.context() as patch:
        patch.setattr(files, "_write_all", file_too_large)
        code, text = run(*one_grid_args(out, "engine.max_num_seqs=8"))
    assert code == 2 and f"cannot write the sweep in {out}" in text, text
    assert not out.exists()
    plan_sweep(SCENARIO, ["engine.max_num_seqs=8"], SMALL, out)  # the rerun starts it
    assert (out / SWEEP_FILE).is_file()
