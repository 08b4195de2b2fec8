"""Expert parallelism: each rank holds E/ep of the routed experts; tokens travel to them.

Legend: A this rank's kept assignments (rows), sorted by global expert; R the rows this rank
receives for its local experts; E experts, El = E/ep local experts, D model dim.

`ExpertParallel.forward(x_AD, counts_E)` (the `Experts` contract: rows grouped by expert):
  1. exchange counts: all_to_all of counts_E (El per peer) → recv_PE [ep, El], rows each peer
     sends for each of my experts;
  2. dispatch: all_to_all_single of x_AD with uneven splits (send: Σ counts of each peer's
     experts; recv: Σ recv_PE per peer) → x_RD ordered by (source peer, local expert);
  3. regroup by local expert (a stable sort), run the local experts (`Experts.compute`), put
     the rows back in (peer, expert) order (a gather by the inverse permutation);
  4. combine: the reverse all_to_all_single → y_AD in this rank's original order.
The router, the gate-weighted sum and the un-permutation stay in `hpctrain.models.moe.layer.MoE`.
`AllToAll` is an autograd Function whose backward is the reverse all-to-all (splits swapped),
so the backward moves exactly the bytes of the forward, the other way.

Gradients: a local expert's gradient sums the contributions of every token routed to it by
the ep peers; the engine then sums it over the dp ranks holding the same experts and divides
by the whole dp (hpctrain.parallel.data: `ExpertGroups`), which is the dp mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_rank, group_size
from hpctrain.models.moe.layer import Experts


class AllToAll(torch.autograd.Function):
    """y = all_to_all_single(x) with uneven splits; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        y = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(gx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def exchange_counts(counts_E: torch.Tensor, group) -> torch.Tensor:
    """recv_PE[p, e]: rows peer p sends to my local expert e (one all-to-all of E int64s)."""
    ep = group_size(group)
    recv = torch.empty_like(counts_E)
    dist.all_to_all_single(recv, counts_E.contiguous(), group=group)
    return recv.view(ep, -1)


class ExpertParallel(Experts):
    """This rank's E/ep experts (a slice of the full `Experts`, same parameter names) that
    serve the rows of every rank of the ep `group` (module docstring)."""

    def __init__(self, full: Experts, *, group):
        ep, me = group_size(group), group_rank(group)
        n, dim, ffn = full.w1.shape
        super().__init__(n // ep, dim, ffn)
        lo, hi = me * n // ep, (me + 1) * n // ep
        with torch.no_grad():
            for name in ("w1", "w3", "w2"):
                getattr(self, name).copy_(getattr(full, name)[lo:hi])
        self.group, self.ep, self.num_experts = group, ep, n
        self.sent_bytes = 0  # bytes this rank sent to other ranks, forward + backward

    def forward(self, x_AD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        recv_PE = exchange_counts(counts_E, self.group)
        if x_AD.is_meta:  # a dry run: every rank routes the same bound (models.moe.bound_routing)
            recv_PE = counts_E.view(self.ep, -1)[group_rank(self.group)].repeat(self.ep, 1)
        send = counts_E.view(self.ep, -1).sum(1).tolist()
        recv = recv_PE.sum(1).tolist()
        x_RD = AllToAll.apply(x_AD, recv, send, self.group)
        local_R = torch.arange(recv_PE.shape[1], device=x_AD.device).repeat(self.ep)
        local_R = local_R.repeat_interleave(recv_PE.flatten().to(x_AD.device),
                                            output_size=sum(recv))
        order = torch.sort(local_R, stable=True).indices
        y_grouped = self.compute(x_RD[order], recv_PE.sum(0))
        # back to (peer, expert) order by a gather through the inverse permutation: its backward
        # keeps only the indices (index_copy's keeps a copy of every expert output row)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        y_RD = y_grouped[inverse]
        self._count(send, recv, x_AD)
        return AllToAll.apply(y_RD, send, recv, self.group)

    def _count(self, send: list[int], recv: list[int], x_AD: torch.Tensor) -> None:
        """Bytes sent off this rank: dispatch + combine forward, and their backward (the
        same rows the other way); a grad-free forward (eval) has no backward."""
        me = group_rank(self.group)
        row = x_AD.shape[1] * x_AD.element_size()
        off = (sum(send) - send[me]) + (sum(recv) - recv[me])
        self.sent_bytes += off * row * (2 if torch.is_grad_enabled() else 1)
