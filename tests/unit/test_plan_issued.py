"""`plan.time` prices the collectives hpctrain issues (issue 44): the bytes `plan.comm_volume`
counts (which the dry run's tally checks op for op), so `task=plan` and `parallel=auto` see
ZeRO-1 at ZeRO-2's bytes, ZeRO-3's gathers every micro-batch, the HSDP replicas overlapped
with backward and the pipeline hop's tp all-gather; the published tables keep their stacks'
traffic (tests/unit/test_plan_published.py)."""

from __future__ import annotations

import dataclasses

import pytest

from hpctrain.models.config import PRESETS
from hpctrain.plan.cluster import dgx_h100_cluster
from hpctrain.plan.comm_volume import step_volumes
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.model import StepShape
from hpctrain.plan.search import evaluate_layout
from hpctrain.plan.shapes import GPTShape
from hpctrain.plan.time import dp_link, issued_dp_parts, ring_time, step_time, tp_link

MODEL = PRESETS["llama3_8b"]
CLUSTER = dgx_h100_cluster()
SEQ, MBS = 4096, 1


def _step(m: int, **kw) -> StepShape:
    return StepShape(seq_len=SEQ, micro_batch_size=MBS, microbatches=m, precision="bf16", **kw)


def _time(layout: Layout, m: int, *, issued: bool = True, **kw):
    return step_time(MODEL, CLUSTER, layout=layout, global_batch=m * layout.dp * MBS,
                     micro_batch_size=MBS, seq_len=SEQ, precision="bf16",
                     issued=_step(m, **kw) if issued else None)


def test_dp_seconds_are_the_bytes_comm_volume_counts_at_the_dp_link():
    lay = Layout(dp=16, zero=2)
    rs, ag, replicas, _ = issued_dp_parts(MODEL, CLUSTER, lay, _step(2))
    bw, lat = dp_link(CLUSTER, stride=1, dp=16)
    shard = step_volumes(MODEL, lay, _step(2))["shard"]
    assert rs + ag == pytest.approx(shard.bytes / bw + shard.ops * 15 * lat, rel=1e-12)
    assert replicas == 0.0


def test_zero1_costs_what_zero2_costs():
    one, two = (_time(Layout(dp=16, zero=z), 2) for z in (1, 2))
    assert one.comm_dp_s == pytest.approx(two.comm_dp_s, rel=1e-12)
    zero0 = _time(Layout(dp=16, zero=0), 2)  # an fp32 all-reduce: 4 bytes each way
    assert zero0.comm_dp_s > one.comm_dp_s


def test_zero3_gathers_every_micro_batch_unless_it_keeps_the_blocks():
    lay = Layout(dp=16, zero=3)
    gathers = {m: issued_dp_parts(MODEL, CLUSTER, lay, _step(m))[1] for m in (2, 4)}
    kept = issued_dp_parts(MODEL, CLUSTER, lay, _step(4, zero3_reshard=False))[1]
    assert gathers[4] == pytest.approx(2 * gathers[2], rel=1e-12)
    # blocks once instead of twice; the unit outside them (embedding, head) once either way
    assert gathers[4] / 2 < kept < gathers[4]
    # the published stacks' model: two gathers a step, whatever the micro-batches
    assert _time(lay, 4, issued=False).comm_dp_s == pytest.approx(
        _time(lay, 2, issued=False).comm_dp_s, rel=1e-12)
    # task=plan and parallel=auto price the setting they are given
    cands = [evaluate_layout(MODEL, CLUSTER, lay, "none", global_batch=64, micro_batch_size=MBS,
                             seq_len=SEQ, precision="bf16", dp_overlap=0.0, zero3_reshard=r)
             for r in (True, False)]
    assert cands[1].time.comm_dp_s < cands[0].time.comm_dp_s


def test_hsdp_replicas_hide_behind_the_last_backward():
    """Each unit's replica all-reduce overlaps the rest of the last backward: what shows is
    the last unit's all-reduce alone when the backward outlasts the others (it does here: a
    llama3_8b block's backward against a 1/8 grad shard's all-reduce)."""
    lay = Layout(dp=16, zero=2, dp_replicate=2)
    rs, ag, replicas, one = issued_dp_parts(MODEL, CLUSTER, lay, _step(2))
    exposed = _time(lay, 2).comm_dp_s - (rs + ag)
    assert replicas > one > 0
    assert exposed == pytest.approx(one, rel=1e-9)
    assert replicas > 10 * one


def test_a_hop_under_tp_without_sp_adds_its_all_gather():
    lay = Layout(dp=1, tp=2, pp=2)
    bw, lat = tp_link(CLUSTER, 2)
    gather = ring_time(MBS * SEQ * MODEL.dim * 2, n=2, bw=bw, latency=lat, op="all_gather")
    assert gather > 0
    sp = dataclasses.replace(lay, sp=True)
    assert _time(lay, 8).comm_pp_s > _time(sp, 8).comm_pp_s


def test_issued_traffic_needs_a_model_with_a_parameter_list():
    gpt = GPTShape("gpt", n_layers=8, dim=1024, n_heads=16, vocab_size=51200, max_seq_len=4096)
    with pytest.raises(ValueError, match="StepShape of this step"):
        step_time(gpt, CLUSTER, layout=Layout(dp=8), global_batch=16, micro_batch_size=1,
                  seq_len=SEQ, issued=_step(2))
    with pytest.raises(ValueError, match="2 micro-batches"):
        step_time(MODEL, CLUSTER, layout=Layout(dp=8), global_batch=16, micro_batch_size=1,
                  seq_len=SEQ, issued=_step(3))
