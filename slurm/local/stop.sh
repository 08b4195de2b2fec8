#!/usr/bin/env bash
# Stop the local Slurm cluster's daemons (slurmd's, slurmctld, slurmdbd; munged and mariadb only
# if start.sh started them). Job and node state is kept, so job ids keep counting.
#
#   stop.sh [--purge]   --purge also deletes the state dir and our /etc/slurm/slurm.conf link
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$HERE/lib.sh"

PURGE=0
case ${1:-} in
  --purge) PURGE=1 ;;
  "") ;;
  *) die "usage: stop.sh [--purge]" 2 ;;
esac

stop_slurm_daemons
for ours in munged mariadbd; do
  f=$HT_DIR/run/$ours.ours
  [[ -f $f ]] || continue
  pid=$(<"$f")
  if [[ -n $pid ]] && pid_alive "$pid"; then log "stopping $ours ($pid)"; stop_pid "$pid" "$ours"; fi
  rm -f "$f"
done
if ((PURGE)); then
  [[ -L $HT_ETC_CONF && $(readlink "$HT_ETC_CONF") == "$HT_CONF" ]] && rm -f "$HT_ETC_CONF"
  log "removing $HT_DIR"
  rm -rf "$HT_DIR"
fi
log "stopped"
