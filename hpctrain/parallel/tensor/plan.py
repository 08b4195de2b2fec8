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
from typing import Literal

import torch
from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.init import full_init
from hpctrain.models.moe import MoE, moe_layers
from hpctrain.ops.linear import Linear
from hpctrain.parallel.tensor.comm import CommCounter, _rank, _size
from hpctrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelEntryRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)

Style = Literal["column", "row", "vocab", "entry_norm"]

# The layout, as a table of module names to styles (one readable place; the per-parameter
# shard spec, hpctrain.parallel.state, is derived from it). Names inside each block:
BLOCK_PLAN: dict[str, Style] = {
    "attn_norm": "entry_norm", "mlp_norm": "entry_norm",  # replicated gain + the entry op
    "attn.wq": "column", "attn.wk": "column", "attn.wv": "column",
    "mlp.w1": "column", "mlp.w3": "column",
    "attn.wo": "row", "mlp.w2": "row",
}
END_PLAN: dict[str, Style] = {"tok_embeddings": "vocab", "output": "column"}
KV_MODULES = ("attn.wk", "attn.wv")  # split by kv head: replicated on tp/K ranks when K < tp


@dataclass(frozen=True)
class TpSlice:
    """How one parameter is split over tp on one rank: it is `full.chunk(parts, dim)[index]`;
    dim None: the rank holds the whole tensor. `replicas`: tp ranks holding identical values
    (1 sharded, tp/K replicated kv heads, tp fully replicated)."""

    dim: int | None
    index: int = 0
    parts: int = 1
    replicas: int = 1


def planned_style(module: str) -> Style | None:
    """The table's style for a full-model module name (None: not planned, so replicated)."""
    head, _, rest = module.partition(".")
    if head == "layers":  # layers.<i>.<name in the block>
        return BLOCK_PLAN.get(rest.partition(".")[2])
    return END_PLAN.get(module)


def kv_slot(n_kv_heads: int, *, tp: int, tp_rank: int) -> tuple[int, int] | None:
    """(slot, K) of the kv head this tp rank holds when the K kv heads are fewer than tp
    (each replicated on tp/K ranks); None when they split evenly."""
    if n_kv_heads % tp == 0:
        return None
    if tp % n_kv_heads:
        raise ValueError(f"model.n_kv_heads={n_kv_heads} and parallel.tp={tp}: kv heads must "
                         "be divisible by tp (split) or divide tp (replicated)")
    return tp_rank // (tp // n_kv_heads), n_kv_heads


