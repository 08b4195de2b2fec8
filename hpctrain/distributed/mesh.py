"""The process-group mesh: this rank's group of every name in `dims.GROUP_NAMES`.

One registry: `Mesh.group(name)` for the four axes, the gradient groups (dp_cp, shard,
replicate), the expert groups (ep, edp) and the world, each derived from
`ParallelDims.ranks_in` — no other module computes a group's ranks. Every rank must call
`new_group` for every group in the same order (a torch requirement), so each name's groups are
all created, in `GROUP_NAMES` order, and this rank keeps its own; a name whose groups equal an
earlier name's reuses them (dp_cp is dp at cp = 1, shard is dp_cp without HSDP), and "world"
is the default group. Modules receive the group they need as an argument; none reads a global
group.

An axis of degree 1 is a group of one rank, never None: code that can skip a collective checks
`group_size(group) == 1` (cheap, no communication), and a size-1 group given to a collective
is still correct. `None` for a group means only "no process group at all" (a single process
without torch.distributed, e.g. a unit test) and is treated like a size-1 group by the helpers
here; it never means "the whole world" — that is spelled `dist.group.WORLD`.

Expert parallelism adds two groups inside dp (ParallelDims.ep_ranks / edp_ranks): `ep`, ep
consecutive dp coordinates (dp_i // ep equal) holding disjoint experts and exchanging tokens
by all-to-all, and `edp`, the dp ranks with the same dp_i % ep, holding the same experts and
reducing their gradients. Example, dp=4 ep=2 (tp=cp=pp=1): ep groups {0,1} {2,3}, edp groups
{0,2} {1,3}.

Hybrid sharding (dims.dp_replicate > 1) adds `shard`, the dp×cp ranks of one replica (ZeRO's
group), and `replicate`, the ranks holding the same shards in the other replicas; the expert
groups stay inside a replica. Example, dp=4 dp_replicate=2: shard {0,1} {2,3}, replicate {0,2}
{1,3}. Without it `shard` is `dp_cp` and `replicate` a one-rank group.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpctrain.distributed.dims import GROUP_NAMES, GroupName, ParallelDims
from hpctrain.distributed.watchdog import NO_HEARTBEAT, Heartbeat

# What a mesh built without an explicit timeout uses (ClusterConfig.timeout_s's default); never
# torch's own default for new groups (30 min on gloo).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass
class Mesh:
    dims: ParallelDims
    rank: int
    device: torch.device
    # name (dims.GROUP_NAMES) → this rank's group of that name.
    groups: dict[GroupName, dist.ProcessGroup] = field(default_factory=dict)
    # Every wait on this mesh (collectives of its groups, point-to-point) gives up after this.
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    # This rank's step heartbeat for the hang watchdog (a no-op outside a launched run).
    heartbeat: Heartbeat = NO_HEARTBEAT
    # A second, gloo group over the whole world for checkpoint writes on a background thread
    # (hpctrain.checkpoint.writer), so their collectives never interleave with training's.
    io: dist.ProcessGroup | None = None

    def group(self, name: GroupName) -> dist.ProcessGroup:
        """This rank's group `name`: of size 1 when it holds only this rank (callers skip
        their collectives by checking `group_size`)."""
        return self.groups[name]

    def ranks(self, name: GroupName) -> list[int]:
        """The global ranks of this rank's group `name`."""
        return self.dims.ranks_in(name, self.rank)

    # The groups the engine and the trainer pass around, by the name they are known under.
    @property
    def dp_cp(self) -> dist.ProcessGroup:
        """dp×cp: the batch's ranks (loss mean, token counts), over which gradients of
        replicated parameters are averaged; the dp group at cp = 1."""
        return self.groups["dp_cp"]

    @property
    def shard(self) -> dist.ProcessGroup:
        """ZeRO's group: dp_cp, or one replica's part of it under HSDP."""
        return self.groups["shard"]

    @property
    def replicate(self) -> dist.ProcessGroup:
        """HSDP: the ranks holding this rank's shards in the other replicas (else itself)."""
        return self.groups["replicate"]

    @property
    def ep(self) -> dist.ProcessGroup:
        """The ranks holding the other experts (this rank alone at ep = 1)."""
        return self.groups["ep"]

    @property
    def edp(self) -> dist.ProcessGroup:
        """The ranks of this replica holding the same experts (the shard group at ep = 1)."""
        return self.groups["edp"]

    @property
    def world(self) -> dist.ProcessGroup:
        """The default group: every rank (the training thread's agreements)."""
        return self.groups["world"]

    def coord(self, axis) -> int:
        return self.dims.coords(self.rank)[axis]

    @property
    def is_logging_rank(self) -> bool:
        return self.dims.is_logging_rank(self.rank)


def build_mesh(dims: ParallelDims, *, rank: int, device: torch.device,
               timeout: datetime.timedelta = DEFAULT_TIMEOUT,
               heartbeat: Heartbeat = NO_HEARTBEAT, io_backend: str = "gloo") -> Mesh:
    """Create every named group, each with `timeout` (a stuck collective raises after it
    instead of waiting torch's 30-minute default); requires an initialised default process
    group of the right size, which should carry the same timeout. A one-rank group is created
    by this rank alone (hashed name, no store round trip with the others), so a degree-1 axis
    costs no collective setup. `io_backend`: the checkpoint writer's group (gloo; the dry run's
    fake backend in `hpctrain.tasks.dryrun.run`)."""
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"process group has {dist.get_world_size()} ranks but the layout needs "
                         f"{dims.world_size} (dp={dims.dp}, cp={dims.cp}, tp={dims.tp}, "
                         f"pp={dims.pp})")
    mesh = Mesh(dims, rank, device, timeout=timeout, heartbeat=heartbeat)
    made: dict[tuple, dist.ProcessGroup] = {}  # a partition of the world → this rank's group
    mesh.groups["world"] = dist.group.WORLD
    for name in GROUP_NAMES[1:]:
        partition = tuple(tuple(g) for g in dims.all_of(lambda r, n=name: dims.ranks_in(n, r)))
        if partition not in made:
            made[partition] = _make(partition, rank, timeout, name)
        mesh.groups[name] = made[partition]
    mesh.io = dist.new_group(list(range(dims.world_size)), timeout=timeout, backend=io_backend,
                             group_desc="io")
    return mesh


def _make(partition: tuple[tuple[int, ...], ...], rank: int, timeout: datetime.timedelta,
          name: str) -> dist.ProcessGroup:
    """This rank's group of `partition` (every group of one name): its own one-rank group, else
    every group created in order (an axis spanning the world too: it gets the mesh's timeout,
    which the default group need not have)."""
    if len(partition[0]) == 1:
        return dist.new_group([rank], timeout=timeout, group_desc=name,
                              use_local_synchronization=True)
    mine = None
    for ranks in partition:
        group = dist.new_group(list(ranks), timeout=timeout, group_desc=name)  # named in dumps
        if rank in ranks:
            mine = group
    return mine


def own_group(timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> dist.ProcessGroup:
    """This rank's one-rank group (what a degree-1 axis is), made without the other ranks."""
    return dist.new_group([dist.get_rank()], timeout=timeout, group_desc="own",
                          use_local_synchronization=True)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; 1 for None (no process group: a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in `group`; 0 for None (no process group: a single process)."""
    return 0 if group is None else dist.get_rank(group)
