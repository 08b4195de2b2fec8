"""The pieces every step shares: the loss, autocast, a dp mean, the step's result, eval.

The step itself is the data-parallel engine's for every layout (hpctrain.parallel.data.engine:
micro-batch loop or pipeline schedule → one reducer → one global norm → clip → AdamW). Loss
scaling is explicit: each micro-batch's loss is the mean over its tokens divided by the number
of micro-batches, and gradients are averaged over data-parallel ranks, so the update equals
that of the mean loss over the whole global batch on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.distributed.mesh import group_size
from hpctrain.ops.documents import split_micro_batch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def lm_loss(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the tokens whose target is not IGNORE_INDEX
    (padding), computed in fp32."""
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), targets_BL.flatten())


@dataclass
class StepResult:
    loss: float  # mean over the global batch (NaN on pipeline ranks that hold no loss)
    grad_norm: float
    skipped: bool  # fp16 overflow: loss scale lowered, no update
    nonfinite: str | None = None  # "loss", "grad norm", "loss and grad norm": no update either


def allreduce_mean(tensors: Iterable[torch.Tensor], group) -> None:
    """In-place average over `group` (one flat buffer, one collective; none for a size-1
    group)."""
    tensors = list(tensors)
    if group_size(group) == 1 or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batches, *, precision: str, dp_group,
              loss_fn: Callable = lm_loss) -> float:
    losses = []
    device = next(model.parameters()).device
    for micro in batches:
        inputs_BL, targets_BL, docs = split_micro_batch(micro)
        with autocast(precision, device):
            logits = model(inputs_BL.to(device), docs=None if docs is None else docs.to(device))
        losses.append(loss_fn(logits, targets_BL.to(device)).double())
    mean = torch.stack(losses).mean()
    allreduce_mean([mean], dp_group)
    return float(mean)
