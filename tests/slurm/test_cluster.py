"""The local Slurm cluster works end to end: nodes up, sbatch + srun across nodes, and submitit
running a gloo all_reduce over 2 nodes x 2 tasks."""

from __future__ import annotations

import subprocess
import sys
import time

import cloudpickle
import pytest

pytestmark = pytest.mark.slurm
JOB_TIMEOUT_S = 120

# submitit pickles with cloudpickle, which pickles functions of importable modules by reference.
# This module is imported by pytest as `test_cluster` from tests/slurm/, which is not on the
# job's sys.path, so ship its functions by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def all_reduce_rank_sum() -> dict:
    """Runs in each Slurm task: all_reduce(rank + 1) over the job's tasks with gloo."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    hosts = subprocess.run(
        ["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    master_addr = hosts.split()[0]
    # All "nodes" share 127.0.0.1: derive the port from the job id so jobs rarely collide.
    master_port = 20000 + int(os.environ["SLURM_JOB_ID"]) % 20000
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        x = torch.tensor([rank + 1.0], dtype=torch.float64)
        dist.all_reduce(x)
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "world": world, "node": os.environ["SLURMD_NODENAME"], "sum": x.item()}


def _wait_job_id(job_id: str, timeout_s: float, job_state) -> str:
    deadline = time.monotonic() + timeout_s
    while (state := job_state(job_id)) in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], timeout=30)
            pytest.fail(f"job {job_id} still {state} after {timeout_s} s; cancelled it")
        time.sleep(0.5)
    return state


def test_cluster_has_two_idle_nodes(slurm_cluster):
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-o", "%N %t %c"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    idle = [line.split() for line in out.splitlines() if line.split()[1] == "idle"]
    assert len(idle) >= 2, out


def test_sbatch_srun_across_two_nodes(slurm_cluster, tmp_path, slurm_job_state):
    out = tmp_path / "job.out"
    submitted = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "-N2",
            "-n4",
            "--time=2",
            f"--output={out}",
            f"--chdir={tmp_path}",
            "--wrap",
            "srun bash -c 'echo $SLURMD_NODENAME $SLURM_PROCID'",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    job_id = submitted.stdout.strip().split(";")[0]
    state = _wait_job_id(job_id, JOB_TIMEOUT_S, slurm_job_state)
    text = out.read_text() if out.exists() else "<no output file>"
    assert state == "COMPLETED", text
    lines = sorted(text.split("\n")[:-1])
    assert [line.split()[1] for line in lines] == ["0", "1", "2", "3"], text
    assert {line.split()[0] for line in lines} == {"n1", "n2"}, text


def test_submitit_gloo_all_reduce_two_nodes(slurm_cluster, tmp_path, wait_job):
    submitit = pytest.importorskip("submitit")
    # A fresh folder per test: job ids restart at 1 with a fresh state dir, and a reused folder
    # would silently hand back a stale result pickle.
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(
        nodes=2, tasks_per_node=2, cpus_per_task=1, timeout_min=3, slurm_partition="debug"
    )
    job = executor.submit(all_reduce_rank_sum)
    wait_job(job, JOB_TIMEOUT_S)
    results = job.results()  # job.result() asserts on multi-task jobs
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["world"] for r in results} == {4}
    assert {r["node"] for r in results} == {"n1", "n2"}
    assert [r["sum"] for r in results] == [10.0] * 4  # 1 + 2 + 3 + 4


def test_cancelled_job_raises_instead_of_hanging(slurm_cluster, tmp_path, wait_job):
    """Without accounting, submitit alone would wait forever for a cancelled job's result:
    wait_job raises. With accounting (start.sh --accounting), submitit sees the CANCELLED state
    and job.results() raises UncompletedJobError (a RuntimeError)."""
    submitit = pytest.importorskip("submitit")
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(nodes=1, tasks_per_node=1, timeout_min=2, slurm_partition="debug")
    job = executor.submit(time.sleep, 300)
    time.sleep(1.0)
    job.cancel()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"ended \(CANCELLED|has not produced any output"):
        wait_job(job, JOB_TIMEOUT_S)
        job.results()
    assert time.monotonic() - t0 < 30
