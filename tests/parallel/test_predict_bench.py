"""cluster.calibration from a real task=bench bench=gemm run (a subprocess, small sizes)."""

from __future__ import annotations

import subprocess
import sys

import torch

from hpctrain.plan.calibrate import calibrated_cluster
from hpctrain.plan.predict import predict_run
from hpctrain.tasks.plan import run_plan
from tests.conftest import ROOT, make_config


def test_calibration_from_a_gemm_bench_run(tmp_path):
    bench_dir = tmp_path / "bench"
    cmd = [sys.executable, "-m", "hpctrain", "task=bench", "bench=gemm", "model=debug",
           "train.micro_batch_size=2", "train.seq_len=64", "bench.gemm_min_dim=64",
           "bench.gemm_max_dim=128", "bench.iters=3", "bench.warmup=1", "logger=none",
           f"hydra.run.dir={bench_dir}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    spec = calibrated_cluster(bench_dir / "bench.json")
    assert spec.device.peak_flops("fp32") > 0 and spec.device.peak_flops("bf16") > 0
    assert spec.intra_node_bw > 0 and spec.inter_node_bw > 0  # gemm only: local constants
    over = ["model=debug", "train=debug", f"cluster.calibration={bench_dir / 'bench.json'}"]
    predicted = predict_run(make_config(over), device=torch.device("cpu"))
    assert "bench GEMM" in predicted["predicted_device"]
    assert predicted["predicted_peak_flops"] == spec.device.peak_flops("fp32")
    report = run_plan(make_config(over, run_dir=tmp_path / "plan"))  # task=plan uses it too
    assert report["path"]
