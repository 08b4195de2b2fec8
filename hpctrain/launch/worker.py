"""The body of one rank: join the process group, build the mesh, run the task, leave.

Used by every launcher (local spawn, Slurm task, torchrun) so a rank behaves the same
whichever way it was started: its log lines also go to `<run_dir>/hpctrain.log` (appended by
every rank, one write per line, each prefixed with the rank); every group and point-to-point
wait uses cluster.timeout_s; the hang watchdog (`distributed.watchdog`) watches its steps, and a
wait that times out or loses its peer ends the rank with the watchdog's report (exit
`EXIT_HANG`) instead of a traceback.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.config.schema import Config
from hpctrain.distributed import hang_report
from hpctrain.distributed.device import local_device, resolve_device_type
from hpctrain.distributed.mesh import Mesh, build_mesh
from hpctrain.distributed.teardown import close_process_groups
from hpctrain.distributed.watchdog import EXIT_HANG, Watchdog, exit_now
from hpctrain.errors import OnceFileHandler
from hpctrain.launch import oom
from hpctrain.metrics.redact import Secrets, install_log_filter

TaskFn = Callable[[Config, Mesh], dict[str, Any]]


# Flight recorder entries kept per process group (torch records only when this is set before
# the group is created); the watchdog dumps them on a hang. A user's own value wins.
FLIGHT_RECORDER_ENTRIES = "2000"


def setup_logging(rank: int, *, log_file: str | os.PathLike | None = None,
                  secrets: Secrets | None = None) -> None:
    """Rank-prefixed log lines on stderr and, given `log_file`, appended to it as well;
    `secrets` (default: the environment's) are masked in both."""
    fmt = f"[%(asctime)s rank{rank} %(name)s %(levelname)s] %(message)s"
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        handlers.append(OnceFileHandler(log_file, mode="a"))
    logging.basicConfig(level=logging.INFO, format=fmt, datefmt="%H:%M:%S", force=True,
                        handlers=handlers)
    install_log_filter(secrets or Secrets.of())


def backend_for(cfg: Config, device_type: str) -> str:
    if cfg.cluster.backend != "auto":
        return cfg.cluster.backend
    return "nccl" if device_type == "cuda" else "gloo"


def run_rank(cfg: Config, task: TaskFn, *, rank: int, world_size: int, local_rank: int,
             store: dist.Store | None = None,
             on_fault: Callable[[hang_report.Fault], None] | None = None) -> dict[str, Any]:
    """Initialise the default group (from `store`, or env:// MASTER_ADDR/PORT), run `task`
    under the hang watchdog. A wait that times out or loses its peer ends the process with
    status EXIT_HANG after the watchdog's report (and `on_fault` when this rank claimed it);
    other errors propagate, named in this rank's heartbeat for its peers' report."""
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(rank, log_file=run_dir / "hpctrain.log",
                  secrets=Secrets.of(cfg.cluster.env, cfg.logger.redact))
    torch.set_num_threads(cfg.cluster.threads_per_proc)
    os.environ.setdefault("OMP_NUM_THREADS", str(cfg.cluster.threads_per_proc))
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    if rank == 0:  # before the rendezvous, so no other rank has started watching yet
        hang_report.archive_previous(run_dir)
    device_type = resolve_device_type(cfg.cluster.device)
    device = local_device(device_type, local_rank)
    oom.record(device)  # CUDA: the allocator's history, for the snapshot at an OOM
    timeout = datetime.timedelta(seconds=cfg.cluster.timeout_s)
    kwargs = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend_for(cfg, device_type), rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
    watchdog = Watchdog(run_dir, rank=rank, world_size=world_size,
                        timeout_s=cfg.cluster.timeout_s, on_fault=on_fault)
    finished = False
    try:
        mesh = build_mesh(cfg.parallel.dims, rank=rank, device=device, timeout=timeout,
                          heartbeat=watchdog)
        with watchdog:
            result = task(cfg, mesh)
        finished = True
        return result
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch's CheckpointException is a BaseException
        if isinstance(err, torch.OutOfMemoryError):
            watchdog.failed(err)
            raise oom.stop(cfg, err, rank=rank, step=watchdog.current, device=device) from err
        if not hang_report.is_comm_failure(err):
            watchdog.failed(err)
            raise
        watchdog.report(hang_report.first_line(err), tb=err.__traceback__)
        exit_now(EXIT_HANG)  # the job is over: no teardown (seconds on a loaded node)
    finally:
        close_process_groups(clean=finished)
