"""Cross entropy over vocabulary-sharded logits, never gathering the full vocabulary.

Legend: T tokens (B·L flattened), v = V/tp local vocabulary, rank r holds columns [r·v, (r+1)·v).
With m_t = max_V z_t (all-reduce MAX), S_t = Σ_V exp(z_t − m_t) and the target logit
z_t[y_t] (one all-reduce SUM of both; only the rank owning y_t contributes it):
    loss = mean_t (log S_t − (z_t[y_t] − m_t))
    ∂loss/∂z_t = (softmax(z_t) − onehot(y_t)) / T, computed locally on each rank's columns.
Tokens whose target is IGNORE_INDEX (padding) are left out of the mean and get no gradient, as
in F.cross_entropy; T counts the others. The step weights this per-micro-batch mean by its real
tokens (hpctrain.parallel.step.loss_divisors), as it does lm_loss.
The computation is in fp32 (fp64 if the logits are fp64).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.ops.documents import IGNORE_INDEX
from hpctrain.parallel.tensor.comm import CommCounter, _rank, _size, all_reduce


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_Tv, targets_T, group, counter, per_token):
        dtype = torch.promote_types(logits_Tv.dtype, torch.float32)
        z_Tv = logits_Tv.to(dtype)
        v = z_Tv.shape[-1]
        m_T = all_reduce(z_Tv.max(dim=-1).values, group=group, counter=counter,
                         op=dist.ReduceOp.MAX)
        exp_Tv = torch.exp(z_Tv - m_T.unsqueeze(-1))
        local_T = targets_T - _rank(group) * v
        mine_T = (local_T >= 0) & (local_T < v)
        local_T = local_T.masked_fill(~mine_T, 0)
        target_T = z_Tv.gather(-1, local_T.unsqueeze(-1)).squeeze(-1) * mine_T
        sums_2T = all_reduce(torch.stack([exp_Tv.sum(-1), target_T]), group=group,
                             counter=counter)
        sum_T, target_T = sums_2T[0], sums_2T[1]
        valid_T = (targets_T != IGNORE_INDEX).to(dtype)
        token_T = (torch.log(sum_T) - (target_T - m_T)) * valid_T
        if per_token is not None:
            per_token.append(token_T.detach().clone())
        loss = token_T.sum() / valid_T.sum().clamp(min=1)
        ctx.save_for_backward(exp_Tv, sum_T, local_T, mine_T, valid_T)
        ctx.logits_dtype = logits_Tv.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        exp_Tv, sum_T, local_T, mine_T, valid_T = ctx.saved_tensors
        g_Tv = exp_Tv / sum_T.unsqueeze(-1)
        g_Tv.scatter_add_(-1, local_T.unsqueeze(-1), -mine_T.to(g_Tv.dtype).unsqueeze(-1))
        g_Tv *= (grad / valid_T.sum().clamp(min=1)) * valid_T.unsqueeze(-1)
        return g_Tv.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits_BLv: torch.Tensor, targets_BL: torch.Tensor, *, group,
                                 counter: CommCounter | None = None,
                                 per_token: list | None = None) -> torch.Tensor:
    """Mean next-token cross entropy from this rank's vocabulary shard of the logits.

    Equals F.cross_entropy(gather(logits), targets) but communicates 3·T numbers, not T·V.
    `per_token`: a list that gets each token's loss_BL too (detached, 0 on padding; the same
    on every rank of `group`)."""
    if _size(group) == 1:
        if per_token is not None:
            with torch.no_grad():
                per_token.append(torch.nn.functional.cross_entropy(
                    logits_BLv.detach().flatten(0, 1).float(), targets_BL.flatten(),
                    reduction="none", ignore_index=IGNORE_INDEX).view_as(targets_BL))
        dtype = torch.promote_types(logits_BLv.dtype, torch.float32)
        targets_T = targets_BL.flatten()
        real = (targets_T != IGNORE_INDEX).sum().clamp(min=1)  # all padding: 0, as lm_loss
        return torch.nn.functional.cross_entropy(logits_BLv.flatten(0, 1).to(dtype), targets_T,
                                                 reduction="sum") / real
    out: list = []
    loss = _VocabParallelCE.apply(logits_BLv.flatten(0, 1), targets_BL.flatten(), group, counter,
                                  out if per_token is not None else None)
    if per_token is not None:
        per_token.append(out[0].view_as(targets_BL))
    return loss
