"""Whole-command faults around the run directory: a second run on a busy directory, a stale
lock, W&B unreachable with a key set, secrets on the command line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hpctrain.launch.rundir_lock import LOCK_NAME
from tests.conftest import ROOT
from tests.harness import die_with_parent

SMALL = ["model=debug", "train=debug", "data.max_bytes=200000", "logger.progress=plain",
         "train.eval_every=0"]


def _cmd(run_dir, *over):
    return [sys.executable, "-m", "hpctrain", *SMALL, *over, f"hydra.run.dir={run_dir}"]


def test_second_run_on_a_busy_directory_is_refused_then_stale_lock_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    first = subprocess.Popen(_cmd(run_dir, "train.steps=100000", "logger.wandb=disabled"),
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             preexec_fn=die_with_parent)  # no orphan if pytest is killed
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / LOCK_NAME).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (run_dir / LOCK_NAME).exists(), "the first run never took the lock"
        second = subprocess.run(_cmd(run_dir, "train.steps=2", "logger.wandb=disabled"),
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        out = second.stdout + second.stderr
        assert second.returncode == 2, out[-2000:]
        assert f"in use by pid {first.pid}" in out and "Traceback" not in out
    finally:
        first.send_signal(signal.SIGKILL)  # dies holding the lock
        first.wait()
    third = subprocess.run(_cmd(run_dir, "train.steps=2", "logger.wandb=disabled",
                                "train.resume=never"),
                           cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = third.stdout + third.stderr
    assert third.returncode == 0, out[-3000:]
    assert f"process {first.pid} has exited" in out
    assert not (run_dir / LOCK_NAME).exists()


def test_wandb_unreachable_with_a_key_and_secrets_never_written(tmp_path):
    run_dir = tmp_path / "run"
    key = "0123456789abcdef" * 2 + "01234567"
    env = {**os.environ, "WANDB_API_KEY": key, "WANDB_BASE_URL": "http://127.0.0.1:9",
           "WANDB_SILENT": "true"}
    t0 = time.monotonic()
    proc = subprocess.run(_cmd(run_dir, "train.steps=3", "logger.wandb=auto",
                               "+cluster.env.HF_TOKEN=hf-very-secret-1"),
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "unreachable: logging offline" in out
    assert time.monotonic() - t0 < 120  # not W&B's 90 s init timeout on top of the run
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    leaked = [p for p in run_dir.rglob("*") if p.is_file()
              and (b"hf-very-secret-1" in p.read_bytes() or key.encode() in p.read_bytes())]
    assert not leaked, leaked
    assert "hf-very-secret-1" not in out and key not in out
    assert "HF_TOKEN=***" in (run_dir / ".hydra" / "overrides.yaml").read_text()
