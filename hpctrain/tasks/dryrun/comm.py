"""The collectives one rank of a dry run issues, per process group: count and bytes sent.

`CommTally` is a dispatch mode that sees every c10d operation the code issues on its tensors
(all-reduce, all-gather, reduce-scatter, all-to-all, broadcast, send, receive) on the dry run's
fake process groups, whatever module issued it, and adds it to the group's tally under the
group's names in the mesh (`hpctrain.distributed.mesh`: aliases joined by "=", e.g. "dp=dp_cp
=shard" when cp = 1 and there is no HSDP). Bytes are what this rank sends on the wire under
ring algorithms, as the planner's communication model counts them (`plan.comm_volume`):
  all-reduce      2·(n−1)/n · N        N the tensor's bytes, n the group's size
  all-gather      (n−1)/n · N_out      reduce-scatter   (n−1)/n · N_in
  all-to-all      N_in less the rows it keeps      send   N      receive   0 (an op, no bytes)
  broadcast       N (the root's share of a pipelined broadcast)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.distributed.dims import GROUP_NAMES
from hpctrain.distributed.mesh import Mesh
from hpctrain.plan.comm_volume import Volume


@dataclass
class GroupTally:
    """One group's collectives in the tallied span: operations and bytes sent, by op name."""

    size: int
    ops: dict[str, int]
    bytes: dict[str, float]

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())


def group_names(mesh: Mesh) -> dict[str, str]:
    """The unique name of each of this rank's process groups → its mesh names, "=" joined
    (one-rank groups are left out: they move nothing)."""
    names: dict[str, list[str]] = defaultdict(list)
    for name in GROUP_NAMES:
        group = mesh.groups.get(name)
        if group is not None and group.size() > 1:
            names[group.group_name].append(name)
    return {key: "=".join(value) for key, value in names.items()}


def _nbytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(_nbytes(t) for t in tensors)


def _sent(op: str, args, n: int, rank: int) -> float:
    """Bytes this rank sends for c10d op `op` (module docstring)."""
    if op.startswith("allreduce"):
        return 2 * (n - 1) / n * _nbytes(args[0])
    if op.startswith("allgather") or op.startswith("_allgather"):
        return (n - 1) / n * _nbytes(args[0])  # the output
    if op.startswith("reduce_scatter") or op.startswith("_reduce_scatter"):
        return (n - 1) / n * _nbytes(args[1])  # the input
    if op.startswith("alltoall"):
        x, in_splits = args[1], args[4] if len(args) > 4 else []
        row = _nbytes(x) / max(1, x.shape[0]) if x.dim() else 0
        keep = in_splits[rank] if in_splits else x.shape[0] / n
        return _nbytes(x) - keep * row
    if op in ("send", "broadcast_"):
        return float(_nbytes(args[0]))
    return 0.0  # recv_, barrier, monitored waits: nothing leaves this rank


class CommTally(TorchDispatchMode):
    """Tallies the c10d operations issued inside it by group (module docstring); `groups`
    holds the result, keyed by mesh name. Operations of groups outside the mesh (the
    checkpoint writer's io group, one-rank groups) are keyed "other"."""

    def __init__(self, mesh: Mesh):
        super().__init__()
        self._names = group_names(mesh)
        self._lock = threading.Lock()  # the pipeline's courier thread records too
        self.groups: dict[str, GroupTally] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self._record(func, args)
        return func(*args, **(kwargs or {}))

    def _record(self, func, args) -> None:
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)
                      and "ProcessGroup" in str(a._type())), None)
        if boxed is None:
            return
        group = dist.ProcessGroup.unbox(boxed)
        n = group.size()
        op = func._schema.name.split("::")[-1]
        name = self._names.get(group.group_name, "other")
        with self._lock:
            tally = self.groups.setdefault(name, GroupTally(n, defaultdict(int),
                                                            defaultdict(float)))
            tally.ops[op] += 1
            tally.bytes[op] += _sent(op, args, n, group.rank())


def comm_rows(groups: dict[str, GroupTally], predicted: dict[str, Volume]) -> dict[str, dict]:
    """Per group the step used (and any the planner expects traffic on that saw none): the
    measured operations and bytes sent (and by op), beside the planner's
    (`plan.comm_volume.step_volumes`) summed over the mesh names the group holds."""
    names = set(groups) | {key for key in predicted
                           if not any(key in name.split("=") for name in groups)}
    rows = {}
    for name in sorted(names):
        tally = groups.get(name)
        expected = sum((predicted.get(key, Volume()) for key in name.split("=")), Volume())
        rows[name] = {"ops": tally.total_ops if tally else 0,
                      "bytes": tally.total_bytes if tally else 0.0,
                      "by_op": dict(tally.ops) if tally else {},
                      "predicted_ops": expected.ops, "predicted_bytes": expected.bytes}
    return rows
