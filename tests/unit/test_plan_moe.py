"""The planner with routed experts: expert memory 1/ep, routed activations, the all-to-all in
the step time, ep in the search and in task=plan (dense plans: test_plan_dense_golden.py)."""

from __future__ import annotations

import json

import pytest

from hpctrain.models.config import PRESETS, MoEConfig
from hpctrain.plan import experts
from hpctrain.plan.cluster import megatron_a100_cluster
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.formulas import memory_breakdown
from hpctrain.plan.search import search_layouts
from hpctrain.plan.time import step_time
from tests.conftest import make_config

MIXTRAL = PRESETS["mixtral_8x7b"]
CLUSTER = megatron_a100_cluster()  # 8 GPUs per node, 300 GB/s NVLink, 200 GB/s per node IB
RUN = dict(global_batch=64, micro_batch_size=1, seq_len=4096)
PSI_E = 32 * 8 * 3 * 4096 * 14336  # Mixtral's routed-expert parameters


def _memory(layout, model=MIXTRAL, **kw):
    return memory_breakdown(model, layout, seq_len=4096, micro_batch_size=1, in_flight=1, **kw)


def test_expert_states_fall_as_one_over_ep():
    base = _memory(Layout(dp=8, zero=0))
    for ep in (2, 4, 8):
        mem = _memory(Layout(dp=8, zero=0, ep=ep))
        assert base.params - mem.params == pytest.approx(2 * PSI_E * (1 - 1 / ep), rel=1e-12)
        assert base.optimizer - mem.optimizer == pytest.approx(12 * PSI_E * (1 - 1 / ep),
                                                               rel=1e-12)
    # Under ZeRO-3 every state is already 1/dp: experts shard over the dp/ep ranks that hold
    # them, so ep changes nothing (the sharding group shrinks by exactly what ep divides).
    z3 = [_memory(Layout(dp=8, zero=3, ep=ep)) for ep in (1, 2, 8)]
    assert all(m.params == pytest.approx(z3[0].params, rel=1e-12) for m in z3)
    # Experts are whole under tp: only the dense part shrinks with tp.
    dense_tp1 = _memory(Layout(dp=2, ep=2)).params - 2 * PSI_E / 2
    dense_tp2 = _memory(Layout(dp=2, tp=2, ep=2)).params - 2 * PSI_E / 2
    assert dense_tp2 == pytest.approx(dense_tp1 / 2, rel=1e-12)


def test_moe_blocks_store_the_router_and_routed_slots():
    """plan.rank_memory's MoE block, per token it routes: fp32 router logits and scores
    (8·E), top-k scores, ids and gate sums (12·k + 8), and per expert slot the dispatched row,
    the expert output and its gate-weighted copy (3·e·h), the expert SwiGLU (4·e·f_e) and
    three ids/gates (20), in place of the dense SwiGLU (4·e·f); k' = capacity_factor · top_k
    with a capacity. (The dry run measures these: tests/integration/test_dryrun.py.)"""
    from hpctrain.plan.memory.model import StepShape, rank_memory

    model = PRESETS["debug"].with_(moe=MoEConfig(num_experts=4, top_k=2))  # 4 MoE blocks
    dense = model.with_(moe=MoEConfig())
    layout = Layout(dp=2, ep=2)
    step = StepShape(seq_len=128, micro_batch_size=4, precision="fp32")

    def extra(m):
        return rank_memory(m, layout, step).activations - rank_memory(
            dense, layout, step).activations

    t, k, h, f, E, e = 128 * 4, 2, 32, 96, 4, 4
    router = 8 * E + 12 * k + 8
    slot = 3 * e * h + 4 * e * f + 20 + 16  # + the received rows' order and its inverse (ep)
    assert extra(model) == pytest.approx(4 * t * (router + k * slot - 4 * e * f), rel=1e-12)
    capped = model.with_(moe=MoEConfig(num_experts=4, top_k=2, capacity_factor=1.5))
    assert extra(capped) == pytest.approx(4 * t * (router + 1.5 * k * slot - 4 * e * f),
                                          rel=1e-12)


def _time(layout, **kw):
    return step_time(MIXTRAL, CLUSTER, layout=layout, **{**RUN, **kw})


def test_step_time_includes_the_all_to_all():
    assert _time(Layout(dp=8)).comm_ep_s == 0.0  # ep = 1: every expert is local
    t = _time(Layout(dp=8, ep=4))
    m, tokens = 64 // 8, 4096
    volume = tokens * 2 * 4096 * 2 * 3 / 4  # T·top_k·h·bytes·(ep−1)/ep
    one = volume / CLUSTER.intra_bw + 3 * CLUSTER.latency_intra  # ep·tp ≤ 8: NVLink
    assert t.comm_ep_s == pytest.approx(m * 32 * 4 * one, rel=1e-12)  # 4 per block per micro
    parts = t.compute_s + t.comm_tp_s + t.comm_pp_s + t.comm_cp_s + t.comm_ep_s + t.bubble_s
    assert t.step_time_s == pytest.approx(parts + t.comm_dp_s, rel=1e-12)
    assert _time(Layout(dp=8, ep=4), recompute="full").comm_ep_s == pytest.approx(
        1.5 * t.comm_ep_s, rel=1e-12)  # the recomputed forward dispatches and combines again
    # An ep group spanning nodes (tp=4: ep=4 covers 16 ranks) pays the NIC share.
    wide = _time(Layout(dp=8, tp=4, ep=4, sp=True), global_batch=64)
    assert wide.comm_ep_s > t.comm_ep_s
    # Compute counts active FLOPs only: a quarter of the experts per token.
    assert t.compute_s < step_time(MIXTRAL.with_(moe=MoEConfig(num_experts=8, top_k=8)),
                                   CLUSTER, layout=Layout(dp=8, ep=4), **RUN).compute_s / 2


