"""cluster=local: `cluster.procs_per_node` rank processes on this machine.

Ranks are spawned (not forked: forked gloo/CUDA state is unsafe) and meet through a FileStore
in the run directory, so concurrent runs never collide on a port. A world of one runs in the
calling process, which keeps the progress display on the terminal and tracebacks plain.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.config import Config
from hpctrain.errors import RunStopped
from hpctrain.launch.worker import TaskFn, run_rank

log = logging.getLogger(__name__)


def _store_path(cfg: Config) -> Path:
    path = Path(cfg.run_dir) / ".rendezvous"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a FileStore file from an earlier run must not be reused
    return path


def _spawned(rank: int, cfg: Config, task: TaskFn, store_path: str, world: int, results):
    store = dist.FileStore(store_path, world)
    try:
        out = run_rank(cfg, task, rank=rank, world_size=world, local_rank=rank, store=store)
    except RunStopped as err:  # an agreed stop: hand the message over, exit without a traceback
        results[rank] = {"stopped": str(err), "exit_code": err.exit_code}
        sys.exit(err.exit_code)
    results[rank] = out


def launch_local(cfg: Config, task: TaskFn) -> dict[str, Any]:
    """Run `task` on every rank; returns the logging rank's result."""
    if cfg.cluster.nodes != 1:
        raise ValueError(f"cluster=local runs on one node but cluster.nodes={cfg.cluster.nodes}: "
                         "use cluster=slurm for several nodes")
    world = cfg.cluster.world_size
    store_path = _store_path(cfg)
    if world == 1:
        store = dist.FileStore(str(store_path), 1)
        return run_rank(cfg, task, rank=0, world_size=1, local_rank=0, store=store)
    with mp.Manager() as manager:
        results = manager.dict()
        try:
            mp.start_processes(_spawned, args=(cfg, task, str(store_path), world, results),
                               nprocs=world, start_method="spawn", join=True)
        except mp.ProcessExitedException:
            # The first rank to exit wrote its message before exiting; the ranks of an agreed
            # stop all carry the same one.
            stopped = [r for r in results.values() if r and "stopped" in r]
            if stopped:
                raise RunStopped(stopped[0]["stopped"],
                                 exit_code=stopped[0]["exit_code"]) from None
            raise
        merged = [r for r in results.values() if r]
        return merged[0] if merged else {}
