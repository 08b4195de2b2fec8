#!/usr/bin/env bash
# Start (or confirm) a local multi-node Slurm cluster: munged, slurmctld and N `slurmd -N nX`.
# Idempotent: a healthy cluster with the same configuration returns at once; any difference
# (config, a dead daemon, a node not up) restarts every Slurm daemon together.
#
#   start.sh [--nodes N] [--cpus-per-node C] [--accounting] [--timeout S]
#
# Exit status: 0 cluster up; 1 failed to start (log tails printed); 2 usage;
# 3 this environment cannot run it (not root, no apt-get) -- tests skip on 3 unless CI=true.
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/lib.sh"

NODES=2 CPUS=4 ACCOUNTING=0 TIMEOUT=${HPCTRAIN_SLURM_START_TIMEOUT:-60}
usage() { sed -n '2,10s/^# \{0,1\}//p' "$0" >&2; exit 2; }
while (($#)); do
  case $1 in
    --nodes) NODES=${2:?}; shift 2 ;;
    --cpus-per-node) CPUS=${2:?}; shift 2 ;;
    --accounting) ACCOUNTING=1; shift ;;
    --timeout) TIMEOUT=${2:?}; shift 2 ;;
    -h | --help) usage ;;
    *) log "unknown argument: $1"; usage ;;
  esac
done
[[ $NODES =~ ^[1-9][0-9]?$ ]] || die "--nodes must be 1..99, got '$NODES'" 2
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "--cpus-per-node must be a positive integer, got '$CPUS'" 2

HOST=$(hostname -s)
BASE_PKGS=(slurmctld slurmd slurm-client munge)
ACCT_PKGS=(mariadb-server slurmdbd)

have_packages() {
  command -v slurmctld && command -v slurmd && command -v sbatch && command -v munged &&
    { ((!ACCOUNTING)) || { command -v slurmdbd && command -v mariadbd; }; }
} >/dev/null

