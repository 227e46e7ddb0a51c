"""Reading user files safely: text files, YAML documents and JSON objects.

Every reader names the file in its error, refuses what is not text (binary, not UTF-8,
larger than a bound) and accepts a UTF-8 byte-order mark, as spreadsheets and some editors
write it. The YAML loader refuses duplicate keys (where plain PyYAML lets the last one win)
and any document whose aliases would expand beyond :data:`MAX_YAML_NODES` nodes, without
expanding it.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from sim.config.limits import MAX_CONFIG_FILE_BYTES, MAX_YAML_NODES
from sim.errors import KvsimConfigError, short_repr

_MERGE_TAG = "tag:yaml.org,2002:merge"
# Byte-order marks of encodings other than UTF-8 (UTF-32 first: its LE mark starts like
# UTF-16's).
_OTHER_BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)


def is_file(path: str | Path) -> bool:
    """``Path.is_file`` that answers False instead of raising on odd paths (NUL bytes, names
    too long, permission problems)."""
    try:
        return Path(path).is_file()
    except (OSError, ValueError):
        return False


def is_dir(path: str | Path) -> bool:
    """``Path.is_dir`` that answers False instead of raising on odd paths."""
    try:
        return Path(path).is_dir()
    except (OSError, ValueError):
        return False


def read_text(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_FILE_BYTES) -> str:
    """The text of a UTF-8 file (a leading byte-order mark dropped), or KvsimConfigError
    naming ``what`` and the file: missing, a directory, too large, binary or not UTF-8."""
    path = Path(path)
    check_readable_file(path, what, max_bytes)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvsimConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    return decode_text(data, path, what)


def check_readable_file(path: Path, what: str, max_bytes: int) -> None:
    """KvsimConfigError unless ``path`` is a regular file of at most ``max_bytes``."""
    if is_dir(path):
        raise KvsimConfigError(f"{what} {path}: is a directory, not a file")
    if not is_file(path):
        raise KvsimConfigError(f"{what} {short_repr(str(path))}: no such file")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise KvsimConfigError(f"{what} {path}: cannot read it ({exc.strerror or exc})") from None
    if size > max_bytes:
        raise KvsimConfigError(
            f"{what} {path}: {size:,} bytes is larger than the {max_bytes:,}-byte limit"
        )


def decode_text(data: bytes, path: str | Path, what: str) -> str:
    """``data`` as UTF-8 text (BOM dropped); binary or other encodings are refused."""
    for bom, encoding in _OTHER_BOMS:
        if data.startswith(bom):
            raise KvsimConfigError(
                f"{what} {path}: is {encoding} text, not UTF-8; save it as UTF-8"
            )
    if b"\x00" in data:
        raise KvsimConfigError(
            f"{what} {path}: is a binary file (it holds NUL bytes), not UTF-8 text"
        )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise KvsimConfigError(
            f"{what} {path}: is not UTF-8 text (byte {data[exc.start]:#04x} at offset "
            f"{exc.start}); save it as UTF-8"
        ) from None


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys and documents whose aliases expand too far."""

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: SafeLoader says so below
                continue
            if duplicate:
                line = key_node.start_mark.line + 1
                first = seen[key].start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {short_repr(key)} (line {line}; first at line {first}): "
                    "YAML would silently keep only the last one",
                    key_node.start_mark,
                )
            seen[key] = key_node
        return super().construct_mapping(node, deep=deep)


def _expanded_size(root: Node) -> int:
    """Nodes the document would have with every alias expanded, computed on the graph
    (each distinct node once), so an alias bomb is measured without being expanded."""
    sizes: dict[int, int] = {}
    # Iterative post-order walk: deep nesting must not hit Python's recursion limit.
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, SequenceNode):
            children: list[Node] = list(node.value)
        elif isinstance(node, MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        if children_done:
            total = 1 + sum(sizes.get(id(c), 0) for c in children)
            sizes[id(node)] = min(total, MAX_YAML_NODES + 1)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def load_yaml(text: str, source: str) -> Any:
    """Parse one YAML document; KvsimConfigError naming ``source`` on any problem."""
    try:
        loader = _StrictLoader(text)  # checks the characters: may raise a ReaderError
    except yaml.YAMLError as exc:
        raise KvsimConfigError(f"{source}: not valid YAML: {_yaml_reason(exc)}") from None
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node)
        if size > MAX_YAML_NODES:
            raise KvsimConfigError(
                f"{source}: its aliases (*name) would expand the document beyond "
                f"{MAX_YAML_NODES:,} nodes; kvsim refuses it without expanding it"
            )
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise KvsimConfigError(f"{source}: not valid YAML: {_yaml_reason(exc)}") from None
    except RecursionError:
        raise KvsimConfigError(f"{source}: nested too deeply to be a scenario") from None
    finally:
        loader.dispose()


def _yaml_reason(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        parts = [p for p in (exc.context, exc.problem) if p]
        mark = exc.problem_mark or exc.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        return " ".join(" ".join(str(p).split()) for p in parts)[:300] + where
    return " ".join(str(exc).split())[:300]


def load_json_object(path: str | Path, what: str) -> dict[str, Any]:
    """A JSON file that must hold one object; KvsimConfigError naming the file otherwise.

    ``NaN`` and ``Infinity``, which Python's json accepts, are refused.
    """
    text = read_text(path, what)

    def refuse_constant(name: str) -> float:
        raise ValueError(f"{name} is not a number JSON allows")

    try:
        value = json.loads(text, parse_constant=refuse_constant)
    except json.JSONDecodeError as exc:
        raise KvsimConfigError(
            f"{what} {path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
        ) from None
    except (ValueError, RecursionError) as exc:
        raise KvsimConfigError(f"{what} {path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise KvsimConfigError(
            f"{what} {path}: expected a JSON object {{...}}, got {type(value).__name__} "
            f"{short_repr(value)}"
        )
    return value
