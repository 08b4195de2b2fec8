"""Tensor parallelism over the parts a rank holds (the whole model, or its pipeline stages).

Each part is sharded in place by `apply_tensor_parallel` with the mesh's tp group (a part keeps
its family's blocks under their global names, so the plan's module names are the whole
model's): blocks are Megatron-sharded, the embedding and the output head are vocab-parallel and
the step's loss is the vocab-parallel cross entropy.

Activations passed between stages are the residual stream: (micro_batch, seq_len, dim),
identical on every tp rank, or with sp the rank's sequence shard (micro_batch, seq_len/tp, dim).
Each tp rank exchanges them with its counterpart in the neighbouring stage (its pp group): its
sequence shard, or without sp its 1/tp piece, all-gathered on arrival
(hpctrain.parallel.pipeline.hop).
"""

from __future__ import annotations

from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.parallel.tensor.plan import TensorParallelPlan, apply_tensor_parallel


def shard_parts(parts: dict[int, nn.Module], *, group, sp: bool,
                cfg: ModelConfig) -> TensorParallelPlan:
    """Shard every part in `parts` (index → module) over `group`, from its current values;
    returns one plan covering them all (module names, replicas and kv slots merged, one comm
    counter). Call before wrapping pipeline stages in `LocalStages` (which registers their
    modules)."""
    merged: TensorParallelPlan | None = None
    for part in parts.values():
        plan = apply_tensor_parallel(part, group=group, sp=sp, cfg=cfg,
                                     counter=merged.counter if merged else None)
        if merged is None:
            merged = plan
            continue
        merged.modules.update(plan.modules)
        merged.replicas.update(plan.replicas)
        merged.kv_slots.update(plan.kv_slots)
    if merged is None:
        raise ValueError("shard_parts needs at least one part")
    return merged


def stage_act_shape(*, micro_batch: int, seq_len: int, dim: int, tp: int,
                    sp: bool) -> tuple[int, int, int]:
    """Shape of the hidden states one tp rank sends between stages."""
    if sp and seq_len % tp:
        raise ValueError(f"train.seq_len={seq_len} is not divisible by parallel.tp={tp}, "
                         "required by parallel.sp=true: choose a multiple of tp or sp=false")
    return (micro_batch, seq_len // tp if sp else seq_len, dim)
