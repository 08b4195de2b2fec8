"""Checks of mixture of experts (`model.moe.*`) and expert parallelism (`parallel.ep`).

Expert-parallel ranks are ep consecutive ranks of the dp group (hpctrain.distributed.mesh),
so ep must divide dp and the expert count. With tp the dense layers are tensor-parallel and
the router and experts run whole on every tp rank (hpctrain.parallel.tensor.plan), on the
replicated sequence or, with sp, on the rank's sequence shard (router statistics summed over
tp, hpctrain.models.moe). With pp the MoE blocks live inside the stages and
each stage seeds its own router losses (hpctrain.parallel.pipeline.runtime); tp × pp composes
the two. Activation checkpointing composes: selective recomputes only attention cores, and
full's recomputation of a block in backward neither adds its router losses again nor counts
its routing twice (hpctrain.models.moe `in_backward`); with ep > 1 it reruns the block's
all-to-alls in backward, on every ep rank in the same order. With cp each rank routes its part
of the rows and the router statistics are summed over cp (dropless); with ep > 1 each cp or sp
rank exchanges its own tokens with the ep ranks of its cp and tp coordinates, and the expert
gradients are summed over the expert-data group, which spans cp (distributed.dims.edp_ranks).
With sp and cp together the statistics are summed over the cp × tp ranks (the mesh's cp_tp
group). Under train.compile the MoE layers run eagerly (hpctrain.models.compile). A capacity
with cp or sp is refused by design (it would all-gather the router scores before every MoE
layer), naming the fix.
"""

from __future__ import annotations

from hpctrain.config import Config


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
    if p.dp % p.ep:
        errs.append(f"parallel.dp={p.dp} is not divisible by parallel.ep={p.ep} (expert-parallel"
                    " ranks live inside the dp group): choose ep dividing dp")
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
