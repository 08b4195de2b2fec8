"""Set-up of one rank: the model for this layout and its `ParallelState`, built once.

Order matters and lives only here: build the model (or, with pp > 1, the pipeline's stages),
shard its routed experts over ep, shard it over tp (which then sees the experts' final
parameters, kept whole on every tp rank), make its linears FP8 (train.fp8), wrap it for
activation checkpointing, compile it (train.compile), move it to the device, then build the
data-parallel engine over the finished parameters (the engine flattens them; expert parameters
get their own units over the ranks holding the same experts), and finally derive the shard spec
from the plan, the stages and the engine
(`hpctrain.parallel.state.parallel_state`). The trainer, checkpointing and metrics receive
the result; nothing is attached to the model or the optimizer.
"""

from __future__ import annotations

from hpctrain.config import Config
from hpctrain.distributed.mesh import Mesh
from hpctrain.models import build_model
from hpctrain.models.checkpointing import apply_activation_checkpointing
from hpctrain.models.compile import apply_compile
from hpctrain.parallel.context.apply import apply_context_parallel
from hpctrain.parallel.context.ring import RingComm
from hpctrain.parallel.data import build_data_parallel
from hpctrain.parallel.fp8 import apply_fp8
from hpctrain.parallel.moe import apply_expert_parallel
from hpctrain.parallel.state import ParallelState, parallel_state
from hpctrain.train.pipeline import PipelineEngine
from hpctrain.train.tensor_parallel import engine_axes, setup_tensor_parallel


def build_parallel_state(cfg: Config, mesh: Mesh, *,
                         pipeline: PipelineEngine | None = None) -> ParallelState:
    """This rank's ParallelState for `cfg`. With pp > 1 pass the `PipelineEngine` (it builds
    the stages, already tp-sharded and checkpointed); else the model is built here."""
    if (pipeline is None) != (cfg.parallel.pp == 1):
        raise ValueError(f"parallel.pp={cfg.parallel.pp} needs a pipeline engine exactly "
                         "when pp > 1: build PipelineEngine(cfg, mesh) and pass it")
    experts = None
    if pipeline is not None:  # stages built, tp-sharded and given ring attention there
        model, plan, cp_comm = pipeline.local, pipeline.tp_plan, pipeline.cp_comm
        experts = pipeline.experts
    else:
        model = build_model(cfg.model, seed=cfg.train.seed)
        experts = apply_expert_parallel(model, mesh)  # ep > 1: this rank's E/ep experts
        plan = setup_tensor_parallel(model, cfg, mesh)
        if cfg.train.fp8:  # after tp (specs name its groups), before checkpointing wraps
            apply_fp8(model, recipe=cfg.train.fp8_recipe, skip=cfg.train.fp8_skip)
        cp_comm = RingComm(mesh.group("cp"), timeout=mesh.timeout,
                           backend=cfg.model.attention)
        # cp > 1: attention over the cp ring (or all-gathered key/value shards)
        apply_context_parallel(model, cp_comm, transport=cfg.parallel.cp_comm)
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
        apply_compile(model, cfg.train.compile, attention=cfg.model.attention)
        model.to(mesh.device)
    # One update path for every layout: gradient reduction (bucketed), the global norm,
    # clipping and AdamW (sharded for zero > 0, 16-bit parameters with fp32 masters under
    # bf16/fp16) live in the data-parallel engine (hpctrain/parallel/data), over the dp group
    # on this rank's tp shard / pipeline stages.
    axes = engine_axes(model, plan, mesh)
    if pipeline is not None:  # + tied embeddings across stages
        axes = pipeline.engine_axes(axes)
    if experts is not None:
        axes["experts"] = experts
    engine = build_data_parallel(model, cfg, mesh, **axes)
    return parallel_state(model, mesh=mesh, engine=engine, tp_plan=plan,
                          stages=pipeline.local if pipeline is not None else None,
                          runtime=pipeline.runtime if pipeline is not None else None,
                          cp_comm=cp_comm,
                          copies=pipeline.copies() if pipeline is not None else frozenset())
