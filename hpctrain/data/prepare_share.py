"""Waiting on the other tasks of a shared prepare (`prepare(..., share=(task, tasks))`: the
tasks of one Slurm job tokenise disjoint units; task 0 trains a bpe tokenizer first, waits for
every unit and assembles). A wait stops with the fix when nothing has moved for its timeout:
a task died, and running again resumes from the finished shards."""

from __future__ import annotations

import fcntl
import time
from pathlib import Path


def task0_alive(out: Path):
    """A progress value for waiting on task 0: it changes while task 0 holds the build lock
    (it is working), and stands still once no process holds it."""
    lock = out.with_name(f"{out.name}.lock")

    def progress():
        try:
            with open(lock, "a") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(f, fcntl.LOCK_UN)
        except BlockingIOError:
            return time.monotonic()  # held: task 0 works
        return None
    return progress


def await_progress(done, timeout_s: float, *, what: str, progress) -> None:
    """Poll `done()` until true; ValueError when `progress()` (a value that changes while
    others work) stays the same for `timeout_s`."""
    seen, since = progress(), time.monotonic()
    while not done():
        if progress() != seen:
            seen, since = progress(), time.monotonic()
        elif time.monotonic() - since > timeout_s:
            raise ValueError(f"prepare: waited {timeout_s:.0f} s without progress for {what} "
                             "(did a task of this job die?): run task=prepare again; the "
                             "finished shards are kept and only the rest is tokenised")
        time.sleep(0.5)
