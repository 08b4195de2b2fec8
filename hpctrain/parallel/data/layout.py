"""Flat shard layout: pure offset arithmetic, no tensors, no processes.

Parameters (numels n_0, n_1, … in a fixed order) are laid end to end in one flat buffer of
Ψ = Σ nᵢ elements, padded with P = (-Ψ) mod dp zeros to Ψ + P = dp·S. Rank r owns the
half-open range [r·S, (r+1)·S). Parameter i occupies [oᵢ, oᵢ + nᵢ) with oᵢ = Σ_{j<i} nⱼ and
is cut at shard boundaries into pieces (rank, local offset in the shard, offset in the
parameter, length). Every element of [0, Ψ) lies in exactly one piece; the padding
[Ψ, dp·S) belongs to the last rank(s) and to no parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class Piece:
    """Elements [param_offset, param_offset + length) of parameter `index`, which live at
    [local_offset, local_offset + length) of rank `rank`'s shard."""

    index: int
    rank: int
    local_offset: int
    param_offset: int
    length: int


@dataclass(frozen=True)
class ShardLayout:
    numels: tuple[int, ...]
    n_shards: int

    def __post_init__(self):
        if self.n_shards < 1:
            raise ValueError(f"n_shards={self.n_shards} must be >= 1")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"numels={self.numels} must be >= 0")

    @property
    def numel(self) -> int:
        """Ψ: parameter elements, without padding."""
        return sum(self.numels)

    @property
    def shard_size(self) -> int:
        """S = ceil(Ψ / dp)."""
        return -(-self.numel // self.n_shards)

    @property
    def padded_numel(self) -> int:
        return self.shard_size * self.n_shards

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    def shard_range(self, rank: int) -> tuple[int, int]:
        if not 0 <= rank < self.n_shards:
            raise ValueError(f"rank={rank} outside [0, {self.n_shards})")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def pieces(self, index: int) -> list[Piece]:
        """The pieces parameter `index` is cut into, in order of parameter offset."""
        start, n, s = self.offsets[index], self.numels[index], self.shard_size
        out, pos = [], start
        while pos < start + n:
            rank = pos // s
            end = min(start + n, (rank + 1) * s)
            out.append(Piece(index, rank, pos - rank * s, pos - start, end - pos))
            pos = end
        return out

    @cached_property
    def _by_rank(self) -> dict[int, tuple[Piece, ...]]:
        by: dict[int, list[Piece]] = {r: [] for r in range(self.n_shards)}
        for i in range(len(self.numels)):
            for piece in self.pieces(i):
                by[piece.rank].append(piece)
        return {r: tuple(p) for r, p in by.items()}

    def owned(self, rank: int) -> tuple[Piece, ...]:
        """Pieces in rank `rank`'s shard, in order of local offset."""
        self.shard_range(rank)
        return self._by_rank[rank]

    def shard_padding(self, rank: int) -> int:
        """Padding elements in rank `rank`'s shard."""
        return self.shard_size - sum(p.length for p in self.owned(rank))
