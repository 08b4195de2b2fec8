"""The MoE layer on one process: counts, routing math, dropping, a per-token reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.models import PRESETS, build_model
from hpctrain.models.config import MoEConfig
from hpctrain.models.moe.layer import MoE, take_moe_stats, take_router_loss
from hpctrain.models.moe.router import route
from tests.conftest import make_config


def moe_cfg(**moe):
    base = dict(num_experts=4, top_k=2, every=2, expert_ffn_dim=24)
    return PRESETS["debug"].with_(name="moe", moe=MoEConfig(**{**base, **moe}))


@pytest.mark.parametrize("shared", [0, 1])
def test_param_count_matches_built_model(shared):
    cfg = moe_cfg(shared_experts=shared)
    model = build_model(cfg, seed=0)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert [isinstance(b.mlp, MoE) for b in model.layers.values()] == [False, True, False, True]


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
    r = route(logits, m, group=None)
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
    r = route(logits, MoEConfig(num_experts=4, top_k=1), group=None)
    assert torch.allclose(r.gate_A.sort().values, logits.softmax(-1).max(-1).values.sort().values)
    s = route(logits, MoEConfig(num_experts=4, top_k=2, router="sigmoid"), group=None)
    top = logits.sigmoid().topk(2, dim=-1).values
    assert torch.allclose(s.gate_A.sort().values, (top / top.sum(-1, True)).flatten().sort().values)


def test_capacity_drops_the_lowest_scores_deterministically():
    # every token prefers expert 0; capacity ceil(0.5 · 4 · 1 / 2) = 1 keeps the top score
    logits = torch.tensor([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [3.0, 0.0]])
    r = route(logits, MoEConfig(num_experts=2, top_k=1, capacity_factor=0.5), group=None)
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
    layer = build_model(cfg, seed=0).layers["1"].mlp.double()
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
    (["model=debug_moe", "parallel.cp=2", "model.moe.capacity_factor=1.25"],
     "set model.moe.capacity_factor=0 (dropless)"),
    (["model=debug_moe", "parallel.tp=2", "parallel.sp=true", "model.moe.capacity_factor=1"],
     "set model.moe.capacity_factor=0 (dropless), or parallel.sp=false"),
    (["model=debug_moe", "parallel.cp=2", "parallel.tp=2", "parallel.sp=true",
      "model.moe.capacity_factor=1", "cluster.procs_per_node=4"], "or parallel.cp=1"),
])
def test_bad_moe_layouts_are_refused_naming_the_fix(overrides, fix):
    with pytest.raises(ValueError, match=fix.replace("(", r"\(").replace(")", r"\)")):
        make_config(overrides)


def test_debug_moe_preset_validates():
    cfg = make_config(["model=debug_moe", "parallel.dp=2", "parallel.ep=2",
                       "cluster.procs_per_node=2"])
    assert cfg.model.moe.num_experts == 8 and cfg.parallel.ep == 2
    # composed and tested in tests/parallel/test_moe.py: full recompute at ep=2, tp × pp
    make_config(["model=debug_moe", "parallel.dp=2", "parallel.ep=2", "cluster.procs_per_node=2",
                 "train.activation_checkpointing=full"])
    make_config(["model=debug_moe", "parallel.tp=2", "parallel.pp=2", "cluster.procs_per_node=4",
                 "train.global_batch_size=8", "train.micro_batch_size=1"])


def _balance_run(aux_coef: float, *, steps: int = 20) -> list[float]:
    """CV of tokens per expert at each step of a short run (one process, fixed seeds) whose
    router starts biased: experts 0 and 1 get + 2·(the mean router input's direction)."""
    from hpctrain.config.schema import OptimConfig
    from hpctrain.parallel.data.engine import DataParallel
    from hpctrain.parallel.data.zero import NormSpec
    from hpctrain.parallel.scaler import LossScaler

    cfg = moe_cfg(num_experts=8, aux_loss_coef=aux_coef, z_loss_coef=0.0).with_(n_layers=2)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, cfg.vocab_size, (8, 33), generator=g) for _ in range(steps)]
    layer, seen = model.layers["1"].mlp, []
    hook = layer.register_forward_pre_hook(lambda m, a: seen.append(a[0].flatten(0, 1).mean(0)))
    with torch.no_grad():
        model(rows[0][:, :-1])
        layer.router.weight[:2] += 2 * seen[0] / seen[0].norm()
    hook.remove()
    engine = DataParallel(model, group=None, batch_group=None, zero=0, precision="fp32",
                          optim=OptimConfig(lr=1e-3, weight_decay=0.0), norm=NormSpec())
    cvs = []
    for r in rows:
        engine.train_step([(r[:, :-1], r[:, 1:])], n_micro=1, precision="fp32",
                          scaler=LossScaler(enabled=False), grad_clip=1.0)
        counts = take_moe_stats(model)[0].routed_E.double()
        cvs.append(float(counts.std(correction=0) / counts.mean()))
    return cvs


def test_aux_loss_balances_the_router_and_its_absence_does_not():
    """20 steps from a biased router: with the aux loss the CV of tokens per expert falls
    below 0.4× its first value (measured ~0.2×: 0.92 → 0.18), without it stays above 0.5×
    (measured ~0.85×: 0.92 → 0.78), and the two end states are far apart."""
    on, off = _balance_run(0.1), _balance_run(0.0)
    end_on, end_off = sum(on[-5:]) / 5, sum(off[-5:]) / 5
    assert on[0] == off[0] > 0.5  # the same biased start
    assert end_on < 0.4 * on[0], on
    assert end_off > 0.5 * off[0], off
    assert end_on < 0.5 * end_off


