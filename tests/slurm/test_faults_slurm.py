"""Faults on the real local Slurm cluster, with no person in the loop (hpctrain.launch.requeue,
hpctrain.launch.elastic): a node taken down and a rank stopped mid-run requeue the job without
that node, it continues on the remaining node at a new layout with the uninterrupted run's
losses, and cluster.max_restarts ends it with one message listing every restart.

The run: dp=4 on 2 nodes × 2 tasks, cluster.elastic (the job asks for --nodes=1-2); after
the fault, dp=2 with twice the gradient accumulation on n1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.slurm.test_train_slurm import SMALL, _local_reference, _losses, _wait_for

pytestmark = pytest.mark.slurm

# 8 micro-batches a rank a step (~0.2 s): the fault lands mid-run, and 30 steps after the
# restart keep the reduction-order drift of dp 4 -> 2 (fp32) within 1e-5 (over 300 steps it
# grows to ~1e-4 by chaos alone, the same for a dp=2 run from step 0).
RUN = ["parallel=dp2", "parallel.dp=4", "train.global_batch_size=64", "train.steps=60",
       "train.checkpoint_every=10", *SMALL]
FAULTS = ["cluster=slurm_local", "cluster.elastic=true", "cluster.timeout_s=20"]


def _start(sweep: Path, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "-m", *FAULTS, *RUN, *extra,
         f"hydra.sweep.dir={sweep}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)


def _steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _beat(run_dir: Path, rank: int) -> dict:
    return json.loads((run_dir / ".hpctrain" / "heartbeat" / f"rank_{rank}.json").read_text())


def _beating(run_dir: Path, rank: int) -> dict:
    """The rank's heartbeat, {} while it has none (a new start has not written it yet)."""
    try:
        return _beat(run_dir, rank)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _job_nodes(job_id: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                         text=True, timeout=30).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith("NodeList=")), "")


def _finish(proc: subprocess.Popen, timeout_s: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    return out


def _logs(sweep: Path) -> str:
    return "".join(p.read_text(errors="replace")
                   for p in sorted((sweep / ".submitit").glob("*/*_log.*")))


def test_a_node_down_requeues_without_it_and_continues_exactly(slurm_cluster, tmp_path):
    sweep, run_dir = tmp_path / "sw", tmp_path / "sw" / "0"
    proc = _start(sweep, ["logger.wandb=offline"])
    try:
        _wait_for(lambda: _steps_logged(run_dir) >= 30, 150, "30 steps on two nodes")
        job_id = next(p.name for p in (sweep / ".submitit").iterdir() if p.is_dir())
        assert _beat(run_dir, 2)["host"] == "n2"
        subprocess.run(["scontrol", "update", "nodename=n2", "state=down",
                        "reason=hpctrain-test"], check=True, timeout=30)
        # The uninterrupted run on this machine while Slurm requeues (costs no wall time).
        ref_run = [o.replace("logger.wandb=offline", "logger.wandb=disabled") for o in RUN]
        ref = _local_reference(["cluster.procs_per_node=4", *ref_run], tmp_path / "local")
        _wait_for(lambda: (run_dir / "restarts.jsonl").exists(), 120, "the restart record")
        nodes_after = _job_nodes(job_id)
        out = _finish(proc, 240)
    finally:
        subprocess.run(["scontrol", "update", "nodename=n2", "state=resume"], timeout=30,
                       capture_output=True)  # back at once (refused when already back)
    assert proc.returncode == 0, out[-4000:]
    record, = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert record["cause"] == "node down" and record["nodes"] == ["n2"], record
    assert (record["world_before"], record["world_after"]) == (4, 2)
    assert record["layout_before"].endswith("accum8") and record["layout_after"].startswith("dp2 ")
    assert record["layout_after"].endswith("accum16")  # the same global batch
    assert nodes_after == "n1"  # the node set DOWN is not in the requeued job
    got = dict(_losses(run_dir))
    assert sorted(got) == list(range(1, 61))
    for step, loss in ref:  # dp2 × 2 accumulated micro-batches after the restart: fp32
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-6), step
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    wandb_id = (run_dir / "wandb_id.txt").read_text().strip()
    assert len(runs) == 2 and all(p.name.endswith(wandb_id) for p in runs), runs  # one run


def test_a_stopped_rank_is_excluded_and_max_restarts_ends_the_job(slurm_cluster, tmp_path):
    """SIGSTOP on a rank of n2: named, n2 excluded, the job continues on n1; a second stopped
    rank (on n1) finds cluster.max_restarts=1 used up: one message lists the restart and
    this fault, and the job ends."""
    sweep, run_dir = tmp_path / "sw", tmp_path / "sw" / "0"
    proc = _start(sweep, ["cluster.max_restarts=1", "logger.wandb=disabled"])
    _wait_for(lambda: _steps_logged(run_dir) >= 30 and _beating(run_dir, 3), 150,
              "30 steps on two nodes")
    first = _beat(run_dir, 3)
    assert first["host"] == "n2"
    os.kill(first["pid"], signal.SIGSTOP)
    _wait_for(lambda: (run_dir / "restarts.jsonl").exists(), 150, "the restart")
    _wait_for(lambda: _beating(run_dir, 1).get("pid", first["pid"]) != first["pid"] and
              (_beating(run_dir, 1).get("step") or 0) > 0, 60, "training on n1")
    os.kill(_beat(run_dir, 1)["pid"], signal.SIGSTOP)
    out = _finish(proc, 120)  # submitit gets the reason as each task's error: no wait
    assert proc.returncode != 0
    assert "cluster.max_restarts=1 reached" in out, out[-3000:]
    record, = [json.loads(line) for line in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert record["cause"] == "rank hung or lost" and record["nodes"] == ["n2"], record
    assert record["world_after"] == 2
    logs = _logs(sweep)
    assert "rank 3 (host n2) stopped responding" in logs, logs[-3000:]
    assert "cluster.max_restarts=1 reached: the job ends" in logs, logs[-3000:]
    assert "1. " in logs and "excluded n2, resumed at step" in logs
    assert "2. " in logs and "rank hung or lost; excluded n1" in logs
