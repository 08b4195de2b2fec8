"""The single-process reference every parallel layout is compared with: plain torch, no
hpctrain engine. One step = forward/backward of each micro-batch (loss / n_micro), torch's
clip_grad_norm_, torch AdamW (matrices decayed, norm gains not; foreach=False), zero_grad."""

from __future__ import annotations

import torch

from hpctrain.config import OptimConfig
from hpctrain.parallel.step import lm_loss
from hpctrain.train.optim import param_groups


def reference_optimizer(model: torch.nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    groups = param_groups(list(model.named_parameters()), optim.weight_decay)
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2),
                             eps=optim.eps, foreach=False)


def reference_step(model: torch.nn.Module, opt: torch.optim.Optimizer, micro_batches, *,
                   n_micro: int, grad_clip: float, loss_fn=lm_loss) -> tuple[float, float]:
    """(mean loss over the micro-batches, grad norm before clipping)."""
    loss_sum = 0.0
    for inputs_BL, targets_BL in micro_batches:
        loss = loss_fn(model(inputs_BL), targets_BL) / n_micro
        loss.backward()
        loss_sum += float(loss.detach())
    params = [p for p in model.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"),
                                          foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss_sum, float(norm)
