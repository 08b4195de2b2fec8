"""A mixture's training loss per corpus (metrics `loss_<name>`): the mean over the step's real
tokens of the rows drawn from that corpus, in every layout.

The step's loss function (hpctrain.parallel.step.lm_loss, or the vocab-parallel one under tp)
also hands out each token's loss (detached) when given `per_token`; `SourceLoss.loss_fn` wraps
it: each call is one micro-batch, whose rows' corpora the trainer gave `begin`, and adds the
rows' loss and real-token sums to its corpus. Calls come in micro-batch order in the plain step,
and in the order of the last stage's F actions under pp (`order`, read from the schedule).
`take` sums over the ranks holding shards of the batch (dp×cp: rows, and pieces of each row
under cp), then over pp, where only the last stage has computed a loss; every tp rank computes
the same per-token losses, so tp is not summed. Outside a train step (evaluation) the wrapper
is the plain loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size
from hpctrain.ops.documents import IGNORE_INDEX
from hpctrain.parallel.step import lm_loss


class SourceLoss:
    """Per-corpus loss sums of this rank's micro-batches (module doc); `names`: the corpora."""

    def __init__(self, base: Callable, names: list[str], *, device: torch.device):
        self.base, self.names, self.device = base, names, device
        self.rows: list[torch.Tensor] | None = None  # each micro-batch's rows' corpora
        self.order: list[int] = []
        self.sums = torch.zeros(2, len(names), dtype=torch.float64, device=device)

    def begin(self, sources: list[list[int]], order: list[int] | None = None) -> None:
        """A train step of micro-batches whose rows come from corpora `sources[m]`; `order`:
        the micro-batches in the order the loss is computed (None: 0, 1, ...)."""
        self.rows = [torch.tensor(s, device=self.device) for s in sources]
        self.order = list(range(len(sources))) if order is None else list(order)
        self.sums.zero_()

    def loss_fn(self, logits_BLV: torch.Tensor, targets_BL: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return self.base(logits_BLV, targets_BL)
        per_token: list[torch.Tensor] = []
        loss = self.base(logits_BLV, targets_BL, per_token=per_token)
        rows = self.rows[self.order.pop(0)]
        real_BL = (targets_BL != IGNORE_INDEX).to(torch.float64)
        self.sums[0].index_add_(0, rows, per_token[0].to(torch.float64).sum(1))
        self.sums[1].index_add_(0, rows, real_BL.sum(1))
        return loss

    def take(self, *, batch_group, pp_group) -> dict[str, float]:
        """End the step: `loss_<name>` of each corpus over the global batch (NaN for a corpus
        with no real token in it), the same on every rank. Collective over both groups."""
        self.rows = None
        sums = self.sums.clone()
        for group in (batch_group, pp_group):
            if group_size(group) > 1:
                dist.all_reduce(sums, group=group)
        loss, tokens = sums.tolist()
        return {f"loss_{n}": (s / t if t else float("nan"))
                for n, s, t in zip(self.names, loss, tokens, strict=True)}


def train_loss_hooks(names: list[str], *, tp_hooks: dict, pipeline,
                     device: torch.device) -> tuple[SourceLoss | None, dict]:
    """For a mixture (`names` not empty): its `SourceLoss`, wrapping the pipeline's loss or
    the plain step's (`tp_hooks`' loss_fn, else lm_loss), and the train step's keyword
    arguments; (None, tp_hooks) for one corpus."""
    if not names:
        return None, tp_hooks
    if pipeline is not None:
        tally = SourceLoss(pipeline.loss_fn, names, device=device)
        pipeline.loss_fn = tally.loss_fn
        return tally, tp_hooks
    tally = SourceLoss(tp_hooks.get("loss_fn", lm_loss), names, device=device)
    return tally, {**tp_hooks, "loss_fn": tally.loss_fn}
