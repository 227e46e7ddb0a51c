"""sim.files: outputs appear whole or not at all, and no temporary file is left behind."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from sim import files
from sim.files import (
    NAME_MAX,
    atomic_path,
    hidden_name,
    probe_folder,
    write_atomic,
    write_new_folder,
)
from sim.results import write_run


def half_written(code: int) -> Callable[[Path, bytes], None]:
    """A stand-in for ``sim.files._write_all``: the write stops half way with OSError
    ``code`` (EFBIG: a file size limit; ENOSPC: a full disk)."""

    def write(path: Path, payload: bytes) -> None:
        with path.open("wb") as handle:
            handle.write(payload[: len(payload) // 2])
        raise OSError(code, os.strerror(code))

    return write


half_then_fail = half_written(errno.EFBIG)


def test_text_and_bytes_are_written_whole_with_no_temporary_left(tmp_path: Path) -> None:
    text = write_atomic(tmp_path / "a.json", '{"é": 1}\n')
    assert text.read_text() == '{"é": 1}\n'
    blob = write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert blob.read_bytes() == b"\x00\x01"
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.bin"]
    mode = stat.S_IMODE(text.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # an ordinary new file's permissions, not mkstemp's 0600
    script = write_atomic(tmp_path / "serve.sh", "#!/bin/sh\n", executable=True)
    assert os.access(script, os.X_OK)


def test_a_failed_write_leaves_the_target_as_it_was_and_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files, "_write_all", half_then_fail)
    with pytest.raises(OSError, match="File too large"):
        write_atomic(tmp_path / "new.json", "x" * 100)
    old = tmp_path / "old.json"
    old.write_text("before")
    with pytest.raises(OSError, match="File too large"):
        write_atomic(old, "after")
    assert old.read_text() == "before"
    assert sorted(os.listdir(tmp_path)) == ["old.json"]


def test_a_writer_that_fails_or_is_interrupted_leaves_no_temporary(tmp_path: Path) -> None:
    for error in (OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()):
        with pytest.raises(type(error)), atomic_path(tmp_path / "t.parquet") as tmp:
            tmp.write_bytes(b"half")
            raise error
    assert os.listdir(tmp_path) == []
    with atomic_path(tmp_path / "t.parquet") as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".t.parquet.")
        tmp.write_bytes(b"whole")
    assert os.listdir(tmp_path) == ["t.parquet"]


def test_a_new_folder_appears_complete_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "deep" / "repo"
    written = write_new_folder(out, {"m/config.pbtxt": "a", "m/1/model.json": b"{}"})
    assert written == [out / "m" / "config.pbtxt", out / "m" / "1" / "model.json"]
    assert (out / "m" / "1" / "model.json").read_bytes() == b"{}"
    with pytest.raises(FileExistsError, match="never overwrites"):
        write_new_folder(out, {"x": "y"})
    monkeypatch.setattr(files, "_write_all", half_then_fail)
    with pytest.raises(OSError, match="File too large"):
        write_new_folder(tmp_path / "cap", {"capacity.json": "{}" * 50})
    assert sorted(os.listdir(tmp_path)) == ["deep"]  # no folder, no hidden leftover


def test_a_long_name_gets_a_hidden_sibling_that_fits(tmp_path: Path) -> None:
    assert hidden_name("run", ".partial-12") == ".run.partial-12"
    long = "é" * 124 + "x"  # 249 bytes: a valid name, its hidden sibling would not be
    sibling = hidden_name(long, ".partial-4194304@0123abcd")
    assert len(sibling.encode()) <= NAME_MAX
    assert sibling.startswith(".é") and sibling.endswith(".partial-4194304@0123abcd")
    assert hidden_name(long[:-1] + "y", ".t") != hidden_name(long, ".t")  # a digest tells
    write_atomic(tmp_path / long, "ok")
    assert os.listdir(tmp_path) == [long]


def test_probe_creates_nothing_and_leaves_nothing(tmp_path: Path) -> None:
    probe_folder(tmp_path / "a" / "b")  # checked where it would be created: tmp_path
    assert os.listdir(tmp_path) == []
    (tmp_path / "a").mkdir()
    probe_folder(tmp_path / "a")
    assert os.listdir(tmp_path / "a") == []
    with pytest.raises(OSError):
        probe_folder("/proc/kvsim-probe")  # access() says yes to root here
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        probe_folder(tmp_path / "file")


def test_a_profile_that_cannot_be_saved_leaves_no_truncated_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sim.config.calibration import load_profile, save_profile
    from sim.cost_model import CostParams
    from tests.profiles import profile_with

    profile = profile_with(CostParams(mode="additive"))
    monkeypatch.setattr(files, "_write_all", half_then_fail)
    with pytest.raises(OSError, match="File too large"):
        save_profile(profile, tmp_path / "profile.json")
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    save_profile(profile, tmp_path / "profile.json")
    assert load_profile(tmp_path / "profile.json") == profile


def test_every_output_reaches_the_disk_before_its_final_name_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync before the rename: a power loss after it cannot leave an empty file under the
    output's name. Each file is synced complete (its bytes as fsync found them) and is the
    very file (inode) that then holds the final name."""
    synced: dict[int, bytes] = {}  # a file's inode -> its bytes when it was synced
    listed: dict[int, list[set[str]]] = {}  # a folder's inode -> its names at each sync
    real_fsync = os.fsync

    def record(descriptor: int) -> None:
        real_fsync(descriptor)
        status = os.fstat(descriptor)
        if stat.S_ISDIR(status.st_mode):
            listed.setdefault(status.st_ino, []).append(set(os.listdir(descriptor)))
        else:
            synced[status.st_ino] = os.pread(descriptor, status.st_size, 0)

    def synced_as(path: Path) -> bytes | None:
        return synced.get(path.stat().st_ino)

    def name_synced(path: Path) -> bool:
        """The folder holding ``path`` was synced once the name was in it (after the
        rename: a power loss cannot take the name back)."""
        return any(path.name in names for names in listed.get(path.parent.stat().st_ino, []))

    monkeypatch.setattr(os, "fsync", record)
    text = write_atomic(tmp_path / "a.json", "whole\n")
    assert synced_as(text) == b"whole\n"
    assert name_synced(text)
    with atomic_path(tmp_path / "t.parquet") as tmp:
        tmp.write_bytes(b"PAR1")
    assert synced_as(tmp_path / "t.parquet") == b"PAR1"
    assert name_synced(tmp_path / "t.parquet")
    made = write_new_folder(tmp_path / "repo", {"a/config.pbtxt": "x", "b.txt": b"y"})
    assert [synced_as(path) for path in made] == [b"x", b"y"]
    assert all(name_synced(path) for path in [*made, made[0].parent, tmp_path / "repo"])
    run = write_run(tmp_path / "run", {"n": 1}, pd.DataFrame({"a": [1]}), pd.DataFrame(), "x: 1\n")
    for path in run.iterdir():
        assert synced_as(path) == path.read_bytes() != b"", path.name
        assert name_synced(path), path.name
    assert name_synced(run)
