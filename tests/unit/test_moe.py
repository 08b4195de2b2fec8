"""The MoE layer on one process: counts, routing math, dropping, a per-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.models import PRESETS, build_model
from hpctrain.models.config import MoEConfig
from hpctrain.models.moe import MoE, route, take_moe_stats, take_router_loss
from tests.conftest import make_config


def moe_cfg(**moe):
    base = dict(num_experts=4, top_k=2, every=2, expert_ffn_dim=24)
    return PRESETS["debug"].with_(name="moe", moe=MoEConfig(**{**base, **moe}))


@pytest.mark.parametrize("shared", [0, 1])
def test_param_count_matches_built_model(shared):
    cfg = moe_cfg(shared_experts=shared)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert [isinstance(b.mlp, MoE) for b in model.layers] == [False, True, False, True]


def test_active_flops_match_counted_flops():
    """MFU's active FLOPs: the router and top_k + shared experts per token, nothing more."""
    cfg = moe_cfg(shared_experts=1).with_(attention="eager")
    model = build_model(cfg, seed=0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    with FlopCounterMode(display=False) as counter:
        model(tokens).sum().backward()
    assert counter.get_total_flops() == cfg.flops_per_token(16) * tokens.numel()


def test_softmax_gates_renormalise_and_aux_is_switch_form():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    m = MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.5, z_loss_coef=0.25)
    r = route(logits, m)
    p = logits.softmax(-1)
    top, idx = p.topk(2, dim=-1)
    gates = top / top.sum(-1, keepdim=True)
    # kept assignments are expert-major; each token's gates still sum to 1
    assert torch.allclose(torch.zeros(3).index_add(0, r.token_A, r.gate_A), torch.ones(3))
    f = torch.bincount(idx.flatten(), minlength=4).float() / 6
    assert torch.allclose(r.aux, 0.5 * 4 * (f * p.mean(0)).sum())
    assert torch.allclose(r.z, 0.25 * logits.logsumexp(-1).square().mean())
    order = sorted(range(6), key=lambda a: (idx.flatten()[a].item(), -top.flatten()[a].item(), a))
    assert r.token_A.tolist() == [a // 2 for a in order]
    assert torch.allclose(r.gate_A, gates.flatten()[order])


def test_top1_keeps_the_raw_probability_and_sigmoid_normalises_scores():
    logits = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    r = route(logits, MoEConfig(num_experts=4, top_k=1))
    assert torch.allclose(r.gate_A.sort().values, logits.softmax(-1).max(-1).values.sort().values)
    s = route(logits, MoEConfig(num_experts=4, top_k=2, router="sigmoid"))
    top = logits.sigmoid().topk(2, dim=-1).values
    assert torch.allclose(s.gate_A.sort().values, (top / top.sum(-1, True)).flatten().sort().values)


def test_capacity_drops_the_lowest_scores_deterministically():
    # every token prefers expert 0; capacity ceil(0.5 · 4 · 1 / 2) = 1 keeps the top score
    logits = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    r = route(logits, MoEConfig(num_experts=2, top_k=1, capacity_factor=0.5))
    assert r.token_A.tolist() == [1]  # tokens 1 and 3 tie at the top: the lower index wins
    assert r.routed_E.tolist() == [4, 0] and r.counts_E.tolist() == [1, 0]


def _reference(layer: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Token by token: Σ over its top-k experts of gate · SwiGLU_e(x)."""
    p = F.linear(x_TD, layer.router.weight).softmax(-1)
    top, idx = p.topk(layer.moe.top_k, dim=-1)
    gates = top / top.sum(-1, keepdim=True)
    w = layer.experts
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for g, e in zip(gates[t], idx[t], strict=True):
            h = F.silu(x_TD[t] @ w.w1[e]) * (x_TD[t] @ w.w3[e])
            out[t] += g * (h @ w.w2[e])
    return out + layer.shared(x_TD)


def test_layer_matches_per_token_reference_and_records_losses():
    cfg = moe_cfg(shared_experts=1)
    layer = build_model(cfg, seed=0).layers[1].mlp.double()
    x = torch.randn(2, 5, cfg.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = layer(x)
    assert torch.allclose(out.view(10, -1), _reference(layer, x.view(10, -1)), atol=1e-12)
    loss = take_router_loss(layer)
    assert loss is not None and take_router_loss(layer) is None
    (stats,) = take_moe_stats(layer)
    assert stats.kept == stats.assignments == 20 and int(stats.routed_E.sum()) == 20
    with torch.no_grad():  # eval forwards add no router loss and no statistics
        layer(x)
    assert take_router_loss(layer) is None and take_moe_stats(layer)[0].forwards == 0


@pytest.mark.parametrize("overrides,fix", [
    (["parallel.ep=2"], "model.moe.num_experts to a multiple of ep"),
    (["model=debug_moe", "model.moe.top_k=9"], "top_k ≤ num_experts"),
    (["model=debug_moe", "parallel.dp=2", "parallel.ep=2", "model.moe.num_experts=3"],
     "divisors of the expert count"),
    (["model=debug_moe", "parallel.dp=1", "parallel.ep=2"], "choose ep dividing dp"),
    (["model=debug_moe", "parallel.tp=2"], "set parallel.tp=1"),
    (["model=debug_moe", "parallel.dp=2", "parallel.ep=2", "parallel.zero=3"], "zero=0, 1 or 2"),
])
def test_bad_moe_layouts_are_refused_naming_the_fix(overrides, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        make_config(overrides)


def test_debug_moe_preset_validates():
    cfg = make_config(["model=debug_moe", "parallel.dp=2", "parallel.ep=2",
                       "cluster.procs_per_node=2"])
    assert cfg.model.moe.num_experts == 8 and cfg.parallel.ep == 2
