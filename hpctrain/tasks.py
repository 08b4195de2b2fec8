"""Task registry: what `task=<name>` runs on every rank (or, for analytical tasks, once)."""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpctrain.config import Config
from hpctrain.data.prepare import prepare
from hpctrain.distributed.mesh import Mesh
from hpctrain.launch import preempt, rundir_lock
from hpctrain.launch.local import launch_local
from hpctrain.launch.record import log_to_run_dir, write_record
from hpctrain.launch.slurm import run_slurm_task
from hpctrain.metrics.redact import Secrets
from hpctrain.validate import reads_data
from hpctrain.validate_inputs import check_prepared

# Each task imports what it runs when it runs: a rank (or `python -m hpctrain` launching ranks)
# does not pay for the modules of the tasks it does not run (the planner's, the exporter's,
# torch.distributed.checkpoint's in a launcher: seconds per process on a small CPU).


def train_task(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    """The trainer, with the launcher's agreed stop check and the planner's prediction."""
    from hpctrain.plan.predict import RunPrediction
    from hpctrain.train.trainer import Trainer

    prediction = RunPrediction(cfg, device=mesh.device, logging_rank=mesh.is_logging_rank)
    stop = functools.partial(preempt.stop_agreed, group=mesh.world, device=mesh.device)
    return Trainer(cfg, mesh, stop_requested=stop, prediction=prediction).run()


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


def prepare_task(cfg: Config) -> dict[str, Any]:
    """Tokenise the data into the cache (hpctrain.data.prepare); returns its meta.json. In a
    Slurm job the job's tasks share the work (each its units; task 0 assembles)."""
    share = (0, 1)
    if cfg.cluster.launcher == "slurm" and "SLURM_PROCID" in os.environ:
        share = (int(os.environ["SLURM_PROCID"]), int(os.environ.get("SLURM_NTASKS", "1")))
    out = prepare(cfg.data, share=share, timeout_s=cfg.cluster.timeout_s)
    return {"data_dir": str(out), **json.loads((out / "meta.json").read_text())}


def export_task(cfg: Config) -> dict[str, Any]:
    """A checkpoint as a Hugging Face directory (hpctrain.train.hf_export)."""
    from hpctrain.train.export_config import export_settings
    from hpctrain.train.hf_export import export_hf

    return export_hf(export_settings(cfg.extra))


def generate_task(cfg: Config) -> dict[str, Any]:
    """Completions of prompts by one model on one device (hpctrain.train.generate)."""
    from hpctrain.train.generate import run_generate

    return run_generate(cfg)


def eval_task(cfg: Config) -> dict[str, Any]:
    """A checkpoint's loss and perplexity, and lm-eval's tasks (hpctrain.train.evaluate)."""
    from hpctrain.train.evaluate import run_eval

    return run_eval(cfg)


def compat_task(cfg: Config) -> dict[str, Any]:
    """The composition matrix from the validation rules (hpctrain.compat), to compat.md."""
    from hpctrain import compat

    text = compat.table()
    path = Path(cfg.run_dir) / "compat.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n", encoding="utf-8")
    return {"text": text, "path": str(path)}


def dryrun_task(cfg: Config) -> dict[str, Any]:
    """Chosen ranks of the job set up on meta tensors, against the planner
    (hpctrain.plan.dryrun), to dryrun.json and dryrun.md."""
    from hpctrain.plan.dryrun import run_dryrun

    return run_dryrun(cfg)


# Analytical tasks run once in this process, with no ranks.
ONCE_TASKS = {"simulate": simulate_task, "plan": plan_task, "prepare": prepare_task,
              "export": export_task, "generate": generate_task, "eval": eval_task,
              "compat": compat_task, "dryrun": dryrun_task}


def preflight(cfg: Config) -> None:
    """Prepare the inputs every rank reads, once, and check them: ValueError (before any rank
    starts) when the data is shorter than a batch. Slurm tasks find them prepared by the
    sweep callback, which runs the same check."""
    if cfg.cluster.launcher == "slurm" or cfg.task in ONCE_TASKS or not reads_data(cfg):
        return
    check_prepared(cfg, prepare(cfg.data))


def launch(cfg: Config, *, record: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run an analytical task here, or launch the ranks (after `preflight`).

    Rank tasks own their run directory while they run (hpctrain.launch.rundir_lock): the
    launcher holds the lock locally, Slurm task 0 holds it in a Slurm job. A directory in use
    by another live run raises RunDirBusy before any rank starts, and before anything is
    written into it: the owner writes `record` (the entry point's `.hydra/` files,
    launch.record), plan.json (parallel=auto) and its log lines only once the lock is held."""
    secrets = Secrets.of(cfg.cluster.env, cfg.logger.redact)
    if cfg.task in ONCE_TASKS:
        write_record(cfg.run_dir, record or {})
        return ONCE_TASKS[cfg.task](cfg)
    slurm = cfg.cluster.launcher == "slurm"
    owner = not slurm or os.environ.get("SLURM_PROCID") == "0"
    if not owner:  # the other Slurm tasks touch the directory only once task 0 owns it
        rundir_lock.wait_for_owner(cfg.run_dir, job_id=os.environ.get("SLURM_JOB_ID"),
                                   timeout_s=cfg.cluster.timeout_s)
    with rundir_lock.held(cfg.run_dir, enabled=owner):
        handler = log_to_run_dir(cfg.run_dir, secrets) if owner else None
        try:
            if owner:
                write_record(cfg.run_dir, record or {})
            if cfg.parallel.auto and owner:  # the choice (made in parse) with its top five
                from hpctrain.parse import runnable_problems
                from hpctrain.plan.auto import write_plan

                write_plan(cfg, accept=runnable_problems)
            if slurm:  # this process is one Slurm task (one rank)
                return run_slurm_task(cfg, RANK_TASKS[cfg.task])
            return launch_local(cfg, RANK_TASKS[cfg.task])
        finally:
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()


def run(cfg: Config) -> dict[str, Any]:
    """`preflight`, then `launch`."""
    preflight(cfg)
    return launch(cfg)
