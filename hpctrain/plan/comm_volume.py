"""The collectives one rank of a layout issues in one training step, per process group: how
many, and the bytes it sends — what hpctrain's code issues, so the dry run's tally of the real
code (`plan.dryrun_comm`) can be checked against it, group by group.

Legend: m microbatches, T = b·s/cp tokens a microbatch on this rank, h model width, e the
activation bytes (4 fp32, 2 bf16), t tp, n a group's size. Sent bytes under ring algorithms:
an all-reduce of N bytes 2(n−1)/n·N, an all-gather (n−1)/n·N_out, a reduce-scatter (n−1)/n·N_in,
an all-to-all N less the part kept, a send N, a receive 0 (one op each).

  tp   per microbatch and block: without sp all-reduces of T·h·e, 4 a dense block (f, g of the
       attention and of the MLP, forward and backward), 2 an MoE block (its experts stay whole:
       attention only); with sp each becomes an all-gather and a reduce-scatter; full
       recomputation repeats the forward's half. The vocab-parallel embedding's exit and the
       head's entry add one each on their stages, and the loss two all-reduces of fp32 row
       statistics (T, then 2·T values). Under sp, once a step, the partial gradients of the
       replicated parameters (norm gains; MoE routers and experts) are summed: one all-reduce
       in the parameters' dtype. MoE under sp or cp: the router statistics' all-reduces
       (`_router_losses`) on the group holding the micro-batch's tokens.
  cp   per microbatch and block: `parallel.context.ring.ring_shards` key/value shards of
       2·b·(K/t)·(s/cp)·d·e bytes, sends to the next cp rank (ring), or the all-gather
       transport's collectives of cp such shards
  pp   per microbatch and stage this rank holds: the activation sent to the next stage and the
       gradient to the previous one where that stage lives on another rank, ⌈T·h/t⌉·e bytes
       (under sp the rank's sequence shard; without sp its piece of the activation every tp
       rank holds, all-gathered over tp on arrival: one tp all-gather of t·⌈T·h/t⌉·e bytes
       per receive, `hpctrain.parallel.pipeline.hop`); as many receives.
       The pipeline's messages go between global ranks over the default ("world") group
  dp   per flat unit (`plan.flat_states.unit_numels`, padded to the shard group, P elements):
       gradients on the wire in fp32 (parallel.grad_comm_dtype=fp32): an all-reduce at ZeRO
       0, a reduce-scatter at 1, 2 and 3 (ZeRO-1 keeps the full gradient bucket through
       accumulation, but needs only its shard of the sum); with a
       16-bit wire an all-gather of every rank's 16-bit buffer (summed in fp32 after); then at
       ZeRO 1 and 2 the updated parameters' all-gather (P·p bytes out); at ZeRO 3 each block's
       unit is gathered twice a microbatch (forward, and again for its backward; once
       with train.zero3_reshard_after_forward=false), the non-block unit once
  ep   per microbatch and MoE block: the counts' all-to-all (E int64) and four all-to-alls of
       the routed rows (dispatch and combine, forward and backward; +2 with full
       recomputation), each sending (ep−1)/ep of the rank's T·k'·h·e routed bytes (the bound
       the dry run routes at: `plan.experts.routed_copies`)
  edp  the routed experts' units as dp's, over the ranks holding the same experts
Not counted: the step's scalar agreements (loss mean, token counts, gradient norm, overflow),
a few bytes each.

`plan.time` prices these counts for hpctrain's models (its `issued` step: dp by
`dp_traffic`'s roles, the hop's tp all-gather, the tp calls of torch's recomputation). For the
published tables it keeps the communication of the stacks its constants were fitted to
(Megatron-LM's), which departs from these counts where hpctrain's code does: ZeRO-3's second
all-gather once a step where hpctrain gathers every microbatch; full recomputation's 2 extra
tp all-reduces a block where torch's early-stopping recomputation issues 1; 16-bit gradient
wires at half the fp32 bytes where hpctrain all-gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.models.config import ModelConfig
from hpctrain.parallel.context.ring import ring_shards
from hpctrain.parallel.data.layout import ShardLayout
from hpctrain.plan.experts import routed_copies
from hpctrain.plan.layout import Layout
from hpctrain.plan.memory.states import (
    rank_chunks,
    rank_expert_groups,
    rank_param_groups,
    unit_numels,
)


@dataclass(frozen=True)
class Volume:
    """Operations and bytes sent by one rank on one group in one step."""

    ops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Volume) -> Volume:
        return Volume(self.ops + other.ops, self.bytes + other.bytes)

    def times(self, k: float) -> Volume:
        return Volume(self.ops * k, self.bytes * k)


def all_reduce(nbytes: float, n: int) -> Volume:
    return Volume(1, 2 * (n - 1) / n * nbytes) if n > 1 else Volume()


def gather(nbytes_full: float, n: int) -> Volume:
    """One all-gather (of N_out bytes) or reduce-scatter (of N_in bytes)."""
    return Volume(1, (n - 1) / n * nbytes_full) if n > 1 else Volume()


def step_volumes(model: ModelConfig, layout: Layout, step, *, pp_rank: int = 0
                 ) -> dict[str, Volume]:
    """Per mesh group ("tp", "cp", "world": the pipeline's messages, "shard": dense
    gradients, "ep", "edp", "replicate"), what pipeline rank `pp_rank` of `layout` sends in one
    step of `step` (a `plan.rank_memory.StepShape`; module docstring). Groups of one rank are
    left out."""
    chunks = rank_chunks(pp_rank, pp=layout.pp, virtual_stages=layout.virtual_stages,
                         schedule=layout.schedule)
    n_stages = layout.pp * layout.virtual_stages
    per = model.n_layers // n_stages
    layers = [i for c in sorted(chunks) for i in range(c * per, (c + 1) * per)]
    e = 4 if step.precision == "fp32" else 2
    tokens = step.micro_batch_size * step.seq_len // layout.cp
    router = _router_losses(model, layout, step, layers=layers)
    hop = -(-tokens * model.dim // layout.tp) * e  # one message: this tp rank's piece
    hops = _pp(layout, step, chunks=chunks, pp_rank=pp_rank, row=hop)
    gathers = (gather(layout.tp * hop, layout.tp).times(hops.ops // 2) if not layout.sp
               else Volume())  # each receive's pieces (module docstring)
    out = {"tp": _tp(model, layout, step, layers=layers, first=0 in chunks,
                     last=n_stages - 1 in chunks, tokens=tokens, e=e)
           + (router if layout.cp == 1 else Volume()) + gathers,
           "cp": _cp(model, layout, step, n_layers=len(layers), e=e)
           + (router if layout.cp > 1 else Volume()),
           "world": hops,
           **_dp(model, layout, step, pp_rank=pp_rank),
           "ep": _ep(model, layout, step, layers=layers, tokens=tokens, e=e)}
    return {k: v for k, v in out.items() if v.ops}


def _tp(model, layout, step, *, layers, first, last, tokens, e) -> Volume:
    t, sp = layout.tp, layout.sp
    if t == 1:
        return Volume()
    act = tokens * model.dim * e
    op = gather(act, t) if sp else all_reduce(act, t)  # one all-gather or reduce-scatter
    full = step.recompute == "full"
    ops = 0  # a microbatch's, in all-reduces (no sp) or all-gathers + reduce-scatters (sp)
    for i in layers:
        moe = model.is_moe_layer(i)
        ops += (2 if moe else 4) * (2 if sp else 1)
        if full:  # torch's recomputation stops at the last saved tensor: a dense block's
            # final g (its MLP's exit) is not rerun
            ops += (2 if moe else 3) if sp else 1
    ops += (first + last) * (2 if sp else 1)  # the embedding's exit, the head's entry
    loss = all_reduce(tokens * 4, t) + all_reduce(2 * tokens * 4, t) if last else Volume()
    total = (op.times(ops) + loss).times(step.microbatches)
    if sp:  # the replicated parameters' partial gradients, once a step
        grad = 4 if step.precision == "fp32" else 2  # the parameters' own dtype
        total += all_reduce(_sp_replicated(model, layers, last=last, ep=layout.ep) * grad, t)
    return total


def _sp_replicated(model, layers, *, last: bool, ep: int) -> int:
    """Elements of the parameters replicated over tp whose gradients sp leaves partial: the
    norm gains, and in MoE blocks the router and the rank's experts (whole on each tp rank)."""
    h, fe, m = model.dim, model.expert_ffn_dim, model.moe
    total = h if last else 0  # the final norm
    for i in layers:
        total += 2 * h
        if model.is_moe_layer(i):
            total += m.num_experts * h + (m.num_experts // ep + m.shared_experts) * 3 * h * fe
    return total


def _router_losses(model, layout, step, *, layers) -> Volume:
    """MoE under sp or cp (a micro-batch's tokens over a group): per block and microbatch the
    router statistics' two all-reduces of E + 1 fp32 values forward (again when recomputed)
    and one backward (`hpctrain.models.moe.router._group_losses`)."""
    n = layout.cp if layout.cp > 1 else layout.tp if layout.sp else 1
    blocks = sum(model.is_moe_layer(i) for i in layers)
    if n == 1 or not blocks:
        return Volume()
    one = all_reduce((model.moe.num_experts + 1) * 4, n)
    return one.times((5 if step.recompute == "full" else 3) * blocks * step.microbatches)


def _cp(model, layout, step, *, n_layers, e) -> Volume:
    cp = layout.cp
    if cp == 1:
        return Volume()
    kv_heads = max(1, model.n_kv_heads // layout.tp)
    shard = 2 * step.micro_batch_size * kv_heads * (step.seq_len // cp) * model.head_dim * e
    if layout.cp_comm == "allgather":
        gathers = 3 if step.recompute == "full" else 2
        layer = gather(cp * shard, cp).times(gathers + 1)
    else:
        sends = ring_shards(cp=cp, recompute=step.recompute)
        layer = Volume(2 * sends, sends * shard)  # each send with its receive
    return layer.times(n_layers * step.microbatches)


def _pp(layout, step, *, chunks, pp_rank, row) -> Volume:
    if layout.pp == 1:
        return Volume()
    n = layout.pp * layout.virtual_stages

    def rank_of(stage: int) -> int:
        return next(r for r in range(layout.pp) if stage in rank_chunks(
            r, pp=layout.pp, virtual_stages=layout.virtual_stages, schedule=layout.schedule))

    sends = sum((s < n - 1 and rank_of(s + 1) != pp_rank) + (s > 0 and rank_of(s - 1) != pp_rank)
                for s in chunks)
    return Volume(2 * sends, sends * row).times(step.microbatches)


@dataclass(frozen=True)
class DpTraffic:
    """One pipeline rank's data-parallel collectives in a step, by role: its gradients'
    reductions and its parameters' all-gathers, over the shard group (dense units) and the
    expert group (routed experts' units), and HSDP's all-reduces over the replicas."""

    reduce: Volume = Volume()
    gathers: Volume = Volume()
    expert_reduce: Volume = Volume()
    expert_gathers: Volume = Volume()
    replicate: Volume = Volume()


def dp_traffic(model: ModelConfig, layout: Layout, step, *, pp_rank: int = 0) -> DpTraffic:
    """The dp part of `step_volumes` split by role (module docstring, dp and edp)."""
    where = dict(pp=layout.pp, virtual_stages=layout.virtual_stages, schedule=layout.schedule,
                 pp_rank=pp_rank)
    p = 4 if step.precision == "fp32" else 2
    kw = dict(zero=layout.zero, p=p, step=step)
    dense = rank_param_groups(model, tp=layout.tp, ep=layout.ep, **where)
    out = dict(zip(("reduce", "gathers"), _units(model, dense, n=layout.dims.shard_size, **kw),
                   strict=True))
    replicate = _replicate(model, dense, n=layout.dims.shard_size, replicas=layout.dp_replicate,
                           **kw)
    if layout.ep > 1:
        held = ([], rank_expert_groups(model, ep=layout.ep, **where), [])
        out["expert_reduce"], out["expert_gathers"] = _units(
            model, held, n=layout.dims.expert_shard_size, **kw)
        replicate += _replicate(model, held, n=layout.dims.expert_shard_size,
                                replicas=layout.dp_replicate, **kw)
    return DpTraffic(**out, replicate=replicate)


def _dp(model, layout, step, *, pp_rank) -> dict[str, Volume]:
    dp = dp_traffic(model, layout, step, pp_rank=pp_rank)
    out = {"shard": dp.reduce + dp.gathers, "replicate": dp.replicate}
    if layout.ep > 1:
        out["edp"] = dp.expert_reduce + dp.expert_gathers
    return out


def _replicate(model, held, *, n: int, zero: int, p: int, step, replicas: int) -> Volume:
    """HSDP: each unit's reduced gradients (its shard at ZeRO 1-3, the whole buffer at 0)
    all-reduced in fp32 over the replicas holding the same shards, once a step."""
    total = Volume()
    if replicas == 1:
        return total
    for numels in unit_numels(model, zero=zero, bucket_mb=step.bucket_mb, elem_bytes=p,
                              held=held):
        lay = ShardLayout(numels, n_shards=n if zero >= 1 else 1)
        total += all_reduce(4 * (lay.shard_size if zero >= 1 else lay.padded_numel), replicas)
    return total


def _units(model, held, *, n: int, zero: int, p: int, step) -> tuple[Volume, Volume]:
    """(gradient reductions, parameter all-gathers) of the units of `held` over n ranks."""
    if n == 1:
        return Volume(), Volume()
    wire = 4 if step.grad_comm_dtype == "fp32" else 2
    reduce, gathers = Volume(), Volume()
    units = unit_numels(model, zero=zero, bucket_mb=step.bucket_mb, elem_bytes=p, held=held)
    has_ends = bool(held[0] or held[2])
    for k, numels in enumerate(units):
        padded = ShardLayout(numels, n_shards=n if zero >= 1 else 1).padded_numel
        if wire == 2:  # a 16-bit wire: every rank's buffer gathered, summed in fp32
            reduce += gather(n * padded * wire, n)
        elif zero == 0:
            reduce += all_reduce(padded * wire, n)
        else:  # a reduce-scatter: the same bytes as the all-gather of its input's size
            reduce += gather(padded * wire, n)
        if zero in (1, 2):
            gathers += gather(padded * p, n)
        elif zero == 3:  # the non-block unit comes first (flat_states.unit_numels)
            ends = k == 0 and has_ends
            once = ends or not step.zero3_reshard  # gathered again for backward, or held
            gathers += gather(padded * p, n).times(step.microbatches * (1 if once else 2))
    return reduce, gathers


def _ep(model, layout, step, *, layers, tokens, e) -> Volume:
    if layout.ep == 1 or not model.moe.enabled:
        return Volume()
    ep, moe_layers = layout.ep, sum(model.is_moe_layer(i) for i in layers)
    routed = tokens / (layout.tp if layout.sp else 1) * routed_copies(model)
    rows = Volume(1, routed * model.dim * e * (ep - 1) / ep)
    counts = Volume(1, model.moe.num_experts * 8 * (ep - 1) / ep)
    full = step.recompute == "full"
    layer = rows.times(4 + (2 if full else 0)) + counts.times(2 if full else 1)
    return layer.times(moe_layers * step.microbatches)
