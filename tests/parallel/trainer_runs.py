"""Trainer runs inside a harness World, shared by the checkpoint-layout and 3D trainer tests."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import build_mesh
from hpctrain.train.trainer import Trainer
from tests.conftest import make_config

STEPS = 4


BASE = ["model=debug", "train=debug", "logger.wandb=disabled", "logger.plot=false",
        "data.max_bytes=200000",
        "train.eval_every=0", "train.global_batch_size=8", "optim.warmup_steps=1"]


def run_trainer(overrides: list[str], run_dir: str, *, steps: int,
                base: tuple[str, ...] = tuple(BASE), run: bool = True) -> Trainer:
    """The real Trainer on this rank of the world (cluster = the world), after `run()`
    (`run=False`: as built); `base`: the overrides before `overrides` (BASE: model=debug)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    cfg = make_config([*base, f"train.steps={steps}",
                       f"cluster.procs_per_node={dist.get_world_size()}", *overrides],
                      run_dir=run_dir)
    mesh = build_mesh(cfg.parallel.dims, rank=dist.get_rank(), device=torch.device("cpu"))
    trainer = Trainer(cfg, mesh)
    if run:
        trainer.run()
    return trainer


def losses_and_memory(overrides: list[str], run_dir: str, *, steps: int):
    """The trainer on this world with `overrides` alone (no BASE): its losses and memory."""
    trainer = run_trainer(overrides, run_dir, steps=steps, base=())
    return [m["loss"] for m in trainer.history], trainer.memory_metrics()


def train_in_world(overrides: list[str], run_dir: str) -> list[tuple[float, float]]:
    trainer = run_trainer(overrides, run_dir, steps=STEPS)
    return [(h["loss"], h["grad_norm"]) for h in trainer.history]


def logged_trajectory(runs):
    """The trajectory as seen by the logging rank (loss is NaN off the last pipeline stage)."""
    return next(r for r in runs if r and r[0][0] == r[0][0])


def assert_trajectory_close(got, want) -> None:
    """(loss, grad norm) per step equal to fp32 tolerance (losses 1e-5, norms 1e-4 relative)."""
    import pytest

    assert len(got) == len(want)
    for (loss, norm), (loss1, norm1) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss1, rel=1e-5)
        assert norm == pytest.approx(norm1, rel=1e-4)
