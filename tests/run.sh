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
# Two pytest workers (pytest-xdist), one per core: the Slurm tests, first in one of them, wait
# on the cluster's jobs, which use the cores meanwhile. The cores are busy throughout, so a
# third worker only oversubscribes them (measured 2026-12-07: 20:40 with two workers, 21:25 to
# 23:30 with three). tests/conftest.py groups the tests and orders the groups, longest
# first (HPCTRAIN_TEST_WORKERS=0 runs everything in this one process). The 20 slowest tests
# end the log.
exec python -m pytest -q -p no:cacheprovider --durations=20 \
  -n "${HPCTRAIN_TEST_WORKERS:-2}" --dist loadgroup --no-loadscope-reorder "$@"
