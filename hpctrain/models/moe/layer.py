"""Mixture of experts: a top-k router over SwiGLU experts in place of a block's dense MLP.

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

Experts are stacked weights (w1, w3: [E, D, F], w2: [E, F, D]). On CPU torch's
`_grouped_mm` takes fp32 only (no fp64, bf16 needs 16-byte-aligned group sizes), so experts run
as a loop over the local experts, one matmul triple each on their contiguous rows. Expert
parallelism (hpctrain.parallel.moe) replaces `MoE.experts` by a subclass that moves rows to
the rank holding their expert and back; the router and the combine stay here.

Router losses join the step's loss: each forward with grad enabled leaves its aux + z tensor in
`MoE.pending_loss`, which `take_router_loss` collects (the step adds it to the micro-batch's LM
loss before the token-weighted division, so it is weighted exactly like the LM loss). Routing
statistics of the forwards since the last `take_moe_stats` accumulate in `MoE.stats`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import nn

from hpctrain.models.config import ModelConfig, MoEConfig
from hpctrain.ops.fp8 import Fp8Spec
from hpctrain.ops.linear import Linear, linear


@dataclass
class Routing:
    """One micro-batch's routing: kept assignments sorted by expert (stable in token order)."""

    token_A: torch.Tensor  # token index of each kept assignment
    gate_A: torch.Tensor  # its gate (fp32, with graph)
    counts_E: torch.Tensor  # kept assignments per expert (int64)
    routed_E: torch.Tensor  # assignments per expert before dropping (int64)
    aux: torch.Tensor  # coef-weighted load-balancing loss (0-d, with graph)
    z: torch.Tensor  # coef-weighted router z-loss (0-d, with graph)


@dataclass
class MoEStats:
    """Sums over the forwards of one step (what the step's metrics report)."""

    routed_E: torch.Tensor | None = None
    kept: int = 0
    assignments: int = 0
    aux: float = 0.0
    z: float = 0.0
    forwards: int = 0
    extra: dict[str, float] = field(default_factory=dict)  # e.g. all-to-all bytes (ep)


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


