"""Document boundaries inside packed rows.

Legend: B batch, L sequence, T total tokens (B·L). A packed row holds several documents, each
ending with the end-of-document token. Token i of a row belongs to document `ids_BL[b, i]` (the
count of end-of-document tokens strictly before it, so the end token closes its own document)
and sits at offset `positions_BL[b, i]` inside it (RoPE restarts there). Attention may only
connect tokens of one document, causally: mask[i, j] = ids[i] == ids[j] and j ≤ i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

IGNORE_INDEX = -100  # a target the loss skips: padding of dynamically batched rows


@dataclass(frozen=True)
class Documents:
    """Per-token document index and in-document position of a batch of packed rows."""

    ids_BL: torch.Tensor
    positions_BL: torch.Tensor

    @classmethod
    def from_eod(cls, tokens_BL: torch.Tensor, *, eod: int) -> Documents:
        """Boundaries of rows whose documents are separated by the token id `eod`."""
        is_end_BL = tokens_BL == eod
        return cls._of(torch.cumsum(is_end_BL, dim=1) - is_end_BL.long())  # non-decreasing

    @classmethod
    def from_ids(cls, ids_BL: torch.Tensor) -> Documents:
        """Boundaries from per-token document ids, non-decreasing along each row (documents
        are contiguous and in order: context parallelism finds its empty blocks from that);
        ValueError otherwise."""
        falls_B = (ids_BL[:, 1:] < ids_BL[:, :-1]).any(1)
        if bool(falls_B.any()):
            row = int(falls_B.nonzero()[0])
            raise ValueError(f"document ids of row {row} decrease ({ids_BL[row].tolist()[:16]}"
                             "...): ids must be non-decreasing along a row, one run per "
                             "document, in order")
        return cls._of(ids_BL)

    @classmethod
    def _of(cls, ids_BL: torch.Tensor) -> Documents:
        ids_BL = ids_BL.long()
        L = ids_BL.shape[1]
        index_BL = torch.arange(L, device=ids_BL.device).expand_as(ids_BL)
        starts_BL = torch.ones_like(ids_BL, dtype=torch.bool)
        starts_BL[:, 1:] = ids_BL[:, 1:] != ids_BL[:, :-1]
        first_BL = torch.cummax(torch.where(starts_BL, index_BL, 0), dim=1).values
        return cls(ids_BL=ids_BL, positions_BL=index_BL - first_BL)

    @classmethod
    def single(cls, batch: int, length: int, *, device: torch.device | None = None) -> Documents:
        """One document per row (what an unpacked batch is)."""
        return cls._of(torch.zeros(batch, length, dtype=torch.long, device=device))

    def to(self, device: torch.device | str) -> Documents:
        return Documents(ids_BL=self.ids_BL.to(device), positions_BL=self.positions_BL.to(device))

    def mask_BLL(self) -> torch.Tensor:
        """Boolean attention mask: True where query i may attend to key j. Built once per
        Documents (every layer of a forward, and its recomputation, shares it)."""
        return self._mask_BLL

    @cached_property
    def _mask_BLL(self) -> torch.Tensor:
        L = self.ids_BL.shape[1]
        causal_LL = torch.ones(L, L, dtype=torch.bool, device=self.ids_BL.device).tril()
        same_BLL = self.ids_BL[:, :, None] == self.ids_BL[:, None, :]
        return same_BLL & causal_LL

    def lengths(self) -> list[list[int]]:
        """Length of each document of each row, in order."""
        return [torch.unique_consecutive(row, return_counts=True)[1].tolist()
                for row in self.ids_BL.cpu()]

    def cu_seqlens(self) -> tuple[torch.Tensor, int]:
        """Cumulative document lengths over the flattened T tokens (int32, starting at 0) and
        the longest document: the variable-length form flash-attn's varlen functions take."""
        flat = [n for row in self.lengths() for n in row]
        cu = torch.zeros(len(flat) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(flat, dtype=torch.int32), dim=0)
        return cu.to(self.ids_BL.device), max(flat)


def split_micro_batch(micro: Sequence) -> tuple[torch.Tensor, torch.Tensor, Documents | None]:
    """A micro-batch is (inputs_BL, targets_BL) or (inputs_BL, targets_BL, docs): the
    boundaries travel with the tokens, so every consumer (a whole model, any pipeline stage)
    masks the same documents. Returns the three parts, docs None for unpacked rows."""
    inputs_BL, targets_BL, *rest = micro
    return inputs_BL, targets_BL, (rest[0] if rest else None)