def test_search_tries_every_ep_dividing_dp_and_the_experts():
    found = search_layouts(MIXTRAL, CLUSTER, n_devices=16, global_batch=64, micro_batch_size=1,
                           seq_len=4096, recomputes=("full",), schedules=("1f1b",))
    by_dp: dict[int, set[int]] = {}
    for c in found:
        by_dp.setdefault(c.layout.dp, set()).add(c.layout.ep)
    assert by_dp[16] == {1, 2, 4, 8} and by_dp[4] == {1, 2, 4} and by_dp[1] == {1}
    assert found[0].fits and found[0].reason == "best"
    dense = search_layouts(PRESETS["llama3_8b"], CLUSTER, n_devices=8, global_batch=64,
                           micro_batch_size=1, seq_len=4096, recomputes=("full",))
    assert {c.layout.ep for c in dense} == {1}
    assert experts.expert_degrees(PRESETS["deepseek_moe_16b"], 48) == [1, 2, 4, 8, 16]


def test_layout_refuses_ep_not_dividing_dp_or_experts():
    with pytest.raises(ValueError, match=r"parallel.ep=3 must be >= 1 and divide parallel.dp=8"):
        Layout(dp=8, ep=3)
    with pytest.raises(ValueError, match=r"ep=2 needs routed experts \(model.moe.num_exp"):
        step_time(PRESETS["llama3_8b"], CLUSTER, layout=Layout(dp=8, ep=2), **RUN)
    with pytest.raises(ValueError, match="ep=16 does not divide num_experts=8"):
        step_time(MIXTRAL, CLUSTER, layout=Layout(dp=16, ep=16), **{**RUN, "global_batch": 64})


def test_task_plan_prints_ep_and_active_params(tmp_path):
    from hpctrain.tasks.plan import run_plan

    cfg = make_config(["task=plan", "model=mixtral_8x7b", "cluster.accelerator=H100-SXM",
                       "cluster.procs_per_node=8", "parallel.dp=8", "parallel.ep=4",
                       "parallel.zero=1", "train.precision=bf16", "train.seq_len=4096",
                       "train.global_batch_size=64", "train.micro_batch_size=1",
                       "train.activation_checkpointing=full"], run_dir=tmp_path)
    table = run_plan(cfg)["text"]  # what the CLI prints on stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["inputs"]["layout"]["ep"] == 4 and plan["time"]["comm_ep_s"] > 0
    assert plan["params"] == {"total": MIXTRAL.num_params(),
                              "active": MIXTRAL.num_params(active=True)}
    assert "dp8 tp1 pp1 v1 z1 1f1b ep4" in table and "ep               4" in table
    assert "46.70B total, 12.88B active" in table and "(active FLOPs)" in table


def test_run_prediction_counts_experts_once_per_ep_rank(tmp_path):
    from hpctrain.plan.predict import predicted_states

    cfg = make_config(["task=plan", "model=debug_moe", "cluster.accelerator=H100-SXM",
                       "cluster.procs_per_node=2", "parallel.dp=2", "parallel.ep=2",
                       "train.precision=bf16"], run_dir=tmp_path)
    model = PRESETS["debug_moe"]
    moe = model.moe  # debug_moe: 2 MoE blocks × 8 experts × 3 matrices of 32 × 48
    psi_e = model.n_moe_layers * moe.num_experts * 3 * model.dim * model.expert_ffn_dim
    assert psi_e == 2 * 8 * 3 * 32 * 48
    states = predicted_states(cfg)
    assert states.params == 2 * (model.num_params() - psi_e / 2)
    assert states.optimizer == 12 * (model.num_params() - psi_e / 2)


def test_fp8_copies_count_the_rank_s_experts():
    """train.fp8 saves a float8 copy (1 byte) of each weight whose GEMMs run in FP8: in a
    Mixtral block the attention projections (/tp) and the rank's routed experts (/ep, whole
    under tp); not the norms or the router."""
    from hpctrain.plan.memory.formulas import fp8_layer_params

    h, q, kv = 4096, 32 * 128, 8 * 128
    attention = 2 * h * q + 2 * h * kv
    for tp, ep in ((1, 1), (2, 4), (8, 8)):
        layout = Layout(dp=8, tp=tp, ep=ep, sp=tp > 1)
        want = attention / tp + PSI_E / 32 / ep
        assert fp8_layer_params(MIXTRAL, layout) == pytest.approx(want, rel=1e-12)
