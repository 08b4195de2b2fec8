"""Trainer with parallel.pp=2: same loss trajectory as pp=1 (fp32), measured bubble logged,
timeline written. Runs the real entry point (`python -m hpctrain`) with the local launcher."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

COMMON = ["model=debug", "train=debug", "train.steps=3", "train.eval_every=3", "logger=none",
          "data.max_bytes=200000", "train.global_batch_size=8", "optim.warmup_steps=1"]


def _train(run_dir, *overrides) -> list[dict]:
    cmd = [sys.executable, "-m", "hpctrain", *COMMON, *overrides, f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("schedule", ["zb_h1"])
def test_pp2_loss_trajectory_matches_pp1(tmp_path, schedule):
    ref = _train(tmp_path / "pp1")
    pp = _train(tmp_path / "pp2", "parallel=pp2", "cluster.procs_per_node=2",
                f"parallel.schedule={schedule}", "parallel.timeline=true")
    assert [r["step"] for r in pp] == [1, 2, 3]
    for a, b in zip(ref, pp, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert 0.0 <= b["bubble_measured_mean"] <= b["bubble_measured"] < 1.0
    assert pp[-1]["eval_loss"] == pytest.approx(ref[-1]["eval_loss"], rel=1e-5)
    trace = json.loads((tmp_path / "pp2" / "pipeline_timeline.json").read_text())
    ranks = {e["tid"] for e in trace["traceEvents"]}
    kinds = {e["cat"] for e in trace["traceEvents"]}
    assert ranks == {0, 1} and kinds == {"F", "B", "W"}
    assert (tmp_path / "pp2" / "pipeline_timeline.png").read_bytes()[:4] == b"\x89PNG"
