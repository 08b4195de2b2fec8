"""The zigzag layout of context parallelism: which tokens of a row each cp rank holds.

Legend: B batch, L full row length, S = L/cp a rank's shard, C = L/(2·cp) one chunk.
A row is cut into 2·cp chunks of C tokens; cp rank i holds chunks i and 2·cp−1−i, in that
order. Under causal attention query chunk c attends to chunks 0..c, so rank i's two chunks
cost (i+1) + (2·cp−i) = 2·cp+1 chunk blocks for every i: the work is balanced, where a
contiguous split would give the last rank 2·cp−1 times the first one's.

A shard keeps the *full row's* document ids and positions of its tokens (RoPE angles and
document masks are those of the single-process row), plus its zigzag coordinates so that
ring attention can tell which key chunks a query chunk may see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpctrain.ops.documents import Documents


def chunk_ids(rank: int, *, cp: int) -> tuple[int, int]:
    """The two chunk indices cp rank `rank` holds: (rank, 2·cp − 1 − rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def shard_index(rank: int, *, cp: int, length: int) -> torch.Tensor:
    """Row positions (0..length-1) of the S = length/cp tokens rank `rank` holds, in order."""
    if length % (2 * cp):
        raise ValueError(f"sequence length {length} is not divisible by 2 × cp = {2 * cp}: "
                         f"choose train.seq_len as a multiple of {2 * cp}")
    C = length // (2 * cp)
    return torch.cat([torch.arange(c * C, (c + 1) * C) for c in chunk_ids(rank, cp=cp)])


def shard_rows(x_BL: torch.Tensor, *, rank: int, cp: int) -> torch.Tensor:
    """This rank's zigzag shard (B×S) of a B×L tensor (tokens, targets, ids, positions)."""
    index = shard_index(rank, cp=cp, length=x_BL.shape[1]).to(x_BL.device)
    return x_BL.index_select(1, index)


def unshard_rows(shards: list[torch.Tensor]) -> torch.Tensor:
    """The B×L rows back from every rank's B×S shard (in cp rank order): the inverse of
    `shard_rows`."""
    cp, (B, S) = len(shards), shards[0].shape[:2]
    out = shards[0].new_empty(B, S * cp, *shards[0].shape[2:])
    for rank, part in enumerate(shards):
        out[:, shard_index(rank, cp=cp, length=S * cp).to(part.device)] = part
    return out


@dataclass(frozen=True)
class ShardDocuments(Documents):
    """A cp rank's `Documents`: ids_BL/positions_BL of its S tokens, taken from the full
    row (so RoPE and masks match one process), plus what ring attention needs to mask a
    key shard of another rank: every rank's ids (`all_ids_RBS`, R = cp) and the layout."""

    all_ids_RBS: torch.Tensor
    rank: int
    cp: int

    def ids_of(self, rank: int) -> torch.Tensor:
        """Document ids (B×S) of the tokens cp rank `rank` holds."""
        return self.all_ids_RBS[rank]

    def to(self, device: torch.device | str) -> ShardDocuments:
        return ShardDocuments(ids_BL=self.ids_BL.to(device),
                              positions_BL=self.positions_BL.to(device),
                              all_ids_RBS=self.all_ids_RBS.to(device), rank=self.rank, cp=self.cp)


def shard_documents(docs: Documents, *, rank: int, cp: int) -> ShardDocuments:
    """Rank `rank`'s view of the full rows' boundaries `docs` (see ShardDocuments)."""
    all_ids = torch.stack([shard_rows(docs.ids_BL, rank=r, cp=cp) for r in range(cp)])
    return ShardDocuments(ids_BL=all_ids[rank],
                          positions_BL=shard_rows(docs.positions_BL, rank=rank, cp=cp),
                          all_ids_RBS=all_ids, rank=rank, cp=cp)


def shard_micro_batch(inputs_BL: torch.Tensor, targets_BL: torch.Tensor,
                      docs: Documents | None, *, rank: int, cp: int):
    """(inputs, targets, docs) of a full micro-batch → this rank's zigzag shard of each.
    Rows without documents become one document each, so the shard still carries its row
    positions (RoPE) and the layout (causal mask)."""
    if docs is None:
        docs = Documents.single(*inputs_BL.shape, device=inputs_BL.device)
    return (shard_rows(inputs_BL, rank=rank, cp=cp), shard_rows(targets_BL, rank=rank, cp=cp),
            shard_documents(docs, rank=rank, cp=cp))
