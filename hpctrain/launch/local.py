"""cluster=local: `cluster.procs_per_node` rank processes on this machine.

Ranks start from a fork server (multiprocessing's `forkserver`): a clean process, started once
per launcher, that has imported the task's modules (torch, the trainer, torch's checkpoint
reader: ~3 s of one core per process on a small CPU) and forks each rank from that state. No
rank inherits the launcher's threads, gloo or CUDA state, as with spawn; each rank applies the
launcher's environment and working directory as they are at its start. Ranks meet through a
FileStore in the run directory, so concurrent runs never collide on a port. Each rank sends its
result back on its own pipe; `launch.supervisor` watches them (signals, failures, no orphans).
A rank also dies with the launcher: a pipe whose only writer the launcher holds closes with it,
and the rank SIGTERMs itself, which stops it with a checkpoint like any SIGTERM (the fork
server, its parent, then ends with its last rank). A world of one runs in the calling process,
which keeps the progress display on the terminal and tracebacks plain.

Signals: SIGINT/SIGTERM stop the ranks through the agreed preemption path (`distributed.preempt`):
every rank checkpoints at the next step boundary and exits; after cluster.signal_delay_s the
launcher kills what is left; a second SIGINT kills at once. The launcher then exits 128+signal.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.config.schema import Config
from hpctrain.distributed import preempt, rundir
from hpctrain.distributed.device import resolve_device_type
from hpctrain.errors import RunStopped, end_process, storage_stop
from hpctrain.launch.supervisor import JobStopped, supervise
from hpctrain.launch.worker import TaskFn, run_rank

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _store_path(cfg: Config) -> Path:
    path = rundir.work_dir(cfg.run_dir) / "rendezvous"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a FileStore file from an earlier run must not be reused
    return path


def end_with(launcher, signum: int = signal.SIGTERM) -> None:
    """Send this process `signum` when the process that started it dies (even by SIGKILL), so
    none is orphaned: a thread waits on `launcher`, a pipe whose only writer that process holds
    (its end closes with it). On Linux also when this process's parent (the fork server) dies."""
    def wait() -> None:
        try:
            launcher.recv()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signum)

    threading.Thread(target=wait, name="hpctrain-launcher-watch", daemon=True).start()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):
        pass


def _spawned(rank: int, cfg: Config, task: TaskFn, store_path: str, world: int, pipe,
             launcher, env: dict[str, str], cwd: str) -> None:
    end_with(launcher)  # SIGTERM: the agreed stop, with a checkpoint
    os.environ.clear()
    os.environ.update(env)  # the launcher's now, not the fork server's at its start
    os.chdir(cwd)
    preempt.STOP.install(preempt.LOCAL_SIGNALS)
    store = dist.FileStore(store_path, world)
    try:
        out = run_rank(cfg, task, rank=rank, world_size=world, local_rank=rank, store=store)
    except RunStopped as err:  # an agreed stop: hand the message over, exit without a traceback
        _hand_over(pipe, {"stopped": str(err), "exit_code": err.exit_code})
        end_process(err.exit_code)
    except ValueError as err:  # a user-facing refusal found inside the ranks (e.g. resume)
        _hand_over(pipe, {"stopped": str(err), "exit_code": 2})
        end_process(2)
    except OSError as err:  # a write the disk refused: one message; anything else: traceback
        stop = storage_stop(err, where=cfg.run_dir)
        if stop is None:
            raise
        _hand_over(pipe, {"stopped": str(stop), "exit_code": stop.exit_code})
        end_process(stop.exit_code)
    _hand_over(pipe, out)


def _hand_over(pipe, result) -> None:
    """Send this rank's result to the launcher; a launcher that is gone (killed: the rank
    stopped through SIGTERM, with its checkpoint) gets one log line, not a traceback."""
    try:
        pipe.send(result)
        pipe.close()
    except OSError:  # BrokenPipeError, ConnectionResetError: the reading end died
        log.warning("the launcher is gone: this rank's result was not delivered (the run "
                    "directory holds what it saved)")


def launch_local(cfg: Config, task: TaskFn, *, preload: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run `task` on every rank; returns the logging rank's result. Raises `JobStopped` when a
    signal stopped the run or a rank failed. `preload`: the modules the ranks run, imported
    once by the fork server when this process starts it (module docstring)."""
    if cfg.cluster.nodes != 1:
        raise ValueError(f"cluster=local runs on one node but cluster.nodes={cfg.cluster.nodes}: "
                         "use cluster=slurm for several nodes")
    world = cfg.cluster.world_size
    warning = oversubscribed(cfg, cores=usable_cores())
    if warning:
        log.warning("%s", warning)
    store_path = _store_path(cfg)
    if world == 1:
        return _in_process(cfg, task, store_path)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, task.__module__, *preload])  # no-op once it runs
    env, cwd = dict(os.environ), os.getcwd()
    procs, readers, alive = [], [], []
    for rank in range(world):
        reader, writer = ctx.Pipe(duplex=False)
        watch, held = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=_spawned, name=f"hpctrain-rank{rank}",
                                 args=(rank, cfg, task, str(store_path), world, writer, watch,
                                       env, cwd)))
        procs[-1].start()
        writer.close()  # the rank holds the only writer: its exit makes the pipe readable
        watch.close()  # ... and this process the only writer of its watch: `end_with`
        readers.append(reader)
        alive.append(held)
    try:
        results = supervise(procs, readers, run_dir=Path(cfg.run_dir),
                            stop_grace_s=cfg.cluster.signal_delay_s)
    finally:
        for held in alive:
            held.close()
    merged = [results[r] for r in sorted(results) if results[r]]
    return merged[0] if merged else {}


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a Slurm or cgroup limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def oversubscribed(cfg: Config, *, cores: int) -> str | None:
    """The warning for CPU ranks whose threads outnumber this machine's cores, else None."""
    if resolve_device_type(cfg.cluster.device) != "cpu":
        return None
    threads = cfg.cluster.world_size * cfg.cluster.threads_per_proc
    if threads <= cores:
        return None
    return (f"{cfg.cluster.world_size} rank(s) × cluster.threads_per_proc="
            f"{cfg.cluster.threads_per_proc} = {threads} threads on {cores} core(s): the ranks "
            "oversubscribe this machine, so step times measure the contention, not the layout "
            "(fewer ranks or threads run faster here)")


def _in_process(cfg: Config, task: TaskFn, store_path: Path) -> dict[str, Any]:
    """The one rank in this process: the same stop path, exit 128+signal after the save.
    (Signal handlers can only be set from the main thread; elsewhere the run is unstoppable
    by signals, as any Python code in a thread is.)"""
    if threading.current_thread() is threading.main_thread():
        preempt.STOP.install(preempt.LOCAL_SIGNALS)
    try:
        store = dist.FileStore(str(store_path), 1)
        result = run_rank(cfg, task, rank=0, world_size=1, local_rank=0, store=store)
        signum = preempt.STOP.signum if preempt.STOP.agreed else None
    finally:
        preempt.STOP.uninstall()
    if signum is not None:
        raise JobStopped(f"stopped by {signal.Signals(signum).name}: checkpoint saved "
                         f"({result.get('checkpoint')})", exit_code=128 + signum)
    return result