class Experts(nn.Module):
    """`n` SwiGLU experts as stacked weights: y = (silu(x w1[e]) ⊙ x w3[e]) w2[e] for the
    rows of each expert. Rows arrive grouped by expert, `counts_E` rows per local expert.
    With `fp8` set (train.fp8: hpctrain.parallel.fp8) each expert's three GEMMs run in float8
    as an FP8 linear's do (hpctrain.ops.fp8: same recipes, scales from that expert's rows and
    weights, so an expert computes the same on every ep layout)."""

    def __init__(self, n: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n, dim, ffn_dim))
        self.w2 = nn.Parameter(torch.empty(n, ffn_dim, dim))
        self.fp8: Fp8Spec | None = None

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        return self.compute(x_AD, counts_E)

    def compute(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The local experts on rows grouped by local expert (a loop: see module docstring)."""
        outs = []
        for e, x_aD in enumerate(torch.split(x_AD, counts_E.tolist())):
            if x_aD.shape[0] == 0:
                continue
            if self.fp8 is not None:  # as linears: weights out × in (contiguous for cuBLAS)
                w1, w3, w2 = (w[e].t().contiguous() for w in (self.w1, self.w3, self.w2))
                up = F.silu(linear(x_aD, w1, fp8=self.fp8)) * linear(x_aD, w3, fp8=self.fp8)
                outs.append(linear(up, w2, fp8=self.fp8))
                continue
            w1, w3, w2 = (w[e].to(x_aD.dtype) for w in (self.w1, self.w3, self.w2))
            outs.append((F.silu(x_aD @ w1) * (x_aD @ w3)) @ w2)
        if not outs:  # no rows reached these experts (their gradients stay zero)
            return x_AD.new_zeros(0, self.w2.shape[-1])
        return torch.cat(outs)


class SharedExperts(nn.Module):
    """`n` always-on SwiGLU experts fused into one MLP of width n·F (what DeepSeek does);
    hpctrain linears, so train.fp8 runs them in float8 too."""

    def __init__(self, n: int, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = Linear(dim, n * ffn_dim)
        self.w3 = Linear(dim, n * ffn_dim)
        self.w2 = Linear(n * ffn_dim, dim)

    def forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x_TD)) * self.w3(x_TD))


class MoE(nn.Module):
    """x_BLD → Σ_{e ∈ top-k} g_e · expert_e(x) (+ shared experts), per token."""

    compile_eagerly = True  # routing's shapes change every step (hpctrain.models.compile)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.moe = cfg.moe
        self.router = nn.Linear(cfg.dim, cfg.moe.num_experts, bias=False)
        self.experts = Experts(cfg.moe.num_experts, cfg.dim, cfg.expert_ffn_dim)
        self.shared = (SharedExperts(cfg.moe.shared_experts, cfg.dim, cfg.expert_ffn_dim)
                       if cfg.moe.shared_experts else None)
        self.pending_loss: torch.Tensor | None = None
        self.stats = MoEStats()
        self.token_group = None  # cp, sp: the ranks holding the rest of the rows (module doc)
        self.loss_share = 1.0  # 1 / tp under sp (module doc)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        acc = torch.promote_types(x_TD.dtype, torch.float32)  # fp32 routing, fp64 stays fp64
        r = route(F.linear(x_TD.to(acc), self.router.weight.to(acc)), self.moe,
                  group=self.token_group)
        y_AD = self.experts(x_TD[r.token_A], r.counts_E)
        out_TD = torch.zeros_like(x_TD).index_add(0, r.token_A,
                                                  (y_AD * r.gate_A[:, None]).to(x_TD.dtype))
        if self.shared is not None:
            out_TD = out_TD + self.shared(x_TD)
        if torch.is_grad_enabled() and not in_backward():  # a training forward, not its
            # recomputation under activation checkpointing: its losses and statistics count once
            loss = r.aux + r.z if self.loss_share == 1 else (r.aux + r.z) * self.loss_share
            self.pending_loss = loss if self.pending_loss is None else self.pending_loss + loss
            if not x_TD.is_meta:  # a dry run's losses have no value to record
                self._record(r)
        return out_TD.view_as(x_BLD)

    def _record(self, r: Routing) -> None:
        s = self.stats
        s.routed_E = r.routed_E if s.routed_E is None else s.routed_E + r.routed_E
        s.kept += int(r.counts_E.sum())
        s.assignments += int(r.routed_E.sum())
        s.aux += float(r.aux.detach())
        s.z += float(r.z.detach())
        s.forwards += 1


def in_backward() -> bool:
    """Whether autograd is running a backward pass now: a forward here is activation
    checkpointing's recomputation (torch.utils.checkpoint reruns the block in backward)."""
    return torch._C._current_graph_task_id() != -1


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def take_router_loss(model: nn.Module | list[MoE]) -> torch.Tensor | None:
    """Σ of the router losses (aux + z) of the forwards since the last call; None when the
    model has no MoE layer or none ran with grad enabled. Takes the model or its
    `moe_layers` (a caller that asks per forward keeps the list: walking the modules costs
    ~50 µs per call at a pipeline stage of 4 blocks)."""
    losses = []
    for m in moe_layers(model) if isinstance(model, nn.Module) else model:
        if m.pending_loss is not None:
            losses.append(m.pending_loss)
            m.pending_loss = None
    return sum(losses[1:], losses[0]) if losses else None


def take_moe_stats(model: nn.Module) -> list[MoEStats]:
    """Each MoE layer's statistics since the last call (then reset), in layer order."""
    out = []
    for m in moe_layers(model):
        out.append(m.stats)
        m.stats = MoEStats()
    return out
