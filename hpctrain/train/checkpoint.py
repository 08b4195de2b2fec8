"""Sharded checkpoints in torch.distributed.checkpoint (DCP) format, written atomically.

A checkpoint is `<run_dir>/checkpoints/step_XXXXXXXX/`: DCP shards of the model and optimizer
(keyed by fully qualified parameter names and holding full, not tp-sliced, tensors — see
`ckpt_layout` — so a later tp/pp layout can load them), one
`rank_XXXXX.pt` per rank (RNG and loss-scaler state) and `train_state.json` (step, layout).
Ranks write into `step_XXXXXXXX.partial/`; after a barrier rank 0 writes `train_state.json`
and renames the directory. Only renamed directories are complete, so a crash mid-save is
never mistaken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpctrain.train import ckpt_layout

_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:08d}"


def latest_complete(run_dir: Path) -> Path | None:
    """The newest complete checkpoint under `run_dir`, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = [p for p in root.iterdir() if _NAME.match(p.name) and (p / "train_state.json").exists()]
    return max(done, key=lambda p: p.name, default=None)


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state()}


def save(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         train_state: dict[str, Any], rank_state: dict[str, Any], keep: int = 2) -> Path:
    """Collective: every rank calls it at the same step."""
    rank = dist.get_rank()
    partial = path.with_name(path.name + ".partial")
    model_sd, optim_sd = _state_dicts(model, optimizer)
    full = ckpt_layout.to_full(model, {"model": model_sd, "optim": optim_sd})  # tp: collective
    dcp.save(full, checkpoint_id=str(partial))
    torch.save({**rank_state, "rng": _rng_state()}, partial / f"rank_{rank:05d}.pt")
    dist.barrier()
    if rank == 0:
        (partial / "train_state.json").write_text(json.dumps(train_state, indent=2))
        if path.exists():
            shutil.rmtree(path)
        os.replace(partial, path)
        _prune(path.parent, keep=keep)
    dist.barrier()
    return path


def _state_dicts(model: torch.nn.Module, optimizer) -> tuple[dict, dict]:
    """FQN-keyed model and optimizer state. A data-parallel engine's sharded optimizer
    (hpctrain.parallel.data) provides full tensors assembled from its shards."""
    engine = getattr(optimizer, "engine", None)
    if engine is None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        for alias in shared_aliases(model):  # a tied tensor is saved once, as the engine does
            model_sd.pop(alias, None)
        return model_sd, optim_sd
    from hpctrain.parallel.data.state import full_model_state, full_optim_state

    return full_model_state(engine), full_optim_state(engine)


def shared_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Second names of a parameter registered twice (tied embeddings: `output.weight`) → its
    first name (`tok_embeddings.weight`), the one `named_parameters` and checkpoints use."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _load_replicated_or_tp(path: Path, model, optimizer, current: dict) -> None:
    """torch AdamW path (tp or pp layouts): read full tensors, slice to this rank's plan.
    Param groups (hyperparameters, membership) stay this run's: the data-parallel engine's
    checkpoints do not carry them, and a different layout has other groups anyway."""
    state = ckpt_layout.full_template(model, current)
    groups = state["optim"].pop("param_groups", None)
    dcp.load(state, checkpoint_id=str(path))
    if groups is not None:
        state["optim"]["param_groups"] = groups
    state = ckpt_layout.to_local(model, state, current=current)
    for alias, owner in shared_aliases(model).items():
        state["model"][alias] = state["model"][owner]
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def _prune(root: Path, *, keep: int) -> None:
    done = sorted(p for p in root.iterdir() if _NAME.match(p.name))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def load(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
         ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load model and optimizer in place; returns (train_state, this rank's rank_state).

    A rank that has no file of its own (the world grew) takes rank 0's RNG state.
    """
    model_sd, optim_sd = _state_dicts(model, optimizer)
    engine = getattr(optimizer, "engine", None)
    if engine is not None:
        from hpctrain.parallel.data.state import load_full_state

        # Full tensors over dp (the engine's state) and over tp (ckpt_layout): read full-size
        # buffers, slice this rank's tp shard, then keep this rank's dp shard of it.
        state = ckpt_layout.full_template(model, {"model": model_sd, "optim": optim_sd})
        state["optim"].pop("param_groups", None)
        dcp.load(state, checkpoint_id=str(path))
        state = ckpt_layout.to_local(model, state, current={})
        load_full_state(engine, state["model"], state["optim"])
    else:
        _load_replicated_or_tp(path, model, optimizer, {"model": model_sd, "optim": optim_sd})
    train_state = json.loads((path / "train_state.json").read_text())
    own = path / f"rank_{dist.get_rank():05d}.pt"
    rank_state = torch.load(own if own.exists() else path / "rank_00000.pt", weights_only=False)
    torch.set_rng_state(rank_state["rng"]["torch"])
    return train_state, rank_state
