"""Checks of the layout's degrees: that they compose (`hpctrain.distributed.dims` states the
rules) and fill the job's ranks, how the data-parallel axis is factored (HSDP), what context
parallelism and routed experts need of them, and what is refused by design.

dp = dp_replicate × dp_shard (hpctrain.distributed.dims): ZeRO shards over the dp_shard × cp
ranks of one replica, which are consecutive (shard index fastest after cp and tp), and the
replicas all-reduce. On Slurm a shard group should sit inside one node (or fill whole nodes):
dp_shard·cp·tp must divide cluster.procs_per_node or be a multiple of it, else its ZeRO
collectives cross the slow network on every step.

Context parallelism: the zigzag layout (hpctrain.parallel.context.shard) cuts every row into
2·cp equal chunks, so the sequence length must divide by 2·cp. Each backend's own kernels run
the ring's blocks (parallel/context/backends.py); flash's block needs a flash-attn whose private
entry points hpctrain knows (checked here).

Routed experts: expert-parallel ranks are ep consecutive ranks of the dp group, so ep divides
the expert count (and dp: the dims rule). With tp the router and experts run whole on every tp
rank, on the replicated sequence or, with sp, on the rank's sequence shard; with cp each rank
routes its part of the rows. A capacity with cp or sp is refused by design (it would all-gather
the router scores before every MoE layer), naming the fix.
"""

from __future__ import annotations

from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.distributed.dims import ParallelDims, divisors
from hpctrain.parallel.context.flash_block import version_problem


@check("parallel.dp", "parallel.cp", "parallel.tp", "parallel.pp", "cluster.nodes",
       "cluster.procs_per_node")
def check_world(c: Config) -> list[str]:
    p, cl = c.parallel, c.cluster
    world, per_replica = cl.world_size, p.tp * p.pp * p.cp
    if p.world_size == world:
        return []
    fixes = []
    if world >= per_replica and world % per_replica == 0:
        fixes.append(f"set parallel.dp={world // per_replica}")
    if p.world_size % cl.nodes == 0:
        fixes.append(f"set cluster.procs_per_node={p.world_size // cl.nodes}")
    fix = ", or ".join(fixes) or "make dp × cp × tp × pp equal cluster.nodes × procs_per_node"
    return [
        f"parallel.pp={p.pp} × parallel.tp={p.tp} × parallel.cp={p.cp} × parallel.dp={p.dp} = "
        f"{p.world_size} ranks, "
        f"but cluster.nodes={cl.nodes} × cluster.procs_per_node={cl.procs_per_node} = {world}:"
        f" {fix}"
    ]


@check("parallel.dp_replicate", "parallel.dp", "parallel.dp_shard", "parallel.ep",
       "cluster.procs_per_node")
