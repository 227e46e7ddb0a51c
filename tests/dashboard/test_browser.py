"""The dashboard in a real browser: `python -m streamlit run` on a free local port, Debian's
headless Chromium driven by Selenium through Debian's chromedriver (no browser download).

Screenshots go to $KVSIM_SCREENSHOT_DIR (else the test's tmp_path). Without Chromium the test
is skipped, unless $CI is set: CI installs it with .ci/install-browser.sh and must run it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from dashboard.launch import streamlit_command

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
VIEWPORT = (1366, 768)
WAIT_S = 90


def _require_browser() -> None:
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium Python package")
    if not missing:
        return
    reason = f"browser test needs {', '.join(missing)} (run .ci/install-browser.sh)"
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but {reason}")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def dashboard_url(small_runs: Path, tmp_path: Path) -> Iterator[str]:
    """The dashboard served by `python -m streamlit run` on 127.0.0.1, stopped afterwards."""
    _require_browser()
    port = _free_port()
    runs = tmp_path / "runs"
    shutil.copytree(small_runs, runs)
    log = (tmp_path / "streamlit.log").open("w")
    command = streamlit_command("127.0.0.1", port, runs, headless=True)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as resp:
                    if resp.read().strip() == b"ok":
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"streamlit did not start:\n{(tmp_path / 'streamlit.log').read_text()}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager download anything
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--window-size={VIEWPORT[0]},{VIEWPORT[1]}",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    driver.set_window_size(*VIEWPORT)
    try:
        yield driver
    finally:
        driver.quit()


def _screenshot_dir(tmp_path: Path) -> Path:
    out = Path(os.environ.get("KVSIM_SCREENSHOT_DIR") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _wait(driver, predicate, what: str):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, WAIT_S, poll_frequency=0.25).until(predicate)
    except TimeoutException:
        pytest.fail(f"timed out waiting for {what}; page text:\n{_body_text(driver)[:2000]}")


def _body_text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def _shot(driver, element, path: Path) -> None:
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", element)
    time.sleep(0.8)  # let Plotly finish its resize after scrolling
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000, path


def test_what_if_in_browser(dashboard_url: str, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    shots = _screenshot_dir(tmp_path)
    browser.get(dashboard_url)
    run = _wait(
        browser,
        lambda d: next(
            (b for b in d.find_elements(By.TAG_NAME, "button") if b.text == "Run simulation"),
            False,
        ),
        "the Run simulation button",
    )
    title = browser.find_element(By.TAG_NAME, "h1")
    ActionChains(browser).move_to_element(title).perform()  # no tooltip in the screenshot
    _shot(browser, title, shots / "what_if_form.png")
    sessions = browser.find_element(By.CSS_SELECTOR, "input[aria-label='agent sessions']")
    sessions.send_keys(Keys.CONTROL, "a")
    sessions.send_keys("10", Keys.TAB)
    run.click()

    _wait(browser, lambda d: "Result" in _body_text(d), "the what-if result")
    charts = _wait(
        browser,
        lambda d: (
            len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot .main-svg")) >= 4
            and d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
        ),
        "the result charts",
    )
    text = _body_text(browser)
    assert "--set workload.sessions=10" in text
    for label in ("TTFT p99", "KV usage peak", "prefix-cache hit rate"):
        assert label in text, label
    assert "KV cache usage (%)" in charts[0].text  # axis titles carry units
    assert "time (s)" in charts[0].text

    result = next(h for h in browser.find_elements(By.TAG_NAME, "h3") if h.text == "Result")
    _shot(browser, result, shots / "what_if_summary.png")
    _shot(browser, charts[0], shots / "what_if_timeline.png")
    _shot(browser, charts[1], shots / "what_if_cdfs.png")


def test_explorer_and_compare_in_browser(dashboard_url: str, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By

    shots = _screenshot_dir(tmp_path)
    browser.get(f"{dashboard_url}/run_explorer")
    _wait(
        browser,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 7,
        "the run explorer charts (the newest run, priority-small, has a block map)",
    )
    text = _body_text(browser)
    assert "HBM block map" in text and "Agent session waterfall" in text
    # A first visit straight to a page's URL still goes through app.py's navigation.
    nav = browser.find_element(By.CSS_SELECTOR, "[data-testid='stSidebarNav']").text
    assert nav.split("\n") == ["What-if", "Run explorer", "Compare"]
    charts = browser.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
    _shot(browser, browser.find_element(By.TAG_NAME, "h1"), shots / "explorer_summary.png")
    for i, name in ((0, "timeline"), (1, "block_map"), (2, "block_strip"), (3, "cdfs")):
        _shot(browser, charts[i], shots / f"explorer_{name}.png")
    _shot(browser, charts[6], shots / "explorer_waterfall.png")

    browser.get(f"{dashboard_url}/compare")
    _wait(
        browser,
        lambda d: len(d.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= 5,
        "the compare charts",
    )
    assert "Error table" in _body_text(browser)
    _shot(browser, browser.find_element(By.TAG_NAME, "h1"), shots / "compare_table.png")
    charts = browser.find_elements(By.CSS_SELECTOR, ".js-plotly-plot")
    _shot(browser, charts[0], shots / "compare_cdfs.png")
    _shot(browser, charts[3], shots / "compare_timelines.png")
