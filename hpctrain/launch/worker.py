"""The body of one rank: join the process group, build the mesh, run the task, leave.

Used by every launcher (local spawn, Slurm task, torchrun) so a rank behaves the same
whichever way it was started.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.config import Config
from hpctrain.distributed.device import local_device, resolve_device_type
from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import Mesh, build_mesh

TaskFn = Callable[[Config, Mesh], dict[str, Any]]


def setup_logging(rank: int) -> None:
    fmt = f"[%(asctime)s rank{rank} %(name)s %(levelname)s] %(message)s"
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", force=True)


def backend_for(cfg: Config, device_type: str) -> str:
    if cfg.cluster.backend != "auto":
        return cfg.cluster.backend
    return "nccl" if device_type == "cuda" else "gloo"


def run_rank(cfg: Config, task: TaskFn, *, rank: int, world_size: int, local_rank: int,
             store: dist.Store | None = None) -> dict[str, Any]:
    """Initialise the default group (from `store`, or env:// MASTER_ADDR/PORT), run `task`."""
    setup_logging(rank)
    torch.set_num_threads(cfg.cluster.threads_per_proc)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.cluster.threads_per_proc))
    device_type = resolve_device_type(cfg.cluster.device)
    device = local_device(device_type, local_rank)
    timeout = datetime.timedelta(seconds=cfg.cluster.timeout_s)
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend_for(cfg, device_type), rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    try:
        p = cfg.parallel
        mesh = build_mesh(ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp), rank=rank, device=device)
        return task(cfg, mesh)
    finally:
        dist.destroy_process_group()
