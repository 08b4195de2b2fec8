"""What the trainer does after a non-finite step (train.on_nonfinite), and the checkpoint guard.

The step never applies a non-finite update: the loss and the global gradient norm are judged in
the norm's own all-reduce before the optimizer runs (hpctrain.parallel.finite), so every rank
holds the same verdict and takes the same branch here, with no collective of its own:

  stop      raise NonFiniteError (exit code 3) naming the step, what was non-finite, the last
            finite loss / grad norm / lr, the last checkpoint and the fix. Nothing is saved.
  skip      the update was dropped (weights and optimizer state unchanged, counted as
            `nonfinite_skipped`); training goes on. MAX_CONSECUTIVE_SKIPS in a row stop as above.
  rollback  the trainer reloads the newest verified checkpoint and skips the data of the steps
            since it, through the bad one (a data offset, kept in train_state.json so that a
            resume stays exact). At most MAX_ROLLBACKS per run; with no checkpoint, stop.

fp16's loss-scale skips (overflowing gradients) are not non-finite steps: the scaler handles them.
`check_finite_state` refuses to write a checkpoint whose weights or optimizer state hold NaN/inf.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from hpctrain.config.schema import Config
from hpctrain.errors import NonFiniteError

MAX_CONSECUTIVE_SKIPS = 10  # skip mode: this many non-finite steps in a row stop the run
MAX_ROLLBACKS = 3  # rollback mode: per run (the count is kept in train_state.json)

Action = Literal["continue", "stop", "rollback"]


@dataclass(frozen=True)
class LastFinite:
    step: int = 0
    loss: float = math.nan  # NaN on pipeline ranks that hold no loss
    grad_norm: float = math.nan
    lr: float = math.nan


class NonFiniteGuard:
    """The policy's state on one rank: counts of skips and rollbacks, the last finite step."""

    def __init__(self, mode: str, *, rollbacks: int = 0):
        self.mode, self.rollbacks = mode, rollbacks
        self.skipped = 0  # updates dropped by skip mode in this process
        self.consecutive = 0
        self.last = LastFinite()
        self.reason = ""

    def after_step(self, step: int, metrics: dict[str, Any]) -> Action:
        """Judge update number `step` from its metrics (adds `nonfinite_skipped` in skip mode);
        on "stop", `reason` says why for `stop_error`."""
        action: Action = "continue"
        if metrics.get("nonfinite") is None:
            self.consecutive = 0
            self.last = LastFinite(step, metrics["loss"], metrics["grad_norm"], metrics["lr"])
        else:
            action = self._decide()
        if self.mode == "skip":
            metrics["nonfinite_skipped"] = self.skipped
        return action

    def _decide(self) -> Action:
        if self.mode == "skip":
            self.skipped += 1
            self.consecutive += 1
            if self.consecutive < MAX_CONSECUTIVE_SKIPS:
                return "continue"
            self.reason = f"{self.consecutive} consecutive non-finite steps skipped, the limit"
            return "stop"
        if self.mode == "rollback" and self.rollbacks < MAX_ROLLBACKS:
            self.rollbacks += 1
            return "rollback"
        self.reason = (f"{self.rollbacks} rollbacks already, the limit"
                       if self.mode == "rollback" else "")
        return "stop"

    def cannot_roll_back(self) -> Action:
        """rollback mode, but no checkpoint to return to: stop."""
        self.reason = "no checkpoint to roll back to"
        return "stop"

    def stop_error(self, step: int, metrics: dict[str, Any], *, cfg: Config,
                   checkpoint: Path | None, device: torch.device) -> NonFiniteError:
        """The one message every rank raises. Collective over the world (all ranks stop at the
        same step): the last finite loss is known only where the loss is, so agree on it."""
        last = self.last
        loss = _agreed_loss(last.loss, device=device)
        o = cfg.optim
        where = (f"last checkpoint {checkpoint}" if checkpoint is not None
                 else "no checkpoint was written yet (set train.checkpoint_every)")
        policy = f"train.on_nonfinite={self.mode}" + (f": {self.reason}" if self.reason else "")
        router = _router_losses(metrics, cfg)
        if router:  # the router's loss broke the step, not the learning rate
            return NonFiniteError(
                f"step {step}: non-finite MoE router loss: {router} (loss="
                f"{_fmt(metrics['loss'])}, grad norm={_fmt(metrics['grad_norm'])}), training "
                f"stopped ({policy}). The bad update was not applied and nothing was saved; "
                f"{where}. Fix: lower the coefficient named, then resume")
        return NonFiniteError(
            f"step {step}: non-finite {metrics['nonfinite']} (loss={_fmt(metrics['loss'])}, "
            f"grad norm={_fmt(metrics['grad_norm'])}, lr={_fmt(metrics['lr'])}), training "
            f"stopped ({policy}). Last finite step {last.step}: loss={_fmt(loss)}, "
            f"grad norm={_fmt(last.grad_norm)}, "
            f"lr={_fmt(last.lr)}. The bad update was not applied and nothing was saved; "
            f"{where}. Fix: lower optim.lr (now {o.lr:g}), raise optim.warmup_steps "
            f"(now {o.warmup_steps}) or set train.grad_clip (now {cfg.train.grad_clip:g}), then "
            f"resume; or set train.on_nonfinite=skip|rollback to step over bad batches")


