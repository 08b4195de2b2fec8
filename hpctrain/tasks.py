"""Task registry: what `task=<name>` runs on every rank (or, for analytical tasks, once)."""

from __future__ import annotations

from typing import Any

from hpctrain.config import Config
from hpctrain.distributed.mesh import Mesh


def train_task(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    from hpctrain.train.trainer import Trainer

    return Trainer(cfg, mesh).run()


RANK_TASKS = {"train": train_task}


def run(cfg: Config) -> dict[str, Any]:
    """Prepare shared inputs once, then launch the ranks with the chosen launcher."""
    if cfg.cluster.launcher == "slurm":  # this process is one Slurm task (one rank)
        from hpctrain.launch.slurm import run_slurm_task

        return run_slurm_task(cfg, RANK_TASKS[cfg.task])
    from hpctrain.launch.local import launch_local
    from hpctrain.train.prepare import prepare

    prepare(cfg.data)  # before any rank starts, so ranks only read the cached tokens
    return launch_local(cfg, RANK_TASKS[cfg.task])
