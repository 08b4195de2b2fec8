"""hpctrain on the real local Slurm cluster, through the CLI (`python -m hpctrain -m
cluster=slurm_local ...`, Hydra's submitit launcher): layouts across nodes match cluster=local,
a preempted job requeues and resumes bit-identically, sweeps end with a summary table."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, make_config

pytestmark = pytest.mark.slurm
SMALL = ["model=debug", "train=debug", "logger.wandb=disabled", "data.max_bytes=200000",
         "train.eval_every=0", "logger.progress=plain"]
CLI_TIMEOUT_S = 240


def _hpctrain(args: list[str], *, timeout_s: float = CLI_TIMEOUT_S, meanwhile=None):
    """The CLI's completed process; `meanwhile()` runs here while it waits on the cluster
    (a local reference: it then costs no wall time of its own). Returns (process, its value)
    when given."""
    env = {**os.environ, "WANDB_SILENT": "true", "HYDRA_FULL_ERROR": "1"}
    argv = [sys.executable, "-m", "hpctrain", "-m", *args]
    if meanwhile is None:
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    with subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        try:
            value = meanwhile()
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:
            proc.kill()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), value


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines) if "loss" in r]


def _local_reference(overrides: list[str], run_dir: Path) -> list[tuple[int, float]]:
    from hpctrain.data.prepare import prepare
    from hpctrain.launch.local import launch_local
    from hpctrain.tasks import TASKS

    cfg = make_config(overrides, run_dir=run_dir)
    prepare(cfg.data)
    launch_local(cfg, TASKS["train"].run)
    return _losses(run_dir)


_DP4 = ["cluster.procs_per_node=4", "parallel=dp2", "parallel.dp=4", "train.global_batch_size=8",
        *SMALL]  # debug steps: 10
_dp4_losses: list[list[tuple[int, float]]] = []


def _dp4_local_reference(tmp_path_factory) -> list[tuple[int, float]]:
    """The never-resharded dp=4 run on this machine (cluster=local, 4 ranks), run once per
    session: the two-node run must match it and the re-laid-out resume must continue it."""
    if not _dp4_losses:
        _dp4_losses.append(_local_reference(_DP4, tmp_path_factory.mktemp("dp4_local")))
    return _dp4_losses[0]


@pytest.fixture(scope="module")
def dp4_two_nodes(slurm_cluster, tmp_path_factory) -> tuple[Path, Any, float]:
    """dp=4 on 2 nodes × 2 tasks (10 steps, checkpoints at 5 and 10), run once: the sweep dir,
    the CLI's result and its seconds. One test compares it with cluster=local, another resumes
    its step-5 checkpoint at another layout."""
    sweep = tmp_path_factory.mktemp("dp4_slurm") / "sw"
    t0 = time.monotonic()
    proc, _ = _hpctrain(["cluster=slurm_local", *_DP4[1:], "train.checkpoint_every=5",
                         f"hydra.sweep.dir={sweep}"],
                        meanwhile=lambda: _dp4_local_reference(tmp_path_factory))
    return sweep, proc, time.monotonic() - t0


def test_dp4_two_nodes_matches_local(dp4_two_nodes, tmp_path_factory):
    sweep, proc, slurm_s = dp4_two_nodes
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = sweep / "0"
    got = _losses(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["completed_steps"] == 10
    log = next((sweep / ".submitit").glob("*/*_0_log.out")).parent
    assert "rank 3/4" in "".join(p.read_text() for p in log.glob("*_log.*"))
    ref = _dp4_local_reference(tmp_path_factory)
    assert got == ref and len(got) == 10, f"slurm {got}\nlocal {ref} (slurm run {slurm_s:.0f} s)"


def test_mission_command_3d_on_two_nodes(slurm_cluster, tmp_path):
    """`python -m hpctrain -m parallel=3d cluster=slurm`: 8 ranks on 2 nodes (debug-sized)."""
    args = ["parallel=3d", "cluster=slurm", *SMALL, "train.global_batch_size=8",
            "train.steps=4", f"hydra.sweep.dir={tmp_path / 'sw'}"]
    proc = _hpctrain(args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "sw" / "0" / "summary.json").read_text())
    assert summary["world_size"] == 8 and summary["completed_steps"] == 4
    assert "| 0 | ok |" in (tmp_path / "sw" / "sweep_summary.md").read_text()


def _wait_for(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not seen after {timeout_s} s")
        time.sleep(0.2)
    return value


def _restarts(job_id: str) -> int:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                         text=True, timeout=30).stdout
    m = re.search(r"\bRestarts=(\d+)", out)
    return int(m.group(1)) if m else -1


def test_preempted_job_requeues_and_resumes_bit_identically(slurm_cluster, tmp_path, wait_job):
    submitit = pytest.importorskip("submitit")
    train = ["parallel=dp2", *SMALL, "train.steps=150", "logger.wandb=offline",
             "train.checkpoint_every=50"]
    sweep = tmp_path / "sw"
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", "-m", "cluster=slurm_local", *train,
         f"hydra.sweep.dir={sweep}"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, env={**os.environ, "WANDB_SILENT": "true"})
    try:
        run_dir = sweep / "0"
        metrics = run_dir / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 20,
                  120, "20 steps in metrics.jsonl")
        wandb_id = (run_dir / "wandb_id.txt").read_text().strip()
        job_dir = _wait_for(lambda: next((sweep / ".submitit").glob("*/*_0_log.out"), None),
                            30, "the job's log").parent  # "<id>" or "<array id>_0"
        job = submitit.SlurmJob(folder=sweep / ".submitit" / "%j", job_id=job_dir.name,
                                tasks=(0, 1))
        job._interrupt()  # SIGTERM + USR2, as a preemption
        # The uninterrupted run on this machine, while Slurm holds the requeued job back
        # (cred_expire, ~15-20 s idle): the comparison costs no wall time of its own.
        ref_train = [o.replace("logger.wandb=offline", "logger.wandb=disabled") for o in train]
        ref = _local_reference(["cluster.procs_per_node=2", *ref_train], tmp_path / "local")
        _wait_for(lambda: _restarts(job.job_id) >= 1, 60, "the requeue")
        wait_job(job, 180)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-4000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
    logs = "".join(p.read_text() for p in job_dir.glob("*_log.*"))
    assert "stop requested by Slurm: checkpointing at step" in logs
    assert re.search(r"resumed from .*step_\d{8} at step (\d+)", logs), logs[-3000:]
    got = _losses(run_dir)
    assert (run_dir / "wandb_id.txt").read_text().strip() == wandb_id
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(p.name.endswith(wandb_id) for p in runs), runs
    assert [s for s, _ in got] == list(range(1, 151))
    assert got == ref  # bit-identical (CPU fp32)


def test_resume_at_another_layout_continues(dp4_two_nodes, tmp_path, tmp_path_factory):
    """The dp=4 run's step-5 checkpoint (2 nodes × 2 tasks) resumed at dp=2 zero=1 on one
    node: the loss continues as the never-resharded run does (fp32 tolerance)."""
    sweep, first, _ = dp4_two_nodes
    assert first.returncode == 0, first.stderr[-4000:]
    saved = sweep / "0" / "checkpoints" / "step_00000005"
    second = _hpctrain(["cluster=slurm_local", "parallel=dp2", "parallel.zero=1",
                        "train.global_batch_size=8", *SMALL, f"train.resume={saved}",
                        f"hydra.sweep.dir={tmp_path / 'sw'}"])
    assert second.returncode == 0, second.stderr[-4000:]
    logs = "".join(p.read_text() for p in (tmp_path / "sw" / ".submitit").glob("*/*_log.*"))
    assert re.search(r"resumed from .*step_00000005 at step 5", logs), logs[-3000:]
    got = _losses(tmp_path / "sw" / "0")
    ref = _dp4_local_reference(tmp_path_factory)
    assert [s for s, _ in got] == list(range(6, 11))
    for (step, a), (_, b) in zip(got, ref[5:], strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)


def _job_field(job_id: str, name: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True,
                         text=True, timeout=30).stdout
    m = re.search(rf"\b{name}=(\S+)", out)
    return m.group(1) if m else ""


def _seconds(hms: str) -> int:  # Slurm's [D-]HH:MM:SS
    days, _, hms = hms.rpartition("-")
    h, m, sec = (int(x) for x in hms.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + sec


def _limit_reached_early(sweep: Path, time_min: int) -> None:
    """Once the run trains (its handlers are in), lower the running job's time limit so that
    slurmctld's next 30 s check sends the --signal; once it is received, give the limit back
    (the requeued slot must not be signalled before its handlers are in)."""
    log = _wait_for(lambda: next((sweep / ".submitit").glob("*/*_0_log.err"), None), 120,
                    "the job's log")
    job_id = log.parent.name
    try:
        _wait_for(lambda: "training steps 1.." in log.read_text(), 120, "training")
        assert _job_field(job_id, "TimeLimit") == f"00:{time_min:02d}:00"  # --time rendered
        # USR2 comes at the first check with limit - 60 s <= run time + 30 s; with 1 minute
        # that is the next one if the run has had 15 s or less, else 2 minutes and <= 60 s in
        limit = 1 if _seconds(_job_field(job_id, "RunTime")) <= 15 else 2
        subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={limit}"],
                       check=True, timeout=30)
        _wait_for(lambda: "received SIGUSR2" in log.read_text(), 90, "the time-limit signal")
        restore = ["scontrol", "update", f"JobId={job_id}", f"TimeLimit={time_min}"]
        _wait_for(lambda: subprocess.run(restore, capture_output=True, timeout=30).returncode
                  == 0, 10, "the restored limit")  # refused while the job is completing
    except BaseException:
        subprocess.run(["scancel", job_id], timeout=30, check=False)
        raise


@pytest.mark.slow
def test_real_time_limit_requeues_and_finishes(slurm_cluster, tmp_path):
    """Slurm's own time-limit signal (--signal=USR2@60 from cluster.signal_delay_s, sent by
    slurmctld's time-limit check): the run checkpoints on it, is requeued and finishes from
    there.

    slurmctld checks limits every 30 s and signals at the first check within signal_delay_s +
    30 s of the limit; with the submitted 3 minutes that would be 90-120 s in. Once training
    (handlers installed ~5 s in, ~15 s on a loaded host) the test lowers the job's limit with
    scontrol (the signal then comes within 30 s, 45 s if training started late) and restores
    it when the signal is seen, so the requeued slot is not signalled again."""
    # One rank (the dp=2 stop agreement is the preemption test's): ~55 s of debug-model steps
    # at ~33/s, against at most 30-45 s before the signal; a checkpoint at the signal only.
    steps, time_min = 1800, 3
    train = ["parallel=single", "cluster.procs_per_node=1", *SMALL, f"train.steps={steps}",
             "train.log_every=500", "train.checkpoint_every=0", f"cluster.time_min={time_min}",
             "cluster.signal_delay_s=60"]
    sweep = tmp_path / "sw"
    proc, _ = _hpctrain(["cluster=slurm_local", *train, f"hydra.sweep.dir={sweep}"],
                        timeout_s=600, meanwhile=lambda: _limit_reached_early(sweep, time_min))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    logs = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.*"))
    assert "received SIGUSR2" in logs and "Job has timed out" in logs, logs[-3000:]
    stopped = re.search(r"checkpointing at step (\d+)", logs)
    resumed = re.search(r"resumed from .*step_\d{8} at step (\d+)", logs)
    assert stopped and resumed and stopped.group(1) == resumed.group(1), logs[-3000:]
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["completed_steps"] == steps


def test_sweep_summary_with_a_failing_point(slurm_cluster, tmp_path):
    """Three points: two train, the third passes validation and fails while training (its loss
    blows up to NaN at step 2 and the NaN guard stops it; a bad path would stop the sweep
    before launch). The summary lists all three."""
    proc = _hpctrain(["cluster=slurm_local", "parallel=dp2", *SMALL, "train.grad_clip=0",
                      "optim.warmup_steps=0", "optim.lr=1e-3,3e-3,1e4",
                      f"hydra.sweep.dir={tmp_path}"])
    assert proc.returncode != 0
    rows = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [r["status"] for r in rows] == ["ok", "ok", "failed"], rows
    assert [r["overrides"][-1] for r in rows] == ["optim.lr=0.001", "optim.lr=0.003",
                                                  "optim.lr=10000.0"]
    assert all(isinstance(r["final_loss"], float) for r in rows[:2])
    assert rows[2]["error"] and "non-finite" in (tmp_path / "2" / "error.txt").read_text()
    assert any(p.endswith("_2_0_log.err") for p in rows[2]["logs"]), rows[2]["logs"]
    table = (tmp_path / "sweep_summary.md").read_text()
    assert "| 1 | ok | optim.lr=0.003 |" in table and "| 0 | ok |" in table
    assert "point 2 failed" in table
    assert "sweep summary" in proc.stderr + proc.stdout
    from hpctrain.config.parse import sweep_group

    cfg = json.loads((tmp_path / "0" / "summary.json").read_text())
    assert cfg["run_dir"] == str(tmp_path / "0")
    assert sweep_group(tmp_path) == f"{tmp_path.parent.name}_{tmp_path.name}"


def test_parallel_auto_on_the_local_cluster(slurm_cluster, tmp_path):
    """`parallel=auto cluster=slurm_local`: every Slurm task chooses the same layout, task 0
    writes plan.json, and it trains to the single process's losses. The job's size comes from
    cluster.nodes × procs_per_node (there are no degrees yet to derive it from)."""
    small = [*SMALL, "train.steps=4"]
    proc, ref = _hpctrain(["cluster=slurm_local", "cluster.nodes=2", "parallel=auto", *small,
                           f"hydra.sweep.dir={tmp_path / 'sw'}"],
                          meanwhile=lambda: _local_reference(small, tmp_path / "single"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "sw" / "0"
    plan = json.loads((run_dir / "plan.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["completed_steps"] == 4
    assert summary["layout"] == f"{plan['chosen']['layout']} {plan['chosen']['recompute']}"
    got = _losses(run_dir)
    assert [s for s, _ in got] == [s for s, _ in ref] == [1, 2, 3, 4]
    assert [v for _, v in got] == pytest.approx([v for _, v in ref], rel=1e-5)
