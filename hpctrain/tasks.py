"""Task registry: what `task=<name>` runs on every rank (or, for analytical tasks, once)."""

from __future__ import annotations

import os
from typing import Any

from hpctrain.config import Config
from hpctrain.distributed.mesh import Mesh
from hpctrain.launch import rundir_lock


def train_task(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    from hpctrain.train.trainer import Trainer

    return Trainer(cfg, mesh).run()


def simulate_task(cfg: Config) -> dict[str, Any]:
    from hpctrain.parallel.pipeline.sim_task import run_simulate

    return run_simulate(cfg)


def bench_task(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    from hpctrain.bench.task import bench_task as run_bench

    return run_bench(cfg, mesh)


RANK_TASKS = {"train": train_task, "bench": bench_task}


def plan_task(cfg: Config) -> dict[str, Any]:
    from hpctrain.plan.task import run_plan

    return run_plan(cfg)


# Analytical tasks run once in this process, with no ranks.
ONCE_TASKS = {"simulate": simulate_task, "plan": plan_task}


def preflight(cfg: Config) -> None:
    """Prepare the inputs every rank reads, once, and check them: ValueError (before any rank
    starts) when the data is shorter than a batch. Slurm tasks find them prepared by the
    sweep callback, which runs the same check."""
    from hpctrain.validate import reads_data

    if cfg.cluster.launcher == "slurm" or not reads_data(cfg):
        return
    from hpctrain.data.prepare import prepare
    from hpctrain.validate_inputs import check_prepared

    check_prepared(cfg, prepare(cfg.data))


def launch(cfg: Config) -> dict[str, Any]:
    """Run an analytical task here, or launch the ranks (after `preflight`).

    Rank tasks own their run directory while they run (hpctrain.launch.rundir_lock): the
    launcher holds the lock locally, Slurm task 0 holds it in a Slurm job. A directory in use
    by another live run raises RunDirBusy before any rank starts."""
    if cfg.task in ONCE_TASKS:
        return ONCE_TASKS[cfg.task](cfg)
    if cfg.cluster.launcher == "slurm":  # this process is one Slurm task (one rank)
        from hpctrain.launch.slurm import run_slurm_task

        with rundir_lock.held(cfg.run_dir, enabled=os.environ.get("SLURM_PROCID") == "0"):
            return run_slurm_task(cfg, RANK_TASKS[cfg.task])
    with rundir_lock.held(cfg.run_dir):
        return _run_local(cfg)


def _run_local(cfg: Config) -> dict[str, Any]:
    from hpctrain.launch.local import launch_local

    return launch_local(cfg, RANK_TASKS[cfg.task])


def run(cfg: Config) -> dict[str, Any]:
    """`preflight`, then `launch`."""
    preflight(cfg)
    return launch(cfg)
