"""One optimizer step: micro-batch forward/backward, gradient averaging over dp, clipping.

Loss scaling is explicit: each micro-batch's loss is the mean over its tokens divided by the
number of micro-batches, and gradients are averaged over data-parallel ranks, so the update
equals that of the mean loss over the whole global batch on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.train.scaler import LossScaler

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def lm_loss(logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all tokens, computed in fp32."""
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), targets_BL.flatten())


@dataclass
class StepResult:
    loss: float  # mean over the global batch (NaN on pipeline ranks that hold no loss)
    grad_norm: float
    skipped: bool  # fp16 overflow: loss scale lowered, no update
    nonfinite: str | None = None  # "loss", "grad norm", "loss and grad norm": no update either


def allreduce_mean(tensors: Iterable[torch.Tensor], group) -> None:
    """In-place average over `group` (one flat buffer, one collective)."""
    tensors = list(tensors)
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               micro_batches: Iterable[tuple[torch.Tensor, torch.Tensor]], *,
               n_micro: int, precision: str, scaler: LossScaler, dp_group,
               grad_clip: float, reduce_grads: Callable | None = None,
               loss_fn: Callable = lm_loss, clip: Callable | None = None) -> StepResult:
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    multiplier = scaler.loss_multiplier()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for inputs_BL, targets_BL in micro_batches:
        with autocast(precision, device):
            logits = model(inputs_BL.to(device))
        loss = loss_fn(logits, targets_BL.to(device)) / n_micro
        (loss * multiplier).backward()
        loss_sum += loss.detach().double()
    grads = [p.grad for p in params if p.grad is not None]
    (reduce_grads or allreduce_mean)(grads, dp_group)
    allreduce_mean([loss_sum], dp_group)
    skipped = scaler.enabled and scaler.found_overflow(grads)
    scaler.update(skipped)
    norm = float("nan")
    if not skipped:
        if multiplier != 1.0:
            torch._foreach_div_(grads, multiplier)
        norm = (clip or _clip)(params, grad_clip)
        optimizer.step()
    # Keep the gradient buffers (zeroed) between steps: they are part of the steady-state
    # memory the ledger reports, and reallocating them every step costs time.
    optimizer.zero_grad(set_to_none=False)
    return StepResult(float(loss_sum), norm, skipped)


def _clip(params: list[torch.nn.Parameter], max_norm: float) -> float:
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))


@torch.no_grad()
def eval_loss(model: torch.nn.Module, batches, *, precision: str, dp_group,
              loss_fn: Callable = lm_loss) -> float:
    losses = []
    device = next(model.parameters()).device
    for inputs_BL, targets_BL in batches:
        with autocast(precision, device):
            logits = model(inputs_BL.to(device))
        losses.append(loss_fn(logits, targets_BL.to(device)).double())
    mean = torch.stack(losses).mean()
    allreduce_mean([mean], dp_group)
    return float(mean)
