"""Trainer glue for tensor parallelism, kept apart so trainer.py and step.py change little.

The model is sharded by `hpctrain.train.setup` (one order for every layout). `step_loss` is the
step's loss (the vocab-parallel one under tp, for the plain step and the pipeline's last
stage); `tp_step_hooks` gives it to the train and eval steps; `engine_axes` gives the
data-parallel engine the replicated-gradient sync (before the dp reduction) and the clip norm
over the unsharded model (and over pp). Every tp rank gets the same batch: the sampler shards by
dp only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpctrain.distributed.mesh import Mesh, group_size
from hpctrain.parallel.step import lm_loss
from hpctrain.parallel.tensor import (
    TensorParallelPlan,
    sync_tp_grads,
    verify_tensor_parallel,
    vocab_parallel_cross_entropy,
)


def step_loss(plan: TensorParallelPlan | None) -> Callable[[torch.Tensor, torch.Tensor],
                                                          torch.Tensor]:
    """logits, targets → mean loss: the cross entropy, over the vocab shards under tp."""
    if plan is None:
        return lm_loss

    def loss_fn(logits_BLv: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_BLv, targets_BL, group=plan.group,
                                            counter=plan.counter)

    return loss_fn


def tp_step_hooks(model: nn.Module, plan: TensorParallelPlan | None) -> dict[str, Any]:
    """Keyword arguments for the train and eval steps (loss_fn); {} without tp.
    Verifies the plan first, so call it after all model set-up (checkpointing, device)."""
    if plan is None:
        return {}
    verify_tensor_parallel(model, plan)
    return {"loss_fn": step_loss(plan)}


def engine_axes(model: nn.Module, plan: TensorParallelPlan | None, mesh: Mesh) -> dict[str, Any]:
    """What the data-parallel engine needs to step a tp shard / pipeline stage of the model:
    replicated-gradient sync over tp before the dp reduction (only with sp or replicated kv
    heads, where those gradients are partial sums; it turns off the overlap of the reduction
    with backward), and the clip norm summed over tp (each replicated value once) and pp.
    {} for the whole model on every rank."""
    groups = tuple(g for g in (mesh.group("tp"), mesh.group("pp")) if group_size(g) > 1)
    if plan is None:
        return {"norm_groups": groups} if groups else {}
    axes: dict[str, Any] = {"norm_groups": groups, "grad_replicas": dict(plan.replicas)}
    if plan.sp or plan.kv_slots:  # else every local gradient is complete: keep the overlap
        params = [p for p in model.parameters() if p.requires_grad]
        axes["pre_reduce"] = lambda: sync_tp_grads(params, plan)
    return axes


def take_comm_bytes(plan: TensorParallelPlan | None) -> dict[str, int]:
    """{"comm_tp_bytes": bytes sent on the tp axis since the last call}; {} without tp."""
    if plan is None:
        return {}
    total = plan.counter.total
    plan.counter.reset()
    return {"comm_tp_bytes": total}
