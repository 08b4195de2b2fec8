"""Turn a built model (or a part of it: a pipeline stage) into this rank's tensor-parallel
shard, in place, following its family's plan (`hpctrain.models.family`): a table of module
names to styles. The decoder's plan splits the attention heads (wq/wk/wv column-parallel, wo
row-parallel) and the SwiGLU (w1/w3 column, w2 row), with both ends vocab-parallel.

Legend: N query heads, K kv heads, p = tp degree, V vocabulary.
The key/value projections split by kv head; when K < p (and p % K == 0) each kv head is
replicated on the p/K ranks whose query heads use it. The embedding and the output head are
vocab-parallel, so the logits stay vocab-sharded and go to the vocab-parallel loss.
Entry norms become `ParallelEntryRMSNorm` so the column layers after a norm share one entry
collective: f (all-reduce in backward) without sp, an all-gather along the sequence with sp.
With sp the residual stream, norms and embedding output are sequence-sharded (B, L/p, D).

Weights are sliced from the model's current (full-size, deterministically initialised)
parameters, or from `full_init(name, …, seed)` when a seed is given, so rank r's shard equals
the corresponding slice of the single-process model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.family import ModelFamily, Style
from hpctrain.models.init import full_init
from hpctrain.models.moe.layer import MoE, moe_layers
from hpctrain.models.registry import family_of
from hpctrain.ops.linear import Linear
from hpctrain.parallel.tensor.comm import CommCounter, _rank, _size
from hpctrain.parallel.tensor.layers import (
    ColumnParallelLinear,
    ParallelEntryRMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
)


@dataclass(frozen=True)
class TpSlice:
    """How one parameter is split over tp on one rank: it is `full.chunk(parts, dim)[index]`;
    dim None: the rank holds the whole tensor. `replicas`: tp ranks holding identical values
    (1 sharded, tp/K replicated kv heads, tp fully replicated)."""

    dim: int | None
    index: int = 0
    parts: int = 1
    replicas: int = 1


# What the decoder's plan splits over tp, by model field: query heads, the SwiGLU width and
# the vocabulary divide evenly; kv heads divide evenly or are replicated (K divides tp).
TP_SPLIT = ("n_heads", "n_kv_heads", "ffn_dim", "vocab_size")


def unsplit(model, tp: int, fields: tuple[str, ...] = TP_SPLIT) -> list[str]:
    """The fields of `model` (among `fields`) that the plan cannot split over `tp` ranks: the
    one statement of the rule, which validation and the planner word for their readers."""
    def splits(name: str) -> bool:
        n = getattr(model, name)
        return n % tp == 0 or (name == "n_kv_heads" and tp % n == 0)
    return [name for name in fields if not splits(name)]


def kv_slot(n_kv_heads: int, *, tp: int, tp_rank: int) -> tuple[int, int] | None:
    """(slot, K) of the kv head this tp rank holds when the K kv heads are fewer than tp
    (each replicated on tp/K ranks); None when they split evenly."""
    if n_kv_heads % tp == 0:
        return None
    if unsplit(SimpleNamespace(n_kv_heads=n_kv_heads), tp, ("n_kv_heads",)):
        raise ValueError(f"model.n_kv_heads={n_kv_heads} and parallel.tp={tp}: kv heads must "
                         "be divisible by tp (split) or divide tp (replicated)")
    return tp_rank // (tp // n_kv_heads), n_kv_heads


def tp_slice(param_name: str, *, family: ModelFamily, tp: int, tp_rank: int,
             kv: tuple[int, int] | None = None) -> TpSlice:
    """The tp slice of a whole-model parameter (e.g. layers.3.attn.wk.weight) on `tp_rank`,
    by the family's table: column/vocab split dim 0 (weight and bias), row splits the weight's
    dim 1 (its bias is replicated), anything else is replicated; `kv` = `kv_slot(...)` for
    the key/value projections."""
    module, _, attr = param_name.rpartition(".")
    style = family.planned_style(module)
    if tp > 1 and (style in ("column", "vocab") or (style == "row" and attr == "weight")):
        index, parts = kv if kv is not None and family.is_kv(module) else (tp_rank, tp)
        return TpSlice(1 if style == "row" else 0, index, parts, tp // parts)
    return TpSlice(None, replicas=tp)


@dataclass
class TensorParallelPlan:
    """What `apply_tensor_parallel` did, for this rank: the planned modules (full name →
    module, per the table) and `kv_shard` = (slot, K) when kv heads
    are replicated (K < tp). For the gradient sync and norm, `replicas` maps id(param) → tp
    ranks holding identical values, `kv_slots` id(kv param) → (slot, K), and `head_norms`
    holds the q/k norm gains, whose gradients each rank has only for its own heads."""

    group: object
    sp: bool
    counter: CommCounter
    family: ModelFamily
    modules: dict[str, nn.Module] = field(default_factory=dict)
    kv_shard: tuple[int, int] | None = None
    replicas: dict[int, int] = field(default_factory=dict)
    kv_slots: dict[int, tuple[int, int]] = field(default_factory=dict)
    head_norms: set[int] = field(default_factory=set)  # id(param): gradient partial per rank

    @property
    def tp(self) -> int:
        return _size(self.group)

    def slice_of(self, param_name: str) -> TpSlice:
        """The tp slice of `param_name` (a full-model name) on this rank (`tp_slice`)."""
        return tp_slice(param_name, family=self.family, tp=self.tp, tp_rank=_rank(self.group),
                        kv=self.kv_shard)


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
                  entry: str, kv: tuple[int, int] | None,
                  bias: torch.Tensor | None = None) -> nn.Module:
    """The parallel module for `style`, from the full weight `w` (and `bias`, column layers).
    `entry`: how a column layer's input enters tp ("none" inside a block, where the entry norm
    already did it)."""
    g, c = plan.group, plan.counter
    exit = "reduce_scatter_seq" if plan.sp else "reduce"
    if style == "entry_norm":
        norm_entry = "gather_seq" if plan.sp else "copy"
        new = ParallelEntryRMSNorm(cfg.dim, eps=cfg.norm_eps, group=g, entry=norm_entry,
                                   counter=c)
        new.weight = nn.Parameter(w.clone())
        return new
    if style == "column":
        return ColumnParallelLinear.from_full(w, bias, group=g, shard=kv, entry=entry,
                                              counter=c)
    if style == "row":
        return RowParallelLinear.from_full(w, group=g, exit=exit, counter=c)
    return VocabParallelEmbedding.from_full(w, group=g, exit=exit, counter=c)


def _plan_block(model, i: str, plan: TensorParallelPlan, *, seed, cfg: ModelConfig) -> None:
    # An MoE block keeps its router and experts whole on every tp rank (computed redundantly
    # on the replicated input, so their gradients are complete on each rank): the norm before
    # it stays a plain norm, since the entry op's backward all-reduce would sum tp full copies.
    # Under sp they run on the rank's sequence shard instead: their gradients are partial and
    # summed over tp like every replicated parameter's (grads.py).
    fam = plan.family
    block = f"{fam.blocks}.{i}"
    moe = isinstance(model.get_submodule(f"{block}.{fam.block_mlp}"), MoE)
    for suffix, style in fam.tp_block.items():
        if moe and suffix.startswith(fam.block_mlp):
            continue
        name = f"{block}.{suffix}"
        module = _optional_submodule(model, name)
        if module is None:  # an optional part this model does not have (q/k norm)
            continue
        if style == "head_norm":  # stays whole; its gradient is summed over tp (grads.py)
            plan.head_norms.update(id(p) for p in module.parameters())
            continue
        kv = plan.kv_shard if suffix in fam.tp_kv else None
        w = _full(model, name + ".weight", seed=seed, cfg=cfg)
        b = (_full(model, name + ".bias", seed=seed, cfg=cfg)
             if getattr(module, "bias", None) is not None else None)
        _set(model, name, _shard_module(style, w, plan=plan, cfg=cfg, entry="none", kv=kv,
                                        bias=b), plan)


def _optional_submodule(model: nn.Module, name: str) -> nn.Module | None:
    """The submodule at `name`, or None where its attribute is None."""
    parent, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(parent), attr)


def _plan_ends(model, plan: TensorParallelPlan, *, seed, cfg: ModelConfig) -> None:
    entry = "gather_seq" if plan.sp else "copy"
    fam = plan.family
    for name, style in fam.tp_ends.items():
        if getattr(model, name, None) is None:  # a pipeline stage without this end
            continue
        w = _full(model, name + ".weight", seed=seed, cfg=cfg)
        new = _shard_module(style, w, plan=plan, cfg=cfg, entry=entry, kv=None)
        if name == fam.head and cfg.tied_embeddings and fam.embedding in plan.modules:
            new.weight = plan.modules[fam.embedding].weight
        _set(model, name, new, plan)


def apply_tensor_parallel(model: nn.Module, *, group, sp: bool, seed: int | None = None,
                          cfg: ModelConfig, counter: CommCounter | None = None
                          ) -> TensorParallelPlan:
    """Replace `model`'s modules named in its family's table (per block, and the two ends)
    by their tp shards, and return the plan (the caller keeps it: nothing is stored on the
    model). `model` is the whole model or a part of it (a pipeline stage).

    Call it on every rank of `group`, before activation checkpointing, optimizers or moving
    the model."""
    plan = TensorParallelPlan(group, sp, counter if counter is not None else CommCounter(),
                              family_of(cfg), kv_shard=kv_slot(cfg.n_kv_heads, tp=_size(group),
                                               tp_rank=_rank(group)))
    with torch.no_grad():
        # blocks keyed by their global layer index: plan names are the whole model's
        for i, _ in plan.family.block_items(model):
            _plan_block(model, i, plan, seed=seed, cfg=cfg)
        _plan_ends(model, plan, seed=seed, cfg=cfg)
    for name, p in model.named_parameters(remove_duplicate=False):
        piece = plan.slice_of(name)
        plan.replicas[id(p)] = piece.replicas
        if piece.dim is not None and piece.parts != plan.tp:
            plan.kv_slots[id(p)] = (piece.index, piece.parts)
    if sp and plan.tp > 1:  # MoE blocks route their sequence shard (hpctrain.models.moe.layer)
        for layer in moe_layers(model):
            layer.token_group, layer.loss_share = group, 1.0 / plan.tp
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