def _recompute_run(mode: str, *, steps: int = 3) -> list[tuple]:
    """(loss, grad norm, router losses, tokens per expert, forwards counted) of each step of a
    2-block all-MoE model under activation checkpointing `mode`, one process, fixed seeds."""
    from hpctrain.config.schema import OptimConfig
    from hpctrain.models.checkpointing import apply_activation_checkpointing
    from hpctrain.parallel.data.engine import DataParallel
    from hpctrain.parallel.data.zero import NormSpec
    from hpctrain.parallel.scaler import LossScaler

    cfg = moe_cfg(num_experts=4, every=1, aux_loss_coef=0.1, z_loss_coef=0.01).with_(n_layers=2)
    model = build_model(cfg, seed=0)
    apply_activation_checkpointing(model, mode)
    engine = DataParallel(model, group=None, batch_group=None, zero=0, precision="fp32",
                          optim=OptimConfig(lr=1e-2, weight_decay=0.0), norm=NormSpec())
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        rows = [torch.randint(0, cfg.vocab_size, (4, 17), generator=g) for _ in range(2)]
        result = engine.train_step([(r[:, :-1], r[:, 1:]) for r in rows], n_micro=2,
                                   precision="fp32", scaler=LossScaler(enabled=False),
                                   grad_clip=0.0)
        stats = take_moe_stats(model)
        assert take_router_loss(model) is None  # nothing left over for the next step
        out.append((result.loss, result.grad_norm, [s.aux + s.z for s in stats],
                    [s.routed_E.tolist() for s in stats], [s.forwards for s in stats]))
    return out


@pytest.mark.parametrize("mode,early_stop", [("selective", True), ("full", True),
                                             ("full", False)])
def test_moe_under_activation_checkpointing_equals_no_recompute(mode, early_stop):
    """Full recompute reruns each MoE block in backward: its router losses are not added
    again and its routing is not counted twice. (torch stops a recomputation once the saved
    tensors are back, which happens to end before the MoE's bookkeeping in this block; without
    that early stop the rerun reaches it: seen red, two routings counted per forward.)"""
    from torch.utils.checkpoint import set_checkpoint_early_stop

    ref = _recompute_run("none")
    with set_checkpoint_early_stop(early_stop):
        got = _recompute_run(mode)
    for (l0, n0, r0, e0, f0), (l1, n1, r1, e1, f1) in zip(ref, got, strict=True):
        assert l1 == pytest.approx(l0, rel=1e-6) and n1 == pytest.approx(n0, rel=1e-6)
        assert r1 == pytest.approx(r0, rel=1e-6) and e1 == e0 and f1 == f0 == [2, 2]


def test_fp8_experts_run_each_expert_as_fp8_linears():
    """apply_fp8 marks the routed-expert groups and the shared experts (hpctrain linears; the
    router stays fp32). An expert group in FP8 computes, forward and backward, what three FP8
    linears holding that expert's weights compute, and differs from its bf16/fp32 path."""
    from hpctrain.models.moe.layer import Experts
    from hpctrain.ops.fp8 import Fp8Spec
    from hpctrain.ops.linear import Linear
    from hpctrain.parallel.fp8 import apply_fp8

    model = build_model(PRESETS["debug_moe"].with_(
        moe=MoEConfig(num_experts=4, top_k=2, shared_experts=1)), seed=0)
    done = apply_fp8(model, recipe="tensorwise", skip=())
    assert any(n.endswith("mlp.experts") for n in done)
    assert any(n.endswith("mlp.shared.w1") for n in done)
    assert not any(n.endswith("router") for n in done)

    torch.manual_seed(0)
    experts = Experts(3, 16, 24)
    for w in (experts.w1, experts.w3, experts.w2):
        torch.nn.init.normal_(w, std=0.2)
    counts = torch.tensor([5, 0, 7])
    x = torch.randn(12, 16, requires_grad=True)
    plain = experts(x, counts)
    experts.fp8 = Fp8Spec("tensorwise")
    y = experts(x, counts)
    assert not torch.equal(y, plain)
    (y.square().sum()).backward()

    want, grads = [], []
    for e, rows in enumerate(torch.split(x.detach(), counts.tolist())):
        if not len(rows):
            continue
        lin = {}
        for name in ("w1", "w3", "w2"):
            w = getattr(experts, name)[e].detach().t().contiguous()
            lin[name] = Linear(w.shape[1], w.shape[0])
            lin[name].weight.data.copy_(w)
            lin[name].fp8 = experts.fp8
        rows = rows.clone().requires_grad_()
        out = lin["w2"](F.silu(lin["w1"](rows)) * lin["w3"](rows))
        out.square().sum().backward()
        want.append(out)
        grads.append((e, lin, rows.grad))
    assert torch.equal(y.detach(), torch.cat(want).detach())
    for e, lin, _ in grads:
        for name in ("w1", "w3", "w2"):
            assert torch.equal(getattr(experts, name).grad[e], lin[name].weight.grad.t())
    assert torch.equal(experts.w1.grad[1], torch.zeros_like(experts.w1.grad[1]))
    assert torch.equal(x.grad, torch.cat([g for _, _, g in grads]))
