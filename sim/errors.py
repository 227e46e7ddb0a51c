"""User-facing configuration errors and a one-paragraph rendering of pydantic errors."""

from __future__ import annotations

import pydantic

# Long inputs (a whole nested dict for a model-level check) would drown the message.
_MAX_INPUT_CHARS = 60
_VALUE_ERROR_PREFIX = "Value error, "


class KvsimConfigError(ValueError):
    """A configuration the user wrote cannot work; the message names the value and a fix."""


def _format_loc(loc: tuple[int | str, ...]) -> str:
    """Dotted field path; list indices in brackets (``workload.sessions[0].turns``)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _format_input(value: object) -> str:
    text = " ".join(repr(value).split())
    if len(text) > _MAX_INPUT_CHARS:
        text = text[: _MAX_INPUT_CHARS - 3] + "..."
    return text


def format_validation_error(exc: pydantic.ValidationError, source: str) -> str:
    """Render every error of ``exc`` in one line: ``source: path = value: message; ...``.

    ``source`` names where the input came from (a file name, ``--engine``). A missing field
    shows no value (its input would be the enclosing dict); a model-level check with an empty
    path shows only its message.
    """
    parts = []
    for error in exc.errors():
        message = " ".join(str(error["msg"]).split())
        message = message.removeprefix(_VALUE_ERROR_PREFIX)
        path = _format_loc(error["loc"])
        if error["type"] == "missing":
            parts.append(f"{path}: {message}")
        elif path:
            parts.append(f"{path} = {_format_input(error['input'])}: {message}")
        else:
            parts.append(message)
    return f"{source}: " + "; ".join(parts)
