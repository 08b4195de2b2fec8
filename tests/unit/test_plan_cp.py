"""The planner under context parallelism: activations ÷ cp, ZeRO over dp·cp, ring traffic."""

from dataclasses import replace

import pytest

from hpctrain.plan.cluster import megatron_a100_cluster
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.formulas import activation_bytes, memory_breakdown
from hpctrain.plan.shapes import GPTShape
from hpctrain.plan.time import step_time

MODEL = GPTShape("g", n_layers=8, dim=1024, n_heads=16, vocab_size=32000, max_seq_len=32768)


def test_activations_per_rank_are_those_of_seq_len_over_cp():
    kw = dict(micro_batch_size=1, in_flight=1)
    cp4 = activation_bytes(MODEL, Layout(cp=4), seq_len=32768, **kw)
    assert cp4 == activation_bytes(MODEL, Layout(), seq_len=8192, **kw)
    assert cp4 < activation_bytes(MODEL, Layout(), seq_len=32768, **kw) / 4


def test_zero_shards_over_dp_times_cp():
    kw = dict(seq_len=4096, micro_batch_size=1, in_flight=1)
    a = memory_breakdown(MODEL, Layout(dp=2, cp=2, zero=1), **kw)
    b = memory_breakdown(MODEL, Layout(dp=4, zero=1), **kw)
    assert a.optimizer == b.optimizer and a.params == b.params


def test_ring_traffic_is_charged_beyond_the_compute_it_overlaps():
    cluster = megatron_a100_cluster()
    kw = dict(global_batch=8, micro_batch_size=1, seq_len=32768, precision="bf16")
    t = step_time(MODEL, cluster, layout=Layout(cp=8), **kw)
    assert t.comm_cp_s == 0.0  # NVLink: the ring hides behind the compute
    slow_link = replace(cluster, intra_node_bw=cluster.intra_node_bw / 1000)
    slow = step_time(MODEL, slow_link, layout=Layout(cp=8), **kw)
    # 8 layers × 8 microbatches × (3·8 − 2) sends of 2·1·4096·16·64·2 bytes
    sends = 8 * 8 * 22
    ring = sends * (2 * 4096 * 16 * 64 * 2 / slow_link.intra_bw + cluster.latency_intra)
    assert slow.comm_cp_s == pytest.approx(ring - slow.compute_s, rel=1e-12)
    assert slow.comm_cp_s > 0 and slow.step_time_s > t.step_time_s
    assert step_time(MODEL, cluster, layout=Layout(dp=8), **kw).comm_cp_s == 0.0


def test_search_tries_cp_when_the_sequence_splits_and_long_context_needs_it():
    from hpctrain.plan.search import search_layouts

    long_ctx = dict(n_devices=8, global_batch=8, micro_batch_size=1, seq_len=524288,
                    zero_stages=(1,), schedules=("1f1b",), recomputes=("selective",))
    cluster = megatron_a100_cluster()
    found = search_layouts(MODEL, cluster, context_parallel=(1, 2, 4, 8), **long_ctx)
    assert {c.layout.cp for c in found} == {1, 2, 4, 8}
    def fits(cp):  # one 512k-token row, no tp, no pp: 204 GiB at cp=1, 28 GiB at cp=8
        return any(c.fits for c in found if (c.layout.cp, c.layout.tp, c.layout.pp) == (cp, 1, 1))
    assert fits(8) and not fits(1)
    odd = search_layouts(MODEL, cluster, context_parallel=(1, 8), **{**long_ctx, "seq_len": 24})
    assert {c.layout.cp for c in odd} == {1}  # 24 is not divisible by 2·8


def test_allgather_traffic_is_charged_in_full_and_full_recompute_reruns_the_forward():
    """cp_comm=allgather: 2 all-gathers and a reduce-scatter of the cp shards per layer, none
    of it hidden (the ring's same-size traffic is, on NVLink); full recompute adds one
    all-gather (ring: cp − 1 sends)."""
    cluster = megatron_a100_cluster()
    kw = dict(global_batch=8, micro_batch_size=1, seq_len=32768, precision="bf16")
    bw, lat = cluster.intra_bw, cluster.latency_intra  # NVLink at NCCL's share
    shard = 2 * 4096 * 16 * 64 * 2  # 2·b·(s/cp)·K·H_d elements of 2 bytes
    one = 7 * (shard / bw + lat)  # a ring collective of 8 shards over 8 ranks: 7 hops
    layers = 8 * 8  # 8 layers × 8 microbatches
    ag = Layout(cp=8, cp_comm="allgather")
    assert ag.describe().endswith("cp8 allgather")
    t = step_time(MODEL, cluster, layout=ag, **kw)
    assert t.comm_cp_s == pytest.approx(layers * 3 * one, rel=1e-12)
    assert step_time(MODEL, cluster, layout=Layout(cp=8), **kw).comm_cp_s == 0.0
    full = step_time(MODEL, cluster, layout=ag, recompute="full", **kw)
    assert full.comm_cp_s == pytest.approx(layers * 4 * one, rel=1e-12)
    slow_link = replace(cluster, intra_node_bw=cluster.intra_node_bw / 1000)
    ring = step_time(MODEL, slow_link, layout=Layout(cp=8), recompute="full", **kw)
    sends = layers * (22 + 7)
    exposed = sends * (shard / slow_link.intra_bw + lat) - ring.compute_s
    assert ring.comm_cp_s == pytest.approx(exposed, rel=1e-12)
    with pytest.raises(ValueError, match="cp_comm='p2p'"):
        Layout(cp=2, cp_comm="p2p")


def test_the_plan_reads_cp_comm_from_the_config():
    from types import SimpleNamespace

    from hpctrain.config.schema import ParallelConfig
    from hpctrain.plan.inputs import layout_of

    cfg = SimpleNamespace(parallel=ParallelConfig(cp=2, cp_comm="allgather"))
    assert layout_of(cfg).cp_comm == "allgather"
