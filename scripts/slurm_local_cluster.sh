#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (slurmctld + slurmd on 127.0.0.1, munge authentication), to try the
# harness's Slurm path (hydra/launcher=slurm) on a workstation and to test it in CI. Needs root: it installs
# Debian's packages when they are missing and slurmd runs jobs as their users.
#
#   sudo scripts/slurm_local_cluster.sh start    # install if needed, write slurm.conf, start, wait for an idle node
#   sudo scripts/slurm_local_cluster.sh install  # only install the packages (CI does it while it builds the venv)
#   export SLURM_CONF=/var/tmp/icecache-slurm/slurm.conf   # (start prints it) for sbatch, squeue, scontrol
#   sudo scripts/slurm_local_cluster.sh status   # sinfo and squeue; exit 1 when the cluster is not up
#   sudo scripts/slurm_local_cluster.sh stop     # cancel its jobs, stop the daemons it started
#
# Partitions: `cpu` (the default) and `urgent`, whose jobs preempt `cpu` jobs (PreemptMode=REQUEUE: a preempted
# job goes back to the queue and starts again from its script). No accounting database: sacct does not work.
#
# Environment: ICECACHE_SLURM_DIR (default /var/tmp/icecache-slurm: slurm.conf, state, spool, logs, pid files),
# ICECACHE_SLURM_PORT (slurmctld's port, default 6817; slurmd takes the next one), ICECACHE_SLURM_APT_TIMEOUT
# (seconds for the package install, default 900).
#
# Exit status: 0 done; 1 the cluster did not come up or stop (the daemons' log tails are printed); 2 usage;
# 3 the packages are missing and cannot be installed here (no apt-get, not root, or apt failed).
set -euo pipefail

DIR=${ICECACHE_SLURM_DIR:-/var/tmp/icecache-slurm}
PORT=${ICECACHE_SLURM_PORT:-6817}
APT_TIMEOUT=${ICECACHE_SLURM_APT_TIMEOUT:-900}
CONF=$DIR/slurm.conf
# slurm-wlm is the metapackage of these plus ~35 optional plugin packages the cluster needs none of.
PACKAGES=(slurmctld slurmd slurm-client munge)
export SLURM_CONF=$CONF

say() { printf 'slurm_local_cluster: %s\n' "$*"; }
die() { printf 'error: %s\n' "$1" >&2; exit "${2:-1}"; }

have_packages() {
    local cmd
    for cmd in slurmctld slurmd sbatch squeue scontrol sinfo munged munge unmunge; do
        command -v "$cmd" >/dev/null 2>&1 || return 1
    done
}

# apt-get with what is left of the install's time budget, waiting that long for another apt or dpkg to finish.
apt_within() {
    local left=$((DEADLINE - SECONDS))
    ((left > 0)) || return 124
    DEBIAN_FRONTEND=noninteractive timeout "$left" apt-get -o DPkg::Lock::Timeout="$left" "$@" >>"$DIR/apt.log" 2>&1
}

install_packages() {
    have_packages && return 0
    [[ $(id -u) -eq 0 ]] || die "Slurm is not installed and installing it needs root (sudo $0 start)" 3
    command -v apt-get >/dev/null 2>&1 || die "Slurm is not installed and this machine has no apt-get to install ${PACKAGES[*]}" 3
    mkdir -p "$DIR"
    : >"$DIR/apt.log"
    say "installing ${PACKAGES[*]} (apt-get, at most ${APT_TIMEOUT}s)"
    DEADLINE=$((SECONDS + APT_TIMEOUT))
    local args=(install -y -q --no-install-recommends "${PACKAGES[@]}")
    # The package lists of a fresh image may be missing or stale (404 on install), or an earlier install was cut
    # short: repair and update once, then retry.
    if ! apt_within "${args[@]}"; then
        if grep -q "dpkg --configure -a" "$DIR/apt.log"; then
            timeout "$((DEADLINE - SECONDS > 1 ? DEADLINE - SECONDS : 1))" dpkg --configure -a >>"$DIR/apt.log" 2>&1 || true
        fi
        if ! { apt_within update -q && apt_within "${args[@]}"; }; then
            if ((SECONDS >= DEADLINE)); then
                die "apt-get did not install ${PACKAGES[*]} within ${APT_TIMEOUT}s (ICECACHE_SLURM_APT_TIMEOUT; log: $DIR/apt.log)" 3
            fi
            die "apt-get could not install ${PACKAGES[*]}: $(grep -E '^(E|W):' "$DIR/apt.log" | tail -1) (log: $DIR/apt.log)" 3
        fi
    fi
    have_packages || die "apt-get installed ${PACKAGES[*]} but their commands are not on PATH" 3
}

# "CPUs=2 Boards=1 SocketsPerBoard=1 CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105": what slurmd finds, so
# the node registers with exactly what slurm.conf says (a node reporting less than configured is drained).
node_hardware() {
    slurmd -C | head -1 | tr ' ' '\n' | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' | tr '\n' ' '
}

