"""Tensor parallelism inside pipeline stages (3D: dp × tp × pp).

Each stage of this rank is sharded in place by `apply_tensor_parallel` with the mesh's tp group
(the stage keeps the Transformer's `Block`s under their global names, so the plan's module names
are the full model's): blocks are Megatron-sharded, the first stage's embedding and the last
stage's output head are vocab-parallel and the last stage's loss is the vocab-parallel cross
entropy. The tp layers are pointed at the stage's weight-gradient queue, so zero-bubble schedules
defer their W through it exactly as for the plain Linears.

Activations passed between stages are the residual stream: (micro_batch, seq_len, dim),
identical on every tp rank, or with sp the rank's sequence shard (micro_batch, seq_len/tp, dim).
Each tp rank exchanges them with its counterpart in the neighbouring stage (its pp group).
"""

from __future__ import annotations

import functools

from hpctrain.models.config import ModelConfig
from hpctrain.parallel.tensor.comm import CommCounter
from hpctrain.parallel.tensor.loss import vocab_parallel_cross_entropy
from hpctrain.parallel.tensor.plan import TensorParallelPlan, apply_tensor_parallel


def shard_stages(stages: dict, *, group, sp: bool, cfg: ModelConfig) -> TensorParallelPlan:
    """Shard every `PipelineStage` in `stages` (stage index → stage) over `group`; returns one
    plan covering them all (module names, replicas and kv slots merged, one comm counter).
    Call before wrapping the stages in `LocalStages` (which registers their modules)."""
    merged = TensorParallelPlan(group, sp, CommCounter())
    for stage in stages.values():
        plan = apply_tensor_parallel(stage, group=group, sp=sp, cfg=cfg, counter=merged.counter)
        merged.kv_shard = plan.kv_shard  # the same for every stage (a function of cfg and rank)
        merged.modules.update(plan.modules)
        merged.replicas.update(plan.replicas)
        merged.kv_slots.update(plan.kv_slots)
        stage.attach_wgrad_queue()
        if stage.is_last:
            stage.loss_fn = functools.partial(vocab_parallel_cross_entropy, group=group,
                                              counter=merged.counter)
    return merged


def stage_act_shape(*, micro_batch: int, seq_len: int, dim: int, tp: int,
                    sp: bool) -> tuple[int, int, int]:
    """Shape of the hidden states one tp rank sends between stages."""
    if sp and seq_len % tp:
        raise ValueError(f"train.seq_len={seq_len} is not divisible by parallel.tp={tp}, "
                         "required by parallel.sp=true: choose a multiple of tp or sp=false")
    return (micro_batch, seq_len // tp if sp else seq_len, dim)
