"""Expert parallelism (`parallel.ep`): routed experts sharded over ep ranks of the dp group.

`apply_expert_parallel` swaps every MoE layer's `experts` for an `ExpertParallel` slice (same
parameter names, first dimension E/ep) and returns the `ExpertGroups` the data-parallel
engine needs to reduce and shard those parameters over the dp ranks that hold the same
experts. The ep group and that expert-data group come from the mesh
(hpctrain.distributed.mesh: ep ranks are consecutive ranks of the dp group).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from hpctrain.distributed.mesh import Mesh, group_size
from hpctrain.models.moe.layer import moe_layers
from hpctrain.parallel.moe.dispatch import AllToAll, ExpertParallel


@dataclass(frozen=True)
class ExpertGroups:
    """What the engine needs about expert parameters: which they are (by id), the group their
    gradients are summed and sharded over (dp ranks holding the same experts: dp/ep of them),
    and the divisor of that sum (the whole dp size: the gradient is the dp mean)."""

    params: frozenset[int]
    group: object  # dist.ProcessGroup: the dp ranks holding the same experts
    divisor: int
    ep_group: object  # dist.ProcessGroup: the ranks holding the other experts


def apply_expert_parallel(model: nn.Module, mesh: Mesh) -> ExpertGroups | None:
    """Shard the routed experts of `model` over the mesh's ep group (in place); None when
    the model has no MoE layer or ep = 1 (then the experts stay whole and plain, no
    communication, and their gradients are reduced with the dense ones)."""
    layers = moe_layers(model)
    if not layers or group_size(mesh.ep) == 1:
        return None
    for layer in layers:
        layer.experts = ExpertParallel(layer.experts, group=mesh.ep)
    ids = frozenset(id(p) for layer in layers for p in layer.experts.parameters())
    return ExpertGroups(ids, mesh.edp, group_size(mesh.dp_cp), mesh.ep)


def take_all_to_all_bytes(model: nn.Module) -> dict[str, int]:
    """{'comm_ep_bytes': bytes this rank sent off-rank in the experts' all-to-alls since the
    last call} ({} without expert parallelism)."""
    total, seen = 0, False
    for layer in moe_layers(model):
        if isinstance(layer.experts, ExpertParallel):
            total += layer.experts.sent_bytes
            layer.experts.sent_bytes = 0
            seen = True
    return {"comm_ep_bytes": total} if seen else {}


__all__ = ["AllToAll", "ExpertGroups", "ExpertParallel", "apply_expert_parallel",
           "take_all_to_all_bytes"]
