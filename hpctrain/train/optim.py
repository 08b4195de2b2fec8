"""AdamW with fp32 state and the learning-rate schedules of optim.lr_schedule, with their checks.

The LR is a pure function of the step (no scheduler object), so resuming needs only the step.
Every schedule starts with a linear warmup, lr·(s+1)/W for s < W = optim.warmup_steps; after it,
with T = total steps, p = (s − W)/(T − W) and m = optim.min_lr:

- cosine:   m + (lr − m)·(1 + cos(π·p))/2
- linear:   m + (lr − m)·(1 − p)
- constant: lr
- inv_sqrt: lr·sqrt(W / max(s, W))  (needs W ≥ 1; min_lr is not used)
- wsd (warmup-stable-decay): lr until the last D = round(optim.decay_fraction·T) steps, then
  m + (lr − m)·f(q), q = (s − (T − D))/D, f by optim.decay_shape: linear 1 − q,
  cosine (1 + cos(π·q))/2, 1-sqrt 1 − sqrt(q).

p and q are clamped to [0, 1], so steps past T stay at the schedule's last value.
"""

from __future__ import annotations

import math

import torch

from hpctrain.config.rule import check
from hpctrain.config.schema import Config, OptimConfig

DECAY_SHAPES = {
    "linear": lambda q: 1.0 - q,
    "cosine": lambda q: 0.5 * (1.0 + math.cos(math.pi * q)),
    "1-sqrt": lambda q: 1.0 - math.sqrt(q),
}


def wsd_decay_steps(optim: OptimConfig, total_steps: int) -> int:
    """D of the wsd schedule: the last steps, after the stable phase, that decay to min_lr."""
    return max(1, round(optim.decay_fraction * total_steps))


def lr_at(step: int, optim: OptimConfig, *, total_steps: int) -> float:
    """The learning rate of `step` (module doc)."""
    warmup, lr, low = optim.warmup_steps, optim.lr, optim.min_lr
    if step < warmup:
        return lr * (step + 1) / warmup
    kind = optim.lr_schedule
    if kind == "constant":
        return lr
    if kind == "inv_sqrt":
        return lr * math.sqrt(warmup / max(step, warmup))
    if kind == "wsd":
        decay = wsd_decay_steps(optim, total_steps)
        q = min(1.0, max(0.0, (step - (total_steps - decay)) / decay))
        return low + (lr - low) * DECAY_SHAPES[optim.decay_shape](q)
    p = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return low + (lr - low) * DECAY_SHAPES["cosine" if kind == "cosine" else "linear"](p)


def param_groups(params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices; leave norm gains (1-D) undecayed, as is standard for transformers."""
    decay = [p for _, p in params if p.ndim >= 2]
    no_decay = [p for _, p in params if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@check("optim.min_lr", "optim.lr", "optim.lr_schedule")
def check_optim(c: Config) -> list[str]:
    """A decaying schedule decays down to min_lr, not up."""
    o = c.optim
    if o.lr_schedule not in ("cosine", "linear", "wsd") or o.min_lr <= o.lr:
        return []
    return [f"optim.min_lr={o.min_lr:g} exceeds optim.lr={o.lr:g}: the {o.lr_schedule} schedule "
            f"decays from lr to min_lr, so the LR would climb to {o.min_lr / o.lr:.3g}× its "
            f"peak; set optim.min_lr at most optim.lr, e.g. optim.min_lr={o.lr / 10:g}"]


@check("optim.lr_schedule", "optim.warmup_steps", "optim.decay_fraction", "train.steps")
def check_lr_schedule(c: Config) -> list[str]:
    """inv_sqrt has a warmup; the wsd decay does not overlap the warmup."""
    o, steps = c.optim, c.train.steps
    if o.lr_schedule == "inv_sqrt" and o.warmup_steps < 1:
        return ["optim.lr_schedule=inv_sqrt is lr·sqrt(warmup/step) and needs "
                "optim.warmup_steps ≥ 1: set e.g. optim.warmup_steps=20"]
    decay = wsd_decay_steps(o, steps)
    if o.lr_schedule != "wsd" or steps - decay >= o.warmup_steps:
        return []
    most = (steps - o.warmup_steps) / steps
    return [f"optim.decay_fraction={o.decay_fraction:g} of train.steps={steps} is {decay} decay "
            f"steps, which overlap the optim.warmup_steps={o.warmup_steps}: set "
            f"optim.decay_fraction at most {most:.3g} or fewer warmup steps"]
