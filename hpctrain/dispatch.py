"""Task dispatch: run `task=<name>` (hpctrain.tasks.TASKS) once in this process, or launch its
ranks here (cluster=local) or as this Slurm task; and what it shows on stdout when it ends."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hpctrain.config.schema import Config
from hpctrain.data.checks import check_prepared
from hpctrain.data.prepare import prepare
from hpctrain.launch import rundir_lock
from hpctrain.launch.local import launch_local
from hpctrain.launch.record import log_to_run_dir, recorded, write_record
from hpctrain.launch.slurm import run_slurm_task
from hpctrain.metrics.redact import Secrets
from hpctrain.plan.auto import write_plan
from hpctrain.tasks import TASKS, reads_data, runnable_problems


def preflight(cfg: Config) -> None:
    """Prepare the inputs every rank reads, once, and check them: ValueError (before any rank
    starts) when the data is shorter than a batch. Slurm tasks find them prepared by the
    sweep callback, which runs the same check."""
    if cfg.cluster.launcher == "slurm" or not TASKS[cfg.task].on_ranks or not reads_data(cfg):
        return
    check_prepared(cfg, prepare(cfg.data))


def launch(cfg: Config, *, record: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run a task that runs once here, or launch the ranks (after `preflight`).

    Rank tasks own their run directory while they run (hpctrain.launch.rundir_lock): the
    launcher holds the lock locally, Slurm task 0 holds it in a Slurm job. A directory in use
    by another live run raises RunDirBusy before any rank starts, and before anything is
    written into it: the owner writes `record` (the entry point's `.hydra/` files,
    launch.record), plan.json (parallel=auto) and its log lines only once the lock is held,
    and a run refused after that (ValueError) puts back the record it replaced."""
    secrets = Secrets.of(cfg.cluster.env, cfg.logger.redact)
    task = TASKS[cfg.task]
    if not task.on_ranks:
        write_record(cfg.run_dir, record or {})
        return task.run(cfg)
    slurm = cfg.cluster.launcher == "slurm"
    owner = not slurm or os.environ.get("SLURM_PROCID") == "0"
    if not owner:  # the other Slurm tasks touch the directory only once task 0 owns it
        rundir_lock.wait_for_owner(cfg.run_dir, job_id=os.environ.get("SLURM_JOB_ID"),
                                   timeout_s=cfg.cluster.timeout_s)
    with rundir_lock.held(cfg.run_dir, enabled=owner):
        handler = log_to_run_dir(cfg.run_dir, secrets) if owner else None
        try:
            with recorded(cfg.run_dir, (record or {}) if owner else {}):
                if cfg.parallel.auto and owner:  # the choice (made in parse) with its top five
                    write_plan(cfg, accept=runnable_problems)
                if slurm:  # this process is one Slurm task (one rank)
                    return run_slurm_task(cfg, task.run)
                return launch_local(cfg, task.run, preload=task.modules)
        finally:
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()


def run(cfg: Config) -> dict[str, Any]:
    """`preflight`, then `launch`."""
    preflight(cfg)
    return launch(cfg)


def format_result(task: str, result: dict[str, Any]) -> str | None:
    """What `task` shows on stdout when it ends: its numbers and where its outputs went."""
    return TASKS[task].show(result) if result else None
