#!/usr/bin/env bash
# A one-node SLURM cluster on this machine for accord's SLURM lane.
#
#   scripts/slurm_cluster.sh start   install slurm-wlm and munge if missing, start munged,
#                                    slurmctld and slurmd, wait until the node is idle
#   scripts/slurm_cluster.sh stop    stop the daemons that `start` started, nothing else
#
# The cluster's configuration is ci/slurm/slurm.conf; clients find it through SLURM_CONF,
# which `start` prints. State and logs go to /tmp/accord-slurm. Needs root (apt-get, and
# slurmd runs jobs as their submitter).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export SLURM_CONF="$ROOT/ci/slurm/slurm.conf"
RUN_DIR=/tmp/accord-slurm
STARTED="$RUN_DIR/started"  # one line per daemon this script started: name pidfile
MUNGE_PID=/run/munge/munged.pid
IDLE_TIMEOUT=${SLURM_IDLE_TIMEOUT:-90}

log() { echo "slurm_cluster: $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v srun >/dev/null && command -v munged >/dev/null; then
        return
    fi
    if [ "$(id -u)" -ne 0 ]; then
        log "slurm-wlm and munge are missing and installing them needs root; run as root or" \
            "apt-get install slurm-wlm munge first"
        exit 1
    fi
    log "installing slurm-wlm and munge"
    # Without recommends: 9 packages instead of 43; the basic plugins hold all the lane uses.
    local install=(apt-get install -y -q --no-install-recommends slurm-wlm munge)
    DEBIAN_FRONTEND=noninteractive "${install[@]}" >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive "${install[@]}" >/dev/null; }
}

munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

start_munge() {
    if munge_works; then
        log "munged already answers; using it"
        return
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        log "generating /etc/munge/munge.key"
        runuser -u munge -- mungekey --create
    fi
    install -d -o munge -g munge -m 0755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    echo "munged $MUNGE_PID" >>"$STARTED"
    for _ in $(seq 1 50); do
        munge_works && return
        sleep 0.2
    done
    log "munged started but does not answer (see /var/log/munge/munged.log)"
    exit 1
}

daemon_running() {  # pidfile
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_slurm() {
    if daemon_running "$RUN_DIR/slurmctld.pid"; then
        log "slurmctld already running"
    else
        rm -rf "$RUN_DIR/state"
        install -d "$RUN_DIR/state"
        /usr/sbin/slurmctld
        echo "slurmctld $RUN_DIR/slurmctld.pid" >>"$STARTED"
    fi
    if daemon_running "$RUN_DIR/slurmd.pid"; then
        log "slurmd already running"
    else
        install -d "$RUN_DIR/spool"
        /usr/sbin/slurmd -N localhost
        echo "slurmd $RUN_DIR/slurmd.pid" >>"$STARTED"
    fi
}

wait_idle() {
    local state=""
    for _ in $(seq 1 $((IDLE_TIMEOUT * 2))); do
        state="$(sinfo -h -N -n localhost -o %T 2>/dev/null || true)"
        case "$state" in
            idle*) log "node localhost is idle"; return ;;
            down*|drain*)
                scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    log "node not idle after ${IDLE_TIMEOUT}s (state: ${state:-no answer});" \
        "see $RUN_DIR/slurmctld.log and $RUN_DIR/slurmd.log"
    exit 1
}

start() {
    install_packages
    install -d "$RUN_DIR"
    touch "$STARTED"
    start_munge
    start_slurm
    wait_idle
    echo "SLURM_CONF=$SLURM_CONF"
}

stop() {
    [ -f "$STARTED" ] || { log "nothing to stop"; return; }
    # Stop in reverse order: slurmd, slurmctld, then munged.
    tac "$STARTED" | while read -r name pidfile; do
        if daemon_running "$pidfile"; then
            local pid
            pid="$(cat "$pidfile")"
            kill "$pid"
            for _ in $(seq 1 100); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            if kill -0 "$pid" 2>/dev/null; then
                log "$name ($pid) ignored SIGTERM for 10 s; killing it"
                kill -9 "$pid" 2>/dev/null || true
            fi
            log "stopped $name"
        fi
    done
    rm -f "$STARTED"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
