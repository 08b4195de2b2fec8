"""Exact per-rank model-state bytes of the flat data-parallel engine (hpctrain.parallel.data).

The ZeRO formulas of `hpctrain.plan.memory.formulas` count Ψ parameters. The engine lays parameters
into flat units, and each unit's layout pads Ψᵤ to dp·Sᵤ (S = ceil(Ψᵤ/dp), see
`hpctrain.parallel.data.layout.ShardLayout`). Per unit, with p bytes per compute element
(2 for bf16/fp16, 4 for fp32) and Pᵤ = dp·Sᵤ the padded size (Pᵤ = Ψᵤ when zero = 0):

  params     p·Pᵤ (full buffer, zero < 3)        p·Sᵤ (shard only, zero 3, between steps)
  grads      p·Pᵤ (full bucket, zero < 2)        p·Sᵤ (grad shard, zero ≥ 2)
  optimizer  12·Sᵤ mixed (fp32 master, m, v)     8·Sᵤ fp32 (m, v; the shard is the master)

Units are the engine's: for zero < 3, consecutive groups of ≈ parallel.bucket_mb in reverse
registration order (`hpctrain.parallel.data.ddp.size_groups`); for zero 3, one unit for the
non-block parameters and one per transformer block. The parameters are the family's own: one
block of each kind (dense, MoE) and the two ends, built on the meta device
(hpctrain.models.registry.meta_part: names, shapes and registration order, no memory), so a
family's biases, q/k norms or routers are counted because the model has them, never restated.

Under tp and pp the engine works the same way on the parameters a rank holds
(`rank_param_groups`): its tp slices (cut by hpctrain.parallel.tensor.plan.tp_slice: column
and row weights 1/t, the embedding and head vocab-parallel 1/t, key/value projections 1/t or
one whole kv head when kv heads < tp, norms whole) of its pipeline chunks' blocks, the
embedding on the rank holding the first chunk and the final norm + head on the one holding the
last (with tied embeddings on two ranks, the head's rank keeps a copy:
hpctrain.parallel.pipeline.tied).
The busiest pipeline rank is reported.

A mixture-of-experts block holds its router, its routed experts and its shared experts whole on
every tp rank, in that order after the attention (hpctrain.parallel.tensor.plan). With ep = 1
the routed experts are dense parameters like any other; with ep > 1 a rank holds E/ep of them
in their own units (`expert_groups`), sharded over the (dp/ep)·cp ranks holding the same
experts (hpctrain.parallel.data.engine).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from torch import nn

from hpctrain.models.config import ModelConfig
from hpctrain.models.family import Part
from hpctrain.models.moe.layer import moe_layers
from hpctrain.models.registry import family_of, meta_part
from hpctrain.parallel.data.layout import ShardLayout
from hpctrain.parallel.pipeline.schedules import stage_ranks
from hpctrain.parallel.tensor.plan import kv_slot, tp_slice
from hpctrain.plan.memory.formulas import ModelStates


def _held_numel(model: ModelConfig, name: str, shape: torch.Size, *, tp: int) -> int:
    """Elements of parameter `name` on a tp rank, cut as the family's tp plan cuts it
    (hpctrain.parallel.tensor.plan.tp_slice: every tp rank holds the same count)."""
    piece = tp_slice(name, family=family_of(model), tp=tp, tp_rank=0,
                     kv=kv_slot(model.n_kv_heads, tp=tp, tp_rank=0))
    return math.prod(shape) // (piece.parts if piece.dim is not None else 1)


def _block(model: ModelConfig, layer: int) -> nn.Module:
    """Block `layer` as the family builds it, on meta (blocks of one kind, dense or MoE, hold
    the same shapes: the first of the kind stands for all)."""
    first = next(i for i in range(model.n_layers)
                 if model.is_moe_layer(i) == model.is_moe_layer(layer))
    return meta_part(model, Part(range(first, first + 1), embed=False, head=False))


def _routed(block: nn.Module) -> set[int]:
    """ids of the routed experts' parameters (those expert parallelism shards)."""
    return {id(p) for moe in moe_layers(block) for p in moe.experts.parameters()}


def block_numels(model: ModelConfig, *, tp: int = 1, layer: int = 0, ep: int = 1) -> list[int]:
    """Parameter sizes of block `layer` on a tp rank, in registration order: the family's block
    (hpctrain.models.registry.meta_part), each parameter cut by the tp plan; with ep > 1 the
    routed experts are left to `expert_groups`."""
    return list(_kind_numels(model, model.is_moe_layer(layer), tp=tp, ep=ep))


