"""What the trainer's step needs under cp > 1: sharded micro-batches and the row-mean loss.

Every cp rank of a dp replica reads the same full micro-batches and keeps its zigzag shard
(hpctrain.parallel.context.shard). The loss must be the mean over all tokens of the rows,
while the engine averages losses and gradients over the dp×cp group; so each cp rank
returns cp · (its shard's summed cross entropy) / (valid tokens of the whole micro-batch),
whose mean over the cp ranks is exactly the rows' mean (padding targets excluded). It is
built on the layout's own mean loss (`base`: lm_loss, or tp's vocab-parallel cross entropy),
rescaled by cp · (the shard's valid tokens) / (the rows' valid tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_rank, group_size
from hpctrain.ops.documents import IGNORE_INDEX, split_micro_batch
from hpctrain.parallel.context.shard import shard_micro_batch
from hpctrain.parallel.step import lm_loss


def shard_batches(micro_batches: Iterable, *, group) -> Iterator[tuple]:
    """Each full micro-batch → (inputs, targets, ShardDocuments) of this rank's zigzag shard;
    unchanged when `group` has one rank."""
    cp, rank = group_size(group), group_rank(group)
    for micro in micro_batches:
        if cp == 1:
            yield micro
        else:
            yield shard_micro_batch(*split_micro_batch(micro), rank=rank, cp=cp)


def cp_loss_fn(group, *, base: Callable = lm_loss) -> Callable:
    """loss_fn(logits_BSV, targets_BS) for the engine under cp (see module docstring); the
    valid-token count is summed over `group` (one scalar all-reduce per micro-batch)."""
    cp = group_size(group)

    def loss_fn(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        local = (targets_BS != IGNORE_INDEX).sum().to(torch.float64)
        total = local.clone()
        dist.all_reduce(total, group=group)
        if local == 0:  # an all-padding shard adds nothing (its mean would be 0/0)
            return logits_BSV.float().sum() * 0.0
        return base(logits_BSV, targets_BS) * float(cp * local / total)

    return loss_fn


def take_cp_bytes(comm) -> dict[str, int]:
    """{"comm_cp_bytes": bytes this rank sent on the cp ring since the last call}; {} without
    cp (`comm` None or a one-rank ring)."""
    if comm is None or comm.size == 1:
        return {}
    sent, comm.bytes_sent = comm.bytes_sent, 0
    return {"comm_cp_bytes": sent}
