"""cluster.check_before_submit (issue 29) on the real local Slurm cluster: a job whose dry run
does not fit is refused before anything reaches the queue."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slurm


def test_check_before_submit_refuses_a_job_that_does_not_fit(slurm_cluster, tmp_path):
    """plan.force skips the planner's check; the dry run still refuses: exit 2, the rank and
    its largest term named, the tables written, nothing submitted."""
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", "-m", "cluster=slurm_local", "model=debug",
         "train=debug", "parallel.dp=4", "train.global_batch_size=8", "logger.wandb=disabled",
         "cluster.check_before_submit=true", "plan.memory_limit_gb=0.001", "plan.force=true",
         f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr  # Hydra's multirun logs to stdout
    assert proc.returncode == 2, out[-2000:]
    assert "rank 0 (pp=0 dp=0 cp=0 tp=0) would hold" in out
    assert "largest term is activations" in out
    assert (sweep / "dryrun.0" / "dryrun.md").exists()
    assert not (sweep / ".submitit").exists()
    queue = subprocess.run(["squeue", "-h", "-o", "%o"], capture_output=True, text=True,
                           timeout=30).stdout
    assert str(sweep) not in queue