install_packages() {
  local pkgs=("${BASE_PKGS[@]}")
  ((ACCOUNTING)) && pkgs+=("${ACCT_PKGS[@]}")
  command -v apt-get >/dev/null || die "Slurm packages missing and no apt-get to install them" 3
  # Refresh the package lists only when one of the packages has no install candidate.
  if apt-cache policy "${pkgs[@]}" 2>/dev/null | grep -q 'Candidate: (none)' ||
    [[ $(apt-cache policy "${pkgs[@]}" 2>/dev/null | grep -c 'Candidate:') -lt ${#pkgs[@]} ]]; then
    log "apt-get update"
    apt-get update -qq >&2 || die "apt-get update failed" 3
  fi
  log "apt-get install ${pkgs[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >&2 ||
    die "apt-get install ${pkgs[*]} failed" 3
}

hostlist() { (($1 == 1)) && echo "$2$3" || echo "$2[$3-$(($3 + $1 - 1))]"; }

# Render slurm.conf.in to stdout.
render_conf() {
  local mem total acct="AccountingStorageType=accounting_storage/none"
  total=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')
  mem=$((total / NODES))
  ((ACCOUNTING)) && acct="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1"
  local t
  t=$(<"$HERE/slurm.conf.in")
  t=${t//@HOST@/$HOST}
  t=${t//@STATE@/$HT_DIR}
  t=${t//@NODES@/$(hostlist "$NODES" n 1)}
  t=${t//@PORTS@/$(hostlist "$NODES" "" 17001)}
  t=${t//@CPUS@/$CPUS}
  t=${t//@MEM@/$mem}
  t=${t//@ACCOUNTING@/$acct}
  printf '%s\n' "$t"
}

healthy() {
  local daemons
  munged_pid >/dev/null || munge_ok || return 1
  daemons=$(our_daemons)
  # (grep on a variable: `producer | grep -q` can fail under pipefail when grep exits early)
  [[ $daemons == *" slurmctld"* ]] || return 1
  [[ $(grep -c ' slurmd ' <<<"$daemons") -eq $NODES ]] || return 1
  ((!ACCOUNTING)) || pid_alive "$(cat "$HT_DIR/run/slurmdbd.pid" 2>/dev/null || echo x)" || return 1
  nodes_ready "$NODES"
}

# Node names must resolve: the first node of SLURM_JOB_NODELIST becomes MASTER_ADDR.
ensure_hosts() {
  local i missing=()
  for ((i = 1; i <= NODES; i++)); do getent hosts "n$i" >/dev/null || missing+=("n$i"); done
  ((${#missing[@]})) || return 0
  log "adding '127.0.0.1 ${missing[*]}' to /etc/hosts"
  echo "127.0.0.1 ${missing[*]}  # $HT_MARK" >>/etc/hosts
}

# Clients (sbatch, squeue, sinfo, scontrol -- and submitit, which calls them, also inside jobs)
# read /etc/slurm/slurm.conf unless SLURM_CONF is set: point it at ours.
link_etc_conf() {
  mkdir -p "$(dirname "$HT_ETC_CONF")"
  if [[ -e $HT_ETC_CONF && ! -L $HT_ETC_CONF ]] && ! grep -q "$HT_MARK" "$HT_ETC_CONF"; then
    die "$HT_ETC_CONF exists and is not ours: move it away, or point clients at $HT_CONF with SLURM_CONF"
  fi
  ln -sfn "$HT_CONF" "$HT_ETC_CONF"
}

ensure_munge() {
  munged_pid >/dev/null && munge_ok && return 0
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  fi
  mkdir -p /run/munge && chown munge:munge /run/munge && chmod 755 /run/munge
  log "starting munged"
  runuser -u munge -- /usr/sbin/munged --force
  local i
  for ((i = 0; i < 50; i++)); do munge_ok && { munged_pid >"$HT_DIR/run/munged.ours"; return 0; }; sleep 0.1; done
  die "munged did not answer: $(tail -n 5 /var/log/munge/munged.log 2>/dev/null)"
}

start_daemons() {
  local i
  for ((i = 1; i <= NODES; i++)); do mkdir -p "$HT_DIR/spool/d-n$i"; done
  log "starting slurmctld"
  slurmctld -f "$HT_CONF" || die "slurmctld failed: $(tail -n 20 "$HT_DIR/log/slurmctld.log")"
  for ((i = 1; i <= NODES; i++)); do
    slurmd -N "n$i" -f "$HT_CONF" || die "slurmd n$i failed: $(tail -n 20 "$HT_DIR/log/slurmd-n$i.log")"
  done
  log "started slurmd n1..n$NODES"
}

# Every slurmd n1..nN registered with the controller at or after epoch $1. (After a restart the
# controller reports saved node states at once, so "idle" alone does not prove a slurmd is up.)
registered_since() {
  local line node t i
  local -A seen=()
  while read -r line; do
    node=$(sed -n 's/^NodeName=\([^ ]*\).*/\1/p' <<<"$line")
    t=$(sed -n 's/.* SlurmdStartTime=\([^ ]*\).*/\1/p' <<<"$line")
    [[ -n $node && $t == 20* ]] || continue
    (($(date -d "$t" +%s) >= $1)) && seen[$node]=1
  done < <(timeout 10 scontrol -o show node 2>/dev/null)
  for ((i = 1; i <= NODES; i++)); do [[ -n ${seen[n$i]:-} ]] || return 1; done
}

wait_ready() {
  local since=$1 deadline=$((SECONDS + TIMEOUT)) resumed=0
  until nodes_ready "$NODES" && registered_since "$since"; do
    if ((SECONDS >= deadline)); then
      log "cluster not ready after ${TIMEOUT} s; sinfo says:"
      node_states >&2 || true
      tail_logs 15 "$NODES"
      die "nodes n1..n$NODES did not become idle (see the logs above, in $HT_DIR/log)"
    fi
    # A node drained by an earlier unclean stop does not come back by itself.
    if ((!resumed)) && grep -Eq ' (drain|drng|drained)' <<<"$(node_states)"; then
      scontrol update nodename="$(hostlist "$NODES" n 1)" state=resume 2>/dev/null || true
      resumed=1
    fi
    sleep 0.2
  done
}

main() {
  local t0=$EPOCHREALTIME new since
  if have_packages && [[ -f $HT_CONF ]] && cmp -s <(render_conf) "$HT_CONF" && healthy; then
    log "already running: $NODES nodes x $CPUS CPUs (state in $HT_DIR)"
    return 0
  fi
  [[ $(id -u) == 0 ]] || die "starting the local Slurm cluster needs root (daemons run as root)" 3
  have_packages || install_packages
  mkdir -p "$HT_DIR"/{ctld,spool,run,log}
  new=$(render_conf)
  printf '%s\n' "$new" >"$HT_CONF.tmp" && mv "$HT_CONF.tmp" "$HT_CONF"
  ensure_hosts
  link_etc_conf
  ensure_munge
  stop_slurm_daemons
  since=$(($(date +%s) - 1))
  if ((ACCOUNTING)); then source "$HERE/accounting.sh"; start_slurmdbd; fi
  start_daemons
  wait_ready "$since"
  log "up: $NODES nodes x $CPUS CPUs in $(awk "BEGIN {printf \"%.1f\", $EPOCHREALTIME - $t0}") s (state in $HT_DIR, conf $HT_CONF)"
}

main
