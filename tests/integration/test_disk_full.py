"""A disk that fills up or turns read-only under a run: one message naming the path, the free
space and the fix, no traceback; the verified checkpoints stay intact and, once there is
space again, the same command resumes from the newest. The disk is a small tmpfs (root)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpctrain.metrics.logger import read_jsonl
from tests.conftest import ROOT

RUN = ["model=debug", "train=debug", "data.max_bytes=200000", "logger.wandb=disabled",
       "logger.progress=plain", "train.eval_every=0", "train.steps=8",
       "train.checkpoint_every=1", "train.keep=2"]


@pytest.fixture
def disk(tmp_path):
    """A 3 MB tmpfs: two checkpoints of the debug model fit, a third does not."""
    path = tmp_path / "disk"
    path.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(path)],
                           capture_output=True, text=True)
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.strip()}")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def _run(run_dir, *extra):
    cmd = [sys.executable, "-m", "hpctrain", *RUN, *extra, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _remount(disk, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(disk)], check=True)


def test_a_full_disk_stops_with_one_message_then_the_same_command_resumes(disk):
    run_dir = disk / "run"
    code, out = _run(run_dir)  # ranks' failed saves: test_ckpt_async.py (disk-full)
    assert code == 1, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    stop = [ln for ln in out.splitlines() if "ERROR" in ln]
    assert len(stop) == 1 and "saving checkpoint" in stop[0] and "MB free" in stop[0], stop
    assert "No space left on device" in stop[0]
    saved = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert saved == ["step_00000001", "step_00000002"], saved  # verified, intact; no .partial
    _remount(disk, "size=40m")  # space freed
    code, out = _run(run_dir)
    assert code == 0, out[-3000:]
    assert "step_00000002" in out and "resum" in out, out[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, 9))


def test_no_space_at_all_and_a_read_only_disk_are_one_message(disk):
    with open(disk / "filler", "wb") as f:  # fill it to the last byte
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    code, out = _run(disk / "run")
    assert code == 1 and "Traceback" not in out, out[-3000:]
    assert f"cannot write into {disk / 'run'}: No space left on device (0.0 MB free" in out, out
    (disk / "filler").unlink()
    _remount(disk, "ro")
    code, out = _run(disk / "ro")
    assert code == 1 and "Traceback" not in out, out[-3000:]
    assert f"cannot write {disk / 'ro'}: Read-only file system" in out, out
    assert "choose another one (hydra.run.dir=<dir>" in out
