"""Whole-model tensor parallelism: loss, every gradient slice, grad norm and comm bytes against
the single-process model built from the same seed (fp64, 1e-12)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.models import PRESETS, build_model
from hpctrain.models.checkpointing import apply_activation_checkpointing
from hpctrain.models.init import full_init
from hpctrain.ops.linear import Linear
from hpctrain.parallel.tensor import (
    apply_tensor_parallel,
    sync_tp_grads,
    tp_activation_bytes,
    tp_grad_norm,
    verify_tensor_parallel,
    vocab_parallel_cross_entropy,
)
from tests.parallel.tp_reference import max_err, shard, tp_group
from tests.references import token_batch

TOL = 1e-12
B, L = 2, 16


def _expected(name: str, full: torch.Tensor, cfg) -> torch.Tensor:
    """This rank's slice of a full-model tensor under the tp plan."""
    p, r = dist.get_world_size(), dist.get_rank()
    if name.endswith(("wo.weight", "w2.weight")):
        return shard(full, 1)
    if name.endswith(("wk.weight", "wv.weight", "wk.bias", "wv.bias")) and cfg.n_kv_heads % p:
        return shard(full, 0, index=r // (p // cfg.n_kv_heads), n=cfg.n_kv_heads)
    if name.endswith("norm.weight"):
        return full
    return shard(full, 0)


def _batch(cfg):
    return token_batch(B, L, vocab=cfg.vocab_size, seed=11)


def _one_step(sp: bool, kv_heads: int, seed_init: bool, options: dict | None = None):
    cfg = PRESETS["debug"].with_(n_kv_heads=kv_heads, **(options or {}))
    group = tp_group()
    inputs, targets = _batch(cfg)
    ref = build_model(cfg, seed=0).double()
    with torch.no_grad():  # biases and norm gains away from their zero/one init
        for name, q in ref.named_parameters():
            if name.endswith(("bias", "q_norm.weight", "k_norm.weight")):
                q.copy_(full_init(name + ".rand", q.shape, cfg, seed=1) * 5 + q)
    logits_ref = ref(inputs)
    loss_ref = F.cross_entropy(logits_ref.flatten(0, 1), targets.flatten())
    loss_ref.backward()
    par = build_model(cfg, seed=0).double()
    par.load_state_dict(ref.state_dict())
    plan = apply_tensor_parallel(par, group=group, sp=sp, cfg=cfg,
                                 seed=0 if seed_init else None)
    verify_tensor_parallel(par, plan)
    logits = par(inputs)
    loss = vocab_parallel_cross_entropy(logits, targets, group=group, counter=plan.counter)
    loss.backward()
    want_bytes = tp_activation_bytes(tp=plan.tp, n_layers=cfg.n_layers, batch=B, seq=L,
                                     dim=cfg.dim, elem_bytes=8, loss_elem_bytes=8)
    assert plan.counter.total == want_bytes, (dict(plan.counter.by_kind), want_bytes)
    sync_tp_grads(par.parameters(), plan)
    errs = {"loss": abs(float(loss) - float(loss_ref)),
            "logits": max_err(logits, shard(logits_ref, -1))}
    full = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        errs[name] = max_err(p.grad, _expected(name, full[name].grad, cfg))
    norm_ref = torch.linalg.vector_norm(torch.stack([q.grad.norm() for q in ref.parameters()]))
    errs["grad_norm"] = abs(float(tp_grad_norm(par.parameters(), plan)) - float(norm_ref))
    return errs


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("sp", [False, True])
def test_model_matches_single_process(size, sp, world2, world4):
    """debug preset has 2 kv heads: tp=2 splits them, tp=4 replicates each on 2 ranks."""
    for errs in {2: world2, 4: world4}[size].run(_one_step, sp, 2, False):
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, (worst, errs[worst])


@pytest.mark.parametrize("sp", [False, True])
def test_model_kv_replicated_single_kv_head(sp, world2):
    for errs in world2.run(_one_step, sp, 1, True):
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, (worst, errs[worst])


@pytest.mark.parametrize(("size", "sp"), [(2, False), (4, True)])
def test_model_with_biases_and_qk_norms(size, sp, world2, world4):
    """q/k/v biases shard with their heads; q/k norm gains stay whole and their gradients,
    each rank's only for its heads, are summed over tp; a head width (16) ≠ dim / n_heads.
    tp=4 replicates each of the 2 kv heads (and its biases) on 2 ranks."""
    options = {"attention_bias": True, "qk_norm": True, "head_dim": 16}
    for errs in {2: world2, 4: world4}[size].run(_one_step, sp, 2, False, options):
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, (worst, errs[worst])


def test_tp1_plan_is_bit_identical():
    """With no tp group every op is the identity: the shard is the whole model, bit for bit."""
    cfg = PRESETS["debug"]
    inputs, targets = _batch(cfg)
    ref, par = build_model(cfg, seed=0), build_model(cfg, seed=0)
    plan = apply_tensor_parallel(par, group=None, sp=True, cfg=cfg)
    assert torch.equal(ref(inputs), par(inputs))
    assert plan.counter.total == 0


def test_verify_catches_unsharded_module():
    cfg = PRESETS["debug"]
    model = build_model(cfg, seed=0)
    plan = apply_tensor_parallel(model, group=None, sp=False, cfg=cfg)
    apply_activation_checkpointing(model, "full")  # in-place recomputation keeps the names
    verify_tensor_parallel(model, plan)
    model.layers["1"].attn.wo = Linear(cfg.dim, cfg.dim)
    with pytest.raises(RuntimeError, match="layers.1.attn.wo"):
        verify_tensor_parallel(model, plan)


def _one_step_moe(sp: bool) -> dict[str, float]:
    """Routed experts in every block (aux and z coefficients 0.5, 0.1) under tp: loss, router
    losses and every gradient slice against one process (fp64). Under sp each tp rank routes
    its sequence shard; the router statistics are summed over tp."""
    import dataclasses

    from hpctrain.models.config import MoEConfig
    from hpctrain.models.moe.layer import take_moe_stats, take_router_loss

    moe = MoEConfig(num_experts=4, top_k=2, expert_ffn_dim=16, aux_loss_coef=0.5,
                    z_loss_coef=0.1)
    cfg = dataclasses.replace(PRESETS["debug"], moe=moe)
    group = tp_group()
    inputs, targets = _batch(cfg)
    ref = build_model(cfg, seed=0).double()
    ce_ref = F.cross_entropy(ref(inputs).flatten(0, 1), targets.flatten())
    (ce_ref + take_router_loss(ref)).backward()
    par = build_model(cfg, seed=0).double()
    par.load_state_dict(ref.state_dict())
    plan = apply_tensor_parallel(par, group=group, sp=sp, cfg=cfg)
    verify_tensor_parallel(par, plan)
    ce = vocab_parallel_cross_entropy(par(inputs), targets, group=group, counter=plan.counter)
    (ce + take_router_loss(par)).backward()
    sync_tp_grads(par.parameters(), plan)
    errs = {"loss": abs(float(ce) - float(ce_ref))}
    for key in ("aux", "z"):
        errs[key] = abs(sum(getattr(s, key) for s in take_moe_stats(par))
                        - sum(getattr(s, key) for s in take_moe_stats(ref)))
    full = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        whole = ".mlp." in name or name.endswith("norm.weight")  # router, experts, norms
        want = full[name].grad if whole else _expected(name, full[name].grad, cfg)
        errs[name] = max_err(p.grad, want)
    return errs


@pytest.mark.parametrize(("size", "sp"), [(2, False), (2, True), (4, True)])
def test_moe_under_tp_and_sp_matches_single_process(size, sp, world2, world4):
    for errs in {2: world2, 4: world4}[size].run(_one_step_moe, sp):
        worst = max(errs, key=errs.get)
        assert errs[worst] < TOL, (worst, errs[worst])