ROUTER_LOSSES = (("moe_aux_loss", "load-balancing loss", "aux_loss_coef"),
                 ("moe_z_loss", "router z-loss", "z_loss_coef"))


def _router_losses(metrics: dict[str, Any], cfg: Config) -> str:
    """The step's non-finite router losses with their coefficients ('' when none): the
    `moe_*` metrics are agreed over the dp and pp groups, so every rank names the same."""
    bad = [f"{name}={_fmt(metrics[key])} with model.moe.{coef}="
           f"{getattr(cfg.model.moe, coef):g}" for key, name, coef in ROUTER_LOSSES
           if metrics.get(key) is not None and not math.isfinite(metrics[key])]
    return ", ".join(bad)


def _fmt(value: float) -> str:
    return "n/a" if value is None else f"{value:.6g}"


def _agreed_loss(loss: float, *, device: torch.device) -> float | None:
    """Every rank's view of the last finite loss: MAX over the world of the ranks that know it
    (they all hold the same dp-averaged value); None when no rank knows one."""
    value = torch.tensor([loss if math.isfinite(loss) else -math.inf], dtype=torch.float64,
                         device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value) if math.isfinite(float(value)) else None


def check_finite_state(tensors: Iterable[torch.Tensor], *, path: Path,
                       device: torch.device) -> None:
    """Raise NonFiniteError on every rank when any rank's `tensors` (its weights and optimizer
    state) hold NaN/inf, before a checkpoint is written to `path`. Collective over the world:
    one sum per tensor, one device sync, one tiny all-reduce."""
    local = [t.detach() for t in tensors if t.is_floating_point() and t.numel() > 0]
    # A sum is finite only if every element is (NaN and ±inf propagate) and runs ~10x faster
    # than an element-wise test; a sum that overflowed on huge finite values is confirmed
    # element by element.
    sums = torch.stack([t.sum().float().to(device) for t in local]) if local else None
    suspects = ([] if sums is None else
                [t for t, ok in zip(local, torch.isfinite(sums).tolist(), strict=True) if not ok])
    bad_here = any(not bool(torch.isfinite(t).all()) for t in suspects)
    world = dist.get_world_size() if dist.is_initialized() else 1
    bad = torch.zeros(world, dtype=torch.float32, device=device)
    bad[dist.get_rank() if dist.is_initialized() else 0] = float(bad_here)
    if dist.is_initialized():
        dist.all_reduce(bad)
    ranks = [r for r, flag in enumerate(bad.tolist()) if flag > 0]
    if ranks:
        raise NonFiniteError(
            f"refusing to write checkpoint {path}: the weights or optimizer state hold NaN/inf "
            f"on rank(s) {ranks}; earlier checkpoints are kept. Fix: resume from the last good "
            f"checkpoint (train.resume=<dir>) with a lower optim.lr, or set "
            f"train.on_nonfinite=skip|rollback")
