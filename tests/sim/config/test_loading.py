"""Safe readers: duplicate keys, alias bombs, binary and non-UTF-8 files, BOMs, JSON objects."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sim.config.limits import MAX_YAML_NODES
from sim.config.loading import load_json_object, load_yaml, read_text
from sim.errors import KvsimConfigError


def test_duplicate_keys_are_errors_at_any_depth() -> None:
    with pytest.raises(KvsimConfigError, match=r"s.yaml: not valid YAML: duplicate key 'a'"):
        load_yaml("a: 1\nb: 2\na: 3\n", "s.yaml")
    with pytest.raises(KvsimConfigError, match=r"duplicate key 'x' \(line 3; first at line 2\)"):
        load_yaml("e:\n  x: 1\n  x: 2\n", "s.yaml")


def test_merge_keys_and_small_aliases_are_fine() -> None:
    doc = load_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  y: 3\nlist: [*b, *b]\n", "s")
    assert doc["other"] == {"x": 1, "y": 3}
    assert doc["list"] == [{"x": 1, "y": 2}, {"x": 1, "y": 2}]


def test_alias_bomb_is_measured_without_expanding() -> None:
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n"
        for p, c in zip("abcdefghi", "bcdefghij", strict=True)
    )  # 10**10 leaves
    with pytest.raises(KvsimConfigError, match=f"beyond {MAX_YAML_NODES:,} nodes"):
        load_yaml(bomb, "bomb.yaml")


def test_deep_nesting_is_an_error_not_a_crash() -> None:
    with pytest.raises(KvsimConfigError, match=r"deep\.yaml"):
        load_yaml("[" * 100_000 + "]" * 100_000, "deep.yaml")


def test_yaml_error_is_short_and_has_a_position() -> None:
    with pytest.raises(KvsimConfigError) as info:
        load_yaml("a: [1, 2\nb: " + "x" * 10_000, "s.yaml")
    assert "(line " in str(info.value) and len(str(info.value)) < 500


def test_read_text_names_file_and_reason(tmp_path: Path) -> None:
    good = tmp_path / "bom.yaml"
    good.write_bytes(b"\xef\xbb\xbfname: x\n")
    assert read_text(good, "scenario") == "name: x\n"
    cases = {
        b"\x00\x01": "is a binary file",
        "caf\u00e9".encode("latin-1"): "is not UTF-8 text (byte 0xe9 at offset 3)",
        "x".encode("utf-16"): "is UTF-16 text, not UTF-8",
    }
    for data, expected in cases.items():
        path = tmp_path / "f.yaml"
        path.write_bytes(data)
        with pytest.raises(KvsimConfigError, match=re.escape(f"scenario {path}: {expected}")):
            read_text(path, "scenario")
    with pytest.raises(KvsimConfigError, match="is a directory"):
        read_text(tmp_path, "scenario")
    with pytest.raises(KvsimConfigError, match="no such file"):
        read_text(tmp_path / "missing", "scenario")
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * 2000)
    with pytest.raises(KvsimConfigError, match="2,000 bytes is larger than the 1,000-byte limit"):
        read_text(big, "scenario", max_bytes=1000)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("7", "expected a JSON object {...}, got int 7"),
        ('"llama"', "got str 'llama'"),
        ('{"a": Infinity}', "Infinity is not a number JSON allows"),
        ("{", "not valid JSON (Expecting property name"),
    ],
)
def test_json_object_reader(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(KvsimConfigError, match=r"config\.json") as info:
        load_json_object(path, "model config")
    assert expected in str(info.value)


def test_unprintable_characters_are_a_yaml_error() -> None:
    with pytest.raises(KvsimConfigError, match=r"s\.yaml: not valid YAML: unacceptable character"):
        load_yaml("\x80name: x\n", "s.yaml")
