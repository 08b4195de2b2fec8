"""Dynamic loss scaling for fp16: scale the loss, skip the step when any rank overflows.

Overflow is agreed by all ranks (a MAX all-reduce of a 0/1 flag) so every rank skips together.
After `growth_interval` clean steps the scale doubles; on overflow it halves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size


@dataclass
class LossScaler:
    scale: float = 2.0**16
    growth_interval: int = 1000
    min_scale: float = 1.0
    clean_steps: int = 0
    enabled: bool = True

    def loss_multiplier(self) -> float:
        return self.scale if self.enabled else 1.0

    def found_overflow(self, grads: list[torch.Tensor], *, group) -> bool:
        """True when any gradient on any rank of `group` holds inf/nan (a one-rank group, or
        None without torch.distributed: this process alone)."""
        local = any(not torch.isfinite(g).all() for g in grads)
        flag = torch.tensor([1.0 if local else 0.0], device=grads[0].device if grads else None)
        if group_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def update(self, overflow: bool) -> None:
        if not self.enabled:
            return
        if overflow:
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
