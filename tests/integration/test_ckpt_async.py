"""Background checkpoint saves on a real dp=2 ZeRO-1 `python -m hpctrain` run, faults injected
from outside (tests/faults/ckpt/sitecustomize.py): training runs on while a save is written;
a rank killed or a disk full during the background write leaves the previous checkpoint intact
and the resume equals the uninterrupted run; SIGTERM during a background write waits for it
and seals it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctrain.checkpoint import manifest
from hpctrain.metrics.logger import read_jsonl
from tests.conftest import ROOT
from tests.harness import die_with_parent

FAULTS = ROOT / "tests" / "faults" / "ckpt"
RUN = ["model=debug", "train=debug", "parallel=dp2", "parallel.zero=1",
       "cluster.procs_per_node=2", "data.max_bytes=200000", "logger.wandb=disabled",
       "logger.progress=plain", "train.eval_every=0", "train.log_every=1",
       "train.checkpoint_every=2", "train.steps=8", "cluster.timeout_s=60"]


def _start(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)]),
           "OMP_NUM_THREADS": "1", "WANDB_SILENT": "true"}
    env.pop("HPCTRAIN_TEST_CKPT_FAULT", None)
    if fault:
        env["HPCTRAIN_TEST_CKPT_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "hpctrain", *RUN, *extra,
                             f"hydra.run.dir={run_dir}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=die_with_parent)


def _run(run_dir: Path, *extra: str, fault: str | None = None) -> tuple[int, str]:
    proc = _start(run_dir, *extra, fault=fault)
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")}


def _verified(run_dir: Path) -> list[str]:
    out = []
    for path in sorted((run_dir / "checkpoints").iterdir()):
        try:
            manifest.verify(path)
            out.append(path.name)
        except manifest.Unverified:
            pass
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> Path:
    """The uninterrupted run, saving synchronously (what every async run must equal)."""
    run_dir = tmp_path_factory.mktemp("async") / "full"
    code, out = _run(run_dir, "train.checkpoint_async=false")
    assert code == 0, out[-3000:]
    return run_dir


def test_training_runs_while_a_save_is_written(full, tmp_path):
    code, out = _run(tmp_path / "slow", "train.keep=0", fault="slow:2:1:1.5")
    assert code == 0, out[-3000:]
    records = read_jsonl(tmp_path / "slow" / "metrics.jsonl")
    save = next(r for r in records if r.get("ckpt_saved_step") == 2)
    during = [r["step"] for r in records
              if save["ckpt_started_at"] < r["time"] < save["ckpt_sealed_at"] and r["step"] > 2]
    assert during, (save, [(r["step"], r["time"]) for r in records])
    assert save["ckpt_background_s"] >= 1.5
    blocked = next(r["ckpt_block_s"] for r in records if r["step"] == 2)
    assert blocked < 0.5 * save["ckpt_background_s"]
    assert _losses(tmp_path / "slow") == _losses(full)
    # what was written is step 2's state, not the buffers training changed meanwhile
    resumed = tmp_path / "resumed"
    code, out = _run(resumed, f"train.resume={tmp_path / 'slow/checkpoints/step_00000002'}")
    assert code == 0, out[-3000:]
    assert _losses(resumed) == {s: v for s, v in _losses(full).items() if s > 2}


@pytest.mark.parametrize("fault", ["kill:4:1", "enospc:4:1"], ids=["killed", "disk-full"])
def test_a_failed_background_write_keeps_the_previous_checkpoint(full, tmp_path, fault):
    run_dir = tmp_path / "run"
    code, out = _run(run_dir, fault=fault)
    assert code != 0, out[-3000:]
    assert _verified(run_dir) == ["step_00000002"], sorted((run_dir / "checkpoints").iterdir())
    if fault.startswith("enospc"):
        assert "saving checkpoint" in out and "No space left on device" in out, out[-3000:]
        assert "the checkpoints before it are intact" in out and "Traceback" not in out
        assert not (run_dir / "checkpoints" / "step_00000004.partial").exists()
        return  # resuming is the same as after the kill
    code, out = _run(run_dir)  # the fault is gone: resume
    assert code == 0, out[-3000:]
    assert _losses(run_dir) == _losses(full)


def test_sigterm_during_a_background_write_seals_it(tmp_path):
    proc = _start(tmp_path, "train.steps=100000", fault="slow:4:1:4")
    partial = tmp_path / "checkpoints" / "step_00000004.partial"
    deadline = time.monotonic() + 60
    while not partial.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    saved = _verified(tmp_path)
    assert "step_00000004" in saved and not partial.exists(), saved
    assert int(saved[-1][5:]) >= 4


def test_disk_full_on_a_real_tmpfs(tmp_path):
    """A 2 MiB tmpfs holds one checkpoint of this model (1.2 MB) but not a second beside it."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                                            str(mount)], capture_output=True).returncode:
        pytest.skip("needs root and tmpfs to make a small disk")
    try:
        code, out = _run(mount / "run", "train.checkpoint_async=false")
        assert code != 0, out[-3000:]
        assert "No space left on device" in out and "MB free" in out, out[-3000:]
        assert "Traceback" not in out, out[-3000:]
        assert _verified(mount / "run") == ["step_00000002"]
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
