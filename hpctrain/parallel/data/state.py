"""Full (unsharded) state dicts for DataParallel, keyed by FQN, for DCP checkpoints.

Saving gathers every unit's master / exp_avg / exp_avg_sq shards into full flat tensors and
cuts them into per-parameter tensors, so a checkpoint is independent of dp and the ZeRO stage:

  model: {fqn: fp32 master value}      optim: {"state": {fqn: {"step", "exp_avg",
  "exp_avg_sq"}}}   (the same keys torch's get_state_dict uses for AdamW)

Loading reads full tensors and keeps only the pieces of this rank's shards (layout.owned),
then refreshes the compute-dtype parameters. Simple and exact; it holds one full copy of each
tensor on every rank while saving or loading.
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


def _group(unit: FlatUnit, engine):
    """The group a unit is sharded over: its own (experts: hpctrain.parallel.moe) or dp."""
    return engine.group if unit.group is None else unit.group


def full_model_state(engine) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        out.update(_split(unit, _gather(unit, engine.optimizer.state[unit.index]["master"],
                                        _group(unit, engine))))
    return out


def full_optim_state(engine) -> dict:
    state: dict[str, dict] = {}
    step = torch.tensor(float(engine.optimizer.steps))
    for unit in engine.units:
        parts = {k: _split(unit, _gather(unit, engine.optimizer.state[unit.index][k],
                                         _group(unit, engine))) for k in OPTIM_KEYS}
        for name in unit.names:
            state[name] = {"step": step.clone(), **{k: parts[k][name] for k in OPTIM_KEYS}}
    return {"state": state}


def _scatter(unit: FlatUnit, shard: torch.Tensor, full: dict[str, torch.Tensor]) -> None:
    shard.zero_()
    for pc in unit.layout.owned(unit.shard_rank):
        src = full[unit.names[pc.index]].reshape(-1)[pc.param_offset : pc.param_offset + pc.length]
        shard[pc.local_offset : pc.local_offset + pc.length].copy_(src)


@torch.no_grad()
def load_full_state(engine, model_sd: dict[str, torch.Tensor], optim_sd: dict) -> None:
    opt = engine.optimizer
    steps = {float(s["step"]) for s in optim_sd["state"].values()}
    opt.steps = int(steps.pop()) if steps else 0
    for unit in engine.units:
        st = opt.state[unit.index]
        _scatter(unit, st["master"], model_sd)
        for k in OPTIM_KEYS:
            _scatter(unit, st[k], {n: optim_sd["state"][n][k] for n in unit.names})
        if st["master"] is not unit.shard:
            unit.shard.copy_(st["master"])
        if unit.zero < 3:
            unit.all_gather_params(_group(unit, engine))
        elif unit.gathered:
            unit.free_params()
