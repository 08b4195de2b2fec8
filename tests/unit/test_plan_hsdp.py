"""The planner knows HSDP: model states shard over dp_shard (not dp), the replicas' all-reduce
is timed on the network between nodes, and the search offers one shard group per node."""

from __future__ import annotations

import pytest

from hpctrain.models.config import PRESETS
from hpctrain.plan.cluster import dgx_h100_cluster
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.formulas import rank_state_bytes
from hpctrain.plan.search import enumerate_layouts
from hpctrain.plan.shapes import rank_params
from hpctrain.plan.time import dp_comm_s, replicate_s, ring_time

MODEL = PRESETS["llama3_8b"]


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_states_shard_over_dp_shard(zero):
    flat = rank_state_bytes(MODEL, Layout(dp=16, zero=zero))
    hybrid = rank_state_bytes(MODEL, Layout(dp=16, zero=zero, dp_replicate=2))
    half = rank_state_bytes(MODEL, Layout(dp=8, zero=zero))
    assert hybrid == half != flat
    assert hybrid.optimizer == pytest.approx(2 * flat.optimizer)


def test_replicas_all_reduce_their_grad_shard_between_nodes():
    cluster = dgx_h100_cluster()
    lay = Layout(dp=16, zero=2, dp_replicate=2)  # a shard group per 8-GPU node
    psi = rank_params(MODEL)
    # bf16 gradients: 2 bytes per parameter; the grad shard is 1/8 of them; one NIC per rank
    want = ring_time(2 * psi / 8, n=2, bw=cluster.inter_bw / 8, latency=cluster.latency_inter,
                     op="all_reduce")
    assert replicate_s(MODEL, cluster, lay, precision="bf16") == pytest.approx(want, rel=1e-9)
    assert replicate_s(MODEL, cluster, Layout(dp=16, zero=2), precision="bf16") == 0.0
    # the shard group's reduce-scatter/all-gather inside a node, then the replicas
    inside = dp_comm_s(MODEL, cluster, Layout(dp=8, zero=2), precision="bf16")
    assert dp_comm_s(MODEL, cluster, lay, precision="bf16") == pytest.approx(
        inside + want, rel=1e-9)


def test_search_offers_a_shard_group_per_node():
    kw = dict(n_devices=16, global_batch=64, micro_batch_size=1, schedules=["1f1b"],
              zero_stages=[0, 1, 3], virtual_stages=[1])
    found = list(enumerate_layouts(MODEL, **kw, gpus_per_node=8))
    hybrid = [lay for lay in found if lay.dp_replicate > 1]
    assert hybrid and all(lay.zero >= 1 and lay.dims.shard_size * lay.tp == 8 for lay in hybrid)
    assert not any(lay.dp_replicate > 1 for lay in enumerate_layouts(MODEL, **kw))
