"""One run per run directory: the lock names its owner, stale locks are taken over."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from hpctrain.launch import rundir_lock
from hpctrain.launch.rundir_lock import (
    LOCK_NAME,
    RunDirBusy,
    acquire,
    held,
    release,
    wait_for_owner,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_owner(run_dir, **owner) -> None:
    (run_dir / LOCK_NAME).write_text(json.dumps(owner))


def test_acquire_release_and_refuse_a_live_owner(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from hpctrain.launch.rundir_lock import acquire;"
         f" acquire({str(tmp_path)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy) as err:
            acquire(tmp_path)
        msg = str(err.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in msg
        assert "hydra.run.dir" in msg and LOCK_NAME in msg
    finally:
        holder.kill()
        holder.wait()


def test_lock_of_an_exited_process_is_taken_over(tmp_path, caplog):
    _write_owner(tmp_path, host=socket.gethostname(), pid=_dead_pid(), pid_start="1",
                 slurm_job_id=None, started="then")
    with caplog.at_level(logging.WARNING), held(tmp_path):
        owner = json.loads((tmp_path / LOCK_NAME).read_text())
        assert owner["pid"] == os.getpid()
    assert "has exited" in caplog.text
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


def test_reused_pid_is_not_the_owner(tmp_path):
    # Our own pid but another start time: the recorded owner is gone, the pid was reused.
    _write_owner(tmp_path, host=socket.gethostname(), pid=os.getpid(), pid_start="0",
                 slurm_job_id=None, started="then")
    release(acquire(tmp_path))


@pytest.mark.parametrize("content", ["", "{not json", "[1, 2]"])
def test_unreadable_lock_is_taken_over(tmp_path, content):
    (tmp_path / LOCK_NAME).write_text(content)
    release(acquire(tmp_path))


def test_other_host_without_slurm_is_refused(tmp_path):
    _write_owner(tmp_path, host="elsewhere", pid=1, pid_start="1", slurm_job_id=None,
                 started="then")
    with pytest.raises(RunDirBusy, match="pid 1 on host elsewhere"):
        acquire(tmp_path)


def test_slurm_owner_rules(tmp_path, monkeypatch):
    me = {"host": "n1", "pid": 5, "slurm_job_id": "42"}
    same_job = {"host": "n2", "pid": 9, "slurm_job_id": "42"}
    assert "requeued" in rundir_lock.stale_reason(same_job, me)
    other = {"host": "n2", "pid": 9, "slurm_job_id": "41"}
    monkeypatch.setattr(rundir_lock, "_slurm_job_running", lambda job: False)
    assert "no longer queued" in rundir_lock.stale_reason(other, me)
    monkeypatch.setattr(rundir_lock, "_slurm_job_running", lambda job: True)
    assert rundir_lock.stale_reason(other, me) is None
    monkeypatch.setattr(rundir_lock, "_slurm_job_running", lambda job: None)  # cannot tell
    assert rundir_lock.stale_reason(other, me) is None


def test_release_leaves_a_later_owner_alone(tmp_path):
    path = acquire(tmp_path)
    _write_owner(tmp_path, host="elsewhere", pid=1, pid_start="1", slurm_job_id=None,
                 started="now")
    release(path)
    assert path.exists()


def test_other_slurm_tasks_wait_for_task_0_of_their_job(tmp_path):
    """Tasks 1..N touch the run directory only once task 0 of their job holds its lock; under
    another run's lock they give up after the timeout (task 0, refused, ends the step first)."""
    lock = tmp_path / LOCK_NAME
    lock.write_text(json.dumps({"pid": 1, "host": "n2", "slurm_job_id": "77",
                                "started": "2026-12-02T01:00:00"}))
    with pytest.raises(RunDirBusy, match=r"task 0 of Slurm job 78 did not take its lock within "
                                         r"0.3 s .*held by pid 1 on host n2, Slurm job 77"):
        wait_for_owner(tmp_path, job_id="78", timeout_s=0.3, poll_s=0.05)
    wait_for_owner(tmp_path, job_id="77", timeout_s=0.3)  # its own job's lock: at once
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME]  # nothing written
