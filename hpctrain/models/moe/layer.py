"""Mixture of experts: a top-k router (`hpctrain.models.moe.router`) over SwiGLU experts in
place of a block's dense MLP.

Legend: T tokens of the micro-batch (B·L flattened), D model dim, E routed experts, F expert
ffn dim, A routed (token, expert) assignments kept (≤ T·k), k = top_k.

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

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.moe.router import Routing, route
from hpctrain.ops.fp8 import Fp8Spec
from hpctrain.ops.linear import Linear, linear


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