@functools.lru_cache(maxsize=256)
def _kind_numels(model: ModelConfig, moe: bool, *, tp: int, ep: int) -> tuple[int, ...]:
    """`block_numels` of the blocks of one kind (a search asks for each layout's every block)."""
    block = _block(model, next(i for i in range(model.n_layers) if model.is_moe_layer(i) == moe))
    routed = _routed(block) if ep > 1 else set()
    return tuple(_held_numel(model, name, p.shape, tp=tp) for name, p in block.named_parameters()
                 if id(p) not in routed)


@functools.lru_cache(maxsize=256)
def _ends(model: ModelConfig, *, embed: bool, tp: int) -> tuple[int, ...]:
    """Sizes on a tp rank of the embedding (`embed`), or of what follows the blocks: the final
    norm and the output head (an untied one: a tied head is the embedding)."""
    part = meta_part(model, Part(range(0), embed=embed, head=not embed))
    head = f"{family_of(model).head}."
    return tuple(_held_numel(model, name, p.shape, tp=tp) for name, p in part.named_parameters()
                 if embed or not (model.tied_embeddings and name.startswith(head)))


def param_groups(model: ModelConfig, *, tp: int = 1, ep: int = 1) -> tuple[
        list[int], list[list[int]], list[int]]:
    """(embedding, per-block sizes, after-blocks sizes: final norm and an untied head) on a
    tp rank; the routed experts of an ep > 1 layout are left to `expert_groups`."""
    blocks = [block_numels(model, tp=tp, layer=i, ep=ep) for i in range(model.n_layers)]
    return list(_ends(model, embed=True, tp=tp)), blocks, list(_ends(model, embed=False, tp=tp))


