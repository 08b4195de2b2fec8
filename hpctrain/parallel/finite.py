"""The step's non-finite verdict, agreed by every rank before the optimizer updates.

A step is non-finite when its loss (the mean over the global batch) or its global gradient
norm is NaN or ±inf. Both ride in the collective the clip norm already needs: each rank
contributes [Σ‖g‖² of its gradients, 0·loss] and the vector is summed over every group the norm
is summed over. The verdict therefore costs no collective of its own, and every rank that steps
together reaches the same one: NaN/inf in any rank's squares or loss poisons that sum everywhere.

The loss must already agree within a data-parallel group (the step averages it over dp before
the update), because with unsharded optimizers the norm is not summed over dp: the gradients
are equal there already. Ranks that hold no loss (pipeline stages before the last) pass None.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size

LOSS, GRAD_NORM = "loss", "grad norm"


@dataclass(frozen=True)
class NormVerdict:
    norm: float  # global gradient norm (NaN when the step was skipped for fp16 overflow)
    nonfinite: str | None = None  # None, "loss", "grad norm" or "loss and grad norm"


SKIPPED = NormVerdict(math.nan)  # fp16 overflow: no norm computed, not a non-finite step


def reduce_norm(sq: torch.Tensor, *, loss: torch.Tensor | None, groups: Iterable,
                unscale: float = 1.0) -> NormVerdict:
    """Sum [sq, 0·loss] (both 0-d float64) over each of `groups` (size-1 groups skipped), one
    all-reduce per group; return ‖g‖ = √Σsq / unscale and what, if anything, was non-finite.
    0·loss is 0 for a finite loss and NaN for NaN/±inf, so the sum is NaN iff any rank's loss
    was non-finite: no comparison, no extra device sync, ~1 op per step."""
    poison = torch.zeros_like(sq) if loss is None else loss.to(sq) * 0
    vec = torch.stack([sq, poison])
    for group in groups:
        if group_size(group) > 1:
            dist.all_reduce(vec, group=group)
    total, poisoned = vec.tolist()  # one device sync, as the norm alone needed
    norm = math.sqrt(total) / unscale
    bad_loss, bad_norm = not math.isfinite(poisoned), not math.isfinite(norm)
    what = [name for name, bad in ((LOSS, bad_loss), (GRAD_NORM, bad_norm)) if bad]
    return NormVerdict(norm, " and ".join(what) or None)
