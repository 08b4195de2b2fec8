"""Gradients of a tensor-parallel model: syncing replicated parameters and the global norm.

After backward, a sharded parameter's gradient is complete on its rank. Two kinds of replicated
parameters hold only partial gradients and are summed here:
  - with sp, replicated parameters (norm gains, row-parallel biases) saw only this rank's
    sequence shard: ∂L/∂g = Σ_tp ∂L/∂g_r (one all-reduce over tp); the q/k norm gains, with
    or without sp, saw only this rank's heads: the same sum;
  - kv heads replicated on p/K ranks saw only those ranks' query heads: each rank writes its
    gradient into slot k of a zero buffer of K slots, one all-reduce sums each slot over exactly
    the ranks that hold head k (no extra process groups needed).
The global norm counts each distinct value once: ‖g‖² = Σ_tp Σ_p ‖g_p‖² / replicas(p).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.parallel.tensor.comm import all_reduce
from hpctrain.parallel.tensor.plan import TensorParallelPlan


def _sum_flat(grads: list[torch.Tensor], plan: TensorParallelPlan) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    flat = all_reduce(flat, group=plan.group, counter=plan.counter)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_tp_grads(params, plan: TensorParallelPlan) -> None:
    """Complete the partial gradients of replicated parameters (see module docstring)."""
    if plan.tp == 1:
        return
    params = [p for p in params if p.grad is not None]
    _sum_flat([p.grad for p in params
               if id(p) in plan.head_norms or (plan.sp and plan.replicas[id(p)] == plan.tp
                                               and id(p) not in plan.kv_slots)], plan)
    kv = [p for p in params if id(p) in plan.kv_slots]
    if kv:
        n_slots = plan.kv_slots[id(kv[0])][1]
        flat = torch.cat([p.grad.reshape(-1) for p in kv])
        buf_SN = flat.new_zeros(n_slots, flat.numel())
        slot = plan.kv_slots[id(kv[0])][0]
        buf_SN[slot] = flat
        buf_SN = all_reduce(buf_SN, group=plan.group, counter=plan.counter)
        _scatter_back(kv, buf_SN[slot])


def _scatter_back(params, flat: torch.Tensor) -> None:
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def tp_grad_norm(params, plan: TensorParallelPlan) -> torch.Tensor:
    """‖g‖₂ of the whole (unsharded) model's gradient, identical on every tp rank (fp64)."""
    params = [p for p in params if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float64, device=params[0].device)
    for p in params:
        sq += p.grad.double().pow(2).sum() / plan.replicas[id(p)]
    if plan.tp > 1:
        dist.all_reduce(sq, group=plan.group)
    return sq.sqrt()


def clip_tp_grads(params, plan: TensorParallelPlan, max_norm: float) -> float:
    """Scale gradients by min(1, max_norm / (‖g‖ + 1e-6)) as torch's clip_grad_norm_ does,
    with the norm over the unsharded model; returns the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = tp_grad_norm(params, plan)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
    return float(norm)
