"""`dashboard.errors.describe`: one paragraph per failure, naming what was being done."""

from __future__ import annotations

import pytest

from dashboard.errors import MAX_CHARS, describe
from sim.errors import KvsimConfigError


def _decode_error() -> UnicodeDecodeError:
    try:
        b"\xff".decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc
    raise AssertionError("unreachable")


@pytest.mark.parametrize(
    ("exc", "subject", "expected"),
    [
        (KvsimConfigError("up.yaml: engine.block_size = 7: bad"), None,
         "up.yaml: engine.block_size = 7: bad"),
        (ValueError("runs/x: cannot read run files: gone"), "runs/x",
         "runs/x: cannot read run files: gone"),
        (ValueError("could not convert\n  string"), "runs/x",
         "up.yaml: could not convert string"),
        (_decode_error(), None, "up.yaml: not UTF-8 text (byte 0: invalid start byte)"),
        (FileNotFoundError(2, "No such file or directory", "/t.jsonl"), None,
         "up.yaml: No such file or directory (/t.jsonl)"),
        (PermissionError("denied"), None, "up.yaml: denied"),
        (RecursionError("maximum recursion depth exceeded"), None,
         "up.yaml: nested too deeply to read"),
        (TypeError("can only concatenate str (not \"int\") to str"), None,
         'up.yaml: TypeError: can only concatenate str (not "int") to str (unexpected: the full '
         "traceback is in the terminal running `kvsim dashboard`)"),
    ],
)  # fmt: skip
def test_describe(exc: BaseException, subject: str | None, expected: str) -> None:
    assert describe(exc, "up.yaml", subject) == expected


def test_describe_cuts_a_huge_message() -> None:
    text = describe(ValueError("x" * 10_000), "up.yaml")
    assert len(text) == MAX_CHARS and text.endswith("...")
