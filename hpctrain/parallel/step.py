"""The pieces every step shares: the loss, its weights, autocast, a dp mean, the result, eval.

The step itself is the data-parallel engine's for every layout (hpctrain.parallel.data.engine:
micro-batch loop or pipeline schedule → one reducer → one global norm → clip → AdamW). Loss
scaling is explicit and weighted by real tokens (targets not IGNORE_INDEX): the step's loss is
    loss = Σ CE over every real token of the global batch / N,  N = real tokens of the batch,
what one process computing one mean over the whole concatenated batch gives, however the
padding falls. Micro-batch i of a rank, mean_i over its n_i real tokens, contributes
mean_i / d_i with d_i = N / (dp · n_i) (`loss_divisors`), and gradients are averaged over dp:
(1/dp) Σ_ranks Σ_i mean_i · dp · n_i / N = Σ CE / N. Without padding every n_i is B·L and d_i is
exactly m, the number of micro-batches: the plain mean of means, bit for bit as before.

N comes from one all-reduce over dp of the local count (16 bytes), not from the sampler: the
count is then right for any loader (training, eval, tests), and the parallel layer need not know
the data layer's row tables; the collective is negligible next to a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.distributed.mesh import group_size
from hpctrain.ops.documents import IGNORE_INDEX, split_micro_batch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device):
    if precision == "fp32" or device.type == "meta":  # no autocast on meta (the dry run)
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def lm_loss(logits_BLV: torch.Tensor, targets_BL: torch.Tensor, *,
            per_token: list | None = None) -> torch.Tensor:
    """Mean next-token cross entropy over the tokens whose target is not IGNORE_INDEX
    (padding), computed in fp32; 0 (with a graph) when every target is padding, e.g. a
    context-parallel shard of a padded row, which then adds nothing to the step's mean.
    Bit-identical to F.cross_entropy's mean otherwise (the same sum and division).
    `per_token`: a list that gets each token's loss_BL too (detached, 0 on padding)."""
    if per_token is not None:
        with torch.no_grad():
            per_token.append(F.cross_entropy(logits_BLV.detach().flatten(0, 1).float(),
                                              targets_BL.flatten(), reduction="none",
                                              ignore_index=IGNORE_INDEX).view_as(targets_BL))
    targets_T = targets_BL.flatten()
    real = (targets_T != IGNORE_INDEX).sum().clamp(min=1)
    return F.cross_entropy(logits_BLV.flatten(0, 1).float(), targets_T, reduction="sum") / real


def loss_divisors(micro_batches, *, dp_group, device: torch.device) -> list[float]:
    """d_i for each of this rank's micro-batches: its mean loss / d_i, summed over the
    micro-batches and averaged over `dp_group` (the group the gradients are averaged over:
    dp, or dp×cp, whose ranks hold shards of the rows), is the mean over every real token of
    the global batch (see the module docstring). d_i = N / (|group| · n_i); one all-reduce of
    [Σ n_i] on `device` (none on a one-rank group). A micro-batch (or shard) with no real
    token gets d_i = 1: its loss is 0 (lm_loss, the vocab-parallel loss), so it adds nothing.

    Raises ValueError on every rank when the whole global batch has no real token (its mean
    is 0/0): the batching must put real targets in it."""
    counts = [int((split_micro_batch(m)[1] != IGNORE_INDEX).sum()) for m in micro_batches]
    total = torch.tensor([sum(counts)], dtype=torch.int64)
    dp = group_size(dp_group)
    if dp > 1:
        total = total.to(device)
        dist.all_reduce(total, group=dp_group)
    n_real = int(total.item())
    if n_real == 0:
        raise ValueError(
            f"the global batch has no real token over the {dp} rank(s) of the dp group: every "
            f"target is IGNORE_INDEX, so the mean loss is undefined: give the batch real "
            f"targets (train.batching=tokens rows always hold one; check the loader's padding)")
    return [n_real / (dp * n) if n else 1.0 for n in counts]


@dataclass
class StepResult:
    loss: float  # mean over the global batch's real tokens (NaN on ranks holding no loss)
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
    """Mean loss over every real token of `batches` on all dp ranks (weighted as the train
    step is: `loss_divisors`), the same float on every rank."""
    batches = list(batches)
    device = next(model.parameters()).device
    divisors = loss_divisors(batches, dp_group=dp_group, device=device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for micro, divisor in zip(batches, divisors, strict=True):
        inputs_BL, targets_BL, docs = split_micro_batch(micro)
        with autocast(precision, device):
            logits = model(inputs_BL.to(device), docs=None if docs is None else docs.to(device))
        total += loss_fn(logits, targets_BL.to(device)).double() / divisor
    allreduce_mean([total], dp_group)
    return float(total)
