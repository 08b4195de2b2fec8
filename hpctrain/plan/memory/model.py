"""The planner's one memory model: the bytes one rank of a layout holds at the peak of a step.

`task=plan` and `parallel=auto` (the layout search), the pre-launch check and the prediction a
run logs beside its measured ledger all call `rank_memory`, and judge fits against the same
usable memory (the limit less plan.headroom), so they never disagree.

For the models hpctrain trains (`ModelConfig`) it counts what hpctrain's engine and blocks
hold, term by term:
  states       the flat engine's units on the busiest rank, with their padding
               (`plan.flat_states`: tp slices, pipeline chunks, ZeRO over the shard group,
               16-bit parameters and gradients with fp32 masters and moments, or fp32 ones;
               routed experts 1/ep per rank in their own units under ep)
  activations  what the blocks save for backward on the busier of the first and the last
               pipeline stage (`plan.activations`, mixture-of-experts blocks included at the
               stated capacity bound), in flight as the schedule keeps them
               (`plan.bubble.in_flight_by_rank`), under the recompute policy
  buffers      FP8 weight copies, and ZeRO-3's gathered units at their most: the unit outside
               the blocks and two blocks, or every block without resharding after forward
               (`plan.memory.states.zero3_gathered_bytes`; the weights autograd saves are
               views of those buffers, freed with them). The engine reduces gradients in its
               units' own buffers (no separate bucket)
  host         offloaded optimizer state; `staging` an asynchronous save's host copy
For other shapes (`GPTShape`: the models of Megatron's papers, which hpctrain does not build)
the published formulas of `plan.memory` stand in, as those papers count them.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hpctrain.models.config import ModelConfig
from hpctrain.plan.bubble import in_flight_by_rank, weighted_peaks
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.activations import rank_activation_bytes
from hpctrain.plan.memory.formulas import (
    MemoryBreakdown,
    checkpoint_staging_bytes,
    fp8_buffer_bytes,
    memory_breakdown,
)
from hpctrain.plan.memory.states import (
    flat_state_bytes,
    rank_expert_groups,
    rank_param_groups,
    zero3_gathered_bytes,
)


@dataclass(frozen=True)
class StepShape:
    """What a training step holds beyond its layout: the micro-batch, how many of them a step
    accumulates (a pipeline's schedule keeps several in flight), recomputation, precision."""

    seq_len: int
    micro_batch_size: int
    microbatches: int = 1
    recompute: str = "none"
    precision: str = "bf16"
    fp8: bool = False
    bucket_mb: float = 25.0
    checkpoint_async: bool = True
    packed: bool = True  # rows of packed documents (data.packing): RoPE per token
    grad_comm_dtype: str = "fp32"  # gradients on the wire (parallel.grad_comm_dtype)
    zero3_reshard: bool = True  # train.zero3_reshard_after_forward


def rank_memory(model, layout: Layout, step: StepShape, *,
                in_flight: tuple[int, ...] | None = None) -> MemoryBreakdown:
    """Bytes on the busiest rank of `layout` (module docstring). `in_flight`: activation sets
    alive at the peak on each pipeline rank, first to last; None takes the schedule's, each
    set weighed by what its stage keeps (`rank_activations`)."""
    sets = in_flight or in_flight_by_rank(layout.schedule, pp=layout.pp, m=step.microbatches,
                                          v=layout.virtual_stages)
    if not isinstance(model, ModelConfig):
        return memory_breakdown(
            model, layout, seq_len=step.seq_len, micro_batch_size=step.micro_batch_size,
            in_flight=max(sets), recompute=step.recompute, precision=step.precision,
            fp8=step.fp8, checkpoint_async=step.checkpoint_async)
    states = engine_states(model, layout, step)
    acts = max(rank_activations(model, layout, step, in_flight=in_flight))
    buffers = fp8_buffer_bytes(model, layout, in_flight=max(sets),
                               recompute=step.recompute) if step.fp8 else 0.0
    buffers += gathered_bytes(model, layout, step)
    return MemoryBreakdown(
        params=states.params, grads=states.grads, optimizer=states.optimizer,
        activations=acts, buffers=buffers, host=states.host,
        staging=checkpoint_staging_bytes(model, layout) if step.checkpoint_async else 0.0)


def engine_states(model: ModelConfig, layout: Layout, step: StepShape, *,
                  pp_rank: int | None = None):
    """Model-state bytes of the flat engine on the busiest rank (module docstring), or on
    pipeline rank `pp_rank`."""
    return flat_state_bytes(model, dp=layout.dims.shard_size, zero=layout.zero,
                            precision=step.precision, bucket_mb=step.bucket_mb,
                            offload=layout.offload, tp=layout.tp, pp=layout.pp,
                            virtual_stages=layout.virtual_stages, schedule=layout.schedule,
                            pp_rank=pp_rank, ep=layout.ep,
                            expert_dp=layout.dims.expert_shard_size)


def gathered_bytes(model: ModelConfig, layout: Layout, step: StepShape) -> float:
    """ZeRO-3's gathered units at their most on a rank (0 at other stages; module docstring)."""
    if layout.zero != 3:
        return 0.0
    return zero3_gathered_bytes(model, dp=layout.dims.shard_size, precision=step.precision,
                                tp=layout.tp, ep=layout.ep,
                                expert_dp=layout.dims.expert_shard_size,
                                reshard_after_forward=step.zero3_reshard)


def rank_checkpoint_bytes(model: ModelConfig, layout: Layout, *, pp_rank: int) -> float:
    """Bytes pipeline rank `pp_rank` writes to a checkpoint: 12 per parameter it owns (fp32
    master, both moments), its pipeline chunks' tp slices over the ZeRO shards (all of them
    at zero 0), its routed experts (ep > 1) over the ranks holding the same experts; a tied
    embedding's copy on the head's rank is left to the embedding's rank."""
    where = dict(pp=layout.pp, virtual_stages=layout.virtual_stages, schedule=layout.schedule,
                 pp_rank=pp_rank)
    embed, blocks, tail = rank_param_groups(model, tp=layout.tp, ep=layout.ep, **where)
    if model.tied_embeddings and not embed and tail:
        tail = tail[:-1]  # rank_param_groups' copy of E
    owned = sum(embed) + sum(sum(b) for b in blocks) + sum(tail)
    experts = sum(map(sum, rank_expert_groups(model, ep=layout.ep, **where)))
    if layout.zero == 0:
        return 12.0 * (owned + experts)
    return 12.0 * (owned / layout.dims.shard_size + experts / layout.dims.expert_shard_size)


def stage_activations(model: ModelConfig, layout: Layout, step: StepShape, *,
                      in_flight: tuple[int, ...] | None = None) -> dict[str, float]:
    """Saved-for-backward bytes at the peak on the first and the last pipeline stage."""
    ranks = rank_activations(model, layout, step, in_flight=in_flight)
    return {"first": ranks[0], "last": ranks[-1]}


def rank_activations(model: ModelConfig, layout: Layout, step: StepShape, *,
                     in_flight: tuple[int, ...] | None = None) -> list[float]:
    """Saved-for-backward bytes at the peak on each pipeline rank, first to last: by default
    the peak over each rank's schedule of what its live (microbatch, stage) sets keep
    (`plan.bubble.weighted_peaks`: the head's and the embedding's stages weigh more); with
    `in_flight` (sets alive at each rank's peak), that many sets of the mean stage."""
    peaks = partial(weighted_peaks, layout.schedule, pp=layout.pp, m=step.microbatches,
                    v=layout.virtual_stages) if in_flight is None else None
    acts = rank_activation_bytes(
        model, seq_len=step.seq_len // layout.cp, micro_batch_size=step.micro_batch_size,
        tp=layout.tp, sp=layout.sp, pp=layout.pp,
        layers_per_chunk=model.n_layers / (layout.pp * layout.virtual_stages),
        in_flight=in_flight, recompute=step.recompute, precision=step.precision, ep=layout.ep,
        chunks=layout.virtual_stages, packed=step.packed or layout.cp > 1,
        head_rank=0 if layout.schedule == "zbv" else layout.pp - 1, stage_peaks=peaks)
    return acts
