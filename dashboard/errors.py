"""Every failure on a dashboard page as one readable paragraph, never a traceback.

kvsim's own errors (:class:`~sim.errors.KvsimConfigError` and the ``ValueError``s of the
loaders) already name the file, field and value: they are shown as they are. Anything else
(an unreadable file, a bug) is shown as one paragraph naming what was being done, the kind of
error and its message; its traceback goes to the log of the terminal running the dashboard.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import streamlit as st

LOG = logging.getLogger("kvsim.dashboard")
MAX_CHARS = 1200  # a message that would fill the page is cut


def _one_paragraph(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


def describe(exc: BaseException, context: str, subject: str | None = None) -> str:
    """One paragraph for ``exc``, raised while doing ``context`` (e.g. ``"upload.yaml"``).

    A ``ValueError`` whose message already names ``subject`` (or starts with ``context``) is
    shown as it is: kvsim's own errors name their file, field and value.
    """
    if isinstance(exc, UnicodeDecodeError):
        text = f"{context}: not UTF-8 text (byte {exc.start}: {exc.reason})"
    elif isinstance(exc, ValueError):  # KvsimConfigError, the loaders' errors
        message = str(exc) or type(exc).__name__
        named = message.startswith(context) or (subject is not None and subject in message)
        text = message if named else f"{context}: {message}"
    elif isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        text = f"{context}: {exc.strerror or exc}{where}"
    elif isinstance(exc, RecursionError):
        text = f"{context}: nested too deeply to read"
    elif isinstance(exc, MemoryError):
        text = f"{context}: too large to hold in memory"
    else:
        text = (
            f"{context}: {type(exc).__name__}: {exc} (unexpected: the full traceback is in "
            "the terminal running `kvsim dashboard`)"
        )
    return _one_paragraph(text)


def show_error(exc: BaseException, context: str, subject: str | None = None) -> None:
    """``st.error`` with :func:`describe`; the traceback of an unexpected error is logged."""
    if not isinstance(exc, ValueError | OSError):
        LOG.error("%s", context, exc_info=exc)
    st.error(describe(exc, context, subject))


@contextmanager
def guard(context: str, subject: str | None = None) -> Iterator[None]:
    """Show any error raised inside as one message and stop the page there.

    ``st.stop()`` and ``st.rerun()`` raise exceptions derived from ``BaseException`` only, so
    they pass through.
    """
    try:
        yield
    except Exception as exc:
        show_error(exc, context, subject)
        st.stop()
