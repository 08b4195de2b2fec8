"""Full (unsharded) state dicts of a DataParallel engine, and refreshing it after a load.

`full_model_state` / `full_optim_state` / `full_grad_state` gather every unit's master /
exp_avg / exp_avg_sq / reduced-gradient shards into full per-parameter tensors keyed by FQN
(one full copy of each tensor on every rank): for comparisons in tests and small
consolidated exports, never for training saves — checkpoints write each rank's own shards
(hpctrain.checkpoint.shards).

`refresh_from_masters` is what a load does after the optimizer's masters and moments were
filled in place: set the step count and rebuild the compute-dtype parameters from the masters.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size
from hpctrain.parallel.data.units import FlatUnit

OPTIM_KEYS = ("exp_avg", "exp_avg_sq")


def _gather(unit: FlatUnit, shard: torch.Tensor, group) -> torch.Tensor:
    if unit.layout.n_shards == 1 or group_size(group) == 1:
        return shard.detach().clone()
    full = torch.empty(unit.layout.padded_numel, dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(full, shard.detach().contiguous(), group=group)
    return full


def _split(unit: FlatUnit, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: flat[o : o + n].view(shape).clone()
            for name, o, n, shape in zip(unit.names, unit.layout.offsets, unit.layout.numels,
                                         unit.shapes, strict=True)}


def full_model_state(engine) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        out.update(_split(unit, _gather(unit, engine.optimizer.state[unit.index]["master"],
                                        unit.group)))
    return out


def full_grad_state(engine) -> dict[str, torch.Tensor]:
    """The reduced gradients the optimizer steps on, gathered from every rank's grad shard
    into full tensors by FQN (after the reduction, before zero_grad)."""
    out: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        out.update(_split(unit, _gather(unit, unit.grad_shard, unit.group)))
    return out


def full_optim_state(engine) -> dict:
    state: dict[str, dict] = {}
    step = torch.tensor(float(engine.optimizer.steps))
    for unit in engine.units:
        parts = {k: _split(unit, _gather(unit, engine.optimizer.state[unit.index][k],
                                         unit.group)) for k in OPTIM_KEYS}
        for name in unit.names:
            state[name] = {"step": step.clone(), **{k: parts[k][name] for k in OPTIM_KEYS}}
    return {"state": state}


@torch.no_grad()
def refresh_from_masters(engine, *, steps: int) -> None:
    """After the masters and moments of every unit were loaded in place: the optimizer's step
    count, then the compute-dtype shards and (zero < 3) the full parameters (collective over
    each unit's group)."""
    opt = engine.optimizer
    opt.steps = steps
    for unit in engine.units:
        master = opt.state[unit.index]["master"]
        if master is not unit.shard:
            unit.shard.copy_(master)
        if unit.zero < 3:
            unit.all_gather_params(unit.group)
        elif unit.gathered:
            unit.free_params()
