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

Hybrid sharding (HSDP) factors dp, not the world: dp = dp_replicate × dp_shard with the shard
index fastest, dp_i = replica_i · dp_shard + shard_i. ZeRO shards over the dp_shard × cp ranks
of one replica (`shard_ranks`: consecutive dp coordinates, one node when dp_shard·cp·tp fills
it) and the replicas all-reduce what those shards hold (`replicate_ranks`: dp_shard·cp·tp ranks
apart, across nodes). An ep group must lie inside one replica (ep divides dp_shard), so the
expert shards (`edp_ranks`) stay inside it too. At dp_replicate = 1 every shard group is the
whole dp×cp group and the replicate group is the rank itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Axis = Literal["pp", "dp", "cp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "cp", "tp")  # slowest to fastest
# Every process group a rank belongs to, by name (`ParallelDims.ranks_in`): the four axes, the
# gradient/ZeRO groups (dp_cp; shard and replicate under HSDP), the expert groups, the world.
GroupName = Literal["world", "pp", "dp", "cp", "tp", "dp_cp", "shard", "replicate", "ep", "edp",
                    "cp_tp"]
GROUP_NAMES: tuple[GroupName, ...] = ("world", *AXES, "dp_cp", "shard", "replicate", "ep", "edp",
                                      "cp_tp")


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism, inside dp (module docstring)
    dp_replicate: int = 1  # HSDP: dp = dp_replicate × dp_shard (module docstring)

    def __post_init__(self) -> None:
        problems = self.problems(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep,
                                 dp_replicate=self.dp_replicate)
        if problems:
            raise ValueError("; ".join(problems))

    @staticmethod
    def problems(*, dp: int, tp: int, pp: int, cp: int, ep: int, dp_replicate: int) -> list[str]:
        """Why these degrees do not compose (each message names the values and the fix; []
        when they do): every axis ≥ 1, dp_replicate divides dp, ep divides dp_shard (module
        docstring). The one statement of these rules: validation reads it before launch."""
        degrees = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        bad = [f"parallel.{axis}={v} must be >= 1" for axis, v in degrees.items() if v < 1]
        if bad:
            return bad
        if dp_replicate < 1 or dp % dp_replicate:
            return [f"parallel.dp_replicate={dp_replicate} does not divide parallel.dp={dp} "
                    f"(dp = dp_replicate × dp_shard): choose dp_replicate among {divisors(dp)}"]
        shard = dp // dp_replicate
        if ep >= 1 and shard % ep == 0:
            return []
        if dp_replicate == 1:
            return [f"parallel.ep={ep} must be >= 1 and divide parallel.dp={dp} (expert-parallel "
                    f"ranks live inside the dp group): choose ep dividing dp, among "
                    f"{divisors(dp)}"]
        return [f"parallel.ep={ep} does not divide parallel.dp_shard={shard} (an expert group "
                f"lives inside one replica): choose ep among {divisors(shard)}, or a smaller "
                "parallel.dp_replicate"]

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def shard_size(self) -> int:
        """Ranks of a ZeRO group (`shard_ranks`): dp_shard × cp."""
        return self.dp_shard * self.cp

    @property
    def expert_shard_size(self) -> int:
        """Ranks of an experts' ZeRO group (`edp_ranks`): dp_shard / ep (cp = 1 with experts)."""
        return self.dp_shard // self.ep * self.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    def degree(self, axis: Axis) -> int:
        return getattr(self, axis)

    def stride(self, name: Literal["tp", "cp", "dp", "ep", "pp", "replicate"]) -> int:
        """Ranks between two consecutive members of a `name` group, whose members are evenly
        spaced (module docstring): tp 1, cp tp, dp and ep cp·tp, pp dp·cp·tp, a replica's
        shards dp_shard·cp·tp."""
        inner = self.cp * self.tp
        return {"tp": 1, "cp": self.tp, "dp": inner, "ep": inner, "pp": self.dp * inner,
                "replicate": self.dp_shard * inner}[name]

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

    def shard_ranks(self, rank: int) -> list[int]:
        """The ZeRO group of `rank`: the dp×cp ranks of its replica (dp coordinates
        replica_i·dp_shard … +dp_shard-1), in rank order. Equal to `dp_cp_ranks` at
        dp_replicate = 1."""
        first = self.coords(rank)["dp"] // self.dp_shard * self.dp_shard
        return [r for r in self.dp_cp_ranks(rank)
                if first <= self.coords(r)["dp"] < first + self.dp_shard]

    def replicate_ranks(self, rank: int) -> list[int]:
        """The ranks holding the same shards as `rank` in the other replicas (same pp, cp, tp
        and shard index), in replica order; [rank] at dp_replicate = 1."""
        c = self.coords(rank)
        shard_i = c["dp"] % self.dp_shard
        return [self.rank_of(pp=c["pp"], dp=r * self.dp_shard + shard_i, cp=c["cp"], tp=c["tp"])
                for r in range(self.dp_replicate)]

    def ep_ranks(self, rank: int) -> list[int]:
        """The ep group of `rank`: ep consecutive dp coordinates, same pp, cp, tp."""
        c = self.coords(rank)
        first = c["dp"] // self.ep * self.ep
        return [self.rank_of(pp=c["pp"], dp=d, cp=c["cp"], tp=c["tp"])
                for d in range(first, first + self.ep)]

    def edp_ranks(self, rank: int) -> list[int]:
        """The ranks of `rank`'s ZeRO group holding its experts (dp coordinates ≡ dp_i mod ep,
        every cp coordinate): the experts' ZeRO group; their replicas are `replicate_ranks`."""
        expert = self.coords(rank)["dp"] % self.ep
        return [r for r in self.shard_ranks(rank) if self.coords(r)["dp"] % self.ep == expert]

    def cp_tp_ranks(self, rank: int) -> list[int]:
        """Ranks sharing `rank`'s pp and dp coordinates: the cp×tp ranks that hold the parts of
        one micro-batch's rows under cp with sp (MoE routing statistics are summed over them)."""
        c = self.coords(rank)
        return [self.rank_of(pp=c["pp"], dp=c["dp"], cp=k, tp=t)
                for k in range(self.cp) for t in range(self.tp)]

    def ranks_in(self, name: GroupName, rank: int) -> list[int]:
        """The global ranks of `rank`'s group `name` (GROUP_NAMES), in group order."""
        if name in AXES:
            return self.group_ranks(name, rank)
        if name == "world":
            return list(range(self.world_size))
        if name not in GROUP_NAMES:
            raise ValueError(f"unknown group {name!r}; groups: {', '.join(GROUP_NAMES)}")
        return getattr(self, f"{name}_ranks")(rank)

    def all_of(self, ranks_of) -> list[list[int]]:
        """Every group `ranks_of(rank)` gives, each once, in a fixed order (new_group needs
        every rank to create every group in the same order): ordered by their lowest rank.
        The groups of one name partition the world (`rank` is in `ranks_of(rank)`), so each is
        computed once, from its lowest rank: linear in the world size (the dry run sets up
        16,384 ranks)."""
        covered = bytearray(self.world_size)
        groups = []
        for r in range(self.world_size):
            if covered[r]:
                continue
            group = list(ranks_of(r))
            for member in group:
                covered[member] = 1
            groups.append(group)
        return groups

    def all_groups(self, axis: Axis) -> list[list[int]]:
        """Every group along `axis`, each listed once, in a fixed order (new_group needs it)."""
        return self.all_of(lambda r: self.group_ranks(axis, r))

    def is_logging_rank(self, rank: int) -> bool:
        """dp=0, cp=0, tp=0, last pipeline stage: the rank that owns the loss and talks to W&B."""
        c = self.coords(rank)
        return c["dp"] == 0 and c["cp"] == 0 and c["tp"] == 0 and c["pp"] == self.pp - 1


def divisors(n: int) -> list[int]:
    """The divisors of n ≥ 1, ascending (the degrees an axis of n ranks can take)."""
    return [d for d in range(1, n + 1) if n % d == 0]
