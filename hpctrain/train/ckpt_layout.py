"""Layout-independent checkpoint contents: full tensors under the full model's names.

With tensor parallelism each rank's parameters (and their AdamW exp_avg / exp_avg_sq) are
slices of the full tensors, yet `get_state_dict` keys them by the full model's names, which DCP
would deduplicate as if they were replicated. So before saving, every tp-sharded tensor is
all-gathered over the tp group into the FULL tensor (identical on all tp ranks, which DCP then
writes once); on loading, full-size buffers are read and this rank's slice is taken under the
current plan. Pipeline ownership needs nothing extra: a rank's state dict holds only its
stages' names (`LocalStages` uses the full model's names), so DCP reads just those.

Routed experts under expert parallelism (`ParamShard.ep`) are handled the same way over the
mesh's ep group: gathered to all E experts before saving, sliced to this rank's E/ep on load,
so an ep=2 checkpoint loads at ep=1 and back.

Which tensors are sharded, and how, comes from the parallel state's shard spec
(`ParallelState.shards`, derived from the tensor-parallel plan's table): a tp-sharded
parameter is `full.chunk(parts, dim)[index]` on this rank, and its AdamW exp_avg / exp_avg_sq
are sliced the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size
from hpctrain.parallel.state import ParallelState, ParamShard

State = dict[str, Any]  # {"model": model_sd, "optim": optim_sd}


def _tensors(state: State, shards: dict[str, ParamShard]):
    """(container, key, shard) of every tp-sharded tensor in `state`, in a fixed order (sorted
    names) so every tp rank visits them in the same order."""
    optim = state["optim"].get("state", {})
    for name in sorted(shards):
        shard = shards[name]
        if name not in state["model"]:
            raise KeyError(f"parameter {name!r} is missing from the model state dict")
        yield state["model"], name, shard
        for key, value in sorted(optim.get(name, {}).items()):
            if torch.is_tensor(value) and value.ndim > 0:
                yield optim[name], key, shard


def _gather_full(local: torch.Tensor, shard: ParamShard, group) -> torch.Tensor:
    dim, n = shard.tp.dim, shard.tp.parts
    tp = group_size(group)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    # rank r holds slice r·n/tp (n < tp: each slice is replicated on tp/n consecutive ranks)
    return torch.cat([parts[i * (tp // n)] for i in range(n)], dim=dim)


def _gather_experts(local: torch.Tensor, shard: ParamShard, group) -> torch.Tensor:
    """The ep group's expert slices, in group order, concatenated along the expert dim."""
    parts = [torch.empty_like(local) for _ in range(shard.ep.parts)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    return torch.cat(parts, dim=shard.ep.dim)


def to_full(parallel: ParallelState, state: State) -> State:
    """Collective over tp and ep: a copy of `state` whose tp- and ep-sharded tensors are the
    full tensors."""
    tp, ep = parallel.tp_sharded(), parallel.ep_sharded()
    if not tp and not ep:
        return state
    out = {"model": dict(state["model"]), "optim": _copy_optim(state["optim"])}
    for container, key, shard in _tensors(out, tp):
        container[key] = _gather_full(container[key], shard, parallel.mesh.group("tp"))
    for container, key, shard in _tensors(out, ep):
        container[key] = _gather_experts(container[key], shard, parallel.mesh.ep)
    return out


def _sharded(parallel: ParallelState) -> dict[str, ParamShard]:
    return {**parallel.tp_sharded(), **parallel.ep_sharded()}


def full_template(parallel: ParallelState, state: State) -> State:
    """A copy of `state` (this rank's local tensors) with each tp- or ep-sharded tensor
    replaced by an empty full-size one, for DCP to load into. `state` itself is left as it was."""
    out = {"model": dict(state["model"]), "optim": _copy_optim(state["optim"])}
    for container, key, shard in _tensors(out, _sharded(parallel)):
        container[key] = container[key].new_empty(shard.full_shape)
    return out


def to_local(parallel: ParallelState, state: State, *, current: State) -> State:
    """Slice the loaded full tensors to this rank's shards; keep `current`'s optimizer
    param-group membership (the loaded groups may name another pipeline rank's parameters)."""
    for container, key, shard in _tensors(state, _sharded(parallel)):
        container[key] = shard.local_of(container[key]).clone()
    groups = state["optim"].get("param_groups")
    if groups is not None:
        mine = current["optim"]["param_groups"]
        if len(groups) != len(mine):
            raise ValueError(f"checkpoint has {len(groups)} optimizer param groups but this run "
                             f"has {len(mine)}: resume with the same optim config")
        state["optim"]["param_groups"] = [{**g, "params": m["params"]}
                                          for g, m in zip(groups, mine, strict=True)]
    return state


def _copy_optim(optim_sd: dict[str, Any]) -> dict[str, Any]:
    out = dict(optim_sd)
    out["state"] = {k: dict(v) for k, v in optim_sd.get("state", {}).items()}
    out["param_groups"] = [{**g, "params": list(g["params"])}
                           for g in optim_sd.get("param_groups", [])]
    return out
