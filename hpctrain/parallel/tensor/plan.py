"""Turn a built single-process Transformer into this rank's tensor-parallel shard, in place.

Legend: N query heads, K kv heads, p = tp degree, V vocabulary.
Per block: attention heads are split (wq/wk/wv column-parallel, wo row-parallel); when K < p
(and p % K == 0) each kv head is replicated on the p/K ranks whose query heads use it; SwiGLU
w1/w3 are column-parallel and w2 row-parallel. The embedding and the output head are
vocab-parallel, so the logits stay vocab-sharded and go to the vocab-parallel loss.
The block norms become `ParallelEntryRMSNorm` so the column layers after a norm share one entry
collective: f (all-reduce in backward) without sp, an all-gather along the sequence with sp.
With sp the residual stream, norms and embedding output are sequence-sharded (B, L/p, D).

Weights are sliced from the model's current (full-size, deterministically initialised)
parameters, or from `full_init(name, …, seed)` when a seed is given, so rank r's shard equals
the corresponding slice of the single-process model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.init import full_init
from hpctrain.ops.linear import Linear
from hpctrain.parallel.tensor.comm import CommCounter, _rank, _size
from hpctrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelEntryRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass
class TensorParallelPlan:
    """What `apply_tensor_parallel` did: the planned modules (name → module) and, for every
    parameter, how many tp ranks hold identical values (`replicas`: 1 sharded, p/K replicated
    kv heads, p fully replicated). `kv_slots` maps replicated kv parameters to (slot, n_slots)."""

    group: object
    sp: bool
    counter: CommCounter
    modules: dict[str, nn.Module] = field(default_factory=dict)
    replicas: dict[int, int] = field(default_factory=dict)
    kv_slots: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return _size(self.group)


def _full(model: nn.Module, name: str, *, seed: int | None, cfg: ModelConfig) -> torch.Tensor:
    p = model.get_parameter(name)
    if seed is None:
        return p.detach()
    return full_init(name, p.shape, cfg, seed=seed).to(p.dtype)


def _set(model: nn.Module, name: str, module: nn.Module, plan: TensorParallelPlan) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
    plan.modules[name] = module


def _kv_shard(cfg: ModelConfig, group) -> tuple[int, int] | None:
    p = _size(group)
    if cfg.n_kv_heads % p == 0:
        return None
    if p % cfg.n_kv_heads:
        raise ValueError(f"model.n_kv_heads={cfg.n_kv_heads} and parallel.tp={p}: kv heads must "
                         "be divisible by tp (split) or divide tp (replicated)")
    return _rank(group) // (p // cfg.n_kv_heads), cfg.n_kv_heads


def _plan_block(model, i: int, plan: TensorParallelPlan, *, seed, cfg: ModelConfig) -> None:
    pre, g, c = f"layers.{i}.", plan.group, plan.counter
    entry, exit = ("gather_seq", "reduce_scatter_seq") if plan.sp else ("copy", "reduce")
    for norm in ("attn_norm", "mlp_norm"):
        new = ParallelEntryRMSNorm(cfg.dim, eps=cfg.norm_eps, group=g, entry=entry, counter=c)
        new.weight = nn.Parameter(_full(model, pre + norm + ".weight", seed=seed, cfg=cfg).clone())
        _set(model, pre + norm, new, plan)
    kv = _kv_shard(cfg, g)
    for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
        shard = kv if name in ("attn.wk", "attn.wv") else None
        w = _full(model, pre + name + ".weight", seed=seed, cfg=cfg)
        new = ColumnParallelLinear.from_full(w, group=g, shard=shard, entry="none", counter=c)
        _set(model, pre + name, new, plan)
        if shard is not None:
            plan.kv_slots[id(new.weight)] = shard
    for name in ("attn.wo", "mlp.w2"):
        w = _full(model, pre + name + ".weight", seed=seed, cfg=cfg)
        _set(model, pre + name, RowParallelLinear.from_full(w, group=g, exit=exit, counter=c),
             plan)


def _plan_ends(model, plan: TensorParallelPlan, *, seed, cfg: ModelConfig) -> None:
    g, c = plan.group, plan.counter
    entry, exit = ("gather_seq", "reduce_scatter_seq") if plan.sp else ("copy", "reduce")
    if getattr(model, "tok_embeddings", None) is not None:
        w = _full(model, "tok_embeddings.weight", seed=seed, cfg=cfg)
        _set(model, "tok_embeddings",
             VocabParallelEmbedding.from_full(w, group=g, exit=exit, counter=c), plan)
    if getattr(model, "output", None) is not None:
        tied = cfg.tied_embeddings and "tok_embeddings" in plan.modules
        w = _full(model, "output.weight", seed=seed, cfg=cfg)
        out = ColumnParallelLinear.from_full(w, group=g, entry=entry, counter=c)
        if tied:
            out.weight = plan.modules["tok_embeddings"].weight
        _set(model, "output", out, plan)


def apply_tensor_parallel(model: nn.Module, *, group, sp: bool, seed: int | None = None,
                          cfg: ModelConfig, counter: CommCounter | None = None
                          ) -> TensorParallelPlan:
    """Replace `model`'s Linear/Embedding/block-norm modules by their tp shards (by name).

    Call it on every rank of `group`, before activation checkpointing, optimizers or moving
    the model. Returns the plan (also stored as `model.tp_plan`)."""
    plan = TensorParallelPlan(group, sp, counter if counter is not None else CommCounter())
    with torch.no_grad():
        # named_children: a Transformer's ModuleList (0..n-1) or a pipeline stage's ModuleDict
        # keyed by global layer index, so plan names are the full model's either way.
        for i, _ in model.layers.named_children():
            _plan_block(model, i, plan, seed=seed, cfg=cfg)
        _plan_ends(model, plan, seed=seed, cfg=cfg)
    sharded = {id(p) for m in plan.modules.values() if not isinstance(m, ParallelEntryRMSNorm)
               for n, p in m.named_parameters() if n == "weight"}
    for p in model.parameters():
        slot = plan.kv_slots.get(id(p))
        plan.replicas[id(p)] = (plan.tp // slot[1] if slot else 1) if id(p) in sharded else plan.tp
    model.tp_plan = plan
    return plan


def verify_tensor_parallel(model: nn.Module, plan: TensorParallelPlan) -> None:
    """Raise RuntimeError unless every planned module is still the parallel one, with the plan's
    group, reachable from `model` (wrappers such as activation checkpointing are fine), and no
    unsharded Linear/Embedding is left. Run it after all set-up."""
    present = {id(m): n for n, m in model.named_modules()}
    for name, module in plan.modules.items():
        if id(module) not in present:
            raise RuntimeError(f"tensor-parallel module {name!r} ({type(module).__name__}) is no "
                               "longer in the model: something replaced it after "
                               "apply_tensor_parallel; apply tensor parallelism last")
        if module.group is not plan.group:
            raise RuntimeError(f"{name!r} uses a different process group than the plan")
    for name, m in model.named_modules():
        if type(m) in (Linear, nn.Linear, nn.Embedding):
            raise RuntimeError(f"{name!r} is an unsharded {type(m).__name__} in a tp="
                               f"{plan.tp} model: apply_tensor_parallel did not cover it")
    unknown = [n for n, p in model.named_parameters() if id(p) not in plan.replicas]
    if unknown:
        raise RuntimeError(f"parameters {unknown} were created after apply_tensor_parallel: "
                           "their tp replication is unknown")
