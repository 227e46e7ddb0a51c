"""Writing output files so that a failure never leaves a half-written one in place.

kvsim never overwrites an output, so a truncated file (a full disk, a file size limit, an
interrupted write) would block the rerun that should replace it. Every single-file output
goes through :func:`write_atomic` (or :func:`atomic_path` for a library that writes a path
itself, such as ``DataFrame.to_parquet``): the bytes go to a hidden temporary file in the
same folder, flushed to the disk (``os.fsync``: a power loss after the rename cannot leave an
empty file under the final name) and renamed onto the target only once complete
(``os.replace``, atomic on one filesystem), and removed on any error; the folder is flushed
after the rename too (:func:`sync_folder`), so the new name itself survives a power loss. A
new folder of outputs (``capacity.json``, a Triton model repository) is written by
:func:`write_new_folder` into a hidden sibling, its files and folders flushed the same way,
renamed into place once complete.
:func:`probe_folder` checks with a real write, before a long search, that its output can be
written at all (``os.access`` says yes to root everywhere).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path

NAME_MAX = 255  # bytes in one file name (ext4, xfs, btrfs, NFS)
_SEQUENCE = itertools.count()  # temporary names unique within this process, across threads


def hidden_name(name: str, suffix: str) -> str:
    """``.<name><suffix>``, a hidden sibling's name; where that would exceed
    :data:`NAME_MAX` bytes, ``name`` is cut and a digest of it added (``.<cut>~<digest>``),
    so a long but valid output name never fails on its hidden sibling."""
    whole = f".{name}{suffix}"
    if len(whole.encode()) <= NAME_MAX:
        return whole
    digest = "~" + hashlib.sha256(name.encode()).hexdigest()[:12]
    room = NAME_MAX - len(f".{digest}{suffix}".encode())
    cut = name.encode()[: max(room, 0)].decode(errors="ignore")
    return f".{cut}{digest}{suffix}"


def _temp_beside(path: Path) -> Path:
    """Create, exclusively, a new empty hidden file in ``path``'s folder and return it (with
    the permissions an ordinary new file gets)."""
    while True:
        tmp = path.with_name(hidden_name(path.name, f".{os.getpid()}-{next(_SEQUENCE)}.tmp"))
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:  # a leftover of a killed process that had this pid
            continue
        return tmp


def _remove(path: Path) -> None:
    with suppress(OSError):
        path.unlink()


@contextmanager
def atomic_path(path: str | Path, executable: bool = False) -> Iterator[Path]:
    """A hidden temporary path beside ``path`` to write, renamed onto ``path`` when the
    block ends without an error and removed when it raises (anything, Ctrl-C included).
    ``executable`` adds the execute bits (a script) before the rename. A missing folder of
    ``path`` is created (:func:`probe_folder` checked it could be, creating nothing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(path)
    try:
        yield tmp
        if executable:
            os.chmod(tmp, tmp.stat().st_mode | 0o111)
        sync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    sync_folder(path.parent)


def write_atomic(path: str | Path, data: str | bytes, executable: bool = False) -> Path:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically: the file is either
    complete or as it was, and no temporary file is left behind. Returns ``path``."""
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    with atomic_path(path, executable) as tmp:
        _write_all(tmp, payload)
    return path


def _write_all(path: Path, payload: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(payload)


def sync_file(path: Path) -> None:
    """Flush ``path``'s bytes to the disk (whoever wrote them) before it is renamed into
    place: without it a crash can leave the new name pointing at an empty file."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries to the disk: after a file or folder is renamed into it, so
    that a power loss cannot take the new name back. Best effort: where the folder cannot be
    opened for reading or its filesystem has no directory fsync (some network and FUSE
    filesystems), the output is complete all the same and only its name's durability is left
    to the filesystem."""
    with suppress(OSError):
        descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def sync_tree(folder: Path) -> None:
    """:func:`sync_file` on every file under ``folder`` and :func:`sync_folder` on every
    folder in it, itself included (a hidden folder about to be renamed into place)."""
    for path in folder.rglob("*"):
        if path.is_symlink():
            continue
        if path.is_file():
            sync_file(path)
        elif path.is_dir():
            sync_folder(path)
    sync_folder(folder)


def write_new_folder(
    folder: str | Path,
    files: Mapping[str, str | bytes],
    extra: Callable[[Path], None] | None = None,
) -> list[Path]:
    """Create the new folder ``folder`` holding ``files`` (path relative to the folder ->
    content; ``a/b.txt`` creates ``a``), written into a hidden sibling and renamed into place
    once complete; a failure leaves neither. ``extra(tmp)`` may adjust the files before the
    rename. Raises FileExistsError if ``folder`` exists. Returns the files' final paths."""
    folder = Path(folder)
    if folder.exists():
        raise FileExistsError(f"{folder}: already exists; kvsim never overwrites")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(hidden_name(folder.name, f".{os.getpid()}-{next(_SEQUENCE)}.tmp"))
    try:
        tmp.mkdir()
        for relative, content in files.items():
            target = tmp / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            _write_all(target, content.encode() if isinstance(content, str) else content)
        if extra is not None:
            extra(tmp)
        sync_tree(tmp)
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    sync_folder(folder.parent)
    return [folder / relative for relative in files]


def probe_folder(folder: str | Path) -> None:
    """Check that files can be made in ``folder`` or, where it does not exist yet, in its
    nearest existing ancestor (where it would be created): create and remove a hidden file
    there. Creates no folder (a check before a long search must leave nothing behind, nor a
    folder that the search's own output then finds in its way). OSError (or ValueError,
    for a path with a NUL byte) when that cannot be done."""
    existing = Path(folder)
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(existing))
    _remove(_temp_beside(existing / "kvsim-probe"))


def reason(exc: BaseException) -> str:
    """An OSError's cause without its errno prefix (``File too large``), else its text."""
    strerror = getattr(exc, "strerror", None)
    return strerror or str(exc) or type(exc).__name__
