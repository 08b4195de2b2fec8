#!/usr/bin/env bash
# The whole test suite on a fresh machine: install what it needs, start the local Slurm
# cluster (root only; Slurm tests skip with the reason elsewhere, and fail under CI=true),
# then run pytest. Usage: bash tests/run.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e '.[dev]'

if [ "$(id -u)" = 0 ]; then
  bash slurm/local/start.sh || echo "local Slurm cluster did not start (exit $?)" >&2
fi

export OMP_NUM_THREADS=1 WANDB_SILENT=true
# Two phases. First every test but Slurm's on three pytest workers (pytest-xdist), each taking
# whole files: most tests wait on their rank processes or a timeout more than they compute, so
# the two cores stay busy (each worker keeps at most 8 ranks of persistent worlds alive:
# tests/conftest.py). Then the Slurm tests alone: their jobs train against real time limits
# and signals, which a loaded machine would make them miss. The slowest tests are listed.
if [ $# -gt 0 ]; then
  exec python -m pytest -q -p no:cacheprovider --durations=25 "$@"
fi
status=0
python -m pytest -q -p no:cacheprovider --durations=25 -n 3 --dist loadfile \
  --ignore=tests/slurm tests || status=$?
python -m pytest -q -p no:cacheprovider --durations=10 tests/slurm || status=$?
exit $status
