"""The process-group mesh: one group per parallel axis for this rank.

Every rank must call `new_group` for every group of an axis in the same order (a torch
requirement), so we walk `ParallelDims.all_groups` and keep the one containing this rank.
Modules receive the group they need from here as an argument; none reads a global group.
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
    groups: dict[Axis, dist.ProcessGroup | None] = field(default_factory=dict)
    # Every wait on this mesh (collectives of its groups, point-to-point) gives up after this.
    timeout: datetime.timedelta = DEFAULT_TIMEOUT
    # This rank's step heartbeat for the hang watchdog (a no-op outside a launched run).
    heartbeat: Heartbeat = NO_HEARTBEAT

    def group(self, axis: Axis) -> dist.ProcessGroup | None:
        """The group along `axis`; None when that axis has degree 1 (ops become no-ops)."""
        return self.groups.get(axis)

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
    the right size, which should carry the same timeout."""
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"process group has {dist.get_world_size()} ranks but the layout needs "
                         f"{dims.world_size} (dp={dims.dp}, tp={dims.tp}, pp={dims.pp})")
    mesh = Mesh(dims, rank, device, timeout=timeout, heartbeat=heartbeat)
    for axis in AXES:
        if dims.degree(axis) == 1:
            continue
        for ranks in dims.all_groups(axis):
            group = dist.new_group(ranks, timeout=timeout, group_desc=axis)  # named in dumps
            if rank in ranks:
                mesh.groups[axis] = group
    return mesh


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)
