#!/usr/bin/env bash
# A real Slurm cluster on this one host, from Debian's packages, for trying the sbatch script and for
# `make test-slurm`: munged, slurmctld and two slurmd, emulated nodes n1 and n2 (`slurmd -N`), everything
# (config, munge key, state, logs, pid files) under one directory, nothing in /etc.
#
#   deploy/slurm/local-cluster.sh up DIR     # installs slurm-wlm and munge if missing (apt-get), starts the
#                                            # daemons, waits until both nodes are idle, prints the env to use
#   deploy/slurm/local-cluster.sh install    # only installs slurm-wlm and munge if missing (exit 2 if it cannot)
#   deploy/slurm/local-cluster.sh env DIR    # prints `export SLURM_CONF=DIR/slurm.conf`
#   deploy/slurm/local-cluster.sh down DIR   # cancels every job, waits for them, stops exactly the daemons
#                                            # `up` started (by their pid files)
#
# Root only: slurmd starts jobs as their users, and munged runs as root here (--force). Debian's slurmd
# accepts -N (one daemon per NodeName on one host: each node has its own Port=, spool dir and pid file).
# Both nodes have NodeAddr=127.0.0.1 and names that do not resolve, as on clusters where NodeName is not a
# host name. Process tracking is proctrack/linuxproc (by ancestry; no cgroups needed). KillWait is Slurm's
# default, 30 s (KILL_WAIT overrides it). The ports are free ones, picked at `up`.
set -euo pipefail

die() { echo "local-cluster.sh: $*" >&2; exit 2; }
usage() { die "usage: $0 up|env|down DIR, or $0 install"; }

install_packages() {
    command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
    [[ $(id -u) == 0 ]] || die "slurm-wlm and munge are not installed, and only root can install them"
    echo "local-cluster.sh: installing slurm-wlm and munge (apt-get)" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >&2 \
        || { apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
             --no-install-recommends slurm-wlm munge >&2; } \
        || die "could not install slurm-wlm and munge with apt-get"
}

[[ ${1:-} == install && $# == 1 ]] && { install_packages; exit 0; }
[[ $# == 2 ]] || usage
cmd=$1
[[ $(id -u) == 0 ]] || die "run it as root: slurmd starts jobs as their users, and munged runs as root here"
mkdir -p "$2"
dir=$(cd "$2" && pwd)
conf=$dir/slurm.conf
daemons=(slurmd-n1 slurmd-n2 slurmctld munged)   # stopped in this order

pid_of() {  # the pid in DIR/NAME.pid while that process runs and is ours (its argv names a file under DIR): a pid
    local pid    # file outliving its daemon may hold a pid some other process has now
    pid=$(cat "$dir/$1.pid" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
    tr '\0' '\n' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF "$dir/" || return 1
    echo "$pid"
}

free_ports() {  # N TCP ports that were free a moment ago
    python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_conf() {
    local ctld_port=$1 n1_port=$2 n2_port=$3 cpus
    cpus=$(nproc)
    cat > "$conf" <<EOF
# written by deploy/slurm/local-cluster.sh: two emulated nodes on $(hostname)
ClusterName=local
SlurmctldHost=$(hostname)(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$n1_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=${KILL_WAIT:-30}
SlurmctldDebug=info
SlurmdDebug=info
NodeName=n1 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$n1_port CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$n2_port CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
}

wait_idle() {
    local deadline=$((SECONDS + 60)) states
    while (( SECONDS < deadline )); do
        states=$(SLURM_CONF=$conf sinfo -h -N -o %t 2>/dev/null | sort -u | tr '\n' ' ') || states=""
        [[ $states == "idle " ]] && return 0
        sleep 0.5
    done
    abort_up "the nodes did not become idle within 60 s (sinfo: ${states:-no answer}; logs in $dir/log)"
}

up() {
    install_packages
    local name
    for name in "${daemons[@]}"; do
        pid_of "$name" >/dev/null && die "$name already runs for $dir (pid $(pid_of "$name")): \`$0 down $dir\` first"
    done
    rm -rf "$dir/state" "$dir/spool" "$dir/log" "$dir/munge"
    mkdir -p "$dir/state" "$dir/spool/n1" "$dir/spool/n2" "$dir/log" "$dir/munge"
    chmod 0700 "$dir/munge"
    head -c 1024 /dev/urandom > "$dir/munge/munge.key"
    chmod 0400 "$dir/munge/munge.key"
    read -r ctld_port n1_port n2_port < <(free_ports 3)
    write_conf "$ctld_port" "$n1_port" "$n2_port"
    export SLURM_CONF=$conf
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed" \
        || abort_up "munged did not start ($dir/log/munged.log)"
    slurmctld -f "$conf" -i || abort_up "slurmctld did not start ($dir/log/slurmctld.log)"
    slurmd -f "$conf" -N n1 || abort_up "slurmd -N n1 did not start ($dir/log/slurmd-n1.log)"
    slurmd -f "$conf" -N n2 || abort_up "slurmd -N n2 did not start ($dir/log/slurmd-n2.log)"
    wait_idle
    echo "export SLURM_CONF=$conf"
}

abort_up() {  # MESSAGE: `up` failed halfway: stop the daemons it had started (nobody calls `down` after an error)
    stop_daemons
    die "$1"
}

wait_gone() {  # PIDS...: wait up to 30 s for them to exit, then SIGKILL what is left
    local deadline=$((SECONDS + 30)) pid left
    while (( SECONDS < deadline )); do
        left=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && left=1; done
        (( left )) || return 0
        sleep 0.2
    done
    for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; done
}

down() {
    local jobs=""
    if pid_of slurmctld >/dev/null; then
        # Jobs first, with their KillWait: a stopped slurmd would leave its slurmstepd and their tasks behind.
        SLURM_CONF=$conf scancel --user=root 2>/dev/null || true
        local deadline=$((SECONDS + 120))
        while (( SECONDS < deadline )); do
            jobs=$(SLURM_CONF=$conf squeue -h -o %i 2>/dev/null) || jobs=""
            [[ -z $jobs ]] && break
            SLURM_CONF=$conf scancel --user=root 2>/dev/null || true   # a job requeued meanwhile, now pending
            sleep 0.5
        done
        [[ -z $jobs ]] || echo "local-cluster.sh: jobs still there after 120 s: $jobs" >&2
    fi
    stop_daemons
}

stop_daemons() {  # exactly the daemons `up` started for DIR (pid_of: by pid file, and only if still theirs)
    local name pid pids=()
    for name in "${daemons[@]}"; do
        if pid=$(pid_of "$name"); then
            kill -TERM "$pid" 2>/dev/null || true
            pids+=("$pid")
        fi
    done
    (( ${#pids[@]} == 0 )) || wait_gone "${pids[@]}"
    rm -f "$dir"/*.pid
}

case $cmd in
    up) up ;;
    env) echo "export SLURM_CONF=$conf" ;;
    down) down ;;
    *) usage ;;
esac