write_conf() {
    local hardware cpus memory
    hardware=$(node_hardware)
    cpus=$(sed -E 's/.*CPUs=([0-9]+).*/\1/' <<<"$hardware")
    memory=$(sed -E 's/.*RealMemory=([0-9]+).*/\1/' <<<"$hardware")
    mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log"
    cat >"$CONF" <<EOF
# Written by scripts/slurm_local_cluster.sh: one node, this machine ($cpus CPUs, $memory MB).
ClusterName=icecache-local
SlurmctldHost=$(hostname -s)(127.0.0.1)
MailProg=/bin/true
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire + 1 s before it may start again (120 s by default).
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: works in containers and on hosts whatever their cgroup setup; jobs are not confined.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=2
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=$((memory / cpus))
SchedulerType=sched/backfill
# Schedule at submission and every 2 s instead of waiting up to 3 s, and up to 30-60 s for a requeued job.
SchedulerParameters=batch_sched_delay=0,sched_interval=2,bf_interval=2
# A preempted or cancelled job's processes get SIGTERM, then SIGKILL after KillWait (30 s by default; slurmd
# waits at least 5 s). Finished jobs stay visible to squeue for MinJobAge.
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
JobRequeue=1
# Jobs in the higher tier (urgent) take a cpu job's resources when they need them; the cpu job is requeued.
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName=localnode NodeAddr=127.0.0.1 NodeHostname=$(hostname) $hardware State=UNKNOWN
PartitionName=cpu Nodes=localnode Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE
PartitionName=urgent Nodes=localnode MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
EOF
}

pid_alive() { [[ -s $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    munge_works && return 0
    if [[ ! -s /etc/munge/munge.key ]]; then
        mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
            || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    # As the munge user, as Debian's service runs it (munged refuses some root setups).
    if command -v runuser >/dev/null 2>&1; then
        runuser -u munge -- munged
    else
        su -s /bin/sh munge -c munged
    fi
    local i
    for i in $(seq 50); do
        if munge_works; then
            cp /run/munge/munged.pid "$DIR/munged.pid"  # the mark that stop may end it: this script started it
            return 0
        fi
        sleep 0.1
    done
    die "munged did not start (see /var/log/munge/munged.log)"
}

node_state() { sinfo -h -n localnode -o %T 2>/dev/null | head -1 || true; }

show_logs() {
    local log
    for log in "$DIR/log/slurmctld.log" "$DIR/log/slurmd.log"; do
        [[ -f $log ]] && { echo "--- $log (last lines)" >&2; tail -n 15 "$log" >&2; }
    done
}

cluster_up() { pid_alive "$DIR/slurmctld.pid" && pid_alive "$DIR/slurmd.pid" && [[ -n $(node_state) ]]; }

start() {
    install_packages
    [[ $(id -u) -eq 0 ]] || die "starting slurmd needs root (sudo $0 start)" 3
    if cluster_up; then
        say "already running (node $(node_state)); export SLURM_CONF=$CONF"
        return 0
    fi
    mkdir -p "$DIR"
    write_conf
    start_munge
    pid_alive "$DIR/slurmctld.pid" || slurmctld -f "$CONF" -i  # -i: ignore saved state of an earlier cluster
    pid_alive "$DIR/slurmd.pid" || slurmd -f "$CONF" -N localnode
    local state="" i
    for i in $(seq 120); do
        state=$(node_state)
        case $state in
            idle*) break ;;
            down*|drain*) scontrol update nodename=localnode state=resume >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    if [[ $state != idle* ]]; then
        show_logs
        die "the node did not become idle within 60 s (state: ${state:-no answer from slurmctld})"
    fi
    say "up: node localnode idle ($(sinfo -h -n localnode -o '%c CPUs, %m MB')), partitions cpu (default) and urgent (preempts cpu)"
    say "export SLURM_CONF=$CONF"
}

# Stop the daemons whose pid files are given, all at once (each takes a second or two to exit).
stop_daemons() {
    local file pid i names=() pids=()
    for file in "$@"; do
        if pid_alive "$file"; then
            pid=$(cat "$file")
            kill "$pid" && pids+=("$pid") && names+=("$(basename "$file" .pid) ($pid)")
        fi
        rm -f "$file"
    done
    ((${#pids[@]})) || return 0
    for i in $(seq 100); do
        kill -0 "${pids[@]}" 2>/dev/null || break
        sleep 0.1
    done
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid"; done
    say "stopped ${names[*]}"
}

stop() {
    [[ -f $CONF ]] || { say "not running (no $CONF)"; return 0; }
    if pid_alive "$DIR/slurmctld.pid"; then
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
        if [[ -n ${jobs// /} ]]; then
            # shellcheck disable=SC2086  # one job id per word
            scancel $jobs 2>/dev/null || true
            local i
            for i in $(seq 100); do [[ -z $(squeue -h -o %A 2>/dev/null) ]] && break; sleep 0.1; done
        fi
    fi
    stop_daemons "$DIR/slurmd.pid" "$DIR/slurmctld.pid"
    stop_daemons "$DIR/munged.pid"  # only when this script started it
}

status() {
    if ! cluster_up; then
        say "not running"
        return 1
    fi
    say "export SLURM_CONF=$CONF"
    sinfo
    squeue
}

case ${1:-} in
    install) install_packages ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) die "unknown command '${1:-}': use $0 start, stop, status or install" 2 ;;
esac
