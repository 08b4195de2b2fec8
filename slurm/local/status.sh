#!/usr/bin/env bash
# Print the local Slurm cluster's daemons and `sinfo`; exit 0 when every node is up.
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/lib.sh"

echo "state dir: $HT_DIR"
echo "munged:    $(munged_pid || echo 'not running')"
daemons=$(our_daemons)
echo "daemons:"
sed 's/^/  /' <<<"${daemons:-none}"
if [[ -f $HT_DIR/run/slurmdbd.pid ]] && pid_alive "$(<"$HT_DIR/run/slurmdbd.pid")"; then
  echo "  $(<"$HT_DIR/run/slurmdbd.pid") slurmdbd"
fi
[[ -f $HT_CONF ]] || { echo "no $HT_CONF: never started"; exit 1; }
n=$(grep -c ' slurmd ' <<<"$daemons" || true)
echo "sinfo:"
timeout 10 sinfo -N -o '  %10N %8t %4c %8m %P' || { echo "  slurmctld does not answer"; exit 1; }
munge_ok || { echo "munge does not work"; exit 1; }
((n > 0)) && nodes_ready "$n" || { echo "unhealthy: not every node n1..n$n is up"; exit 1; }
echo "healthy: $n nodes"