def tp_slice(param_name: str, *, tp: int, tp_rank: int,
             kv: tuple[int, int] | None = None) -> TpSlice:
    """The tp slice of a full-model parameter (e.g. layers.3.attn.wk.weight) on `tp_rank`, by
    the table: column/vocab split dim 0 (weight and bias), row splits the weight's dim 1 (its
    bias is replicated), anything else is replicated; `kv` = `kv_slot(...)` for wk/wv."""
    module, _, attr = param_name.rpartition(".")
    style = planned_style(module)
    if tp > 1 and (style in ("column", "vocab") or (style == "row" and attr == "weight")):
        is_kv = module.partition(".")[0] == "layers" and module.split(".", 2)[-1] in KV_MODULES
        index, parts = kv if kv is not None and is_kv else (tp_rank, tp)
        return TpSlice(1 if style == "row" else 0, index, parts, tp // parts)
    return TpSlice(None, replicas=tp)


@dataclass
class TensorParallelPlan:
    """What `apply_tensor_parallel` did, for this rank: the planned modules (full name →
    module, per the table) and `kv_shard` = (slot, K) when kv heads
    are replicated (K < tp). For the gradient sync and norm, `replicas` maps id(param) → tp
    ranks holding identical values and `kv_slots` id(kv param) → (slot, K)."""

    group: object
    sp: bool
    counter: CommCounter
    modules: dict[str, nn.Module] = field(default_factory=dict)
    kv_shard: tuple[int, int] | None = None
    replicas: dict[int, int] = field(default_factory=dict)
    kv_slots: dict[int, tuple[int, int]] = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return _size(self.group)

    def slice_of(self, param_name: str) -> TpSlice:
        """The tp slice of `param_name` (a full-model name) on this rank (`tp_slice`)."""
        return tp_slice(param_name, tp=self.tp, tp_rank=_rank(self.group), kv=self.kv_shard)


def _full(model: nn.Module, name: str, *, seed: int | None, cfg: ModelConfig) -> torch.Tensor:
    p = model.get_parameter(name)
    if seed is None:
        return p.detach()
    return full_init(name, p.shape, cfg, seed=seed).to(p.dtype)


def _set(model: nn.Module, name: str, module: nn.Module, plan: TensorParallelPlan) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
    plan.modules[name] = module


def _shard_module(style: Style, w: torch.Tensor, *, plan: TensorParallelPlan, cfg: ModelConfig,
                  entry: str, kv: tuple[int, int] | None) -> nn.Module:
    """The parallel module for `style`, from the full weight `w`. `entry`: how a column layer's
    input enters tp ("none" inside a block, where the entry norm already did it)."""
    g, c = plan.group, plan.counter
    exit = "reduce_scatter_seq" if plan.sp else "reduce"
    if style == "entry_norm":
        norm_entry = "gather_seq" if plan.sp else "copy"
        new = ParallelEntryRMSNorm(cfg.dim, eps=cfg.norm_eps, group=g, entry=norm_entry,
                                   counter=c)
        new.weight = nn.Parameter(w.clone())
        return new
    if style == "column":
        return ColumnParallelLinear.from_full(w, group=g, shard=kv, entry=entry, counter=c)
    if style == "row":
        return RowParallelLinear.from_full(w, group=g, exit=exit, counter=c)
    return VocabParallelEmbedding.from_full(w, group=g, exit=exit, counter=c)


def _plan_block(model, i: str, plan: TensorParallelPlan, *, seed, cfg: ModelConfig) -> None:
    # An MoE block keeps its router and experts whole on every tp rank (computed redundantly
    # on the replicated input, so their gradients are complete on each rank): its mlp_norm
    # stays a plain norm, since the entry op's backward all-reduce would sum tp full copies.
    moe = isinstance(model.get_submodule(f"layers.{i}.mlp"), MoE)
    for suffix, style in BLOCK_PLAN.items():
        if moe and suffix.startswith("mlp"):
            continue
        name = f"layers.{i}.{suffix}"
        kv = plan.kv_shard if suffix in KV_MODULES else None
        w = _full(model, name + ".weight", seed=seed, cfg=cfg)
        _set(model, name, _shard_module(style, w, plan=plan, cfg=cfg, entry="none", kv=kv), plan)


def _plan_ends(model, plan: TensorParallelPlan, *, seed, cfg: ModelConfig) -> None:
    entry = "gather_seq" if plan.sp else "copy"
    for name, style in END_PLAN.items():
        if getattr(model, name, None) is None:  # a pipeline stage without this end
            continue
        w = _full(model, name + ".weight", seed=seed, cfg=cfg)
        new = _shard_module(style, w, plan=plan, cfg=cfg, entry=entry, kv=None)
        if name == "output" and cfg.tied_embeddings and "tok_embeddings" in plan.modules:
            new.weight = plan.modules["tok_embeddings"].weight
        _set(model, name, new, plan)


def apply_tensor_parallel(model: nn.Module, *, group, sp: bool, seed: int | None = None,
                          cfg: ModelConfig, counter: CommCounter | None = None
                          ) -> TensorParallelPlan:
    """Replace `model`'s modules named in the table (BLOCK_PLAN per block, END_PLAN) by their
    tp shards, and return the plan (the caller keeps it: nothing is stored on the model).

    Call it on every rank of `group`, before activation checkpointing, optimizers or moving
    the model."""
    plan = TensorParallelPlan(group, sp, counter if counter is not None else CommCounter(),
                              kv_shard=kv_slot(cfg.n_kv_heads, tp=_size(group),
                                               tp_rank=_rank(group)))
    with torch.no_grad():
        # named_children: a Transformer's ModuleList (0..n-1) or a pipeline stage's ModuleDict
        # keyed by global layer index, so plan names are the full model's either way.
        for i, _ in model.layers.named_children():
            _plan_block(model, i, plan, seed=seed, cfg=cfg)
        _plan_ends(model, plan, seed=seed, cfg=cfg)
    for name, p in model.named_parameters(remove_duplicate=False):
        piece = plan.slice_of(name)
        plan.replicas[id(p)] = piece.replicas
        if piece.dim is not None and piece.parts != plan.tp:
            plan.kv_slots[id(p)] = (piece.index, piece.parts)
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
    whole = {id(m) for layer in moe_layers(model) for m in layer.modules()}  # experts whole
    for name, m in model.named_modules():
        if type(m) in (Linear, nn.Linear, nn.Embedding) and id(m) not in whole:
            raise RuntimeError(f"{name!r} is an unsharded {type(m).__name__} in a tp="
                               f"{plan.tp} model: apply_tensor_parallel did not cover it")
    unknown = [n for n, p in model.named_parameters() if id(p) not in plan.replicas]
    if unknown:
        raise RuntimeError(f"parameters {unknown} were created after apply_tensor_parallel: "
                           "their tp replication is unknown")
