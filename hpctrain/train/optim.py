"""AdamW with fp32 state and the warmup + cosine learning-rate schedule.

The LR is a pure function of the step (no scheduler object), so resuming needs only the step.
"""

from __future__ import annotations

import math

import torch

from hpctrain.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, *, total_steps: int) -> float:
    """Linear warmup from lr/warmup to lr, then cosine decay to min_lr at total_steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.lr_schedule == "constant":
        return optim.lr
    span = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    return optim.min_lr + 0.5 * (optim.lr - optim.min_lr) * (1 + math.cos(math.pi * progress))


def param_groups(params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices; leave norm gains (1-D) undecayed, as is standard for transformers."""
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
