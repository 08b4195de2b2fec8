"""The step's non-finite verdict, agreed by every rank before the optimizer updates.

A step is non-finite when its loss (the mean over the global batch) or its global gradient
norm is NaN or ±inf. Both ride in the collective the clip norm already needs: each rank
contributes [Σ‖g‖² of its gradients, 1 if its loss is non-finite else 0] and the vector is
summed over every group the norm is summed over. The verdict therefore costs no collective of
its own, and every rank that steps together reaches the same one: NaN/inf in any rank's
squares poisons the sum everywhere, and the loss flag is > 0 everywhere iff it was set anywhere.

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

LOSS, GRAD_NORM = "loss", "grad norm"


@dataclass(frozen=True)
class NormVerdict:
    norm: float  # global gradient norm (NaN when the step was skipped for fp16 overflow)
    nonfinite: str | None = None  # None, "loss", "grad norm" or "loss and grad norm"


SKIPPED = NormVerdict(math.nan)  # fp16 overflow: no norm computed, not a non-finite step


def reduce_norm(sq: torch.Tensor, *, loss: torch.Tensor | None, groups: Iterable,
                unscale: float = 1.0) -> NormVerdict:
    """Sum [sq, loss flag] over each of `groups` (None entries skipped) in one all-reduce per
    group; return ‖g‖ = √Σsq / unscale and what, if anything, was non-finite."""
    sq = sq.to(torch.float64).reshape(())
    # A tensor, not a Python bool: no device sync beyond the one the norm needs anyway.
    flag = (torch.zeros_like(sq) if loss is None
            else (~torch.isfinite(loss)).any().to(sq))
    vec = torch.stack([sq, flag])
    for group in groups:
        if group is not None:
            dist.all_reduce(vec, group=group)
    total, flags = vec.tolist()  # one device sync
    norm = math.sqrt(total) / unscale
    bad_loss, bad_norm = flags > 0, not math.isfinite(norm)
    what = [name for name, bad in ((LOSS, bad_loss), (GRAD_NORM, bad_norm)) if bad]
    return NormVerdict(norm, " and ".join(what) or None)
