"""End to end: the main command, exact resume, dp=2 ≡ single process, W&B offline on one rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain import dispatch
from hpctrain.metrics.logger import read_jsonl
from tests import wandb_records
from tests.conftest import ROOT, make_config

SMALL = ["model=debug", "train=debug", "data.max_bytes=300000", "logger.wandb=disabled",
         "logger.progress=plain"]


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_main_command_trains_and_writes_outputs(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpctrain", *SMALL, "train.steps=40", "train.eval_every=20",
           "optim.warmup_steps=5", "train.profile=true", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "mem_bytes",
                "step_time_s", "mem_params_bytes", "mem_optim_bytes"):
        assert key in records[-1], key
    assert records[-1]["mfu"] is None  # CPU: no peak in the table, never a guess
    first, last = records[0]["loss"], records[-1]["loss"]
    assert last < first - 1.0, (first, last)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_loss"] == last and summary["tokens_per_s"] > 0
    assert (run_dir / "training.png").stat().st_size > 1000
    assert (Path(summary["checkpoint"]) / "train_state.json").exists()
    assert list((run_dir / "profile").glob("trace_rank0.json"))
    assert "run summary" in proc.stderr + proc.stdout


def test_bad_config_exits_before_any_rank_starts(tmp_path):
    cmd = [sys.executable, "-m", "hpctrain", "parallel.dp=2", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "set parallel.dp=1" in proc.stderr + proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


def test_stop_and_resume_is_bit_identical(tmp_path):
    over = [*SMALL, "train.steps=12", "train.eval_every=0"]
    dispatch.run(make_config(over, run_dir=tmp_path / "full"))
    dispatch.run(make_config([*over, "train.stop_after=5"], run_dir=tmp_path / "split"))
    assert len(_losses(tmp_path / "split")) == 5
    dispatch.run(make_config(over, run_dir=tmp_path / "split"))
    assert _losses(tmp_path / "split") == _losses(tmp_path / "full")


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(precision, tmp_path):
    over = [*SMALL, "train.steps=6", "train.eval_every=0", "train.allow_slow_precision=true"]
    dispatch.run(make_config(over, run_dir=tmp_path / "fp32"))
    dispatch.run(make_config([*over, f"train.precision={precision}"], run_dir=tmp_path / "mp"))
    ref, got = _losses(tmp_path / "fp32"), _losses(tmp_path / "mp")
    assert all(abs(a - b) < 0.05 * a for a, b in zip(ref, got, strict=True)), (ref, got)


def _train_on_rank(overrides: list[str], run_dir: str) -> list[float]:
    import torch.distributed as dist

    from hpctrain.distributed.dims import ParallelDims
    from hpctrain.distributed.mesh import build_mesh
    from hpctrain.train.trainer import Trainer

    cfg = make_config(overrides, run_dir=run_dir)
    p = cfg.parallel
    mesh = build_mesh(ParallelDims(dp=p.dp, tp=p.tp, pp=p.pp), rank=dist.get_rank(),
                      device=__import__("torch").device("cpu"))
    Trainer(cfg, mesh).run()
    return _losses(Path(run_dir)) if mesh.is_logging_rank else []


def test_dp2_matches_single_process(world2, tmp_path):
    over = [*SMALL, "train.steps=6", "train.eval_every=0", "train.global_batch_size=8"]
    dispatch.run(make_config(over, run_dir=tmp_path / "single"))
    dp2 = [*over, "parallel=dp2", "cluster.procs_per_node=2"]
    got = world2.run(_train_on_rank, dp2, str(tmp_path / "dp2"))[0]
    ref = _losses(tmp_path / "single")
    assert len(got) == len(ref) == 6
    for a, b in zip(ref, got, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (ref, got)


def test_wandb_offline_one_run_continued_on_resume(world2, tmp_path):
    run_dir = tmp_path / "wb"
    over = [*SMALL, "logger.wandb=offline", "parallel=dp2", "cluster.procs_per_node=2",
            "train.steps=6", "train.eval_every=0", "train.global_batch_size=8"]
    os.environ["WANDB_SILENT"] = "true"
    world2.run(_train_on_rank, [*over, "train.stop_after=3"], str(run_dir))
    world2.run(_train_on_rank, over, str(run_dir))
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2, files  # one per launch (not per rank), both the same run
    rid = (run_dir / "wandb_id.txt").read_text().strip()
    assert all(wandb_records.run_ids(f) == {rid} for f in files)
    assert {"model", "parallel", "train"} <= wandb_records.config_keys(files[0])
    logged = [float(h["loss"]) for f in files for h in wandb_records.history(f) if "loss" in h]
    assert logged == _losses(run_dir)
