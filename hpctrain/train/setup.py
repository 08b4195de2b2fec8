"""Set-up of one rank: the model for this layout and its `ParallelState`, built once.

One order for every layout, and it lives only here (`build_rank_model`): on the meta device
(shapes, no memory), build this rank's parts of the model (the whole model, or with pp > 1 its
pipeline stages: the model's own modules for a range of layers, `hpctrain.models.family.Part`),
shard the routed experts over ep, shard over tp (which then sees the experts' final
parameters, kept whole on every tp rank), tie a stage's head to the embedding on the same rank,
make the linears FP8 (train.fp8); then swap attention for the cp ring, wrap for activation
checkpointing, compile (train.compile). Then `build_parallel_state` adds the pipeline runtime
over the finished stages, the placements (where each parameter lives: the first half of the
shard spec, which the clip norm reads), the data-parallel engine over the finished parameters
(its flat units are the first memory the parameters get, on the rank's device: the full
buffers at ZeRO 0-2, the shards at ZeRO-3; expert parameters get their own units over the
ranks holding the same experts), completes the shard spec
(`hpctrain.parallel.state.parallel_state`) and computes the initial values of the rank's own
elements into them (`hpctrain.checkpoint.initial`: one full parameter at a time). The
trainer, checkpointing and metrics receive the result; nothing is attached to the model or the
optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hpctrain.checkpoint.initial import init_from_seed
from hpctrain.config.schema import Config
from hpctrain.distributed.mesh import Mesh, group_size
from hpctrain.models import build_model
from hpctrain.models.checkpointing import apply_activation_checkpointing
from hpctrain.models.compile import apply_compile
from hpctrain.parallel.context.apply import apply_context_parallel
from hpctrain.parallel.context.ring import RingComm
from hpctrain.parallel.data import build_data_parallel
from hpctrain.parallel.fp8 import apply_fp8
from hpctrain.parallel.moe import ExpertGroups, apply_expert_parallel
from hpctrain.parallel.pipeline.actions import Schedule
from hpctrain.parallel.pipeline.schedules import build_schedule
from hpctrain.parallel.pipeline.stage import LocalStages, assemble_stages, stage_parts
from hpctrain.parallel.pipeline.tp_stages import shard_parts
from hpctrain.parallel.state import ParallelState, norm_spec, parallel_state, placements
from hpctrain.parallel.tensor import TensorParallelPlan
from hpctrain.train.pipeline import PipelineEngine
from hpctrain.train.tensor_parallel import tp_pre_reduce


@dataclass
class RankModel:
    """This rank's finished model and what its set-up made: `module` is the whole model
    (pp = 1) or the rank's `LocalStages` (then also `stages`)."""

    module: nn.Module
    tp_plan: TensorParallelPlan | None  # None: tp = 1
    cp_comm: RingComm
    experts: ExpertGroups | None  # None: no expert parallelism
    stages: LocalStages | None


def build_rank_model(cfg: Config, mesh: Mesh, *, schedule: Schedule | None) -> RankModel:
    """This rank's model for `cfg`, every transform applied in the one order (module
    docstring); `schedule` (pp > 1) says which stages the rank holds."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    with torch.device("meta"):  # the engine gives the rank's own elements memory
        parts = ({0: build_model(m, seed=t.seed)} if schedule is None else
                 stage_parts(m, schedule.stages_of(mesh.coord("pp")),
                             n_stages=schedule.n_stages, seed=t.seed))
        experts = apply_expert_parallel(nn.ModuleList(parts.values()), mesh)  # ep > 1: E/ep
        plan = (shard_parts(parts, group=mesh.group("tp"), sp=p.sp, cfg=m)
                if group_size(mesh.group("tp")) > 1 else None)
        stages = (assemble_stages(parts, n_stages=schedule.n_stages, cfg=m)  # ties tp shards
                  if schedule is not None else None)
        model = stages if stages is not None else parts[0]
        if t.fp8:  # after tp (specs name its groups), before checkpointing wraps
            apply_fp8(model, recipe=t.fp8_recipe, skip=t.fp8_skip)
    cp_comm = RingComm(mesh.group("cp"), timeout=mesh.timeout, backend=m.attention)
    rows = mesh.group("cp_tp") if plan is not None and p.sp else cp_comm.group  # MoE routing
    apply_context_parallel(model, cp_comm, token_group=rows, transport=p.cp_comm)  # cp > 1
    # After tp sharding, so recomputation reruns the sharded layers (names unchanged).
    apply_activation_checkpointing(model, t.activation_checkpointing)
    apply_compile(model, t.compile, attention=m.attention)  # after both
    return RankModel(model, plan, cp_comm, experts, stages)


def build_parallel_state(cfg: Config, mesh: Mesh) -> tuple[ParallelState, PipelineEngine | None]:
    """This rank's ParallelState for `cfg`, and with pp > 1 the `PipelineEngine` that runs its
    stages (None at pp = 1)."""
    p = cfg.parallel
    schedule = (build_schedule(p.schedule, pp=p.pp, microbatches=cfg.grad_accum,
                               virtual_stages=p.virtual_stages) if p.pp > 1 else None)
    built = build_rank_model(cfg, mesh, schedule=schedule)
    pipeline = (PipelineEngine(cfg, mesh, built.stages, schedule, tp_plan=built.tp_plan)
                if schedule is not None else None)
    # Where every parameter lives (tp, pp, ep, copies), known before the engine: the clip
    # norm is read from it, each element counted once (hpctrain.parallel.state).
    placed = placements(built.module, tp_plan=built.tp_plan, stages=built.stages,
                        tied=pipeline.tied if pipeline is not None else None)
    # One update path for every layout: gradient reduction (bucketed), the global norm,
    # clipping and AdamW (sharded for zero > 0, 16-bit parameters with fp32 masters under
    # bf16/fp16) live in the data-parallel engine (hpctrain/parallel/data), over the dp group
    # on this rank's tp shard / pipeline stages.
    pre_reduce = tp_pre_reduce(built.module, built.tp_plan)
    if pipeline is not None:  # + tied embeddings across stages
        pre_reduce = pipeline.pre_reduce(pre_reduce)
    engine = build_data_parallel(built.module, cfg, mesh, norm=norm_spec(placed, mesh),
                                 pre_reduce=pre_reduce, experts=built.experts)
    state = parallel_state(built.module, placed, mesh=mesh, engine=engine,
                           tp_plan=built.tp_plan, stages=built.stages,
                           runtime=pipeline.runtime if pipeline is not None else None,
                           cp_comm=built.cp_comm)
    if any(unit.deferred for unit in engine.units):  # not on the dry run's meta device
        init_from_seed(state, cfg.model, seed=cfg.train.seed)
    return state, pipeline
