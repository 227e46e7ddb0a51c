"""The replay process's environment (no vLLM needed)."""

from __future__ import annotations

import ctypes.util

import pytest

from validate.runner import worker_env


def test_cpu_replays_preload_tcmalloc_when_the_machine_has_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = {"tcmalloc_minimal": "libtcmalloc_minimal.so.4"}
    monkeypatch.setattr(ctypes.util, "find_library", found.get)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert worker_env("cpu")["LD_PRELOAD"] == "libtcmalloc_minimal.so.4"
    assert "LD_PRELOAD" not in worker_env("cuda")
    # The user's own preloads stay, after it; a tcmalloc they chose is left alone.
    monkeypatch.setenv("LD_PRELOAD", "libfoo.so")
    assert worker_env("cpu")["LD_PRELOAD"] == "libtcmalloc_minimal.so.4:libfoo.so"
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/libtcmalloc.so.4")
    assert worker_env("cpu")["LD_PRELOAD"] == "/opt/lib/libtcmalloc.so.4"
    # Without the library the replay runs on the default allocator.
    monkeypatch.setattr(ctypes.util, "find_library", {}.get)
    monkeypatch.delenv("LD_PRELOAD")
    assert "LD_PRELOAD" not in worker_env("cpu")
