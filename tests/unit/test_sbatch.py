"""render_sbatch is a pure function of the Config: compare with tests/golden/train.sbatch.
Regenerate after an intended change: HPCTRAIN_UPDATE_GOLDEN=1 pytest tests/unit/test_sbatch.py"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hpctrain.launch.resolvers import gres_for, launcher_setup, nodes_for, setup_lines
from hpctrain.launch.sbatch import main, render_sbatch
from tests.conftest import compose, make_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "train.sbatch"
OVERRIDES = ["cluster=example_site", "model=debug", "parallel.dp=16",
             "train.global_batch_size=128", "train.eval_samples=128", "optim.lr=3e-4"]


def test_render_matches_golden():
    cfg = make_config(OVERRIDES, run_dir="/scratch/me/run1")
    script = render_sbatch(cfg, OVERRIDES, job_name="golden")
    if os.environ.get("HPCTRAIN_UPDATE_GOLDEN"):
        GOLDEN.write_text(script)
    assert script == GOLDEN.read_text()


def test_render_local_cluster_has_no_gres_and_pins_run_dir():
    ov = ["cluster=slurm_local", "parallel=dp2", "parallel.dp=4", "train.global_batch_size=32",
          "hydra.run.dir=/elsewhere"]
    cfg = make_config(ov[:-1], run_dir="/tmp/r")
    script = render_sbatch(cfg, ov)
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in script
    assert "--gres" not in script and "#SBATCH --partition=debug" in script
    assert script.rstrip().endswith("global_batch_size=32 hydra.run.dir=/tmp/r")
    assert "/elsewhere" not in script


def test_render_refuses_local_launcher():
    with pytest.raises(ValueError, match="launcher=local"):
        render_sbatch(make_config([]), [])


def test_cli_writes_script_and_run_dir(tmp_path, capsys):
    out, run_dir = tmp_path / "job.sbatch", tmp_path / "run"
    assert main(["cluster=slurm_local", "parallel=dp2", "--out", str(out),
                 "--run-dir", str(run_dir)]) == 0
    assert run_dir.is_dir() and out.read_text().startswith("#!/bin/bash")


def test_slurm_config_composes_launcher_from_cluster():
    cfg = compose(["cluster=example_site", "parallel.dp=16", "+hydra_check=1"])
    assert cfg.cluster.nodes == 2
    from hydra import compose as hc
    from hydra import initialize_config_dir

    from hpctrain.config.hydra_schema import register
    from tests.conftest import CONF

    register()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        full = hc(config_name="config", overrides=["cluster=example_site", "parallel.dp=16"],
                  return_hydra_config=True)
    launcher = full.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gres) == (2, 8, "gpu:8")
    assert launcher.signal_delay_s == 120 and launcher.partition == "gpu"
    assert "export NCCL_SOCKET_IFNAME=ib0" in launcher.setup


def test_resolvers():
    def lay(dp, tp, pp, cp=1):
        return {"dp": dp, "tp": tp, "pp": pp, "cp": cp}

    assert nodes_for(lay(4, 1, 1), 2) == 2 and nodes_for(lay(2, 2, 2), 4) == 2
    assert nodes_for(lay(3, 1, 1), 2) == 2 and nodes_for(lay(2, 1, 1, cp=4), 4) == 2
    assert gres_for(0) is None and gres_for(4) == "gpu:4"
    assert setup_lines(["module load x"], {"B": "a b", "A": 1}) == [
        "module load x", "export A=1", "export B='a b'"]


def test_world_not_filling_nodes_is_refused():
    with pytest.raises(ValueError, match="parallel.dp=3"):
        make_config(["cluster=slurm_local", "parallel.dp=3"])


def test_submitit_jobs_keep_their_ranks_when_a_node_fails():
    """srun under submitit takes no flags of ours: the job script exports --no-kill's variable
    (with --kill-on-bad-exit's, a node failure would end the ranks that requeue the job)."""
    assert launcher_setup(["module load x"], {"A": 1}) == [
        "module load x", "export A=1", "export SLURM_NO_KILL=set"]
