"""Fixtures for tests that run on the real local Slurm cluster (slurm/local/start.sh).

`slurm_cluster` (session) starts or confirms the cluster; where this machine cannot run one
(not root, no apt-get) it skips the tests, except under CI=true, where it fails them; jobs an
interrupted earlier session left on it are cancelled first.
`wait_job(job, timeout_s)` bounds every wait on a submitit job: without Slurm accounting,
submitit cannot learn that a job died before writing its result and would wait forever.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
START_SH = REPO / "slurm" / "local" / "start.sh"
START_TIMEOUT_S = 300  # includes apt-get install on a bare machine
CANNOT_RUN_HERE = 3  # start.sh's exit status for "this environment cannot run a cluster"
# Set where tests are submitted, sbatch would export them into the job (SLURM_NOTES gotcha 4).
LEAKY_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
FAILED_STATES = (
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "COMPLETED",
)
NO_RESULT_GRACE_S = 5.0


@dataclass(frozen=True)
class SlurmCluster:
    state_dir: Path
    conf: Path
    start_s: float


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


@functools.cache
def _start_cluster(state_dir: Path) -> tuple[int | None, str]:
    """(exit status or None on timeout, stderr) of start.sh, run once per session: pytest
    would otherwise retry a failed session fixture for every test that uses it."""
    env = {**os.environ, "HPCTRAIN_SLURM_DIR": str(state_dir)}
    args = shlex.split(os.environ.get("HPCTRAIN_SLURM_ARGS", ""))
    try:
        proc = subprocess.run(
            ["bash", str(START_SH), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        return None, f"{START_SH} did not finish in {START_TIMEOUT_S} s:\n{e.stderr}"
    return proc.returncode, proc.stderr


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster, started if needed (2 nodes x 4 CPUs, or start.sh arguments from
    HPCTRAIN_SLURM_ARGS, e.g. "--accounting"); Slurm clients pointed at its config."""
    state_dir = Path(os.environ.get("HPCTRAIN_SLURM_DIR", "/var/tmp/hpctrain-slurm"))
    t0 = time.monotonic()
    returncode, stderr = _start_cluster(state_dir)
    if returncode == CANNOT_RUN_HERE:
        last_line = (stderr.strip().splitlines() or ["start.sh exited 3"])[-1]
        reason = f"local Slurm cluster unavailable: {last_line}"
        if _in_ci():
            pytest.fail(f"{reason} (CI=true: failing instead of skipping)")
        pytest.skip(reason)
    if returncode != 0:
        pytest.fail(f"{START_SH} failed (exit {returncode}):\n{stderr}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(state_dir / "slurm.conf"))
        for name in LEAKY_VARS:
            mp.delenv(name, raising=False)
        _cancel_left_test_jobs()
        yield SlurmCluster(state_dir, state_dir / "slurm.conf", time.monotonic() - t0)


def _cancel_left_test_jobs(timeout_s: float = 90) -> None:
    """Cancel the jobs an interrupted earlier session left (their batch scripts lie under
    pytest's temporary folders) and wait until every node is idle: a test that counts idle
    nodes or CPUs must not find a stranger's job there."""
    queue = subprocess.run(["squeue", "-h", "-o", "%i %o"], capture_output=True, text=True,
                           timeout=30).stdout
    left = [line.split()[0] for line in queue.splitlines() if "/pytest-of-" in line]
    if not left:
        return
    subprocess.run(["scancel", "--full", *left], capture_output=True, timeout=30)
    deadline = time.monotonic() + timeout_s
    while True:
        states = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True,
                                text=True, timeout=30).stdout.split()
        if states and all(s == "idle" for s in states):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"cancelled jobs {left} left by an earlier session; nodes still "
                        f"{states} after {timeout_s} s")
        time.sleep(0.5)


def slurm_job_state(job_id: str) -> str | None:
    """JobState from slurmctld (works without accounting, for MinJobAge after the end)."""
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30
    ).stdout
    states = re.findall(r"\bJobState=(\S+)", out)
    return states[0] if states else None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<unreadable: {e}>"


def describe_job_logs(job) -> str:
    tasks = [job.task(i) for i in range(job.num_tasks)]
    parts = []
    for task in tasks:
        for path in (task.paths.stdout, task.paths.stderr):
            parts.append(f"--- {path}\n{_tail(path)}")
    return "\n".join(parts)


def wait_job(job, timeout_s: float, *, poll_s: float = 0.5):
    """Wait until every task of a submitit `job` has written its result, at most `timeout_s`.

    Returns the job (call `job.results()` next). If slurmctld reports the job ended but a result
    is still missing after a grace period (killed, cancelled), or the deadline passes, the job is
    cancelled and the error names each task's stdout/stderr log with its tail.
    """
    deadline = time.monotonic() + timeout_s
    ended_at = None
    while not job.done():
        now = time.monotonic()
        state = slurm_job_state(str(job.job_id))
        if state is not None and state.startswith(FAILED_STATES):
            ended_at = ended_at or now
            if now - ended_at > NO_RESULT_GRACE_S:
                raise RuntimeError(
                    f"Slurm job {job.job_id} ended ({state}) without a result for "
                    f"every task:\n{describe_job_logs(job)}"
                )
        if now > deadline:
            job.cancel(check=False)
            raise TimeoutError(
                f"Slurm job {job.job_id} not done after {timeout_s} s (state "
                f"{state}); cancelled it:\n{describe_job_logs(job)}"
            )
        time.sleep(poll_s)
    return job


@pytest.fixture(name="wait_job")
def _wait_job_fixture():
    """`wait_job(job, timeout_s)` for test modules (conftest itself is not importable)."""
    return wait_job


@pytest.fixture(name="slurm_job_state")
def _slurm_job_state_fixture():
    return slurm_job_state
