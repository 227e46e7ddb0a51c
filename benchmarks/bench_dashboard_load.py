"""How long the dashboard takes to show something and to load a 100k-request run.

    python benchmarks/bench_dashboard_load.py [--requests 100000] [--keep DIR] [--paint-only]

Synthesizes a run directory (``tests/dashboard/synth.py``: 100k requests, ~32M per-token
times, 2M steps, a 30k-block map of 120 snapshots), then:

1. times ``build_view`` alone (reading and reducing the files) and the Run explorer page's
   first render through AppTest (cold cache: load + charts), then a warm rerun (target:
   under 5 s); skipped with ``--paint-only``;
2. first paint in a real browser (Debian's headless Chromium through Selenium, as
   ``tests/dashboard/test_browser.py``; skipped when they are missing): for each page, a
   fresh ``streamlit run`` (so the first session pays every import), then the time from
   ``driver.get`` to the page's title (``h1``) being shown, and to the page being complete;
   then the same again in a second session of the same server (warm). Target: the title
   within a second, even while the rest loads.

Not a test: timings depend on the machine, so nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

# The synthetic run builder lives with the dashboard tests; run this file from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dashboard.launch import streamlit_command
from tests.dashboard.synth import synthesize_run, write_block_map

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
WAIT_S = 120.0
# (path, title, what marks the page complete: a CSS selector and how many of it)
PAGES = (
    ("", "What-if", "[data-testid='stFormSubmitButton'] button", 1),
    ("run_explorer", "Run explorer", ".js-plotly-plot", 7),
)


def bench_apptest(base: Path, run: Path) -> None:
    from dashboard.loaders import build_view

    started = time.perf_counter()
    view = build_view(run)
    print(
        f"build_view: {time.perf_counter() - started:.2f} s "
        f"({len(view.requests):,} requests; {view.timeline.note()})"
    )

    from streamlit.testing.v1 import AppTest

    os.environ["KVSIM_RUNS_DIR"] = str(base)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    at.switch_page("views/run_explorer.py")
    started = time.perf_counter()
    at.run()
    cold = time.perf_counter() - started
    assert not at.exception and not at.error, (at.exception, at.error)
    started = time.perf_counter()
    at.run()
    warm = time.perf_counter() - started
    print(f"Run explorer first render (cold cache): {cold:.2f} s; rerun (warm): {warm:.2f} s")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(base: Path, log: Path, port: int) -> tuple[subprocess.Popen, str]:
    out = log.open("w")
    proc = subprocess.Popen(
        streamlit_command("127.0.0.1", port, base, headless=True),
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=1) as resp:
                if resp.read().strip() == b"ok":
                    return proc, url
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"streamlit did not start:\n{log.read_text()}")


def _browser(profile: Path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ["SE_OFFLINE"] = "true"  # never let Selenium Manager download anything
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.page_load_strategy = "none"  # get() returns at once; the polling below times
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                "--window-size=1366,768"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _WS_HOOK})
    return driver


_PROBE = """
const h1 = document.querySelector('h1');
return [h1 ? h1.textContent : null, document.querySelectorAll(arguments[0]).length];
"""
# Records when the page's websocket to the server opens (the session starts there).
_WS_HOOK = """
const Native = window.WebSocket;
window.WebSocket = function (...args) {
  const ws = new Native(...args);
  ws.addEventListener('open', () => { window.__kvsimWsOpen ??= performance.now(); });
  return ws;
};
window.WebSocket.prototype = Native.prototype;
Object.assign(window.WebSocket, Native);
"""
# The browser's marks (ms since navigation start): HTML and scripts loaded, websocket open.
_MARKS = """
const nav = performance.getEntriesByType('navigation')[0];
return [nav ? nav.domContentLoadedEventEnd : null, window.__kvsimWsOpen ?? null];
"""


def _load(driver, url: str, title: str, selector: str, count: int) -> tuple[float, ...]:
    """Seconds from get() to the title shown and to ``count`` elements of ``selector``; the
    browser's DOMContentLoaded and websocket open (s since navigation start)."""
    started = time.perf_counter()
    driver.get(url)
    first = None
    while time.perf_counter() - started < WAIT_S:
        try:
            heading, found = driver.execute_script(_PROBE, selector)
        except Exception:  # the document is being replaced
            heading, found = None, 0
        now = time.perf_counter() - started
        if first is None and heading and title in heading:
            first = now
        if first is not None and found >= count:
            loaded, connected = driver.execute_script(_MARKS)
            return first, now, (loaded or 0) / 1e3, (connected or 0) / 1e3
        time.sleep(0.01)
    raise SystemExit(f"{url}: title {title!r} at {first} s, {selector} x{count} never shown")


def bench_first_paint(base: Path) -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium")
    if missing:
        print(f"first paint: skipped (needs {', '.join(missing)}; see .ci/install-browser.sh)")
        return
    work = Path(tempfile.mkdtemp(prefix="kvsim-paint-"))
    try:
        port = _free_port()  # every server on the same port: the browser's cache applies
        driver = _browser(work / "profile")
        try:
            # A first visit with an empty browser cache, then each page on a fresh server (its
            # first session pays every import) and again in a second session.
            runs = [("What-if", "first visit (empty browser cache)", True), *(
                (page[1], session, session == "fresh server")
                for page in PAGES for session in ("fresh server", "second session")
            )]  # fmt: skip
            proc = None
            for title, session, restart in runs:
                path, _, selector, count = next(p for p in PAGES if p[1] == title)
                if restart:
                    if proc is not None:
                        proc.terminate()
                        proc.wait()
                    proc, url = _serve(base, work / "streamlit.log", port)
                first, done, loaded, connected = _load(
                    driver, f"{url}/{path}", title, selector, count
                )
                print(
                    f"{title}, {session}: title shown after {first:.2f} s, complete after "
                    f"{done:.2f} s (scripts loaded {loaded:.2f} s, session open "
                    f"{connected:.2f} s: title {first - connected:.2f} s after the session "
                    "began)"
                )
        finally:
            driver.quit()
            if proc is not None:
                proc.terminate()
                proc.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--keep", type=Path, help="Write (or reuse) the run directory here.")
    parser.add_argument("--paint-only", action="store_true", help="Only the browser timings.")
    args = parser.parse_args()

    base = args.keep or Path(tempfile.mkdtemp(prefix="kvsim-bench-"))
    run = base / f"synthetic-{args.requests}"
    if not run.exists():
        started = time.perf_counter()
        synthesize_run(run, num_requests=args.requests)
        end_s = json.loads((run / "summary.json").read_text())["duration_s"]
        write_block_map(run, end_s, 30_000, 120, np.random.default_rng(1))
        print(f"synthesized {run} in {time.perf_counter() - started:.1f} s")
    size_mb = sum(f.stat().st_size for f in run.iterdir()) / 1e6
    print(f"run directory: {size_mb:,.0f} MB on disk")
    try:
        if not args.paint_only:
            bench_apptest(base, run)
        bench_first_paint(base)
    finally:
        if args.keep is None:
            shutil.rmtree(base)


if __name__ == "__main__":
    main()
