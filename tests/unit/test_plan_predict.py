"""Pieces of the run prediction that need no processes: shapes, bench-file calibration."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hpctrain.models import build_model
from hpctrain.models.config import PRESETS
from hpctrain.plan.calibrate import LOCAL_BW, calibrated_cluster, gemm_flops, measured_spec
from hpctrain.plan.cluster import megatron_a100_cluster
from hpctrain.plan.memory.formulas import model_state_bytes
from hpctrain.plan.memory.states import flat_state_bytes, param_groups


@pytest.mark.parametrize("tied", [False, True])
def test_param_groups_match_the_built_model(tied):
    model_cfg = PRESETS["debug"].with_(tied_embeddings=tied)
    embed, blocks, tail = param_groups(model_cfg)
    built = [p.numel() for p in build_model(model_cfg, seed=0).parameters()]
    assert embed + [n for b in blocks for n in b] + tail == built


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_flat_states_equal_the_zero_formulas_without_padding(zero, precision):
    model_cfg = PRESETS["debug"]  # every parameter is a multiple of dim = 32: no padding at dp 2
    got = flat_state_bytes(model_cfg, dp=2, zero=zero, precision=precision, bucket_mb=0.01)
    ref = model_state_bytes(model_cfg.num_params(), dp=2, zero=zero, precision=precision)
    assert (got.params, got.grads, got.optimizer) == (ref.params, ref.grads, ref.optimizer)


def test_measured_spec_reports_only_what_was_measured():
    spec = measured_spec("cpu", {"fp32": 1e9})
    assert spec.peak_flops("fp32") == 1e9
    with pytest.raises(ValueError, match="bf16"):
        spec.peak_flops("bf16")


def test_gemm_flops_is_positive():
    assert gemm_flops(32, 32, 32, precision="fp32", device=torch.device("cpu"),
                      seconds=0.01) > 0


def _rec(bench, **kw):
    return {"bench": bench, "rank": kw.pop("rank", 0), "node": kw.pop("node", "n0"), **kw}


def _bench_file(tmp_path):
    gemm = [_rec("gemm", rank=r, precision="bf16", kind="square", shape=f"{n}^3", m=n, k=n, n=n,
                 tflops=t, peak_tflops=None, device="FakeGPU")
            for r in (0, 1) for n, t in ((64, 1.0), (128, 3.0 + r))]
    comm = [_rec("comm", rank=r, node=f"n{r // 2}", collective="all_reduce", supported=True,
                 group=g, group_ranks=ranks, bytes=b, busbw_GBps=bw)
            for g, ranks, bw in (("tp", [0, 1], 100.0), ("dp", [0, 2], 20.0))
            for r in ranks for b in (1024, 4096)]
    p2p = [_rec("p2p", rank=0, src=0, dst=d, src_node="n0", dst_node=f"n{d // 2}",
                bw_GBps=5.0, latency_s=lat) for d, lat in ((1, 2e-6), (2, 8e-6))]
    path = tmp_path / "bench.json"
    doc = {"meta": {"world_size": 4, "nodes": ["n0", "n1"]}, "records": gemm + comm + p2p}
    path.write_text(json.dumps(doc))
    return path


def test_from_bench_takes_peak_links_and_latencies(tmp_path):
    spec = calibrated_cluster(_bench_file(tmp_path))
    assert spec.device.peak_flops("bf16") == 3.5e12  # max over shapes of the rank median
    assert math.isnan(spec.device.fp32_flops)
    assert (spec.intra_node_bw, spec.inter_node_bw) == (100e9, 20e9)
    assert (spec.latency_intra, spec.latency_inter) == (2e-6, 8e-6)
    assert spec.gpus_per_node == 2


def test_from_bench_keeps_what_the_file_lacks_from_base(tmp_path):
    path = tmp_path / "gemm_only.json"
    path.write_text(json.dumps({"meta": {}, "records": [
        _rec("gemm", precision="fp32", kind="square", shape="8^3", m=8, k=8, n=8, tflops=0.5,
             peak_tflops=None)]}))
    base = megatron_a100_cluster()
    spec = calibrated_cluster(path, base=base)
    assert spec.device.peak_flops("fp32") == 0.5e12
    assert spec.device.peak_flops("bf16") == base.device.bf16_flops
    assert spec.intra_node_bw == base.intra_node_bw
    assert calibrated_cluster(path).intra_node_bw == LOCAL_BW


def test_from_bench_names_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="task=bench"):
        calibrated_cluster(tmp_path / "nope.json")


@pytest.mark.parametrize("pp", [1, 2])
def test_predicted_states_shard_over_dp_times_cp(tmp_path, pp):
    """ZeRO shards over the dp×cp group the engine replicates over: dp=1 × cp=2 holds what
    dp=2 × cp=1 holds (parallel=auto once chose a cp8 layout that the pre-launch check,
    sharding over dp alone, then refused at 2× its memory)."""
    from hpctrain.plan.predict import predicted_states
    from tests.conftest import make_config

    base = ["model=debug", "train=debug", "parallel.zero=1", f"parallel.pp={pp}",
            f"cluster.procs_per_node={2 * pp}", "train.seq_len=64", "train.global_batch_size=8",
            "train.micro_batch_size=1"]
    cp2 = make_config([*base, "parallel.cp=2"], run_dir=tmp_path / "cp")
    dp2 = make_config([*base, "parallel.dp=2"], run_dir=tmp_path / "dp")
    one = make_config([*base, f"cluster.procs_per_node={pp}"], run_dir=tmp_path / "one")
    assert predicted_states(cp2) == predicted_states(dp2)
    assert predicted_states(cp2).optimizer < predicted_states(one).optimizer


@pytest.mark.parametrize("over", [
    [], ["parallel.dp=2", "parallel.zero=3"], ["parallel.tp=2", "parallel.sp=true"],
    ["parallel.pp=2", "train.global_batch_size=16", "train.activation_checkpointing=full"],
    ["model=debug_moe", "parallel.dp=2", "parallel.ep=2", "train.precision=bf16"],
], ids=["single", "zero3", "tp2_sp", "pp2_full", "moe_ep2"])
def test_search_and_run_prediction_are_one_model(over, tmp_path):
    """The layout search (task=plan, parallel=auto) scores a layout with the same bytes the
    pre-launch check and the run's prediction use (plan.rank_memory), so `fits` is one
    verdict: the candidate of the config's own layout equals predicted_peak term by term."""
    from hpctrain.plan.cluster import dgx_h100_cluster
    from hpctrain.plan.inputs import layout_of
    from hpctrain.plan.predict import predicted_peak, predicted_states
    from hpctrain.plan.search import evaluate_layout
    from tests.conftest import make_config

    n = 2 if over else 1
    cfg = make_config(["model=debug", "train=debug", f"cluster.procs_per_node={n}", *over],
                      run_dir=tmp_path)
    t = cfg.train
    c = evaluate_layout(cfg.model, dgx_h100_cluster(), layout_of(cfg),
                        t.activation_checkpointing, global_batch=t.global_batch_size,
                        micro_batch_size=t.micro_batch_size, seq_len=t.seq_len,
                        precision=t.precision, dp_overlap=0.0, bucket_mb=cfg.parallel.bucket_mb)
    peak, states = predicted_peak(cfg), predicted_states(cfg)
    assert (c.memory.params, c.memory.grads, c.memory.optimizer) == (
        states.params, states.grads, states.optimizer)
    assert c.memory.activations == peak["activations"] and c.memory.total == peak["total"]
