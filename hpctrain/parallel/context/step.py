"""What the trainer's step needs under cp > 1: sharded micro-batches, and the cp bytes sent.

Every cp rank of a dp replica reads the same full micro-batches and keeps its zigzag shard
(hpctrain.parallel.context.shard). The loss needs nothing of its own: each shard's mean loss
is weighted by its real tokens over the dp×cp group the engine averages over
(hpctrain.parallel.step.loss_divisors), which makes the step's loss the mean over every real
token of the rows; a shard that is all padding has loss 0 (lm_loss) and adds nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from hpctrain.distributed.mesh import group_rank, group_size
from hpctrain.ops.documents import split_micro_batch
from hpctrain.parallel.context.shard import shard_micro_batch


def shard_batches(micro_batches: Iterable, *, group) -> Iterator[tuple]:
    """Each full micro-batch → (inputs, targets, ShardDocuments) of this rank's zigzag shard;
    unchanged when `group` has one rank."""
    cp, rank = group_size(group), group_rank(group)
    for micro in micro_batches:
        if cp == 1:
            yield micro
        else:
            yield shard_micro_batch(*split_micro_batch(micro), rank=rank, cp=cp)


def take_cp_bytes(comm) -> dict[str, int]:
    """{"comm_cp_bytes": bytes this rank sent on the cp ring since the last call}; {} without
    cp (`comm` None or a one-rank ring)."""
    if comm is None or comm.size == 1:
        return {}
    sent, comm.bytes_sent = comm.bytes_sent, 0
    return {"comm_cp_bytes": sent}
