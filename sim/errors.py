"""User-facing configuration errors and a one-paragraph rendering of pydantic errors."""

from __future__ import annotations

import reprlib

import pydantic

# Long inputs (a whole nested dict for a model-level check) would drown the message.
_MAX_INPUT_CHARS = 60
# One error's message, and how many errors one paragraph lists.
_MAX_MESSAGE_CHARS = 300
_MAX_ERRORS = 6
_VALUE_ERROR_PREFIX = "Value error, "

# repr() of a value bounded in depth and width, so an error message never walks (or prints)
# a huge input: a YAML alias bomb, a megabyte-long string, a list of a million rows.
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel = 2
_SHORT_REPR.maxdict = 4
_SHORT_REPR.maxlist = 4
_SHORT_REPR.maxtuple = 4
_SHORT_REPR.maxset = 4
_SHORT_REPR.maxstring = _MAX_INPUT_CHARS
_SHORT_REPR.maxother = _MAX_INPUT_CHARS
_SHORT_REPR.maxlong = 40


class KvsimConfigError(ValueError):
    """A configuration the user wrote cannot work; the message names the value and a fix."""


def short_repr(value: object, limit: int = _MAX_INPUT_CHARS) -> str:
    """``repr(value)`` on one line, cut to about ``limit`` characters without ever building
    the full repr of a large or deeply nested value."""
    text = " ".join(_SHORT_REPR.repr(value).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


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
    return short_repr(value)


def _bounded(text: str, limit: int = _MAX_MESSAGE_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_validation_error(exc: pydantic.ValidationError, source: str) -> str:
    """Render every error of ``exc`` in one line: ``source: path = value: message; ...``.

    ``source`` names where the input came from (a file name, ``--engine``). A missing field
    shows no value (its input would be the enclosing dict), nor does a section-level check
    (its input is the whole section: its message names the fields); a model-level check with
    an empty path shows only its message. At most a few errors are listed, then how many more.
    """
    parts = []
    errors = exc.errors(include_url=False)
    for error in errors[:_MAX_ERRORS]:
        message = _bounded(str(error["msg"]).removeprefix(_VALUE_ERROR_PREFIX))
        path = _bounded(_format_loc(error["loc"]), 120)
        section_check = error["type"] in ("value_error", "assertion_error") and isinstance(
            error["input"], dict
        )
        if error["type"] == "missing" or (path and section_check):
            parts.append(f"{path}: {message}")
        elif path:
            parts.append(f"{path} = {_format_input(error['input'])}: {message}")
        else:
            parts.append(message)
    if len(errors) > _MAX_ERRORS:
        parts.append(f"and {len(errors) - _MAX_ERRORS} more")
    return f"{source}: " + "; ".join(parts)
