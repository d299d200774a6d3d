#!/usr/bin/env bash
# A single-node SLURM cluster on this machine, for lra-sweep's tests and for trying a sweep:
# munged, slurmctld and slurmd, one partition "debug" holding this host's cores and memory.
#
#   scripts/slurm_local.sh install   apt-get the Debian packages (slurmctld slurmd slurm-client munge)
#   scripts/slurm_local.sh start     write the config under $SLURM_LOCAL_DIR, start the daemons, wait until
#                                    the node takes jobs (seconds)
#   scripts/slurm_local.sh stop      stop the daemons
#   scripts/slurm_local.sh status    exit 0 when the cluster takes jobs
#
# Needs root. The config lives in $SLURM_LOCAL_DIR (default /tmp/lra-slurm); `start` prints the
# SLURM_CONF to export so that sbatch, squeue and scontrol find it. No accounting database runs:
# squeue and scontrol answer, sacct does not (lra-sweep reads neither sacct nor submitit's job states).
set -euo pipefail

dir="${SLURM_LOCAL_DIR:-/tmp/lra-slurm}"
conf="$dir/slurm.conf"
export SLURM_CONF="$conf"

die() { echo "slurm_local: $*" >&2; exit 2; }

install() {
  [[ $EUID -eq 0 ]] || die "install needs root (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
}

write_conf() {
  local host cpus mem
  host="$(hostname -s)"
  cpus="$(nproc)"
  # slurmd refuses a node that claims more memory than it has: a little under the total
  mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  cat >"$conf" <<CONF
ClusterName=lra-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits for the job credential to expire before it starts again (default 120 s)
AuthInfo=cred_expire=10
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
# no cgroups in a container: process groups track a job's processes
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
# jobs share the node core by core, as runs of a sweep do on a cluster's nodes
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# a job that asks for no memory gets 2 GB a core, not the whole node
DefMemPerCPU=2048
ReturnToService=2
JobRequeue=1
# a requeued job may start again at once
MinJobAge=60
SchedulerParameters=sched_interval=2
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
}

up() { timeout 5 sinfo -h -o '%t' 2>/dev/null | grep -qE '^(idle|mix|alloc)'; }

start() {
  [[ $EUID -eq 0 ]] || die "start needs root (the daemons run as root)"
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
    || die "the SLURM packages are missing; run: scripts/slurm_local.sh install"
  stop quiet
  write_conf
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  if ! pgrep -x munged >/dev/null; then
    [[ -s /etc/munge/munge.key ]] || /usr/sbin/mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
      || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
    chmod 400 /etc/munge/munge.key
    munged --force 2>/dev/null
  fi
  slurmctld -f "$conf"
  slurmd -f "$conf"
  for _ in $(seq 1 60); do
    if up; then
      echo "slurm_local: up ($(hostname -s), $(nproc) cores); export SLURM_CONF=$conf"
      return 0
    fi
    scontrol update nodename="$(hostname -s)" state=resume >/dev/null 2>&1 || true
    sleep 1
  done
  die "the node did not come up in 60 s; see $dir/log/"
}

stop() {
  for daemon in slurmd slurmctld; do
    pkill -x "$daemon" 2>/dev/null || true
  done
  for _ in $(seq 1 20); do
    pgrep -x slurmd >/dev/null || pgrep -x slurmctld >/dev/null || break
    sleep 0.5
  done
  [[ "${1:-}" == quiet ]] || echo "slurm_local: stopped"
}

case "${1:-}" in
  install) install ;;
  start) start ;;
  stop) stop ;;
  status) up ;;
  *) die "usage: scripts/slurm_local.sh install|start|stop|status" ;;
esac
