#!/usr/bin/env bash
# Start or stop a real single-node SLURM cluster (munged + slurmctld + slurmd) on this machine, for tests.
#
#   sudo apt-get install -y slurm-wlm munge          # Debian 12: slurm 22.05 (once)
#   scripts/slurm/local_cluster.sh start [STATE_DIR] # prints `export SLURM_CONF=...`; eval it in your shell
#   scripts/slurm/local_cluster.sh status [STATE_DIR]
#   scripts/slurm/local_cluster.sh stop [STATE_DIR]  # stops the three daemons by pid, removes STATE_DIR
#
# Everything lives under STATE_DIR (default /tmp/draftheads-slurm): slurm.conf, the munge key and socket,
# spool and state folders, logs and pid files. Nothing is written to /etc, so an existing SLURM
# installation is left alone; clients (sbatch, squeue, scontrol) find this cluster through SLURM_CONF.
# Runs as root (SlurmUser=root), as on a throwaway test machine. Ports: SLURM_LOCAL_PORT (default 6817)
# for slurmctld and the next one for slurmd.
#
# Why cred_expire=10: SLURM holds a requeued job until cred_expire seconds have passed (default 120 s);
# the short value lets the requeue test finish in about a minute.
set -euo pipefail

cmd=${1:-}
STATE_DIR=${2:-${SLURM_LOCAL_STATE:-/tmp/draftheads-slurm}}
PORT=${SLURM_LOCAL_PORT:-6817}
HOST=$(hostname -s)

die() { echo "local_cluster.sh: $*" >&2; exit 1; }

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf() {
  local cpus mem
  cpus=$(nproc)
  # RealMemory must not exceed what slurmd measures, or the node is drained: stay below free memory.
  mem=$(awk '/MemAvailable/ {printf "%d", $2 / 1024 * 0.8}' /proc/meminfo)
  cat > "$STATE_DIR/slurm.conf" <<EOF
ClusterName=draftheads-local
SlurmctldHost=$HOST
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$STATE_DIR/munge/munge.socket,cred_expire=10
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation=$STATE_DIR/state
SlurmdSpoolDir=$STATE_DIR/spool
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd.pid
SlurmctldLogFile=$STATE_DIR/slurmctld.log
SlurmdLogFile=$STATE_DIR/slurmd.log
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_interval=5
MinJobAge=300
KillWait=30
NodeName=$HOST CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
  command -v slurmctld >/dev/null || die "slurmctld not found: apt-get install -y slurm-wlm munge"
  [[ $(id -u) == 0 ]] || die "run as root (the test cluster uses SlurmUser=root)"
  if pid_alive "$STATE_DIR/slurmctld.pid"; then die "already running (state in $STATE_DIR); stop it first"; fi
  rm -rf "$STATE_DIR"
  mkdir -p "$STATE_DIR"/{state,spool,munge}
  chmod 700 "$STATE_DIR" "$STATE_DIR/munge"
  write_conf
  export SLURM_CONF=$STATE_DIR/slurm.conf

  # munged refuses a key readable by others; 1024 random bytes is the format mungekey writes.
  head -c 1024 /dev/urandom > "$STATE_DIR/munge/munge.key"
  chmod 400 "$STATE_DIR/munge/munge.key"
  munged --force --key-file="$STATE_DIR/munge/munge.key" --socket="$STATE_DIR/munge/munge.socket" \
    --pid-file="$STATE_DIR/munged.pid" --log-file="$STATE_DIR/munged.log" \
    --seed-file="$STATE_DIR/munge/munged.seed"
  # Each daemon forks into the background and writes its pid file; stop() kills exactly those pids.
  slurmctld -f "$SLURM_CONF"
  slurmd -f "$SLURM_CONF"

  local i state
  for i in $(seq 1 60); do
    state=$(sinfo -h -N -o '%T' 2>/dev/null | head -n1 || true)
    if [[ $state == idle* ]]; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 1
  done
  echo "node state after 60 s: '${state:-none}'; logs:" >&2
  tail -n 20 "$STATE_DIR"/slurmctld.log "$STATE_DIR"/slurmd.log "$STATE_DIR"/munged.log >&2 || true
  stop
  die "cluster did not come up"
}

stop() {
  local name f pid i
  # slurmd first (it reports to slurmctld), munged last (both daemons authenticate through it).
  for name in slurmd slurmctld munged; do
    f=$STATE_DIR/$name.pid
    if pid_alive "$f"; then
      pid=$(cat "$f")
      kill -TERM "$pid"
      for i in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
    fi
  done
  # Job processes slurmd started outlive it only if they ignore SIGTERM; none of ours do. Keep logs
  # out of harm's way only when asked (SLURM_LOCAL_KEEP_LOGS=DIR), then remove all state.
  if [[ -n ${SLURM_LOCAL_KEEP_LOGS:-} && -d $STATE_DIR ]]; then
    mkdir -p "$SLURM_LOCAL_KEEP_LOGS"
    cp "$STATE_DIR"/*.log "$SLURM_LOCAL_KEEP_LOGS"/ 2>/dev/null || true
  fi
  rm -rf "$STATE_DIR"
}

status() {
  local name
  for name in munged slurmctld slurmd; do
    if pid_alive "$STATE_DIR/$name.pid"; then echo "$name: running (pid $(cat "$STATE_DIR/$name.pid"))"
    else echo "$name: stopped"; fi
  done
  if pid_alive "$STATE_DIR/slurmctld.pid"; then SLURM_CONF=$STATE_DIR/slurm.conf sinfo; fi
}

case $cmd in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) die "usage: local_cluster.sh start|stop|status [STATE_DIR]" ;;
esac
