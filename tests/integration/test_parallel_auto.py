"""parallel=auto and the pre-launch memory check through the real entry point (issue 17)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hpctrain import dispatch
from hpctrain.metrics.logger import read_jsonl
from hpctrain.plan.predict import predicted_peak
from hpctrain.plan.search import GIB
from tests.conftest import ROOT, make_config

SMALL = ["model=debug", "train=debug", "data.max_bytes=200000", "logger.wandb=disabled",
         "logger.progress=plain", "train.steps=4", "train.eval_every=0"]


def _cli(overrides, run_dir):
    cmd = [sys.executable, "-m", "hpctrain", *overrides, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def _losses(run_dir):
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_memory_check_refuses_over_and_runs_just_under_then_auto_matches_it(tmp_path):
    cfg = make_config(SMALL, run_dir=tmp_path / "probe")
    need = predicted_peak(cfg)["total"] / GIB / 0.9  # headroom 0.1
    with pytest.raises(ValueError, match="is predicted to need") as refused:  # before launch
        dispatch.run(make_config([*SMALL, f"plan.memory_limit_gb={need * 0.95}"],
                              run_dir=tmp_path / "over"))
    assert "parallel=auto (it would run" in str(refused.value)
    assert "plan.force=true" in str(refused.value)
    assert not (tmp_path / "over" / "metrics.jsonl").exists()

    single = tmp_path / "single"  # just under the limit: runs (in process, one rank)
    dispatch.run(make_config([*SMALL, f"plan.memory_limit_gb={need * 1.02}"], run_dir=single))
    ref = _losses(single)
    assert len(ref) == 4

    auto = tmp_path / "auto"
    proc = _cli([*SMALL, "parallel=auto", "cluster.procs_per_node=4"], auto)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = json.loads((auto / "plan.json").read_text())
    chosen, top = plan["chosen"], plan["top"]
    assert chosen["reason"] == "best" and len(top) == 5
    assert all(r["reason"] != "best" and r["reason"] for r in top[1:])
    assert "parallel=auto chose " + chosen["layout"] in proc.stdout + proc.stderr
    summary = json.loads((auto / "summary.json").read_text())
    assert summary["layout"] == f"{chosen['layout']} {chosen['recompute']}"
    assert summary["world_size"] == 4
    got = _losses(auto)
    assert got == pytest.approx(ref, rel=1e-5)


def test_force_runs_a_layout_predicted_not_to_fit(tmp_path):
    cfg = make_config([*SMALL, "plan.memory_limit_gb=1e-6", "plan.force=true"],
                      run_dir=tmp_path)
    assert cfg.parallel.dp == 1  # parsed: not refused
    with pytest.raises(ValueError, match="is predicted to need .* GiB per rank"):
        make_config([*SMALL, "plan.memory_limit_gb=1e-6"], run_dir=tmp_path)
