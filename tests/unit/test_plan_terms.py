"""Each term issue 31 added to the time model, against its formula: the generation table, the
fused causal attention, the fp32 cross entropy, NCCL's share of the links, the stack's
tp/dp/pp overlap and fp32 gradient reduction, and the search of unstated settings."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hpctrain.bench.gemm import model_shapes
from hpctrain.metrics.devices import DEVICES
from hpctrain.models.config import PRESETS
from hpctrain.plan.assume import Allowed, assume_unstated
from hpctrain.plan.calibrate import measure_gemm_shapes
from hpctrain.plan.cluster import ClusterSpec, dgx_h100_cluster, megatron_a100_cluster
from hpctrain.plan.hardware import GENERIC, KERNELS, KernelConstants, kernel_constants
from hpctrain.plan.kernels import (
    CE_BYTES_PER_LOGIT,
    LayerCost,
    _attention_core,
    causal_keys,
    loss_cost,
    roofline,
)
from hpctrain.plan.layout import Layout
from hpctrain.plan.shapes import GPTShape
from hpctrain.plan.stack import MEGATRON_CORE, NONE, Stack, dp_exposed, exposed
from hpctrain.plan.time import _tp_exposed, dp_comm_parts, step_time

GPT = GPTShape("g", n_layers=8, dim=2048, n_heads=16, vocab_size=51200, max_seq_len=4096,
               attention="flash")
H100 = DEVICES["H100-SXM"]


def test_generation_rows_by_device_name_and_generic_elsewhere():
    assert kernel_constants(DEVICES["A100-80GB"]) is KERNELS["A100"]
    assert kernel_constants(H100) is KERNELS["H100"]
    assert kernel_constants(DEVICES["H200"]) is KERNELS["H200"]
    assert kernel_constants(replace(H100, name="H100-SXM (bench GEMM)")) is KERNELS["H100"]
    assert kernel_constants(DEVICES["MI300X"]) is GENERIC
    with pytest.raises(ValueError, match="gemm=0.9 exceeds mamf=0.8"):
        KernelConstants("X", gemm=0.9, mamf=0.8, attn_fwd=0.5, attn_bwd=0.5, hbm=0.8,
                        nvlink=1, nic=1)
    with pytest.raises(ValueError, match="hbm=1.2 must be in"):
        KernelConstants("X", gemm=0.5, mamf=0.8, attn_fwd=0.5, attn_bwd=0.5, hbm=1.2,
                        nvlink=1, nic=1)


def test_cluster_takes_the_generations_gemm_share_unless_given():
    def spec(device, **kw):
        return ClusterSpec(DEVICES[device], gpus_per_node=8, intra_node_bw=1e11,
                           inter_node_bw=1e11, **kw)

    assert spec("H100-SXM").achievable_fraction == KERNELS["H100"].gemm
    assert spec("A100-80GB").achievable_fraction == KERNELS["A100"].gemm
    assert spec("MI300X").achievable_fraction == GENERIC.gemm
    assert spec("H100-SXM", achievable_fraction=0.61).achievable_fraction == 0.61


def test_links_at_nccls_share_of_the_datasheet_unless_measured():
    c = dgx_h100_cluster()
    assert c.intra_bw == pytest.approx(450e9 * KERNELS["H100"].nvlink)
    assert c.inter_bw == pytest.approx(400e9 * KERNELS["H100"].nic)
    measured = replace(c, links="measured")
    assert (measured.intra_bw, measured.inter_bw) == (450e9, 400e9)
    with pytest.raises(ValueError, match="links='nccl'"):
        replace(c, links="nccl")


def test_fused_attention_skips_the_causal_upper_tiles_at_the_attention_shares():
    assert causal_keys(4096) == 4096 / 2 + 64  # half the keys + half a 128-key tile
    assert causal_keys(64) == 64  # one tile: nothing to skip
    r = roofline(H100, precision="bf16", achievable_fraction=0.5)
    k = KERNELS["H100"]
    assert r.attn_fwd == pytest.approx(989e12 * k.attn_fwd * 0.5 / k.mamf)
    assert r.attn_bwd == pytest.approx(989e12 * k.attn_bwd * 0.5 / k.mamf)
    fwd, bwd = _attention_core(GPT, r, mbs=2, seq_len=4096, keys=4096, tp=2, elem=2)
    flops = 4 * (2 * 16 / 2) * 4096 * causal_keys(4096) * 128
    assert (fwd, bwd) == pytest.approx((flops / r.attn_fwd, 2.5 * flops / r.attn_bwd))
    eager_f, eager_b = _attention_core(replace(GPT, attention="eager"), r, mbs=2,
                                       seq_len=4096, keys=4096, tp=2, elem=2)
    assert eager_b == 2 * eager_f and eager_f > fwd  # every score, written and re-read


def test_measured_gemm_shapes_replace_the_roofline_for_those_shapes():
    r = roofline(H100, precision="bf16", achievable_fraction=0.5,
                 measured=((4096, 2048, 6144, 600e12),))
    in_step = 0.5 / KERNELS["H100"].mamf
    flops = 2 * 4096 * 6144 * 2048
    assert r.gemm(4096, 6144, 2048, elem=2) == pytest.approx(flops / (600e12 * in_step))
    assert r.gemm(4096, 6144, 4096, elem=2) == pytest.approx(2 * flops / (989e12 * 0.5))
    c = replace(dgx_h100_cluster(), gemm_flops=(("bf16", 1, 2, 3, 4.0), ("fp32", 5, 6, 7, 8.0)))
    assert c.measured_gemms("bf16") == ((1, 2, 3, 4.0),)


def test_gemm_shapes_are_timed_once_each_on_this_device():
    model = PRESETS["debug"]
    rows = measure_gemm_shapes(model, tokens=64, tp=1, precision="fp32",
                               device=torch.device("cpu"), seconds=0.01)
    shapes = {s[2:] for s in model_shapes(model, tokens=64, tp=1)}
    assert {row[1:4] for row in rows} == shapes and len(rows) == len(shapes)
    assert all(row[0] == "fp32" and row[4] > 0 for row in rows)


def test_cross_entropy_streams_fp32_logits():
    assert CE_BYTES_PER_LOGIT == 52
    r = roofline(H100, precision="bf16", achievable_fraction=0.5)
    assert loss_cost(GPT, r, mbs=2, seq_len=4096, tp=4) == pytest.approx(
        2 * 4096 * 51200 / 4 * 52 / (3.35e12 * KERNELS["H100"].hbm))


def test_tp_overlap_exposes_only_what_outlasts_the_gemms():
    lc = LayerCost(f=5.0, b=9.0, w=3.0)  # w: one pass of the projection GEMMs
    assert _tp_exposed(lc, 1.0, recompute="none", tp_overlap="none") == (2.0, 2.0)
    assert _tp_exposed(lc, 1.0, recompute="full", tp_overlap="none") == (2.0, 4.0)
    assert _tp_exposed(lc, 1.0, recompute="none", tp_overlap="full") == (0.0, 0.0)
    assert _tp_exposed(lc, 2.0, recompute="none", tp_overlap="full") == (1.0, 0.0)
    assert _tp_exposed(lc, 3.0, recompute="full", tp_overlap="full") == (3.0, 3.0)
    assert exposed(5.0, 7.0) == 0.0 and exposed(7.0, 5.0) == 2.0
    with pytest.raises(ValueError, match="Stack.tp='backward'"):
        Stack(tp="backward")


def test_dp_overlap_hides_the_collectives_behind_one_microbatch():
    # reduce-scatter 10 s behind a 4 s backward, all-gather 6 s behind a 2 s forward
    assert dp_exposed(10, 6, bucket_s=1, backward_s=4, forward_s=2) == 6 + 4
    # both hidden but the last bucket of each
    assert dp_exposed(3, 1, bucket_s=0.5, backward_s=4, forward_s=2) == 0.5 + 0.5
    assert dp_exposed(0.2, 0.1, bucket_s=0.5, backward_s=4, forward_s=2) == 0.2 + 0.1
    c = dgx_h100_cluster()
    lay = Layout(dp=64, tp=8, pp=1, sp=True, zero=1)
    kw = dict(layout=lay, global_batch=64, micro_batch_size=1, seq_len=4096)
    plain, hidden = step_time(GPT, c, **kw), step_time(GPT, c, ov=Stack(dp=True), **kw)
    assert 0 < hidden.comm_dp_s < plain.comm_dp_s


def test_fp32_gradient_reduction_doubles_the_reduce_scatter_only():
    c, lay = dgx_h100_cluster(), Layout(dp=16, tp=8, zero=1)
    rs, ag = dp_comm_parts(GPT, c, lay, precision="bf16")
    rs32, ag32 = dp_comm_parts(GPT, c, lay, precision="bf16", ov=Stack(grad_reduce="fp32"))
    hops = 15 * c.latency_inter  # a ring of 16 across nodes: 15 latencies, bytes-free
    assert rs32 - hops == pytest.approx(2 * (rs - hops)) and ag32 == ag
    assert Stack(grad_reduce="fp32").grad_bytes(2) == 4 and NONE.grad_bytes(2) == 2


def test_pp_overlap_leaves_only_the_hop_latency():
    c = megatron_a100_cluster()
    kw = dict(layout=Layout(dp=1, tp=1, pp=4), global_batch=16, micro_batch_size=1,
              seq_len=2048)
    overlapped = step_time(GPT, c, ov=Stack(pp=True), **kw)
    instant = step_time(GPT, replace(c, inter_node_bw=1e30, intra_node_bw=1e30), **kw)
    assert overlapped.comm_pp_s == pytest.approx(instant.comm_pp_s)
    assert overlapped.comm_pp_s < step_time(GPT, c, **kw).comm_pp_s


def test_assume_unstated_takes_the_fastest_fitting_option():
    c = dgx_h100_cluster()
    kw = dict(layout=Layout(dp=2, tp=1, pp=2), global_batch=32, seq_len=4096, ov=MEGATRON_CORE)
    allowed = Allowed((1, 2), ("none", "full"), (1, 2))
    best = assume_unstated(GPT, c, allowed=allowed, **kw)
    for mbs in (1, 2):
        for v in (1, 2):
            lay = Layout(dp=2, pp=2, virtual_stages=v,
                         schedule="interleaved_1f1b" if v > 1 else "1f1b")
            for rec in ("none", "full"):
                t = step_time(GPT, c, layout=lay, global_batch=32, micro_batch_size=mbs,
                              seq_len=4096, recompute=rec, ov=MEGATRON_CORE)
                assert best.candidate.time.step_time_s <= t.step_time_s
    assert "mbs" in best.describe() and best.stack is MEGATRON_CORE
    with pytest.raises(ValueError, match="widen Allowed"):
        assume_unstated(GPT, c, allowed=Allowed((3,), ("none",), (1,)), **kw)
