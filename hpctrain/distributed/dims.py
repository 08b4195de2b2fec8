"""ParallelDims: the degrees of each mesh axis and pure integer rank arithmetic.

Rank layout (row-major, tp fastest): rank = ((pp_i * dp) + dp_i) * tp + tp_i.
A tensor-parallel group is therefore tp consecutive ranks (one NVLink island on a GPU node),
data-parallel peers are tp apart, and pipeline stages are dp·tp apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Axis = Literal["pp", "dp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "tp")  # slowest to fastest


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def degree(self, axis: Axis) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[Axis, int]:
        """The (pp, dp, tp) coordinates of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp_i = rank % self.tp
        dp_i = (rank // self.tp) % self.dp
        pp_i = rank // (self.tp * self.dp)
        return {"pp": pp_i, "dp": dp_i, "tp": tp_i}

    def rank_of(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, axis: Axis, rank: int) -> list[int]:
        """Ranks that share every coordinate with `rank` except along `axis`, in axis order."""
        c = self.coords(rank)
        out = []
        for i in range(self.degree(axis)):
            c2 = dict(c)
            c2[axis] = i
            out.append(self.rank_of(**c2))
        return out

    def all_groups(self, axis: Axis) -> list[list[int]]:
        """Every group along `axis`, each listed once, in a fixed order (new_group needs it)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(self.group_ranks(axis, r)), None)
        return [list(g) for g in seen]

    def is_logging_rank(self, rank: int) -> bool:
        """dp=0, tp=0, last pipeline stage: the rank that owns the loss and talks to W&B."""
        c = self.coords(rank)
        return c["dp"] == 0 and c["tp"] == 0 and c["pp"] == self.pp - 1
