"""Benchmarks on a real 2-rank gloo world, and `python -m hpctrain task=bench` end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from hpctrain.bench.outliers import find_outliers, gemm_rank_scores
from hpctrain.config.bench import BenchConfig
from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh
from tests.conftest import ROOT

SMALL = dict(min_bytes=64, max_bytes=4096, iters=3, warmup=1)


def _mesh():
    return build_mesh(ParallelDims(dp=2), rank=dist.get_rank(), device=torch.device("cpu"))


def _comm():
    from hpctrain.bench.comm import run_comm

    return run_comm(BenchConfig(**SMALL), _mesh())


def _p2p():
    from hpctrain.bench.p2p import run_p2p

    return run_p2p(BenchConfig(**SMALL), _mesh())


def _gemm_with_slow_rank1():
    from hpctrain.bench.gemm import run_gemm
    from tests.conftest import make_config

    cfg = make_config(["task=bench", "bench=gemm", "model=debug", "train.micro_batch_size=2",
                       "train.seq_len=64"])
    b = BenchConfig(name="gemm", gemm_min_dim=64, gemm_max_dim=128, iters=5, warmup=1,
                    slow_ranks=(1,), slow_factor=4.0)
    return run_gemm(b, _mesh(), cfg)


def test_comm_completes_with_positive_numbers_and_correct_results(world2):
    records = [r for rs in world2.run(_comm) for r in rs]
    collectives = {r["collective"] for r in records}
    assert collectives == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    assert all(r["supported"] for r in records)  # gloo on CPU runs all five (torch 2.13)
    assert len(records) == 2 * 5 * 7  # ranks × collectives × sizes 64..4096
    assert all(r["correct"] and r["time_s"] > 0 and r["busbw_GBps"] > 0 for r in records)
    ar = [r for r in records if r["collective"] == "all_reduce"]
    assert all(r["busbw_GBps"] == r["algbw_GBps"] for r in ar)  # 2(n-1)/n = 1 at n = 2


def _comm_ep2_of_dp4():
    from hpctrain.bench.comm import run_comm

    mesh = build_mesh(ParallelDims(dp=4, ep=2), rank=dist.get_rank(),
                      device=torch.device("cpu"))
    b = BenchConfig(collectives=("all_to_all",), groups=("ep",), min_bytes=64, max_bytes=512,
                    iters=2, warmup=1)
    return run_comm(b, mesh)


def _comm_groups(dims: ParallelDims, groups: tuple[str, ...]):
    from hpctrain.bench.comm import run_comm

    mesh = build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu"))
    b = BenchConfig(collectives=("all_reduce",), groups=groups, min_bytes=64, max_bytes=64,
                    iters=1, warmup=0)
    return {(r["group"], tuple(r["group_ranks"])) for r in run_comm(b, mesh) if r["correct"]}


@pytest.mark.parametrize("dims, want", [
    (ParallelDims(dp=2, cp=2), {("cp", (0, 1)), ("cp", (2, 3)), ("dp", (0, 2)), ("dp", (1, 3))}),
    (ParallelDims(dp=4, dp_replicate=2), {("shard", (0, 1)), ("shard", (2, 3)),
                                          ("replicate", (0, 2)), ("replicate", (1, 3))}),
])
def test_comm_times_a_group_per_axis_from_the_mesh(world4, dims, want):
    """Context-parallel and HSDP groups are timed as the mesh builds them (the dp group of
    dp=4 is the world: timed as `world` only)."""
    got = set().union(*world4.run(_comm_groups, dims, ("cp", "dp", "shard", "replicate")))
    assert got == want


def test_comm_measures_all_to_all_over_the_expert_parallel_groups(world4):
    """parallel.ep=2 inside dp=4: the MoE all-to-all groups are {0, 1} and {2, 3}; bus
    bandwidth = algbw · (n−1)/n."""
    records = [r for rs in world4.run(_comm_ep2_of_dp4) for r in rs]
    assert {(r["rank"], tuple(r["group_ranks"])) for r in records} == {
        (0, (0, 1)), (1, (0, 1)), (2, (2, 3)), (3, (2, 3))}
    assert all(r["group"] == "ep" and r["n"] == 2 and r["correct"] for r in records)
    assert len(records) == 4 * 4  # ranks × sizes 64..512
    assert all(r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] / 2) for r in records)


def test_p2p_measures_both_directions(world2):
    records = [r for rs in world2.run(_p2p) for r in rs]
    assert sorted((r["src"], r["dst"]) for r in records) == [(0, 1), (1, 0)]
    assert all(r["bw_GBps"] > 0 and r["latency_s"] > 0 for r in records)


def test_gemm_injected_slow_rank_is_the_outlier(world2):
    records = [r for rs in world2.run(_gemm_with_slow_rank1) for r in rs]
    assert {r["precision"] for r in records} == {"fp32", "bf16"}
    assert all(r["tflops"] > 0 and r["fraction_of_peak"] is None for r in records)  # CPU: no peak
    scores = gemm_rank_scores(records)
    assert scores[1] < 0.8 < scores[0]
    assert [f.name for f in find_outliers(records, fraction=0.8)] == ["rank 1"]


def _hpctrain(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpctrain", *args, "cluster.procs_per_node=2", "parallel.dp=2",
           "logger=none", "bench.iters=3", "bench.warmup=1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_bench_comm_end_to_end_writes_json_report_plot_and_wandb_offline(tmp_path):
    """One `task=bench bench=comm` run (a CLI run with 2 ranks costs ~15 s): bench.json,
    the report and its plot, and the W&B offline run of the report rank alone."""
    from tests import wandb_records

    _hpctrain("task=bench", "bench=comm", "bench.min_bytes=256", "bench.max_bytes=2048",
              "logger.wandb=offline", f"hydra.run.dir={tmp_path}")
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["meta"]["bench"] == "comm" and doc["meta"]["world_size"] == 2
    assert doc["outliers"] == [] and doc["exclude"] is None
    for rec in doc["records"]:
        for key in ("bench", "rank", "node", "collective", "group", "n", "bytes", "time_s",
                    "algbw_GBps", "busbw_GBps", "correct"):
            assert key in rec, key
    assert {r["rank"] for r in doc["records"]} == {0, 1}
    assert all(r["correct"] for r in doc["records"])
    report = (tmp_path / "bench_report.md").read_text()
    assert "## Collectives" in report and "bench_comm_busbw.png" in report
    assert (tmp_path / "bench_comm_busbw.png").stat().st_size > 1000
    files = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1  # one run, from the report rank only
    keys = {k for row in wandb_records.history(files[0]) for k in row}
    assert "bench/comm/_type" in keys and "bench_plot/comm/_type" in keys, keys


def test_sweep_with_injected_slow_rank_names_it_in_the_report(tmp_path):
    _hpctrain("-m", "task=bench", "bench=comm,gemm", "model=debug", "bench.max_bytes=1024",
              "bench.gemm_min_dim=64", "bench.gemm_max_dim=128", "bench.slow_ranks=[1]",
              "bench.slow_factor=4", "train.micro_batch_size=2", "train.seq_len=64",
              f"hydra.sweep.dir={tmp_path}")
    comm = json.loads((tmp_path / "0" / "bench.json").read_text())
    gemm = json.loads((tmp_path / "1" / "bench.json").read_text())
    assert comm["meta"]["bench"] == "comm" and gemm["meta"]["bench"] == "gemm"
    assert [(o["bench"], o["name"]) for o in gemm["outliers"]] == [("gemm", "rank 1")]
    node = gemm["records"][0]["node"]
    assert gemm["exclude"] == f"--exclude={node}"
    report = (tmp_path / "1" / "bench_report.md").read_text()
    assert "rank 1" in report and f"--exclude={node}" in report
    assert (tmp_path / "1" / "bench_gemm.png").exists()
