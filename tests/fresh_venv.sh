#!/usr/bin/env bash
# Prove the README's first command on a fresh machine: a new virtualenv without system
# packages, `pip install torch==2.13.0 -e .`, then `python -m hpctrain` for a few steps.
# A dependency that only the test extras or this machine's site-packages provide fails here.
# Usage: bash tests/fresh_venv.sh [extra hpctrain overrides...]
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d -t hpctrain-fresh-XXXXXX)
trap 'rm -rf "$work"' EXIT
python -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet --disable-pip-version-check torch==2.13.0 -e .
env -u PYTHONPATH WANDB_SILENT=true "$work/venv/bin/python" -m hpctrain train.steps=3 \
  train.eval_every=0 logger.progress=plain "hydra.run.dir=$work/run" "$@"
test -s "$work/run/summary.json"
echo "fresh virtualenv: the README's first command trained and wrote summary.json"
