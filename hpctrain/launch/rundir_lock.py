"""One run per run directory: a lock file naming its owner (host, pid, Slurm job).

Two runs on one directory would share the rendezvous file, resume from each other's
half-written checkpoints and interleave one `metrics.jsonl`. The launcher takes
`<run_dir>/.hpctrain.lock` before any rank starts and removes it when the run ends. The file
is created atomically (a complete temp file hard-linked into place, which fails if the lock
exists, also on NFS), so a reader never sees half an owner.

A lock left by an owner that is gone is taken over with a warning: a process on this host
that no longer exists (pid and its start time, so a reused pid is not mistaken for the
owner), the same Slurm job (a requeued job restarts on its own directory), or a Slurm job
that `squeue` no longer lists. Anything else is refused with the owner's identity.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
LOCK_NAME = ".hpctrain.lock"


class RunDirBusy(ValueError):
    """Another live run owns the run directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_start": _start_time(pid),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": datetime.datetime.now().isoformat(timespec="seconds")}


def _alive_here(owner: dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int):
        return False
    start = _start_time(pid)
    return start is not None and start == owner.get("pid_start")


def _slurm_job_running(job_id: str) -> bool | None:
    """True/False from squeue; None when squeue cannot tell (not installed, timed out)."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", str(job_id), "-o", "%T"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return False if "Invalid job id" in out.stderr else None
    return bool(out.stdout.strip())


def stale_reason(owner: dict[str, Any] | None, me: dict[str, Any]) -> str | None:
    """Why the lock's owner is gone (so the lock may be taken over), or None if it may live."""
    if owner is None:
        return "the lock file is unreadable"
    job = owner.get("slurm_job_id")
    if job is not None and job == me["slurm_job_id"]:
        return f"it belongs to this Slurm job {job} (requeued)"
    if owner.get("host") == me["host"] and job is None:
        return None if _alive_here(owner) else f"process {owner.get('pid')} has exited"
    if job is not None and _slurm_job_running(job) is False:
        return f"Slurm job {job} is no longer queued or running"
    return None


def _read(path: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _try_create(path: Path, owner: dict[str, Any]) -> bool:
    tmp = path.with_name(f"{LOCK_NAME}.{owner['host']}.{owner['pid']}")
    tmp.write_text(json.dumps(owner) + "\n")
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)


def _describe(owner: dict[str, Any]) -> str:
    job = f", Slurm job {owner['slurm_job_id']}" if owner.get("slurm_job_id") else ""
    return (f"pid {owner.get('pid')} on host {owner.get('host')}{job}, "
            f"since {owner.get('started')}")


def acquire(run_dir: str | Path) -> Path:
    """Take the run directory's lock or raise RunDirBusy naming its owner."""
    path = Path(run_dir) / LOCK_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    me = _owner()
    for _ in range(2):  # the second try follows taking over a stale lock
        if _try_create(path, me):
            return path
        owner = _read(path)
        reason = stale_reason(owner, me)
        if reason is None:
            raise RunDirBusy(
                f"run directory {run_dir} is in use by {_describe(owner)}: wait for that run "
                f"to end, choose another directory (hydra.run.dir=...), or delete {path} if "
                "that run is really gone")
        log.warning("taking over %s: %s", path, reason)
        path.unlink(missing_ok=True)
    raise RunDirBusy(f"run directory {run_dir}: another run took {path} at the same moment")


def release(path: Path) -> None:
    """Remove the lock if it is still ours (a takeover by a later run is left alone)."""
    owner = _read(path)
    if owner is not None and owner.get("pid") == os.getpid() \
            and owner.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def wait_for_owner(run_dir: str | Path, *, job_id: str | None, timeout_s: float,
                   poll_s: float = 0.2) -> None:
    """A Slurm task other than 0: return once task 0 of this job holds the lock, before this
    task touches the directory (its log, its rank files); RunDirBusy after `timeout_s`. When
    another run holds it, task 0 is refused and exits 2, which ends the job step."""
    path = Path(run_dir) / LOCK_NAME
    deadline = time.monotonic() + timeout_s
    while True:
        owner = _read(path)
        if owner is not None and owner.get("slurm_job_id") == job_id:
            return
        if time.monotonic() > deadline:
            held_by = f": it is held by {_describe(owner)}" if owner else ""
            raise RunDirBusy(f"run directory {run_dir}: task 0 of Slurm job {job_id} did not "
                             f"take its lock within {timeout_s:g} s (cluster.timeout_s)"
                             f"{held_by}")
        time.sleep(poll_s)


@contextlib.contextmanager
def held(run_dir: str | Path, *, enabled: bool = True) -> Iterator[None]:
    """The run directory's lock for the duration of the block (a no-op when not enabled)."""
    if not enabled:
        yield
        return
    path = acquire(run_dir)
    try:
        yield
    finally:
        release(path)
