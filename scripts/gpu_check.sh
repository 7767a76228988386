#!/usr/bin/env bash
# The one-call GPU check (see scripts/gpu_check.py): random Llama-3.1-8B-shaped target on one GPU, ~2-4 min.
#   ./scripts/gpu_check.sh                 -> runs/gpu_check.json + runs/gpu_check.md (table also printed)
#   ./scripts/gpu_check.sh --tiny          the same code on CPU with tiny shapes
# Uses .venv/bin/python when there is one, else the machine's python3 (the GPU image: torch + transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" scripts/gpu_check.py --json runs/gpu_check.json "$@"
