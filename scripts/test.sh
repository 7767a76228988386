#!/usr/bin/env bash
# Install the dev extras into .venv and run the checks CI runs: ruff, then the default pytest suite.
#   ./scripts/test.sh                 # default suite (no GPU, no hub; under 10 minutes on 2 cores)
#   ./scripts/test.sh -m slow         # extra arguments go to pytest (here: the real-model tests)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh dev
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"
