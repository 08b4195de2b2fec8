"""The router of a mixture-of-experts block: which experts each token goes to, with what gate,
and the load-balancing and z losses.

Legend: T tokens of the micro-batch (B·L flattened), D model dim, E routed experts, F expert
ffn dim, A routed (token, expert) assignments kept (≤ T·k), k = top_k.

Routing (`route`), in fp32 (fp64 for fp64 models) whatever the compute dtype:
  logits_TE = x_TD W_rᵀ;  softmax router: s = softmax(logits);  sigmoid router: s = σ(logits).
  The top-k experts of each token by s; gates g = s_topk / Σ s_topk when k > 1 (Mixtral for
  softmax, DeepSeek-V3 for sigmoid), g = s_top1 unrenormalised when k = 1 (Switch: a gate of 1
  would give the router no gradient from the LM loss).
  aux  = coef · E · Σ_e f_e · P_e (Switch/GShard): f_e the fraction of the T·k assignments to
        e (before any dropping; no gradient), P_e the mean over tokens of e's normalised score
        (s itself for softmax, s / Σ_e s for sigmoid).
  z    = coef · mean_T logsumexp(logits)² (ST-MoE router z-loss).
  capacity (capacity_factor c > 0): expert e keeps its C = ceil(c·T·k/E) assignments of highest
  score, ties to the lower token index (deterministic); the rest are dropped (the token keeps
  its residual stream and the shared experts). c = 0 is dropless.
  Under context parallelism each cp rank holds a part of every row (`MoE.token_group`, set by
  hpctrain.parallel.context.apply), and under sequence parallelism each tp rank a part of the
  sequence (set by hpctrain.parallel.tensor.plan): every token is routed where it is, and the
  statistics aux and z average over (f_e, Σ_T P, Σ_T lse², T) are summed over the group first
  — P and lse² through an all-reduce whose backward sums the gradients too — so each rank
  holds the micro-batch's own aux and z, as one process would. Under sp every tp rank adds
  them to the same loss and the all-reduce's backward sums tp copies of their gradient, so
  the loss a rank adds is (aux + z) / tp (`MoE.loss_share`); cp ranks average their losses
  instead (share 1). Dropless only (capacity ranks assignments across the whole micro-batch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from hpctrain.models.config import MoEConfig


@dataclass
class Routing:
    """One micro-batch's routing: kept assignments sorted by expert (stable in token order)."""

    token_A: torch.Tensor  # token index of each kept assignment
    gate_A: torch.Tensor  # its gate (fp32, with graph)
    counts_E: torch.Tensor  # kept assignments per expert (int64)
    routed_E: torch.Tensor  # assignments per expert before dropping (int64)
    aux: torch.Tensor  # coef-weighted load-balancing loss (0-d, with graph)
    z: torch.Tensor  # coef-weighted router z-loss (0-d, with graph)


def capacity(moe: MoEConfig, tokens: int) -> int:
    """Assignments an expert keeps at capacity_factor c: ceil(c·T·k/E); T·k when dropless."""
    if moe.capacity_factor <= 0:
        return tokens * moe.top_k
    return math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.num_experts)