def expert_groups(model: ModelConfig, *, ep: int) -> list[list[int]]:
    """Per block, the sizes of the routed experts one rank of an ep > 1 layout holds in the
    experts' own units (E/ep of each stacked weight; [] for a dense block)."""
    if ep == 1:
        return [[] for _ in range(model.n_layers)]
    out = []
    for i in range(model.n_layers):
        block = _block(model, i)
        routed = _routed(block)
        out.append([p.numel() // ep for p in block.parameters() if id(p) in routed])
    return out


def rank_chunks(pp_rank: int, *, pp: int, virtual_stages: int, schedule: str) -> list[int]:
    """The pipeline chunks (stage ids) pp rank `pp_rank` holds, in stage order, as the schedule
    places them (`schedules.stage_ranks`)."""
    placed = stage_ranks(schedule, pp=pp, virtual_stages=virtual_stages)
    return [stage for stage, rank in enumerate(placed) if rank == pp_rank]


def rank_param_groups(model: ModelConfig, *, tp: int = 1, pp: int = 1, virtual_stages: int = 1,
                      schedule: str = "1f1b", pp_rank: int = 0, ep: int = 1):
    """`param_groups` of the parameters pp rank `pp_rank` holds (module docstring)."""
    embed, blocks, tail = param_groups(model, tp=tp, ep=ep)
    first, last, mine = _rank_blocks(model, blocks, pp=pp, virtual_stages=virtual_stages,
                                     schedule=schedule, pp_rank=pp_rank)
    if last and not first and model.tied_embeddings:  # the head's copy of E
        tail = tail + embed
    return embed if first else [], mine, tail if last else []


def rank_expert_groups(model: ModelConfig, *, ep: int, pp: int = 1, virtual_stages: int = 1,
                       schedule: str = "1f1b", pp_rank: int = 0) -> list[list[int]]:
    """`expert_groups` of the blocks pp rank `pp_rank` holds."""
    return _rank_blocks(model, expert_groups(model, ep=ep), pp=pp,
                        virtual_stages=virtual_stages, schedule=schedule, pp_rank=pp_rank)[2]


def _rank_blocks(model, blocks, *, pp, virtual_stages, schedule, pp_rank):
    """(holds the first chunk, holds the last chunk, the blocks of its chunks in order)."""
    n = pp * virtual_stages
    per = model.n_layers // n
    chunks = rank_chunks(pp_rank, pp=pp, virtual_stages=virtual_stages, schedule=schedule)
    mine = [b for c in sorted(chunks) for b in blocks[c * per:(c + 1) * per]]
    return 0 in chunks, n - 1 in chunks, mine


def unit_numels(model: ModelConfig, *, zero: int, bucket_mb: float, elem_bytes: int,
                held=None) -> list[tuple[int, ...]]:
    """Parameter sizes of every flat unit, as `hpctrain.parallel.data.engine` groups them
    (`held`: the parameters a rank holds, `rank_param_groups`; default the whole model's)."""
    embed, blocks, tail = held or param_groups(model)
    if zero == 3:
        ends = [tuple(embed + tail)] if embed or tail else []  # a middle stage has none
        return ends + [tuple(b) for b in blocks if b]  # an expert unit per MoE block
    named = embed + [n for b in blocks for n in b] + tail
    bucket_bytes, units, size = bucket_mb * 2**20, [[]], 0
    for n in reversed(named):  # the same rule as ddp.size_groups
        if units[-1] and size + n * elem_bytes > bucket_bytes:
            units.append([])
            size = 0
        units[-1].append(n)
        size += n * elem_bytes
    return [tuple(u) for u in units if u]


def flat_state_bytes(model: ModelConfig, *, dp: int, zero: int, precision: str,
                     bucket_mb: float = 25.0, offload: str = "none", tp: int = 1, pp: int = 1,
                     virtual_stages: int = 1, schedule: str = "1f1b",
                     pp_rank: int | None = None, ep: int = 1,
                     expert_dp: int | None = None) -> ModelStates:
    """Bytes the engine's ledger reports between steps on the busiest rank of a layout
    (module docstring), or on pipeline rank `pp_rank`; `expert_dp`: the ranks an ep > 1
    layout's expert units shard over (default dp / ep)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} must be one of 0, 1, 2, 3")
    kw = dict(zero=zero, precision=precision, bucket_mb=bucket_mb, offload=offload)
    where = dict(pp=pp, virtual_stages=virtual_stages, schedule=schedule)

    def states(r: int) -> ModelStates:
        dense = _rank_states(model, dp=dp, held=rank_param_groups(
            model, tp=tp, ep=ep, pp_rank=r, **where), **kw)
        if ep == 1:
            return dense
        held = ([], rank_expert_groups(model, ep=ep, pp_rank=r, **where), [])
        ex = _rank_states(model, dp=expert_dp or dp // ep, held=held, **kw)
        return ModelStates(dense.params + ex.params, dense.grads + ex.grads,
                           dense.optimizer + ex.optimizer, host=dense.host + ex.host)

    ranks = [states(r) for r in ([pp_rank] if pp_rank is not None else sorted({0, pp - 1}))]
    return max(ranks, key=lambda s: s.total + s.host)


def zero3_gathered_bytes(model: ModelConfig, *, dp: int, precision: str, tp: int = 1,
                         ep: int = 1, expert_dp: int | None = None,
                         reshard_after_forward: bool = True) -> float:
    """ZeRO-3 (pipelines refuse it: one stage): the most gathered parameter bytes a rank holds
    at once beyond its shards (hpctrain.parallel.data.zero3): the unit outside the blocks and
    two consecutive blocks (the one running and the one prefetched), each with its routed
    experts' unit under ep; every block when they stay gathered until their backward
    (train.zero3_reshard_after_forward=false). Units padded as the engine pads them."""
    p = 4 if precision == "fp32" else 2
    embed, blocks, tail = param_groups(model, tp=tp, ep=ep)

    def padded(numels: list[int], n: int) -> int:
        return ShardLayout(tuple(numels), n_shards=n).padded_numel if numels else 0

    sizes = [padded(b, dp) + padded(e, expert_dp or dp // ep)
             for b, e in zip(blocks, expert_groups(model, ep=ep), strict=True)]
    if reshard_after_forward:
        held = max((a + b for a, b in itertools.pairwise(sizes)), default=sum(sizes))
    else:
        held = sum(sizes)
    return float(p * (padded(embed + tail, dp) + held))


def _rank_states(model, *, dp, zero, precision, bucket_mb, offload, held) -> ModelStates:
    p = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    params = grads = optim = 0
    for numels in unit_numels(model, zero=zero, bucket_mb=bucket_mb, elem_bytes=p,
                              held=held):
        lay = ShardLayout(numels, n_shards=dp if zero >= 1 else 1)
        s, full = lay.shard_size, lay.padded_numel
        params += p * (s if zero == 3 else full)
        grads += p * (s if zero >= 2 else full)
        optim += k * s
    if offload == "cpu":
        return ModelStates(float(params), float(grads), 0.0, host=float(optim))
    return ModelStates(float(params), float(grads), float(optim))
