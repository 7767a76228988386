#!/usr/bin/env bash
# The main job on the packaged default target (SmolLM2-135M-Instruct, CPU is fine):
#   ./scripts/quickstart.sh [OUT]        (default OUT=runs/quickstart)
# 1. install the project into .venv (CPU torch pinned where there is no CUDA);
# 2. the target writes its own training prompts (coding, math, writing, ... user turns; deduplicated, none
#    overlapping a benchmark prompt), mixed with bundled GSM8K train questions (40%);
# 3. regenerate answers to them with the target itself (self-distillation);
# 4. tokenize them and extract the target's hidden states into an offline store;
# 5. train an EAGLE-3 head on that store (prints held-out per-step top-1 and simulated tau);
# 6. evaluate the head + n-gram hybrid (and the head alone) with the exact speculative decoder; print the report.
# Each stage resumes where it stopped if the script is interrupted and run again; each prints its time.
# Knobs (environment): QS_PROMPTS (default 448), QS_MAX_NEW (answer tokens, default 128), QS_STEPS
# (training steps), QS_QUESTIONS (eval questions per benchmark, default 4), QS_THREADS (eval's torch threads,
# default 0 = every core: the quickstart's numbers are for an otherwise idle machine, where a verify pass over
# k+1 tokens costs far less with every core (data/packed.py); use 1 on a machine shared with other jobs),
# QS_FAMILY (default eagle3; dflash trains the block drafter of configs/smollm2-135m-dflash.yaml on the same
# store, into OUT/dflash, and evaluates that head).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-runs/quickstart}"
PROMPTS="${QS_PROMPTS:-448}"
MAX_NEW="${QS_MAX_NEW:-128}"
QUESTIONS="${QS_QUESTIONS:-4}"
THREADS="${QS_THREADS:-0}"
FAMILY="${QS_FAMILY:-eagle3}"
CONFIG=configs/smollm2-135m.yaml
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

./scripts/setup_env.sh
PY=.venv/bin/python
mkdir -p "$OUT"
TRAIN_ARGS=()
[ -n "${QS_STEPS:-}" ] && TRAIN_ARGS=("--train.max_steps=$QS_STEPS")
# The recipe trains under bf16 autocast, which pays where the CPU multiplies bf16 natively; elsewhere the
# kernels emulate it, slower than float32, so such a CPU trains in float32 (Linux reports the flags).
if [ -r /proc/cpuinfo ] && ! grep -qwE 'avx512_bf16|amx_bf16|bf16' /proc/cpuinfo; then
  echo "this CPU has no native bfloat16: training in float32 (--train.mixed_precision=no)"
  TRAIN_ARGS+=("--train.mixed_precision=no")
fi

stage() { echo "== $1"; STAGE_START=$SECONDS; }
took() { echo "-- took $((SECONDS - STAGE_START)) s"; }

stage "1/5 the target writes $PROMPTS training prompts"
$PY -m data.prompts --config "$CONFIG" --out "$OUT" --prompts.num_prompts="$PROMPTS"
took

stage "2/5 regenerate answers with the target (<= $MAX_NEW new tokens each)"
$PY -m data.regenerate --config "$CONFIG" --out "$OUT" --regenerate.prompts="$OUT/prompts.jsonl" \
  --regenerate.max_new_tokens="$MAX_NEW"
took

stage "3/5 extract the target's features into an offline store"
$PY -m data.extract --config "$CONFIG" --out "$OUT" --data.path="$OUT/regenerated.jsonl"
took

HEAD_OUT="$OUT"
case "$FAMILY" in
  eagle3)
    stage "4/5 train the EAGLE-3 head"
    $PY train/eagle.py --config "$CONFIG" --out "$OUT" --data.path="$OUT/regenerated.jsonl" \
      --resume auto "${TRAIN_ARGS[@]}" ;;
  dflash)  # the same store (EAGLE-3's captured layers), given absolute: relative stores go under --out
    HEAD_OUT="$OUT/dflash"
    stage "4/5 train the DFlash block drafter"
    $PY -m train --config configs/smollm2-135m-dflash.yaml --out "$HEAD_OUT" \
      --data.path="$OUT/regenerated.jsonl" --features.store="$(cd "$OUT" && pwd)/features" \
      --resume auto "${TRAIN_ARGS[@]}" ;;
  *) echo "QS_FAMILY must be eagle3 or dflash, got '$FAMILY'" >&2; exit 2 ;;
esac
took

stage "5/5 evaluate with the exact speculative decoder (head + n-gram, the head alone beside it)"
$PY -m eval.run --head "$HEAD_OUT/head" --drafter head+ngram --bench mt_bench,humaneval,gsm8k --max-questions "$QUESTIONS" \
  --threads "$THREADS" --out "$HEAD_OUT/eval"
took
cat "$HEAD_OUT/eval/report.md"