def route(logits_TE: torch.Tensor, moe: MoEConfig, *, group) -> Routing:
    """Top-k routing of T tokens (module docstring: gates, aux, z, capacity dropping);
    `group`: the ranks holding the rest of the micro-batch's tokens (cp, sp), or None (this
    rank holds them all)."""
    T, E = logits_TE.shape
    logits_TE = logits_TE.to(torch.promote_types(logits_TE.dtype, torch.float32))
    scores_TE = logits_TE.softmax(-1) if moe.router == "softmax" else logits_TE.sigmoid()
    top_TK, expert_TK = scores_TE.topk(moe.top_k, dim=-1)
    gate_TK = top_TK / top_TK.sum(-1, keepdim=True) if moe.top_k > 1 else top_TK
    probs_TE = scores_TE if moe.router == "softmax" else scores_TE / scores_TE.sum(-1, True)
    if logits_TE.is_meta:  # a dry run: meta tensors make no choice (`bound_routing`)
        return bound_routing(logits_TE, probs_TE, gate_TK, moe, group=group)
    routed_E = torch.bincount(expert_TK.flatten(), minlength=E)
    aux, z = _losses(logits_TE, probs_TE, routed_E, moe, group=group)
    # Sort assignments by expert, then score descending, then token: the capacity keeps the
    # first C of each expert, and the kept order is the expert-major order the experts need.
    expert_A, score_A = expert_TK.flatten(), top_TK.detach().flatten()
    token_A = torch.arange(T, device=logits_TE.device).repeat_interleave(moe.top_k)
    order = torch.sort(score_A, descending=True, stable=True).indices
    order = order[torch.sort(expert_A[order], stable=True).indices]
    start_E = torch.cumsum(routed_E, 0) - routed_E
    rank_A = torch.arange(order.numel(), device=order.device) - start_E[expert_A[order]]
    keep = order[rank_A < capacity(moe, T)]
    counts_E = torch.bincount(expert_A[keep], minlength=E)
    return Routing(token_A[keep], gate_TK.flatten()[keep], counts_E, routed_E, aux, z)


def bound_routing(logits_TE, probs_TE, gate_TK, moe: MoEConfig, *, group) -> Routing:
    """The routing of a dry run (hpctrain.tasks.dryrun.rank: meta logits, no choice made), at
    the bound the planner counts (hpctrain.plan.experts.routed_copies): dropless, the T·k
    assignments spread evenly over the E experts; with a capacity, every expert full (C
    each). The counts are host tensors (their values size the experts' rows and the
    all-to-all's splits); the kept indices are meta, so every tensor the real routing saves
    for backward exists with its real shape."""
    T, E = logits_TE.shape
    base, extra = divmod(T * moe.top_k, E)
    routed_E = torch.tensor([base + (e < extra) for e in range(E)])
    counts_E = routed_E if moe.capacity_factor <= 0 else torch.full((E,), capacity(moe, T))
    aux, z = _losses(logits_TE, probs_TE, routed_E, moe, group=group)
    token_A = torch.arange(T, device=logits_TE.device).repeat_interleave(moe.top_k)
    keep = torch.empty(int(counts_E.sum()), dtype=torch.long, device=logits_TE.device)
    return Routing(token_A[keep], gate_TK.flatten()[keep], counts_E, routed_E, aux, z)


def _losses(logits_TE, probs_TE, routed_E, moe: MoEConfig, *, group):
    """aux and z (module docstring), of this rank's tokens or of the micro-batch `group`
    holds between its ranks."""
    T, E = logits_TE.shape
    if group is None:
        frac_E = routed_E.to(probs_TE.device, probs_TE.dtype) / (T * moe.top_k)
        aux = moe.aux_loss_coef * E * (frac_E * probs_TE.mean(0)).sum()
        return aux, moe.z_loss_coef * logits_TE.logsumexp(-1).square().mean()
    return _group_losses(logits_TE, probs_TE, routed_E, moe, group=group)


def _group_losses(logits_TE, probs_TE, routed_E, moe: MoEConfig, *, group):
    """aux and z of the micro-batch whose tokens `group` holds between its ranks."""
    counts = torch.cat([routed_E, routed_E.new_tensor([logits_TE.shape[0]])]).to(
        probs_TE.device, probs_TE.dtype)
    dist.all_reduce(counts, group=group)  # no gradient: the assignments and the token count
    T = counts[-1]
    sums = dist_nn.all_reduce(torch.cat([probs_TE.sum(0), logits_TE.logsumexp(-1).square()
                                         .sum().reshape(1)]), group=group)
    frac_E = counts[:-1] / (T * moe.top_k)
    aux = moe.aux_loss_coef * probs_TE.shape[1] * (frac_E * sums[:-1] / T).sum()
    return aux, moe.z_loss_coef * sums[-1] / T
