"""Trainer glue for tensor parallelism, kept apart so trainer.py and step.py change little.

The model is sharded by `hpctrain.train.setup` (one order for every layout). `step_loss` is the
step's loss (the vocab-parallel one under tp, for the plain step and the pipeline's last
stage); `tp_step_hooks` gives it to the train and eval steps; `tp_pre_reduce` gives the
data-parallel engine the replicated-gradient sync (before the dp reduction). Every tp rank
gets the same batch: the sampler shards by dp only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hpctrain.parallel.step import lm_loss
from hpctrain.parallel.tensor import (
    TensorParallelPlan,
    sync_tp_grads,
    verify_tensor_parallel,
    vocab_parallel_cross_entropy,
)


def step_loss(plan: TensorParallelPlan | None) -> Callable[[torch.Tensor, torch.Tensor],
                                                          torch.Tensor]:
    """logits, targets → mean loss: the cross entropy, over the vocab shards under tp
    (`per_token=`: a list that gets each token's loss too)."""
    if plan is None:
        return lm_loss

    def loss_fn(logits_BLv: torch.Tensor, targets_BL: torch.Tensor, *,
                per_token: list | None = None) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_BLv, targets_BL, group=plan.group,
                                            counter=plan.counter, per_token=per_token)

    return loss_fn


def tp_step_hooks(model: nn.Module, plan: TensorParallelPlan | None) -> dict[str, Any]:
    """Keyword arguments for the train and eval steps (loss_fn); {} without tp.
    Verifies the plan first, so call it after all model set-up (checkpointing, device)."""
    if plan is None:
        return {}
    verify_tensor_parallel(model, plan)
    return {"loss_fn": step_loss(plan)}


def tp_pre_reduce(model: nn.Module,
                  plan: TensorParallelPlan | None) -> Callable[[], None] | None:
    """The replicated-gradient sync over tp the data-parallel engine runs before its dp
    reduction, or None: needed only with sp, replicated kv heads or q/k norms, where those
    gradients are partial sums (it turns off the overlap of the reduction with backward). The
    clip norm's share of tp comes from the shard spec (hpctrain.parallel.state.norm_spec)."""
    if plan is None or not (plan.sp or plan.kv_slots or plan.head_norms):  # all complete
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    return lambda: sync_tp_grads(params, plan)


def take_comm_bytes(plan: TensorParallelPlan | None) -> dict[str, int]:
    """{"comm_tp_bytes": bytes sent on the tp axis since the last call}; {} without tp."""
    if plan is None:
        return {}
    total = plan.counter.total
    plan.counter.reset()
    return {"comm_tp_bytes": total}
