"""ParallelDims: the degrees of each mesh axis and pure integer rank arithmetic.

Rank layout (row-major, tp fastest): rank = (((pp_i * dp) + dp_i) * cp + cp_i) * tp + tp_i.
Axes are ordered by how much they talk: tp (an all-reduce per layer, on the critical path) is
innermost, so a tensor-parallel group is tp consecutive ranks (one NVLink island on a GPU
node); cp comes next (ring attention sends a key/value shard per layer, overlapped with
compute, so cp·tp ranks fill a node before cp spills onto InfiniBand); dp (one gradient
reduction per step) and pp (point-to-point activations only) are outermost and cross nodes.
Context-parallel peers are tp apart, data-parallel peers cp·tp apart, pipeline stages dp·cp·tp
apart. This is Megatron-Core's order (tp, cp, dp, pp from fastest to slowest).

Expert parallelism is not a fifth factor of the world: ep divides dp, and the ep group of a
rank is ep consecutive dp coordinates (dp_i // ep the same: the nearest data-parallel peers,
cp·tp ranks apart), holding disjoint experts. The expert-data group (`edp_ranks`) is the dp
ranks with the same dp_i % ep: they hold the same experts and reduce their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Axis = Literal["pp", "dp", "cp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "cp", "tp")  # slowest to fastest


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism, inside dp (module docstring)

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"parallel.ep={self.ep} must be >= 1 and divide parallel.dp="
                             f"{self.dp}: choose ep among the divisors of dp")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def degree(self, axis: Axis) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict[Axis, int]:
        """The (pp, dp, cp, tp) coordinates of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        tp_i = rank % self.tp
        cp_i = (rank // self.tp) % self.cp
        dp_i = (rank // (self.tp * self.cp)) % self.dp
        pp_i = rank // (self.tp * self.cp * self.dp)
        return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i}

    def rank_of(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def group_ranks(self, axis: Axis, rank: int) -> list[int]:
        """Ranks that share every coordinate with `rank` except along `axis`, in axis order."""
        c = self.coords(rank)
        out = []
        for i in range(self.degree(axis)):
            c2 = dict(c)
            c2[axis] = i
            out.append(self.rank_of(**c2))
        return out

    def dp_cp_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s pp and tp coordinates: the dp×cp group over which gradients
        of parameters replicated across both axes are reduced (and ZeRO shards), in rank
        order. Equal to the dp group at cp = 1."""
        c = self.coords(rank)
        return [self.rank_of(pp=c["pp"], dp=d, cp=k, tp=c["tp"])
                for d in range(self.dp) for k in range(self.cp)]

    def all_dp_cp_groups(self) -> list[list[int]]:
        """Every dp×cp group once, in a fixed order (for new_group)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(self.dp_cp_ranks(r)), None)
        return [list(g) for g in seen]

    def ep_ranks(self, rank: int) -> list[int]:
        """The ep group of `rank`: ep consecutive dp coordinates, same pp, cp, tp."""
        c = self.coords(rank)
        first = c["dp"] // self.ep * self.ep
        return [self.rank_of(pp=c["pp"], dp=d, cp=c["cp"], tp=c["tp"])
                for d in range(first, first + self.ep)]

    def edp_ranks(self, rank: int) -> list[int]:
        """The dp ranks holding `rank`'s experts: dp coordinates ≡ dp_i (mod ep)."""
        c = self.coords(rank)
        return [self.rank_of(pp=c["pp"], dp=d, cp=c["cp"], tp=c["tp"])
                for d in range(c["dp"] % self.ep, self.dp, self.ep)]

    def all_groups(self, axis: Axis) -> list[list[int]]:
        """Every group along `axis`, each listed once, in a fixed order (new_group needs it)."""
        seen: dict[tuple[int, ...], None] = {}
        for r in range(self.world_size):
            seen.setdefault(tuple(self.group_ranks(axis, r)), None)
        return [list(g) for g in seen]

    def is_logging_rank(self, rank: int) -> bool:
        """dp=0, cp=0, tp=0, last pipeline stage: the rank that owns the loss and talks to W&B."""
        c = self.coords(rank)
        return c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0 and c["pp"] == self.pp - 1
