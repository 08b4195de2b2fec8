"""cluster.launcher=slurm: the body of one Slurm task (one task per rank, no torchrun).

The job is submitted by Hydra's submitit launcher (`python -m hpctrain -m cluster=slurm ...`)
or by a plain sbatch script (`hpctrain.launch.sbatch`); in both, every task runs
`python -m hpctrain` (or submitit's unpickled call of it), arrives here, reads its rank from
SLURM_PROCID via `distributed.env`, exports MASTER_ADDR/MASTER_PORT for env:// and runs the
rank. Data is normally prepared in the submitting process (the sweep callback); local rank 0
of each node prepares it again if missing (a cache hit otherwise) while the others wait at a
barrier, so ranks only ever read a complete token cache.

Faults: the rank that claims a hang report requeues the job without the nodes it names
(`hpctrain.launch.requeue`); with cluster.elastic every start first fits the layout to the
nodes Slurm gave it (`hpctrain.launch.elastic`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch.distributed as dist

from hpctrain.config.schema import Config
from hpctrain.data.prepare import prepare
from hpctrain.distributed import preempt
from hpctrain.distributed.env import DistEnv, from_environ
from hpctrain.distributed.mesh import Mesh
from hpctrain.launch import task_results
from hpctrain.launch.requeue import SCONTROL_S, Requeue, leave_excluded
from hpctrain.launch.worker import TaskFn, run_rank

log = logging.getLogger(__name__)


def slurm_env(cfg: Config) -> DistEnv:
    """This task's rank and rendezvous, checked against the config's world."""
    env = from_environ()
    if env.source != "slurm":
        raise ValueError(
            f"cluster.launcher=slurm runs inside Slurm tasks, but this process has no "
            f"SLURM_PROCID (source: {env.source}): submit with `python -m hpctrain -m "
            f"cluster={cfg.cluster.name} ...` or a script from `python -m hpctrain.launch.sbatch`")
    if env.world_size != cfg.cluster.world_size:
        raise ValueError(
            f"the Slurm job has {env.world_size} tasks but cluster.nodes={cfg.cluster.nodes} × "
            f"cluster.procs_per_node={cfg.cluster.procs_per_node} = {cfg.cluster.world_size}: "
            "submit with --nodes/--ntasks-per-node matching the config")
    return env


def _prepared_then(task: TaskFn, local_rank: int) -> TaskFn:
    def prepared_task(cfg: Config, mesh: Mesh) -> dict[str, Any]:
        if local_rank == 0:
            prepare(cfg.data)
        dist.barrier()
        return task(cfg, mesh)

    return prepared_task


def elastic_config(cfg: Config) -> Config:
    """With cluster.elastic, `cfg` fitted to this job's node count (hpctrain.launch.elastic);
    else `cfg`."""
    if not cfg.cluster.elastic:
        return cfg
    from hpctrain.launch import elastic  # the planner and Hydra's parse: only when elastic

    fitted, note = elastic.fit_world(cfg, int(os.environ["SLURM_JOB_NUM_NODES"]))
    if os.environ.get("SLURM_PROCID") == "0":
        log.info("elastic: %s", note)
    return fitted


def run_slurm_task(cfg: Config, task: TaskFn) -> dict[str, Any]:
    """Run this Slurm task's rank; afterwards requeue if a USR2 stopped the run. A fault
    requeues the job without the nodes it names (`Requeue`)."""
    submitted, ppn = cfg.cluster.world_size, cfg.cluster.procs_per_node
    job_id, nodelist = os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_JOB_NODELIST", "")
    if os.environ.get("SLURM_PROCID") == "0" and leave_excluded(
            cfg, job_id=job_id, nodelist=nodelist, most_nodes=submitted // ppn):
        time.sleep(3 * SCONTROL_S)  # the requeue ends every task of this start
        raise RuntimeError(f"job {job_id} was not requeued off its excluded nodes: cancel it "
                           "and resubmit")
    cfg = elastic_config(cfg)
    env = slurm_env(cfg)
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    for key, value in cfg.cluster.env.items():
        os.environ.setdefault(key, str(value))  # the job script exports them too
    preempt.STOP.install()
    log.info("slurm task: rank %d/%d (local %d), master %s:%d", env.rank, env.world_size,
             env.local_rank, env.master_addr, env.master_port)
    try:
        on_fault = Requeue(cfg, job_id=job_id, nodelist_at_start=nodelist,
                           layout=cfg.layout_label, most_nodes=submitted // ppn)
        result = run_rank(cfg, _prepared_then(task, env.local_rank), rank=env.rank,
                          world_size=env.world_size, local_rank=env.local_rank,
                          on_fault=on_fault)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as err:  # noqa: BLE001
        # torch's CheckpointException is a BaseException: neither Hydra nor submitit would
        # record it, the task would die without a result, and without Slurm accounting
        # submitit would wait for that result forever.
        if isinstance(err, Exception):
            raise
        raise RuntimeError(f"{type(err).__name__}: {err}") from err
    # an elastic start of fewer tasks: results for the tasks that did not run (task_results)
    if not preempt.requeue_if_asked(rank=env.rank) and env.rank == 0:
        task_results.write("success", result, range(env.world_size, submitted))
    return result
