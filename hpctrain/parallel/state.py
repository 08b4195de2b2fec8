"""This rank's parallel state: built once at setup, then passed to whoever needs it.

`ParallelState` holds the mesh, this rank's model (its tensor-parallel shard and/or pipeline
stages, always under the full model's parameter names), the per-parameter shard spec, the
data-parallel engine (the one update path of every layout) and, with pp > 1, the stages and
the pipeline runtime. Nothing of it is attached to modules or optimizers: checkpointing reads
the spec to reassemble and cut tensors, metrics read the tp plan's byte counter, the trainer
steps the engine.

The shard spec has one `ParamShard` per parameter name, saying where the parameter lives. It
is built in two halves: the `Placement`s (tp, pp, ep, copies: where the model is split) before
the data-parallel engine exists, so that the clip norm is read from them (`norm_spec`: each
element counted once, from where it lives), then the engine's flat-unit places (dp):

  tp   `TpSlice(dim, index, parts, replicas)`: this rank holds full.chunk(parts, dim)[index]
       (dim None: all of it), and `replicas` tp ranks hold identical values — read from the
       tensor-parallel plan's table of module styles, never from the module classes;
  pp   the pipeline stage holding it (0 without pp) — from the stage split;
  dp   the flat unit holding it, its offset there, and the unit's dp shards holding a piece
       of it (zero ≥ 1; zero 0 has one shard, held whole by every dp rank) — from the
       engine's shard layout (an expert unit's shards are over the ranks holding its experts);
  ep   `TpSlice(0, index, ep)` for routed-expert weights under expert parallelism: this rank
       holds experts full.chunk(ep, 0)[index] (index = its rank in the mesh's ep group);
       WHOLE otherwise — from the `ExpertParallel` modules.

A parameter reachable under two names (tied embeddings: `tok_embeddings.weight` and
`output.weight` are one Parameter) is listed once, under the first name `named_parameters`
gives (the name checkpoints use); its style is looked up under every name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from hpctrain.distributed.mesh import Mesh, group_rank, group_size
from hpctrain.parallel.context.ring import RingComm
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.data.zero import NormSpec
from hpctrain.parallel.moe import ExpertParallel
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.stage import LocalStages
from hpctrain.parallel.pipeline.tied import TiedEmbeddings
from hpctrain.parallel.tensor.plan import TensorParallelPlan, TpSlice

WHOLE = TpSlice(None)  # not split over tp (tp = 1, or a parameter outside the plan at tp = 1)


@dataclass(frozen=True)
class ParamShard:
    """Where one parameter (by full-model name) lives on this rank (see module docstring)."""

    name: str
    local_shape: tuple[int, ...]
    tp: TpSlice
    stage: int
    unit: int
    unit_offset: int
    dp_shards: tuple[int, ...]
    ep: TpSlice = WHOLE
    # A copy of a parameter whose original another rank holds (the last pipeline stage's tied
    # head, summed with the first stage's embedding): checkpoints write the original only.
    copy: bool = False
    held_by: int = 1  # ranks of the tp and pp groups holding identical values (`Placement`)

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The single-process model's shape of this parameter."""
        shape = list(self.local_shape)
        for piece in (self.tp, self.ep):
            if piece.dim is not None:
                shape[piece.dim] *= piece.parts
        return tuple(shape)

    def local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's ep then tp slice of `full` (a full-shape tensor of this parameter), as a
        view."""
        for piece in (self.ep, self.tp):
            if piece.dim is not None:
                full = full.chunk(piece.parts, dim=piece.dim)[piece.index]
        return full


@dataclass(frozen=True)
class ParallelState:
    """Everything parallel about this rank, built once (`hpctrain.train.setup`) and passed."""

    mesh: Mesh
    model: nn.Module  # this rank's parameters under the full model's names
    shards: Mapping[str, ParamShard]
    engine: DataParallel
    tp_plan: TensorParallelPlan | None = None  # None: tp = 1 (the model was not sharded)
    stages: LocalStages | None = None  # pp > 1: this rank's stages (`model` is the same object)
    runtime: PipelineRuntime | None = None  # pp > 1: the interpreter of this rank's actions
    cp_comm: RingComm | None = None  # the cp ring (its byte counter feeds comm_cp_bytes)

    def tp_sharded(self) -> dict[str, ParamShard]:
        """The parameters split over tp (dim not None), by name; {} at tp = 1."""
        return {n: s for n, s in self.shards.items() if s.tp.dim is not None}

    def ep_sharded(self) -> dict[str, ParamShard]:
        """The routed-expert parameters split over ep, by name; {} at ep = 1."""
        return {n: s for n, s in self.shards.items() if s.ep.dim is not None}


def _stage_of(model: nn.Module, stages: LocalStages | None) -> dict[int, int]:
    """id(param) → pipeline stage; 0 without stages. A Parameter shared by two stages on this
    rank (tied embeddings under a V schedule) belongs to the lower one, where it is used first."""
    if stages is None:
        return {id(p): 0 for p in model.parameters()}
    out: dict[int, int] = {}
    for index in sorted(stages.stages, reverse=True):
        out.update({id(p): index for p in stages.parts[index].parameters()})
    return out


def _tp_slices(model: nn.Module, plan: TensorParallelPlan | None) -> dict[int, TpSlice]:
    """id(param) → its tp slice, from the plan's table under any of the parameter's names."""
    if plan is None:
        return {id(p): WHOLE for p in model.parameters()}
    out: dict[int, TpSlice] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        piece = plan.slice_of(name)
        if piece.dim is not None or id(p) not in out:  # a planned name beats an alias
            out[id(p)] = piece
    return out


def _ep_slices(model: nn.Module) -> dict[int, TpSlice]:
    """id(param) → its expert-parallel slice, for the experts `ExpertParallel` holds."""
    out = {}
    for m in model.modules():
        if isinstance(m, ExpertParallel):
            piece = TpSlice(0, group_rank(m.group), m.ep)
            out.update({id(p): piece for p in m.parameters()})
    return out


def _dp_places(engine: DataParallel) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """name → (unit index, offset in the unit, the unit's dp shards holding a piece)."""
    out = {}
    for unit in engine.units:
        for i, name in enumerate(unit.names):
            shards = tuple(sorted({piece.rank for piece in unit.layout.pieces(i)}))
            out[name] = (unit.index, unit.layout.offsets[i], shards or (0,))
    return out


@dataclass(frozen=True)
class Placement:
    """Where one parameter lives on the axes that split the model, known before the engine
    exists: its tp slice, pipeline stage and ep slice, whether it is a copy of another rank's
    parameter (`copy`: the last stage's tied head when the first stage lives elsewhere), and
    `held_by`: how many ranks of the tp and pp groups hold identical values (the tp replicas,
    twice that for an embedding tied across two pipeline ranks)."""

    tp: TpSlice
    stage: int
    ep: TpSlice = WHOLE
    copy: bool = False
    held_by: int = 1


def placements(model: nn.Module, *, tp_plan: TensorParallelPlan | None,
               stages: LocalStages | None, tied: TiedEmbeddings | None
               ) -> dict[int, Placement]:
    """id(param) → its `Placement`, for every parameter of the finished `model` (this rank's
    tp shard / stages): the first half of the shard spec, which the clip norm (`norm_spec`)
    and the checkpoints read; the data-parallel engine adds where each one sits in its flat
    units (`shard_spec`)."""
    tp, stage, ep = _tp_slices(model, tp_plan), _stage_of(model, stages), _ep_slices(model)
    split = tied is not None and tied.split
    first_here = stages is None or 0 in stages.parts
    out = {}
    for p in model.parameters():
        twin = split and p is tied.weight
        out[id(p)] = Placement(tp[id(p)], stage[id(p)], ep.get(id(p), WHOLE),
                               copy=twin and not first_here,
                               held_by=tp[id(p)].replicas * (2 if twin else 1))
    return out


def norm_spec(placed: Mapping[int, Placement], mesh: Mesh) -> NormSpec:
    """The clip norm read from where each element lives: squares summed over the tp and pp
    groups (when they split the model), a parameter held by k of their ranks counted 1/k."""
    groups = tuple(g for g in (mesh.group("tp"), mesh.group("pp")) if group_size(g) > 1)
    return NormSpec(groups, {i: pl.held_by for i, pl in placed.items() if pl.held_by > 1})


def shard_spec(model: nn.Module, placed: Mapping[int, Placement], *,
               engine: DataParallel) -> dict[str, ParamShard]:
    """The spec of every trainable parameter of `model`: its `Placement` and its place in
    the engine's units. Raises RuntimeError if the engine does not hold exactly the model's
    trainable parameters."""
    dp = _dp_places(engine)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if sorted(n for n, _ in named) != sorted(dp):
        raise RuntimeError(f"the data-parallel engine holds {sorted(dp)} but the model's "
                           f"trainable parameters are {sorted(n for n, _ in named)}: build the "
                           "engine on the finished model")
    out = {}
    for name, p in named:
        unit = engine.units[dp[name][0]]
        shape = tuple(unit.shapes[unit.names.index(name)])  # p itself may be freed (ZeRO-3)
        pl = placed[id(p)]
        out[name] = ParamShard(name, shape, pl.tp, pl.stage, *dp[name], ep=pl.ep, copy=pl.copy,
                               held_by=pl.held_by)
    return out


def parallel_state(model: nn.Module, placed: Mapping[int, Placement], *, mesh: Mesh,
                   engine: DataParallel, tp_plan: TensorParallelPlan | None = None,
                   stages: LocalStages | None = None, runtime: PipelineRuntime | None = None,
                   cp_comm: RingComm | None = None) -> ParallelState:
    """Freeze the built pieces into one ParallelState, completing the shard spec."""
    spec = shard_spec(model, placed, engine=engine)
    return ParallelState(mesh, model, MappingProxyType(spec), engine, tp_plan, stages, runtime,
                         cp_comm)
