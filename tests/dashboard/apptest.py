"""Helpers for driving the dashboard's pages under streamlit.testing.v1.AppTest."""

from __future__ import annotations

import json
from typing import Any

from streamlit.testing.v1 import AppTest

from tests.dashboard.conftest import APP

TIMEOUT_S = 120


def start_app() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT_S)
    at.run()
    assert not at.exception, at.exception
    return at


def open_page(at: AppTest, page: str) -> AppTest:
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, at.exception
    return at


def texts(elements: Any) -> list[str]:
    return [str(e.value) for e in elements]


def charts(at: AppTest) -> list:
    return at.get("plotly_chart")


def trace_names(at: AppTest, key: str) -> list[str]:
    """The trace names of the page's chart with this widget key."""
    (chart,) = [c for c in charts(at) if c.proto.id.endswith(f"-{key}")]
    return [trace.get("name") for trace in json.loads(chart.proto.spec)["data"]]
