"""Run functions in a persistent world of N gloo ranks (1 thread each).

Starting a world costs seconds, so a `World` is started once per test session and reused: each
`world.run(fn, *args)` ships `fn` (a module-level function, pickled by reference) to every rank
and returns the per-rank results. Ranks rendezvous through a FileStore in a temp dir (no ports)
and use a short process-group timeout, so a mismatched collective fails a test instead of
hanging CI. A rank that raises marks the world broken; the next `run` starts a fresh one.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import traceback
from typing import Any

from hpctrain.launch.local import end_with


def die_with_parent() -> None:
    """Linux: this process (a rank, or a run a test launched) is SIGKILLed when the test process
    dies (even killed), instead of living on as an orphan that spins in a collective and loads
    the machine (a killed pytest once left four 100,000-step runs going for an hour); elsewhere
    a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _groups() -> set:
    from torch.distributed import distributed_c10d as c10d  # private: the live groups

    return set(c10d._world.pg_map)


def _destroy_new_groups(before: set) -> None:
    """Destroy the sub-groups a job created (each gloo group keeps threads that poll while
    idle: hundreds of them in a session-long world took about a core). After the barrier no
    rank is still using them."""
    import torch.distributed as dist

    new = [g for g in _groups() - before if g is not dist.group.WORLD]
    if not new:
        return
    dist.barrier()
    for group in new:
        dist.destroy_process_group(group)


# What a rank imports, imported once by the fork server every World of this process (and every
# local launch, hpctrain.launch.local, which asks for the same) forks its ranks from.
PRELOAD = ["hpctrain.launch.local", "hpctrain.tasks", "hpctrain.tasks.train"]


def _serve(rank: int, world: int, store_path: str, timeout_s: float, inbox, outbox, watch,
           env: dict[str, str], cwd: str) -> None:
    end_with(watch, signal.SIGKILL)  # the launcher's own way: a pipe only the test writes
    os.environ.clear()
    os.environ.update(env)  # the test process's now, not the fork server's at its start
    os.chdir(cwd)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    while True:
        job = inbox.get()
        if job is None:
            break
        fn, args, kwargs = job
        before = _groups()
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - report everything, including assertion errors
            outbox.put((rank, False, traceback.format_exc()))
        try:
            _destroy_new_groups(before)
        except Exception:  # noqa: BLE001 - a rank that failed the job: end; the next run respawns
            break
    dist.destroy_process_group()


class World:
    def __init__(self, size: int, *, timeout_s: float = 60.0):
        self.size, self.timeout_s = size, timeout_s
        self._procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # once: the server then serves every world
        self._dir = tempfile.TemporaryDirectory(prefix=f"world{self.size}-")
        store = os.path.join(self._dir.name, "store")
        self._inboxes = [ctx.Queue() for _ in range(self.size)]
        self._outbox = ctx.Queue()
        env, cwd = dict(os.environ), os.getcwd()
        self._procs, self._watches = [], []
        for r in range(self.size):
            watch, held = ctx.Pipe(duplex=False)
            self._procs.append(ctx.Process(target=_serve, daemon=True,
                                           args=(r, self.size, store, self.timeout_s,
                                                 self._inboxes[r], self._outbox, watch, env,
                                                 cwd)))
            self._procs[-1].start()
            watch.close()
            self._watches.append(held)

    def run(self, fn, *args, timeout_s: float = 300.0, **kwargs) -> list[Any]:
        """fn(*args, **kwargs) on every rank; returns results ordered by rank."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for box in self._inboxes:
            box.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: list[str] = []
        try:
            for _ in range(self.size):
                # Once a rank has failed, its peers are likely stuck in a collective: give
                # them a short grace to report, then tear the world down.
                wait = min(timeout_s, 15.0) if errors else timeout_s
                rank, ok, value = self._outbox.get(timeout=wait)
                if ok:
                    results[rank] = value
                else:
                    errors.append(f"rank {rank}:\n{value}")
        except queue.Empty:
            self.close()
            if errors:
                raise AssertionError("\n".join(errors)) from None
            raise TimeoutError(f"{fn.__name__} did not finish on all {self.size} ranks "
                               f"within {timeout_s}s") from None
        if errors:
            self.close()  # a failed collective can leave peers in a bad state
            raise AssertionError("\n".join(errors))
        return [results[r] for r in range(self.size)]

    def close(self) -> None:
        for box, p in zip(getattr(self, "_inboxes", []), self._procs, strict=False):
            if p.is_alive():
                box.put(None)
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        for held in getattr(self, "_watches", []):
            held.close()
        self._procs, self._watches = [], []
