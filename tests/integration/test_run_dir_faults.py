"""Whole-command faults around the run directory: a second run on a busy directory, a stale
lock, W&B unreachable with a key set, secrets on the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

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
        while not (run_dir / ".hydra" / "config.yaml").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        record = {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()}
        assert set(record) == {"config.yaml", "overrides.yaml", "hydra.yaml"}, record
        second = subprocess.run(_cmd(run_dir, "train.steps=2", "logger.wandb=disabled"),
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        out = second.stdout + second.stderr
        assert second.returncode == 2, out[-2000:]
        assert f"in use by pid {first.pid}" in out and "Traceback" not in out
        # the refused run wrote nothing: the live run's record and log are its own
        assert {p.name: p.read_bytes() for p in (run_dir / ".hydra").iterdir()} == record
        assert b"steps: 100000" in record["config.yaml"]
        assert "in use by" not in (run_dir / "hpctrain.log").read_text()
        assert not (run_dir / "error.txt").exists()
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
    secrets = {"WANDB_API_KEY": key, "DB_PASSWD": "db-very-secret-2",
               "HF_AUTH": "hf-auth-secret-3", "TEAM_LABEL": "team-label-secret-4",
               "GITHUB_PAT": "ghp-pat-secret-5"}  # issue 45: PAT and a URL's password leaked
    env = {**os.environ, **secrets, "WANDB_BASE_URL": "http://127.0.0.1:9",
           "WANDB_SILENT": "true", "SSH_AUTH_SOCK": str(run_dir), "PWD": str(ROOT)}
    t0 = time.monotonic()
    proc = subprocess.run(_cmd(run_dir, "train.steps=3", "logger.wandb=auto",
                               "+cluster.env.HF_TOKEN=hf-very-secret-1",
                               "+cluster.env.DATABASE_URL=postgres://u:pw@dbhost/db",
                               "logger.redact=[TEAM_LABEL]",  # by the user's own list
                               "logger.run_name=team-label-secret-4_db-very-secret-2"),
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "unreachable: logging offline" in out
    assert time.monotonic() - t0 < 120  # not W&B's 90 s init timeout on top of the run
    assert list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    values = ["hf-very-secret-1", "u:pw@dbhost", *secrets.values()]
    leaked = [(p, v) for p in run_dir.rglob("*") if p.is_file()
              for v in values if v.encode() in p.read_bytes()]
    assert not leaked, leaked
    assert not [v for v in values if v in out]
    hydra = (run_dir / ".hydra")
    assert "HF_TOKEN=***" in (hydra / "overrides.yaml").read_text()
    assert "logger.run_name=***_***" in (hydra / "overrides.yaml").read_text()
    # paths are never masked, though SSH_AUTH_SOCK and PWD name them
    assert str(run_dir) in (hydra / "hydra.yaml").read_text()
    assert str(ROOT) in (hydra / "hydra.yaml").read_text()
    assert str(run_dir) in (run_dir / "summary.json").read_text()


@pytest.mark.parametrize("link", ["dangling", "looping"])
def test_a_broken_symlink_as_run_directory_is_one_message(tmp_path, link):
    """Issue 45: a dangling or looping symlink as hydra.run.dir was a 29-line traceback."""
    run_dir = tmp_path / "run"
    run_dir.symlink_to(tmp_path / "nowhere" if link == "dangling" else run_dir)
    proc = subprocess.run(_cmd(run_dir, "train.steps=1", "logger.wandb=disabled"), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(err) == 1, proc.stderr[-2000:]
    want = "does not exist" if link == "dangling" else "loops back to itself"
    assert f"cannot use {run_dir} as a directory: a symbolic link" in err[0] and want in err[0]


def test_a_file_where_the_checkpoints_go_is_named_with_the_fix_that_applies(tmp_path):
    """Issue 45: a checkpoint path blocked by a plain file stopped the run asking for free space
    or permissions; the file in the way is named instead."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("not a directory")
    proc = subprocess.run(_cmd(run_dir, "train.steps=2", "train.checkpoint_every=1",
                               "logger.wandb=disabled"), cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert f"{run_dir / 'checkpoints'} is a file where a directory must be" in proc.stderr
    assert "free space" not in proc.stderr.lower()


def test_a_run_refused_after_taking_the_directory_leaves_its_record_alone(tmp_path):
    """Issue 45: a seed change against the finished run's checkpoint was refused, but only
    after rewriting that run's .hydra/ record with its own overrides."""
    run_dir = tmp_path / "run"
    first = subprocess.run(_cmd(run_dir, "train.steps=2", "logger.wandb=disabled"), cwd=ROOT,
                           capture_output=True, text=True, timeout=180)
    assert first.returncode == 0, first.stderr[-2000:]
    record = {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()}
    refused = subprocess.run(_cmd(run_dir, "train.steps=3", "train.seed=5",
                                  "logger.wandb=disabled"), cwd=ROOT, capture_output=True,
                             text=True, timeout=180)
    assert refused.returncode == 2 and "would not continue the same run" in refused.stderr
    assert {p.name: p.read_text() for p in (run_dir / ".hydra").iterdir()} == record


def test_a_resume_from_an_earlier_checkpoint_starts_a_line_that_auto_follows(tmp_path):
    """Issue 45: after train.resume=<earlier step>, the next resume=auto took the abandoned
    line's newest checkpoint and pruning deleted the new line's. The abandoned checkpoints now
    move aside (kept), so the new line is what auto resumes and pruning keeps."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"

    def run(*over):
        proc = subprocess.run(_cmd(run_dir, "logger.wandb=disabled", "train.checkpoint_every=1",
                                   *over), cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    run("train.steps=4", "train.keep=2")
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003", "step_00000004"]
    log = run("train.steps=5", "train.keep=2", f"train.resume={ckpts / 'step_00000003'}")
    assert "moved to" in log
    (aside,) = ckpts.glob("abandoned_after_00000003_*")
    assert [p.name for p in aside.iterdir()] == ["step_00000004"]  # kept, out of the way
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000004", "step_00000005"]
    new_line = json.loads((ckpts / "step_00000005" / "train_state.json").read_text())
    log = run("train.steps=6", "train.keep=2")  # resume=auto: the new line's newest
    assert f"resumed from {ckpts / 'step_00000005'}" in log
    assert new_line["step"] == 5
