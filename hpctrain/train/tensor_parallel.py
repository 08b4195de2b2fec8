"""Trainer glue for tensor parallelism, kept apart so trainer.py and step.py change little.

`setup_tensor_parallel` shards the freshly built model when parallel.tp > 1 (else returns
None and the single-process path is untouched); `tp_step_hooks` gives the train and eval steps
the vocab-parallel loss; `engine_axes` gives the data-parallel engine the replicated-gradient
sync (before the dp reduction) and the clip norm over the unsharded model (and over pp). Every
tp rank gets the same batch: the sampler shards by dp only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hpctrain.config import Config
from hpctrain.distributed.mesh import Mesh, group_size
from hpctrain.parallel.tensor import (
    TensorParallelPlan,
    apply_tensor_parallel,
    sync_tp_grads,
    verify_tensor_parallel,
    vocab_parallel_cross_entropy,
)


def setup_tensor_parallel(model: nn.Module, cfg: Config, mesh: Mesh) -> TensorParallelPlan | None:
    if cfg.parallel.tp == 1:
        return None
    return apply_tensor_parallel(model, group=mesh.group("tp"), sp=cfg.parallel.sp,
                                 seed=cfg.train.seed, cfg=cfg.model)


def tp_step_hooks(model: nn.Module, plan: TensorParallelPlan | None) -> dict[str, Any]:
    """Keyword arguments for the train and eval steps (loss_fn); {} without tp.
    Verifies the plan first, so call it after all model set-up (checkpointing, device)."""
    if plan is None:
        return {}
    verify_tensor_parallel(model, plan)

    def loss_fn(logits_BLv, targets_BL):
        return vocab_parallel_cross_entropy(logits_BLv, targets_BL, group=plan.group,
                                            counter=plan.counter)

    return {"loss_fn": loss_fn}


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
