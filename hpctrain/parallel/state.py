"""This rank's parallel state: built once at setup, then passed to whoever needs it.

`ParallelState` holds the mesh, this rank's model (its tensor-parallel shard and/or pipeline
stages, always under the full model's parameter names), the per-parameter shard spec, the
data-parallel engine (the one update path of every layout) and, with pp > 1, the stages and
the pipeline runtime. Nothing of it is attached to modules or optimizers: checkpointing reads
the spec to reassemble and cut tensors, metrics read the tp plan's byte counter, the trainer
steps the engine.

The shard spec has one `ParamShard` per parameter name, saying where the parameter lives:

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

from hpctrain.distributed.mesh import Mesh, group_rank
from hpctrain.parallel.context.ring import RingComm
from hpctrain.parallel.data.engine import DataParallel
from hpctrain.parallel.moe import ExpertParallel
from hpctrain.parallel.pipeline.runtime import PipelineRuntime
from hpctrain.parallel.pipeline.stage import LocalStages
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


def shard_spec(model: nn.Module, *, engine: DataParallel, tp_plan: TensorParallelPlan | None,
               stages: LocalStages | None = None,
               copies: frozenset[int] = frozenset()) -> dict[str, ParamShard]:
    """The spec of every trainable parameter of `model` (see the module docstring); `copies`:
    ids of parameters held as a copy of another rank's (`ParamShard.copy`). Raises
    RuntimeError if the engine does not hold exactly the model's trainable parameters."""
    tp, stage, dp = _tp_slices(model, tp_plan), _stage_of(model, stages), _dp_places(engine)
    ep = _ep_slices(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if sorted(n for n, _ in named) != sorted(dp):
        raise RuntimeError(f"the data-parallel engine holds {sorted(dp)} but the model's "
                           f"trainable parameters are {sorted(n for n, _ in named)}: build the "
                           "engine on the finished model")
    out = {}
    for name, p in named:
        unit = engine.units[dp[name][0]]
        shape = tuple(unit.shapes[unit.names.index(name)])  # p itself may be freed (ZeRO-3)
        out[name] = ParamShard(name, shape, tp[id(p)], stage[id(p)], *dp[name],
                               ep=ep.get(id(p), WHOLE), copy=id(p) in copies)
    return out


def parallel_state(model: nn.Module, *, mesh: Mesh, engine: DataParallel,
                   tp_plan: TensorParallelPlan | None = None, stages: LocalStages | None = None,
                   runtime: PipelineRuntime | None = None, cp_comm: RingComm | None = None,
                   copies: frozenset[int] = frozenset()) -> ParallelState:
    """Freeze the built pieces into one ParallelState, deriving the shard spec."""
    spec = shard_spec(model, engine=engine, tp_plan=tp_plan, stages=stages, copies=copies)
    return ParallelState(mesh, model, MappingProxyType(spec), engine, tp_plan, stages, runtime,
                         cp_comm)
