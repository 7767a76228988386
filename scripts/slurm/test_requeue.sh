#!/usr/bin/env bash
# End-to-end check of scripts/slurm/train.sbatch under a real SLURM: submit a short run of the tiny model
# (2 CPU processes, DDP over gloo), force the preemption path once, and check that the job saved, requeued
# itself, resumed from its checkpoint and reached its final step.
#
#   scripts/slurm/test_requeue.sh [RUN_DIR]        # about 2-4 minutes on 2 cores; needs root + slurm-wlm
#
# Uses the cluster named by SLURM_CONF when it answers; otherwise starts one with local_cluster.sh and
# stops it (by pid, state folder removed) on exit. The job log is RUN_DIR/slurm.log; it is printed at the
# end. Exit status 0 only when every check passed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
cd "$repo"
RUN_DIR=${1:-$(mktemp -d /tmp/draftheads-requeue.XXXXXX)}
STEPS=${STEPS:-60}  # enough steps that the signal lands mid-run even when a step takes ~0.1 s
TIMEOUT_S=${TIMEOUT_S:-600}

started_cluster=0
jid=""
cleanup() {
  if [[ -n $jid ]] && squeue -h -j "$jid" -o %i 2> /dev/null | grep -q .; then scancel "$jid" || true; fi
  if (( started_cluster )); then "$here/local_cluster.sh" stop "$SLURM_LOCAL_STATE"; fi
}
trap cleanup EXIT

if ! { [[ -n ${SLURM_CONF:-} ]] && sinfo -h > /dev/null 2>&1; }; then
  export SLURM_LOCAL_STATE=${SLURM_LOCAL_STATE:-/tmp/draftheads-slurm-test.$$}
  eval "$("$here/local_cluster.sh" start "$SLURM_LOCAL_STATE")"
  started_cluster=1
fi

fail() {
  echo "FAIL: $*" >&2
  echo "----- $RUN_DIR/slurm.log -----" >&2
  cat "$RUN_DIR/slurm.log" >&2 2> /dev/null || true
  exit 1
}

# Newest `train` step in metrics.jsonl (0 before the first row).
last_step() {
  if [[ -f $RUN_DIR/metrics.jsonl ]]; then
    grep '"event": "train"' "$RUN_DIR/metrics.jsonl" | tail -n 1 | sed -E 's/.*"step": ([0-9]+).*/\1/'
  fi | grep . || echo 0
}

mkdir -p "$RUN_DIR"
jid=$(OMP_NUM_THREADS=1 CPU_PROCS_PER_NODE=2 sbatch --parsable --job-name=draftheads-requeue-test \
  --nodes=1 --cpus-per-task="$(nproc)" --output="$RUN_DIR/slurm.log" \
  scripts/slurm/train.sbatch configs/tiny-eagle.yaml "$RUN_DIR" \
  --train.max_steps="$STEPS" --train.batch_size=2 --data.max_samples=24 --head.draft_vocab_size=32 \
  --train.log_every=1 --train.eval_every=1000 --train.checkpoint_every=1000)
echo "submitted job $jid; run folder $RUN_DIR"

deadline=$((SECONDS + TIMEOUT_S))
# 1. Let it train a couple of steps, then deliver exactly what --signal=B:USR1@120 delivers.
until (( $(last_step) >= 2 )); do
  (( SECONDS < deadline )) || fail "no training step logged in time"
  squeue -h -j "$jid" -o %i | grep -q . || fail "job ended before training started"
  sleep 2
done
(( $(last_step) < STEPS )) || fail "the run finished before the signal; raise STEPS"
echo "step $(last_step) logged: sending USR1 to the batch shell"
scancel --signal=USR1 --batch "$jid"

# 2. The job must save, requeue (restart count 1), resume and finish.
until grep -q '"event": "end"' "$RUN_DIR/metrics.jsonl" 2> /dev/null && ! squeue -h -j "$jid" -o %i | grep -q .; do
  (( SECONDS < deadline )) || fail "job did not finish within ${TIMEOUT_S}s"
  sleep 3
done

log=$RUN_DIR/slurm.log
grep -q 'stopped by signal; state saved to' "$log" || fail "no 'stopped by signal' line: the loop did not save on SIGTERM"
grep -q "requeueing job $jid" "$log" || fail "the batch shell did not requeue the job"
grep -q "job $jid restart 1:" "$log" || fail "the job did not come back with SLURM_RESTART_COUNT=1"
grep -q 'resumed from .*checkpoints/step-' "$log" || fail "the requeued job did not resume from a checkpoint"
grep -q 'training step ended with status 0' "$log" || fail "the resumed run did not exit cleanly"
end_step=$(grep '"event": "end"' "$RUN_DIR/metrics.jsonl" | sed -E 's/.*"step": ([0-9]+).*/\1/')
[[ $end_step == "$STEPS" ]] || fail "final step $end_step, expected $STEPS"
# Every step 1..STEPS logged exactly once across the two runs: resumed where it stopped, no step redone.
steps=$(grep '"event": "train"' "$RUN_DIR/metrics.jsonl" | sed -E 's/.*"step": ([0-9]+).*/\1/' | tr '\n' ' ')
[[ $steps == "$(seq -s ' ' 1 "$STEPS") " ]] || fail "logged steps '$steps', expected 1..$STEPS once each"
[[ -f $RUN_DIR/head/model.safetensors ]] || fail "no head folder in $RUN_DIR"

echo "----- $log -----"
cat "$log"
echo "PASS: job $jid saved on USR1, requeued, resumed and reached step $STEPS (run folder $RUN_DIR)"
