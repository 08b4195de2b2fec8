"""Per-step routing metrics of a mixture-of-experts model (metrics.jsonl keys `moe_*`).

From the statistics every MoE layer accumulated over the step's training forwards
(hpctrain.models.moe.layer `take_moe_stats`), summed over the dp×cp group (every rank routes its own
tokens over all E experts), so the numbers describe the whole global batch:

  moe_tokens_per_expert_min / _max   assignments (token, expert) an expert was routed, the
                                     extremes over every expert of every MoE layer
  moe_load_cv                        coefficient of variation (std / mean over experts) of
                                     those counts, averaged over the MoE layers: 0 is perfect
                                     balance
  moe_dropped_fraction               assignments dropped by the capacity factor / all
  moe_aux_loss, moe_z_loss           the router losses added to the training loss (their
                                     coefficients included), per micro-batch, summed over
                                     layers, averaged over micro-batches and dp ranks
  comm_ep_bytes                      bytes this rank sent to other ranks in the experts'
                                     all-to-alls (dispatch + combine, forward + backward),
                                     measured from the split counts (ep > 1 only)

With pipeline stages (`pp_group`) the layer sums add over the pp ranks and the extremes are
taken over every layer of every stage, so the numbers equal the single process's.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.distributed.mesh import group_size
from hpctrain.models.moe.layer import moe_layers, take_moe_stats
from hpctrain.parallel.moe import take_all_to_all_bytes


def drop_moe_metrics(model: nn.Module) -> None:
    """Forget what forwards outside the step (eval) counted."""
    take_moe_stats(model)
    take_all_to_all_bytes(model)


def _layer_counts(layers, stats, *, device: torch.device) -> torch.Tensor:
    """Assignments per expert of each layer, [layers, E] in fp64 ([0, 1] with no layer)."""
    if not layers:
        return torch.zeros(0, 1, dtype=torch.float64, device=device)
    return torch.stack([
        s.routed_E.cpu() if s.routed_E is not None else torch.zeros(m.moe.num_experts)
        for m, s in zip(layers, stats, strict=True)]).to(device, torch.float64)


def moe_metrics(model: nn.Module, *, group, device: torch.device, pp_group,
                sp_group) -> dict[str, Any]:
    """The step's `moe_*` metrics (module docstring); {} without MoE layers. Collective over
    `group` (the dp×cp group): every rank of it calls this after every step. `pp_group`: the
    pipeline group (one rank without pp); with stages each rank holds only its stages'
    layers, so the per-layer sums and extremes are combined over it (every pp rank calls,
    also one whose stages hold no MoE layer), giving the whole model's numbers. `sp_group`:
    the tp group under sequence parallelism, whose ranks route parts of the same rows (their
    counts add; their aux and z are the micro-batch's already), else None."""
    layers = moe_layers(model)
    if not layers and group_size(pp_group) == 1:
        return {}
    stats = take_moe_stats(model)  # in the order of `layers`
    counts_LE = _layer_counts(layers, stats, device=device)
    forwards = max(1, max((s.forwards for s in stats), default=1))
    scalars = torch.tensor([sum(s.kept for s in stats), sum(s.assignments for s in stats),
                            sum(s.aux for s in stats) / forwards,
                            sum(s.z for s in stats) / forwards], dtype=torch.float64,
                           device=device)
    if group_size(sp_group) > 1:
        counts = torch.cat([counts_LE.flatten(), scalars[:2]])
        dist.all_reduce(counts, group=sp_group)
        counts_LE, scalars = counts[:-2].view_as(counts_LE), torch.cat([counts[-2:], scalars[2:]])
    if group_size(group) > 1:
        flat = torch.cat([counts_LE.flatten(), scalars])
        dist.all_reduce(flat, group=group)
        counts_LE, scalars = flat[:-4].view_as(counts_LE), flat[-4:]
        scalars[2:] /= group_size(group)
    cv = counts_LE.std(1, correction=0) / counts_LE.mean(1).clamp(min=1e-12)
    sums = torch.cat([scalars, torch.stack([cv.sum(), torch.tensor(float(len(cv)),
                                                                   device=device)])])
    low = counts_LE.min() if layers else torch.tensor(math.inf, device=device)
    high = counts_LE.max() if layers else torch.tensor(-math.inf, device=device)
    if group_size(pp_group) > 1:  # the stages' layers: sums add, extremes over all layers
        low, high = low.to(torch.float64).reshape(1), high.to(torch.float64).reshape(1)
        dist.all_reduce(sums, group=pp_group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=pp_group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=pp_group)
    kept, assigned, aux, z, cv_sum, n_layers = sums.tolist()
    return {"moe_tokens_per_expert_min": int(low.min()),
            "moe_tokens_per_expert_max": int(high.max()),
            "moe_load_cv": cv_sum / max(n_layers, 1.0), "moe_aux_loss": aux, "moe_z_loss": z,
            "moe_dropped_fraction": 1.0 - kept / assigned if assigned else 0.0,
            **take_all_to_all_bytes(model)}