def check_hsdp(c: Config) -> list[str]:
    """The degrees compose (dims), dp_shard agrees with them, a shard group fits the nodes."""
    p, ppn = c.parallel, c.cluster.procs_per_node
    if p.dp_shard is not None and p.dp_shard < 1:
        return []  # the range check reports it
    composed = ParallelDims.problems(dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, ep=p.ep,
                                     dp_replicate=p.dp_replicate)
    if composed:
        return composed
    shard = p.dp // p.dp_replicate
    if p.dp_shard is not None and p.dp_shard != shard:
        return [f"parallel.dp_shard={p.dp_shard} × parallel.dp_replicate={p.dp_replicate} = "
                f"{p.dp_shard * p.dp_replicate}, but parallel.dp={p.dp}: set "
                f"parallel.dp_shard={shard} (or leave it unset: dp / dp_replicate)"]
    group = shard * p.cp * p.tp
    if (p.dp_replicate > 1 and c.cluster.launcher == "slurm" and ppn > 0
            and ppn % group and group % ppn):
        fits = [d for d in divisors(p.dp) if ppn % (p.dp // d * p.cp * p.tp) == 0
                or (p.dp // d * p.cp * p.tp) % ppn == 0]
        return [f"a shard group of parallel.dp_shard={shard} × cp={p.cp} × tp={p.tp} = "
                f"{group} ranks straddles nodes of cluster.procs_per_node={ppn} (its ZeRO "
                f"collectives would cross the network): choose parallel.dp_replicate among "
                f"{fits}"]
    return []


@check("parallel.cp", "parallel.cp_comm", "train.seq_len", "parallel.", "model.")
def check_cp(c: Config) -> list[str]:
    p, L = c.parallel, c.train.seq_len
    if p.cp <= 1:  # below 1: the range check reports it
        return []
    errs = []
    if L % (2 * p.cp):
        ok = [1, *(n for n in (2, 4, 8, 16, 32) if L % (2 * n) == 0)]  # cp=1: no chunks
        below, above = L - L % (2 * p.cp), L + 2 * p.cp - L % (2 * p.cp)
        near = f"{below} or {above}" if below >= 2 * p.cp else str(above)
        errs.append(f"train.seq_len={L} is not divisible by 2 × parallel.cp={p.cp} = {2 * p.cp}"
                    f" (the zigzag layout cuts each row into 2·cp chunks): choose a seq_len "
                    f"that is a multiple of {2 * p.cp} (e.g. {near}), or parallel.cp in {ok}")
    if c.model.attention == "flash" and (problem := version_problem()):
        errs.append(problem)
    return errs


@check("model.moe.", "parallel.", "train.activation_checkpointing")
def check_moe(c: Config) -> list[str]:
    m, p, errs = c.model.moe, c.parallel, []
    if not m.enabled:
        if p.ep != 1:
            errs.append(f"parallel.ep={p.ep} needs routed experts but model.moe.num_experts=0: "
                        "set parallel.ep=1, or model.moe.num_experts to a multiple of ep")
        return errs
    if m.every > c.model.n_layers:
        errs.append(f"model.moe.every={m.every} exceeds model.n_layers={c.model.n_layers}, so no "
                    f"block would have experts: choose every ≤ {c.model.n_layers} (1: every "
                    "block), or model.moe.num_experts=0 for a dense model")
    if m.top_k > m.num_experts:
        errs.append(f"model.moe.top_k={m.top_k} exceeds model.moe.num_experts="
                    f"{m.num_experts}: choose top_k ≤ num_experts")
    if m.num_experts % p.ep:
        errs.append(f"model.moe.num_experts={m.num_experts} is not divisible by parallel.ep="
                    f"{p.ep}: choose ep among the divisors of the expert count")
    if c.task == "bench" and (c.extra.get("bench") or {}).get("name") != "train":
        return errs  # benchmarks other than bench=train build process groups, never a model
    if (p.cp > 1 or (p.tp > 1 and p.sp)) and m.capacity_factor > 0:
        split = f"parallel.cp={p.cp}" if p.cp > 1 else "parallel.sp=true"
        errs.append(f"{split} with model.moe.capacity_factor={m.capacity_factor:g} is refused: "
                    "a capacity ranks the assignments of the whole micro-batch, whose rows the "
                    "cp (or sp) ranks hold in parts, so every MoE layer would first all-gather "
                    "every token's router scores over them; the dropless router needs no such "
                    "exchange: set model.moe.capacity_factor=0 (dropless), or "
                    f"{'parallel.cp=1' if p.cp > 1 else 'parallel.sp=false'}")
    return errs


@check("parallel.", "bench")
def check_not_built(c: Config) -> list[str]:
    """Combinations refused by design (the message says why), never silently ignored."""
    p = c.parallel
    # Benchmarks other than bench=train only build the layout's process groups, never a model.
    groups_only = c.task == "bench" and (c.extra.get("bench") or {}).get("name") != "train"
    # ZeRO 0-2 compose with tp and pp, ZeRO-3 with tp (the engine works on local parameters,
    # so do offload and grad_comm_dtype); ZeRO-3 with pp is refused by design.
    if p.zero == 3 and p.pp > 1 and not groups_only:
        return [_ZERO3_PP.format(pp=p.pp, m=c.grad_accum, gathers=2 * c.grad_accum)]
    return []


# Refused by design, not for lack of time: see the message.
_ZERO3_PP = (
    "parallel.zero=3 with parallel.pp={pp} is refused: a pipeline runs each stage's blocks once "
    "per microbatch and action, so ZeRO-3 would all-gather the stage's parameters before every "
    "F and B action ({m} microbatches → {gathers} all-gathers of the whole stage per step, "
    "interleaved with the schedule's p2p and lengthening its critical path), against one "
    "all-gather per step for ZeRO-1/2; keeping them gathered for the step would save no memory "
    "over ZeRO-2. Pipeline parallelism already divides parameters by pp: use parallel.zero=1 "
    "or 2 with parallel.pp > 1 (or zero=3 with parallel.pp=1)")
