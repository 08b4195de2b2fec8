"""The process-group mesh: one group per parallel axis for this rank.

Every rank must call `new_group` for every group of an axis in the same order (a torch
requirement), so we walk `ParallelDims.all_groups` and keep the one containing this rank.
Modules receive the group they need from here as an argument; none reads a global group.

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
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpctrain.distributed.dims import AXES, Axis, ParallelDims
from hpctrain.distributed.watchdog import NO_HEARTBEAT, Heartbeat

# What a mesh built without an explicit timeout uses (ClusterConfig.timeout_s's default); never
# torch's own default for new groups (30 min on gloo).
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


@dataclass
class Mesh:
    dims: ParallelDims
    rank: int
    device: torch.device
    groups: dict[Axis, dist.ProcessGroup] = field(default_factory=dict)
    # Every wait on this mesh (collectives of its groups, point-to-point) gives up after this.
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    # This rank's step heartbeat for the hang watchdog (a no-op outside a launched run).
    heartbeat: Heartbeat = NO_HEARTBEAT
    # The dp×cp group (gradient reduction and ZeRO sharding of replicated parameters); the dp
    # group itself at cp = 1.
    dp_cp: dist.ProcessGroup | None = None
    # Expert parallelism (dims.ep; ParallelDims says the order): `ep` holds disjoint experts
    # (size 1 at ep = 1), `edp` the same experts (the dp group at ep = 1).
    ep: dist.ProcessGroup | None = None
    edp: dist.ProcessGroup | None = None
    # The whole world, named: `world` is the default group (the training thread's agreements);
    # `io` is a second, gloo group over the same ranks for checkpoint writes on a background
    # thread (hpctrain.train.ckpt_writer), so their collectives never interleave with training's.
    world: dist.ProcessGroup | None = None
    io: dist.ProcessGroup | None = None

    def group(self, axis: Axis) -> dist.ProcessGroup:
        """The group along `axis`: of size 1 when the axis has degree 1 (callers skip their
        collectives by checking `group_size`)."""
        return self.groups[axis]

    def coord(self, axis: Axis) -> int:
        return self.dims.coords(self.rank)[axis]

    @property
    def is_logging_rank(self) -> bool:
        return self.dims.is_logging_rank(self.rank)


def build_mesh(dims: ParallelDims, *, rank: int, device: torch.device,
               timeout: datetime.timedelta = DEFAULT_TIMEOUT,
               heartbeat: Heartbeat = NO_HEARTBEAT) -> Mesh:
    """Create the axis groups, each with `timeout` (a stuck collective raises after it instead
    of waiting torch's 30-minute default); requires an initialised default process group of
    the right size, which should carry the same timeout. A degree-1 axis gets this rank's own
    one-rank group, created by this rank alone (hashed name, no store round trip with the
    others), so it costs no collective setup."""
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"process group has {dist.get_world_size()} ranks but the layout needs "
                         f"{dims.world_size} (dp={dims.dp}, cp={dims.cp}, tp={dims.tp}, "
                         f"pp={dims.pp})")
    mesh = Mesh(dims, rank, device, timeout=timeout, heartbeat=heartbeat)
    for axis in AXES:
        if dims.degree(axis) == 1:
            mesh.groups[axis] = dist.new_group([rank], timeout=timeout, group_desc=axis,
                                               use_local_synchronization=True)
            continue
        for ranks in dims.all_groups(axis):
            group = dist.new_group(ranks, timeout=timeout, group_desc=axis)  # named in dumps
            if rank in ranks:
                mesh.groups[axis] = group
    mesh.dp_cp = mesh.groups["dp"]
    if dims.cp > 1 and dims.dp > 1:
        for ranks in dims.all_dp_cp_groups():
            group = dist.new_group(ranks, timeout=timeout, group_desc="dp_cp")
            if rank in ranks:
                mesh.dp_cp = group
    elif dims.cp > 1:
        mesh.dp_cp = mesh.groups["cp"]
    _expert_groups(mesh, timeout)
    mesh.world = dist.group.WORLD
    mesh.io = dist.new_group(list(range(dims.world_size)), timeout=timeout, backend="gloo",
                             group_desc="io")
    return mesh


def _expert_groups(mesh: Mesh, timeout: datetime.timedelta) -> None:
    """mesh.ep and mesh.edp (ParallelDims.ep_ranks / edp_ranks), each made by every rank in
    the same order; at ep = 1 the rank's own group and the dp×cp group."""
    dims, rank = mesh.dims, mesh.rank
    mesh.edp = mesh.dp_cp
    if dims.ep == 1:
        mesh.ep = dist.new_group([rank], timeout=timeout, group_desc="ep",
                                 use_local_synchronization=True)
        return
    for kind, ranks_of in (("ep", dims.ep_ranks), ("edp", dims.edp_ranks)):
        seen: dict[tuple[int, ...], None] = {}
        for r in range(dims.world_size):
            seen.setdefault(tuple(ranks_of(r)), None)
        for ranks in seen:
            group = dist.new_group(list(ranks), timeout=timeout, group_desc=kind)
            if rank in ranks:
                setattr(mesh, kind, group)


def group_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in `group`; 1 for None (no process group: a single process)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in `group`; 0 for None (no process group: a single process)."""
    return 0 if group is None else dist.get_rank(group)
