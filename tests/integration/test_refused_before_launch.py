"""Bad inputs through the real entry point: exit code 2, one message, no traceback, no rank.

`.hpctrain/rendezvous` is the first file a launch writes (launch.local), metrics.jsonl the first a
rank writes: neither may exist after a refusal.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

SMALL = ["model=debug", "train=debug", "logger.wandb=disabled"]


def _refused(overrides: list[str], run_dir) -> str:
    cmd = [sys.executable, "-m", "hpctrain", *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "Traceback" not in out and "Error executing job" not in out, out
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / ".hpctrain").exists()
    return out


def test_many_mistakes_one_message(tmp_path):
    out = _refused([*SMALL, "parallel.dp=0", "model.n_heads=0", "+trian.steps=10",
                    "train.resume=nevr", "optim.min_lr=1", "optim.beta1=1.5",
                    "train.grad_clip=-1", "train.eval_samples=0"], tmp_path)
    assert "invalid configuration (8 problem(s))" in out
    for text in ("parallel.dp=0 must be > 0", "model.n_heads=0 must be > 0",
                 "did you mean train.steps?", "did you mean train.resume=never?",
                 "optim.min_lr=1 exceeds optim.lr", "optim.beta1=1.5", "train.grad_clip=-1.0",
                 "train.eval_every=0 to skip eval"):
        assert text in out


def test_zero_procs_per_node(tmp_path):
    out = _refused([*SMALL, "cluster.procs_per_node=0"], tmp_path)
    assert "cluster.procs_per_node=0 must be > 0" in out and "dp=0" not in out


@pytest.mark.parametrize("text,tokens", [("", 0), ("x", 1)], ids=["empty", "tiny"])
def test_data_file_shorter_than_a_batch(text, tokens, tmp_path):
    (tmp_path / "data.txt").write_text(text)
    out = _refused([*SMALL, "data=files", f"data.paths=[{tmp_path / 'data.txt'}]"],
                   tmp_path / "run")
    assert f"train split holds {tokens} tokens" in out
    assert "train.global_batch_size=4 × train.seq_len=64 + 1 = 257" in out


def test_data_too_small_after_prepare(tmp_path):
    out = _refused([*SMALL, "data.max_bytes=100", f"data.cache_dir={tmp_path / 'cache'}"],
                   tmp_path / "run")
    assert "train split holds" in out and "= 257" in out


def test_sweep_point_with_too_little_data_stops_the_sweep(tmp_path):
    """The sweep callback prepares each point's data, then refuses before any job starts."""
    cmd = [sys.executable, "-m", "hpctrain", "-m", *SMALL, "data.max_bytes=100,200000",
           f"data.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out
    assert "1 of 2 sweep point(s) have less data than a batch" in out
    assert "point 0 (" in out and "data.max_bytes=100 " in out
    assert not list((tmp_path / "sweep").glob("*/metrics.jsonl"))
    assert not (tmp_path / "sweep" / "0").exists()
