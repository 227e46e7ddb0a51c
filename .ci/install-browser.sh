#!/usr/bin/env bash
# What tests/dashboard/test_browser.py needs: Debian's Chromium and its chromedriver (no browser
# download), a font for Plotly's SVG text, and the selenium package in .venv. Idempotent: when
# everything is there it only checks, in well under a second.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"

if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ] \
  || [ ! -d /usr/share/fonts/truetype/liberation ]; then
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then SUDO=(sudo); fi
  echo "installing chromium, chromium-driver, fonts-liberation (apt)..." >&2
  "${SUDO[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends \
    chromium chromium-driver fonts-liberation >/dev/null
fi

if ! "$PYTHON" -c "import selenium" 2>/dev/null; then
  echo "installing selenium into $PYTHON's environment..." >&2
  "$PYTHON" -m pip --disable-pip-version-check --quiet install "selenium>=4.20"
fi
