"""A sweep is validated point by point before anything is launched."""

from __future__ import annotations

import subprocess
import sys

from hpctrain.launch.sweep_check import sweep_points
from tests.conftest import ROOT


def test_sweep_points_expand_like_hydra():
    points = sweep_points(["model=debug", "optim.lr=1e-4,3e-4", "train.steps=range(1,3)"])
    assert points == [["model=debug", "optim.lr=0.0001", "train.steps=1"],
                      ["model=debug", "optim.lr=0.0001", "train.steps=2"],
                      ["model=debug", "optim.lr=0.0003", "train.steps=1"],
                      ["model=debug", "optim.lr=0.0003", "train.steps=2"]]


def test_a_bad_point_stops_the_sweep_before_launch(tmp_path):
    cmd = [sys.executable, "-m", "hpctrain", "-m", "model=debug", "train=debug",
           "logger.wandb=disabled", "train.steps=2,0", f"hydra.sweep.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "1 of 2 sweep point(s) are invalid" in proc.stderr + proc.stdout
    assert "train.steps=0 must be > 0" in proc.stderr + proc.stdout
    assert not list(tmp_path.glob("*/metrics.jsonl"))  # point 0 (valid) did not run either
