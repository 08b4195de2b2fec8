"""Layout-independent checkpoint contents: full tensors under the full model's names.

With tensor parallelism each rank's parameters (and their AdamW exp_avg / exp_avg_sq) are
slices of the full tensors, yet `get_state_dict` keys them by the full model's names, which DCP
would deduplicate as if they were replicated. So before saving, every tp-sharded tensor is
all-gathered over the tp group into the FULL tensor (identical on all tp ranks, which DCP then
writes once); on loading, full-size buffers are read and this rank's slice is taken under the
current plan. Pipeline ownership needs nothing extra: a rank's state dict holds only its
stages' names (`LocalStages` uses the full model's names), so DCP reads just those.

A shard is (dim, index, n): the tensor is `full.chunk(n, dim)[index]`. Column-parallel weights
and biases and the vocab-parallel embedding split dim 0 (n = tp, or n = K kv heads replicated on
tp/K ranks), row-parallel weights dim 1; norm gains and row-parallel biases are replicated.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpctrain.parallel.tensor.comm import _rank, _size
from hpctrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from hpctrain.parallel.tensor.plan import TensorParallelPlan

Shard = tuple[int, int, int]  # (dim, index, n)
State = dict[str, Any]  # {"model": model_sd, "optim": optim_sd}


def tp_shards(model: nn.Module) -> dict[str, Shard | None]:
    """Parameter name → its tp shard, None for replicated; {} without a tp plan (tp = 1)."""
    plan: TensorParallelPlan | None = getattr(model, "tp_plan", None)
    if plan is None or plan.tp == 1:
        return {}
    by_id: dict[int, Shard] = {}
    for module in plan.modules.values():
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            index, n = plan.kv_slots.get(id(module.weight), (_rank(plan.group), plan.tp))
            for p in (module.weight, getattr(module, "bias", None)):
                if p is not None:
                    by_id[id(p)] = (0, index, n)
        elif isinstance(module, RowParallelLinear):
            by_id[id(module.weight)] = (1, _rank(plan.group), plan.tp)
    return {name: by_id.get(id(p)) for name, p in model.named_parameters()}


def _tensors(state: State, shards: dict[str, Shard | None]):
    """(container, key, shard) of every sharded tensor in `state`, in a fixed order (sorted
    names) so every tp rank visits them in the same order."""
    optim = state["optim"].get("state", {})
    for name in sorted(shards):
        shard = shards[name]
        if shard is None:
            continue
        if name not in state["model"]:
            raise KeyError(f"parameter {name!r} is missing from the model state dict")
        yield state["model"], name, shard
        for key, value in sorted(optim.get(name, {}).items()):
            if torch.is_tensor(value) and value.ndim > 0:
                yield optim[name], key, shard


def _gather_full(local: torch.Tensor, shard: Shard, group) -> torch.Tensor:
    dim, _, n = shard
    tp = _size(group)
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=group)
    # rank r holds slice r·n/tp (n < tp: each slice is replicated on tp/n consecutive ranks)
    return torch.cat([parts[i * (tp // n)] for i in range(n)], dim=dim)


def to_full(model: nn.Module, state: State) -> State:
    """Collective over tp: a copy of `state` whose tp-sharded tensors are the full tensors."""
    shards = tp_shards(model)
    if not shards:
        return state
    group = model.tp_plan.group
    out = {"model": dict(state["model"]), "optim": _copy_optim(state["optim"])}
    for container, key, shard in _tensors(out, shards):
        container[key] = _gather_full(container[key], shard, group)
    return out


def full_template(model: nn.Module, state: State) -> State:
    """A copy of `state` (this rank's local tensors) with each tp-sharded tensor replaced by an
    empty full-size one, for DCP to load into. `state` itself is left as it was."""
    shards = tp_shards(model)
    out = {"model": dict(state["model"]), "optim": _copy_optim(state["optim"])}
    for container, key, (dim, _, n) in _tensors(out, shards):
        local = container[key]
        shape = list(local.shape)
        shape[dim] *= n
        container[key] = local.new_empty(shape)
    return out


def to_local(model: nn.Module, state: State, *, current: State) -> State:
    """Slice the loaded full tensors to this rank's shards; keep `current`'s optimizer
    param-group membership (the loaded groups may name another pipeline rank's parameters)."""
    shards = tp_shards(model)
    for container, key, (dim, index, n) in _tensors(state, shards):
        container[key] = container[key].chunk(n, dim=dim)[index].clone()
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
