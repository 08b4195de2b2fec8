# Shared helpers for start.sh / stop.sh / status.sh (sourced, not run).
# Our daemons are found by their command line (they all carry `-f $HT_CONF`), never by a bare
# process name, so a site's own Slurm on the same host is left alone.

HT_DIR=${HPCTRAIN_SLURM_DIR:-/var/tmp/hpctrain-slurm}
HT_CONF=$HT_DIR/slurm.conf
HT_ETC_CONF=/etc/slurm/slurm.conf
HT_MARK="hpctrain-local-slurm"
export SLURM_CONF=$HT_CONF

log() { echo "[hpctrain-slurm] $*" >&2; }
die() { log "error: $1"; exit "${2:-1}"; }

# Alive = exists and not a zombie/dead. In sandboxes without a reaping init a killed daemon
# lingers as a zombie, and `kill -0` still succeeds on it.
pid_alive() {
  local state
  state=$(awk '/^State:/ {print $2}' "/proc/$1/status" 2>/dev/null) || return 1
  [[ -n $state && $state != Z && $state != X ]]
}

# Print "PID NAME [NODE]" for each live daemon started with our config file.
our_daemons() {
  local d pid cmd
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    cmd=$(tr '\0' ' ' 2>/dev/null <"$d/cmdline") || continue
    [[ $cmd == *"-f $HT_CONF"* ]] || continue
    pid_alive "$pid" || continue
    set -- $cmd
    case ${1##*/} in
      slurmctld) echo "$pid slurmctld" ;;
      slurmd) echo "$pid slurmd $(sed -n 's/.*-N \([^ ]*\).*/\1/p' <<<"$cmd")" ;;
    esac
  done
}

# SIGTERM, wait up to 10 s, then SIGKILL.
stop_pid() {
  local pid=$1 name=$2 i
  pid_alive "$pid" || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do pid_alive "$pid" || return 0; sleep 0.1; done
  log "$name ($pid) ignored SIGTERM for 10 s: SIGKILL"
  kill -KILL "$pid" 2>/dev/null || true
  for ((i = 0; i < 20; i++)); do pid_alive "$pid" || return 0; sleep 0.1; done
  die "$name ($pid) survived SIGKILL"
}

stop_slurm_daemons() {
  local pid name node
  # slurmd first, so the controller does not mark nodes down while it is going away itself.
  while read -r pid name node; do
    [[ $name == slurmd ]] && { log "stopping slurmd $node ($pid)"; stop_pid "$pid" "slurmd $node"; }
  done < <(our_daemons)
  while read -r pid name node; do
    log "stopping $name ($pid)"; stop_pid "$pid" "$name"
  done < <(our_daemons)
  if [[ -f $HT_DIR/run/slurmdbd.pid ]]; then
    pid=$(<"$HT_DIR/run/slurmdbd.pid")
    pid_alive "$pid" && { log "stopping slurmdbd ($pid)"; stop_pid "$pid" slurmdbd; }
  fi
  return 0
}

munged_pid() {
  local pid
  pid=$(cat /run/munge/munged.pid 2>/dev/null) || return 1
  pid_alive "$pid" && echo "$pid"
}

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }

# Node states "n1 idle" lines for our nodes; empty when the controller does not answer.
node_states() { timeout 10 sinfo -h -N -o '%N %t' 2>/dev/null | sort -u; }

# True when exactly nodes n1..nN exist and each is up (idle/mixed/allocated/completing).
nodes_ready() {
  local n=$1 states i
  states=$(node_states) || return 1
  [[ $(wc -l <<<"$states") -eq $n ]] || return 1
  for ((i = 1; i <= n; i++)); do
    grep -Eq "^n$i (idle|mix|alloc|comp)\$" <<<"$states" || return 1
  done
}

# tail_logs LINES NODES: the last lines of the daemon logs, without the harmless pmix noise.
tail_logs() {
  local f i files=("$HT_DIR/log/slurmctld.log" "$HT_DIR/log/slurmdbd.log")
  for ((i = 1; i <= $2; i++)); do files+=("$HT_DIR/log/slurmd-n$i.log"); done
  for f in "${files[@]}" /var/log/munge/munged.log; do
    [[ -f $f ]] || continue
    echo "----- tail $f" >&2
    grep -v -e 'pmix' -e 'MPI: Cannot create context' "$f" | tail -n "$1" >&2
  done
}
