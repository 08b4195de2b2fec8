"""Step-time model: a pipeline of per-chunk kernel costs, timed by the schedule's simulator.

Per rank, with n = dp·cp·tp·pp devices, m microbatches of b sequences, v chunks per rank of
L = l/(pp·v) layers, each term below with its source:
  kernels  = `hpctrain.plan.kernels.layer_cost`: each layer's GEMMs on a roofline (so GEMM
             efficiency follows the matrix shape), the attention core (eager: every score
             through HBM; fused: the causal kernel at the generation's flash-attention shares),
             and the memory-bound LayerNorm/softmax/dropout/GeLU kernels at HBM bandwidth
             (Megatron-LM 2021 §4.2's fused kernels; no sequence parallelism unless layout.sp),
             every rate the device generation's share of its datasheet
             (`hpctrain.plan.hardware`). Full recomputation
             re-runs each layer's forward inside its backward (Megatron 2021 ran every Table 1
             model so: its FLOP count 96·B·s·l·h²·(…) includes the recomputed forward)
  comm_tp  = per layer and microbatch 2 all-reduces of b·s·h activations in the forward, 2 in
             the backward, +2 when the forward is recomputed (Shoeybi et al. 2019, f and g);
             blocking, on the critical path (Megatron 2021 does not overlap them), or under
             ov.tp="full" only what outlasts the projection GEMMs it is chunked with
             (`hpctrain.plan.stack`). Links run at NCCL's share of the datasheet
             (ClusterSpec.intra_bw, inter_bw)
  per-chunk action costs for the simulator: T_F = L·(F + TP_F), T_B = L·(B + TP_B),
             T_W = L·W (the weight-gradient GEMMs; schedules without a W split run B+W), TP
             the exposed tp seconds (2·AR and (2|4)·AR without overlap)
  bubble   = the simulator's idle time of the exact schedule with those costs and no hop
             latency (`hpctrain.plan.bubble`): cost − work
  comm_pp  = what one stage-to-stage hop (b·s·h/t bytes: Megatron's scatter/gather send of
             1/t of the activation, then an all-gather over NVLink) adds to the simulated
             step: cost(T_comm) − cost(0), i.e. only the p2p on the critical path; under
             ov.pp a hop costs its latency alone (sends on their own stream)
  head     = the output layer's three GEMMs per microbatch (`kernels.head_cost`) and the fp32
             vocab-parallel cross entropy over its logits (`kernels.loss_cost`), on the last
             stage, which paces the pipeline
  fp8      = with train.fp8 the block projections' GEMMs run on an FP8 roofline (the device's
             dense FP8 peak · achievable_fraction, 1-byte operands); the output head and the
             attention core stay in 16 bits (train.fp8_skip). MoE experts (routed and shared)
             run their GEMMs in float8 too (hpctrain.models.moe.layer), counted with the projections
  comm_dp  = (1 − dp_overlap) · ring cost of the rank's gradients: reduce-scatter + all-gather
             (= one all-reduce) for ZeRO 0–2, plus a second parameter all-gather for ZeRO 3
             (Megatron 2021 reduces after the pipeline flush: dp_overlap = 0); under ov.dp
             what outlasts one microbatch's backward (reduce-scatter) and forward (all-gather),
             at least the last bucket; gradients in fp32 under ov.grad_reduce="fp32"
  comm_cp  = the cp traffic per layer and microbatch, in key/value shards of 2·b·(s/cp)·K·H_d
             elements (parallel.context.ring.ring_shards; + (cp − 1) with full recompute,
             which reruns the forward's traffic), by transport (parallel.cp_comm):
             ring       (3·cp − 2) sends to the next cp rank, each posted before the blocks
                        it overlaps: exposed max(0, ring − compute)
             allgather  an all-gather of the cp shards forward, again in backward, and a
                        reduce-scatter of their gradients: 3·(cp − 1) shards by the ring
                        formula, with no overlap (each collective is waited on before the
                        blocks that need it, or after those that produce it): exposed in full
             Under this model the all-gather moves one shard less per layer but hides none
             of it: it is the cheaper transport only when the compute is shorter than one
             shard's send. What favours it in practice (GQA's few kv heads making per-step
             sends too small to overlap usefully, 3 collectives instead of 3·cp − 1 p2p steps)
             is below this model's resolution.
             The tp, pp and dp terms use the rank's s/cp tokens and the dp·cp gradient group
  comm_ep  = the all-to-all of MoE blocks under ep > 1, and expert gradients reduce over the
             (dp/ep)·cp ranks holding the same experts (`hpctrain.plan.experts`); compute
             counts active FLOPs (the top_k + shared experts a token passes through)
  ep and the exposed cp time are added to the step outside the simulated actions (serially,
             not yet split into T_F/T_B)
Ring costs: all-reduce 2(n−1)/n · bytes/bw + 2(n−1)·latency; all-gather or reduce-scatter half.

The terms above price the traffic of the published stacks the constants were fitted to
(Megatron-LM's). `issued` (a `StepShape`; `evaluate_layout` passes it for a `ModelConfig`,
so `task=plan`, `parallel=auto` and the trainer's prediction use it) prices instead the
collectives hpctrain's code issues, as `plan.comm_volume` counts them (and the dry run's tally
checks op for op):
  dp       per unit and role (`comm_volume.dp_traffic`) on the busier end of the pipeline:
           the reductions on the wire dtype (parallel.grad_comm_dtype; a 16-bit wire is an
           all-gather of every rank's buffer), the parameter all-gathers (ZeRO-1/2 once a
           step; ZeRO-3 each block twice a micro-batch, once without
           train.zero3_reshard_after_forward), each op its ring latency
  HSDP     the replica all-reduces start as each unit's reduction lands, overlapped with the
           rest of the last micro-batch's backward: exposed max(one unit's, all − backward)
  tp       a dense block's 4 all-reduces (or sp's 4 all-gather/reduce-scatter pairs), an MoE
           block's 2 (its experts stay whole); full recomputation reruns what torch's
           early-stopping recomputation reruns: 1 all-reduce a block without sp, 3 half-size
           collectives a dense block under sp, 2 an MoE block
  pp       each hop's 1/t piece, then (tp without sp) its all-gather over tp on arrival
The optimizer step and the embedding lookup are not timed (< 1% at these sizes).
tflops_per_device counts the FLOPs executed (`shapes.training_flops_per_token`), as Megatron
reports; mfu counts model FLOPs only. Attention is linear in the attended keys per token: s
for rows of one sequence, Σ lᵢ²/Σ lᵢ for rows packed with documents (`attended_per_token`).
With one set of constants per device generation this meets every visible row of Megatron-LM
2021 Table 1, Korthikanti et al. 2022 and the Megatron-LM README's H100 table within ±8%, the
settings they leave unstated searched (`hpctrain.plan.published`; tests/unit/
test_plan_published.py; benchmarks/results/planner.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from hpctrain.models.config import ModelConfig
from hpctrain.parallel.context.ring import ring_shards
from hpctrain.plan import experts, stack
from hpctrain.plan.bubble import bubble_fraction
from hpctrain.plan.cluster import ClusterSpec
from hpctrain.plan.comm_volume import Volume, dp_traffic
from hpctrain.plan.kernels import head_cost, layer_cost, loss_cost, roofline
from hpctrain.plan.layout import Layout, check_layout, num_microbatches
from hpctrain.plan.memory.formulas import state_bytes_per_param
from hpctrain.plan.shapes import (
    Shape,
    rank_params,
    training_flops_per_token,
)
from hpctrain.plan.stack import Stack

ACT_BYTES = 2  # activations travel in 16 bits (fp32 runs: 4, see `_act_bytes`)
A2A_PER_LAYER = 4  # MoE dispatch + combine, forward + backward


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds per optimizer step and its parts; rates derived from it.

    tflops_per_device counts executed FLOPs (recomputation included), as Megatron-LM reports;
    mfu counts model FLOPs only (no recomputation) against the dense bf16 (`precision`)
    peak, also with fp8: FP8 runs stay comparable with peers' bf16-peak MFU.
    """

    step_time_s: float
    compute_s: float
    comm_tp_s: float
    comm_dp_s: float
    comm_pp_s: float
    bubble_s: float
    bubble_fraction: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    comm_cp_s: float = 0.0  # exposed ring-attention traffic (0 at cp = 1)
    comm_ep_s: float = 0.0  # MoE all-to-all (0 for dense models and ep = 1)


def ring_time(nbytes: float, *, n: int, bw: float, latency: float, op: str) -> float:
    """Seconds for a ring collective of `nbytes` per rank over `n` ranks at `bw` bytes/s."""
    if n <= 1:
        return 0.0
    steps = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}.get(op)
    if steps is None:
        raise ValueError(f"op={op!r} must be all_reduce, reduce_scatter or all_gather")
    return steps * ((n - 1) / n * nbytes / bw + (n - 1) * latency)


def tp_link(cluster: ClusterSpec, tp: int) -> tuple[float, float]:
    """(bytes/s, latency) of a tp group: NVLink when it fits in a node, else a NIC share."""
    if tp <= cluster.gpus_per_node:
        return cluster.intra_bw, cluster.latency_intra
    return cluster.inter_bw / cluster.gpus_per_node, cluster.latency_inter


def dp_link(cluster: ClusterSpec, *, stride: int, dp: int) -> tuple[float, float]:
    """(bytes/s, latency) for the ring of a group of `dp` ranks `stride` ranks apart (the
    layout's `ParallelDims.stride`: cp·tp for the dp group).

    The group spans dp·stride ranks. Within a node: NVLink. Across nodes each node has g/k
    concurrent groups sharing its NICs, with k = members of one group per node =
    max(1, min(dp, g // stride)); a ring crosses each node boundary once, so each group gets
    inter_bw · k / g (all NICs for stride 1, one NIC's share for stride g).
    """
    g = cluster.gpus_per_node
    if dp * stride <= g:
        return cluster.intra_bw, cluster.latency_intra
    k = max(1, min(dp, g // stride))
    return min(cluster.intra_bw, cluster.inter_bw * k / g), cluster.latency_inter


def pp_link(cluster: ClusterSpec, layout: Layout) -> tuple[float, float]:
    """(bytes/s, latency) of a stage boundary: NVLink if the job is one node, else a NIC share."""
    if layout.n_devices <= cluster.gpus_per_node:
        return cluster.intra_bw, cluster.latency_intra
    return cluster.inter_bw / cluster.gpus_per_node, cluster.latency_inter


def _act_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else ACT_BYTES


def tp_comm_s(model: Shape, cluster, layout, *, m, mbs, seq_len, recompute, precision) -> float:
    """m · (l/pp) · k all-reduces of b·s·h activations, k = 4 (+2 with full recompute)."""
    k = 6 if recompute == "full" else 4
    nbytes = mbs * seq_len * model.dim * _act_bytes(precision)
    bw, lat = tp_link(cluster, layout.tp)
    one = ring_time(nbytes, n=layout.tp, bw=bw, latency=lat, op="all_reduce")
    return m * model.n_layers / layout.pp * k * one


def pp_comm_s(model: Shape, cluster, layout, *, m, mbs, seq_len, precision) -> float:
    """2 · m · v sends of b·s·h/t activations (forward) or gradients (backward)."""
    if layout.pp == 1:
        return 0.0
    bw, lat = pp_link(cluster, layout)
    nbytes = mbs * seq_len * model.dim * _act_bytes(precision) / layout.tp
    return 2 * m * layout.virtual_stages * (nbytes / bw + lat)


def dp_comm_s(model: Shape, cluster, layout, *, precision: str) -> float:
    """Gradient reduce-scatter + parameter all-gather of this rank's Ψ (2 for ZeRO-3); routed
    experts' Ψ_E/(pp·ep) over their own (dp/ep)·cp group, whose members are ep·cp·tp apart;
    under HSDP over one replica's part (dp_shard for dp), plus `replicate_s`."""
    return (sum(dp_comm_parts(model, cluster, layout, precision=precision))
            + replicate_s(model, cluster, layout, precision=precision))


def dp_comm_parts(model: Shape, cluster, layout, *, precision: str,
                  ov: Stack = stack.NONE) -> tuple[float, float]:
    """(reduce-scatter, all-gathers) seconds of `dp_comm_s`; gradients of ov.grad_bytes."""
    p_b, g_b = state_bytes_per_param(precision)[:2]
    g_b = ov.grad_bytes(g_b)
    psi = rank_params(model, tp=layout.tp, pp=layout.pp)
    dims = layout.dims  # gradients of replicated parameters reduce over (a replica's) dp×cp
    bw, lat = dp_link(cluster, stride=dims.stride("dp"), dp=dims.dp_shard)
    rs, ag = _reduce_gather(psi, g_b, p_b, n=dims.shard_size, bw=bw, lat=lat, zero=layout.zero)
    expert_psi = experts.rank_expert_params(model, ep=layout.ep, pp=layout.pp)
    if expert_psi:
        # the ranks holding the same experts: every ep-th dp coordinate of the replica
        bw, lat = dp_link(cluster, stride=dims.stride("ep") * dims.ep,
                          dp=dims.dp_shard // dims.ep)
        e_rs, e_ag = _reduce_gather(expert_psi, g_b, p_b, n=dims.expert_shard_size,
                                    bw=bw, lat=lat, zero=layout.zero)
        rs, ag = rs + e_rs, ag + e_ag
    return rs, ag


def replicate_s(model: Shape, cluster, layout, *, precision: str,
                ov: Stack = stack.NONE) -> float:
    """HSDP: seconds of the all-reduce of each rank's reduced gradients over the dp_replicate
    ranks holding the same shards (dp_shard·cp·tp apart, across nodes): its grad shard under
    ZeRO-1/2/3, the whole buffers under ZeRO-0; dense and expert units. Charged in full: the
    code issues each unit's as soon as its reduction is done, overlapped with the rest of
    backward (hpctrain.parallel.data.ddp), which this model does not credit yet."""
    r, dims = layout.dp_replicate, layout.dims
    if r == 1:
        return 0.0
    g_b = ov.grad_bytes(state_bytes_per_param(precision)[1])
    bw, lat = dp_link(cluster, stride=dims.stride("replicate"), dp=r)
    dense = rank_params(model, tp=layout.tp, pp=layout.pp)
    routed = experts.rank_expert_params(model, ep=layout.ep, pp=layout.pp)
    zero = layout.zero >= 1
    nbytes = g_b * (dense / (dims.shard_size if zero else 1)
                    + routed / (dims.expert_shard_size if zero else 1))
    return ring_time(nbytes, n=r, bw=bw, latency=lat, op="all_reduce")


def _reduce_gather(psi: float, g_b: int, p_b: int, *, n: int, bw: float, lat: float,
                   zero: int) -> tuple[float, float]:
    gathers = 2 if zero == 3 else 1
    rs = ring_time(psi * g_b, n=n, bw=bw, latency=lat, op="reduce_scatter")
    ag = ring_time(psi * p_b, n=n, bw=bw, latency=lat, op="all_gather")
    return rs, gathers * ag


def cp_comm_s(model: Shape, cluster, layout, *, m, mbs, seq_len, precision,
              recompute: str = "none") -> float:
    """Seconds of cp traffic per step, before overlap: m · (l/pp) attention layers, each
    moving ring_shards key/value shards (cp ranks sit inside tp·cp consecutive ranks: NVLink
    while that fits in a node). ring: that many sends to the next cp rank; allgather: the
    all-gathers (2, 3 with full recompute) and the reduce-scatter of cp shards."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    kv_heads = max(1, getattr(model, "n_kv_heads", model.n_heads) // layout.tp)
    shard = 2 * mbs * kv_heads * (seq_len // cp) * (model.dim // model.n_heads) \
        * _act_bytes(precision)
    bw, lat = tp_link(cluster, cp * layout.dims.stride("cp"))  # the cp group's span
    if layout.cp_comm == "allgather":
        gathers = 3 if recompute == "full" else 2
        one = ring_time(cp * shard, n=cp, bw=bw, latency=lat, op="all_gather")
        layer = gathers * one + ring_time(cp * shard, n=cp, bw=bw, latency=lat,
                                          op="reduce_scatter")
    else:
        layer = ring_shards(cp=cp, recompute=recompute) * (shard / bw + lat)
    return m * model.n_layers / layout.pp * layer


def cp_exposed_s(traffic_s: float, *, compute_s: float, transport: str) -> float:
    """The part of the cp traffic the step waits for: the ring's sends overlap the compute
    (up to all of it); the all-gather's collectives overlap nothing."""
    return traffic_s if transport == "allgather" else max(0.0, traffic_s - compute_s)


def ep_comm_s(model: Shape, cluster, layout, *, m, mbs, seq_len, recompute, precision) -> float:
    """m · (MoE blocks / pp) · (4, or 6 with full recompute) all-to-alls of T·k'·h tokens' bytes
    (`experts.a2a_bytes`, `experts.a2a_time`); 0 for dense models and ep = 1."""
    if not experts.is_moe(model) or layout.ep == 1:
        return 0.0
    k = A2A_PER_LAYER + (2 if recompute == "full" else 0)
    tokens = experts.rank_tokens(layout, seq_len=seq_len, micro_batch_size=mbs)
    nbytes = experts.a2a_bytes(model, tokens=tokens, ep=layout.ep,
                               elem_bytes=_act_bytes(precision))
    return m * model.n_moe_layers / layout.pp * k * experts.a2a_time(nbytes, cluster, layout)


def _tp_exposed(lc, ar: float, *, recompute: str, tp_overlap: str,
                calls: tuple[float, float] | None = None) -> tuple[float, float]:
    """(forward, backward) tp seconds a layer waits for: `calls` all-reduces forward and
    backward (default the published stacks': 2 and 2, +2 for the recomputed forward),
    blocking, or pipelined with the layer's projection GEMMs (lc.w: one pass of them) under
    tp_overlap="full" (`hpctrain.plan.stack`)."""
    k_f, k_b = calls or (2, 4 if recompute == "full" else 2)
    if tp_overlap == "none":
        return k_f * ar, k_b * ar
    gemms_b = (3 if recompute == "full" else 2) * lc.w  # dgrad + wgrad (+ the rerun forward)
    return stack.exposed(k_f * ar, lc.w), stack.exposed(k_b * ar, gemms_b)


def issued_tp_calls(model: ModelConfig, layout: Layout, recompute: str) -> tuple[float, float]:
    """(forward, backward) all-reduces' worth of tp traffic a layer issues in hpctrain,
    averaged over the model's layers (module docstring, `issued`; sp's all-gather and
    reduce-scatter pairs count as one all-reduce)."""
    moe = model.n_moe_layers / model.n_layers
    rerun = 0.0
    if recompute == "full":
        rerun = (1 - moe) * (1.5 if layout.sp else 1.0) + moe * 1.0
    per_pass = 2 * (1 - moe) + moe
    return per_pass, per_pass + rerun


def _action_costs(model: Shape, cluster: ClusterSpec, layout: Layout, *, mbs: int,
                  seq_len: int, keys: float, recompute: str, precision: str,
                  fp8: bool = False, tp_overlap: str = "none",
                  tp_calls: tuple[float, float] | None = None):
    """(T_F, T_B, T_W) of one chunk and microbatch with the exposed tp traffic, then the
    chunk's kernel seconds and its exposed tp seconds (module docstring)."""
    r = roofline(cluster.device, precision=precision,
                 achievable_fraction=cluster.achievable_fraction,
                 measured=cluster.measured_gemms(precision))
    r8 = roofline(cluster.device, precision="fp8",
                  achievable_fraction=cluster.achievable_fraction) if fp8 else None
    lc = layer_cost(model, r, mbs=mbs, seq_len=seq_len, keys=keys, tp=layout.tp, sp=layout.sp,
                    recompute=recompute, precision=precision, fp8=r8)
    bw, lat = tp_link(cluster, layout.tp)
    nbytes = mbs * seq_len * model.dim * _act_bytes(precision)
    ar = ring_time(nbytes, n=layout.tp, bw=bw, latency=lat, op="all_reduce")
    tp_f, tp_b = _tp_exposed(lc, ar, recompute=recompute, tp_overlap=tp_overlap,
                             calls=tp_calls)
    per_chunk = model.n_layers / (layout.pp * layout.virtual_stages)
    return (per_chunk * (lc.f + tp_f), per_chunk * (lc.b + tp_b), per_chunk * lc.w,
            per_chunk * (lc.f + lc.b + lc.w), per_chunk * (tp_f + tp_b))


def _pipeline(layout: Layout, *, m: int, costs, hop: float) -> tuple[float, float, float]:
    """(work, bubble, exposed p2p) seconds of one step's pipeline, from the simulator."""
    t_f, t_b, t_w = costs
    work = m * layout.virtual_stages * (t_f + t_b + t_w)
    if layout.pp == 1:
        return work, 0.0, 0.0
    kw = dict(pp=layout.pp, m=m, v=layout.virtual_stages, t_f=t_f, t_b=t_b, t_w=t_w)
    f0 = bubble_fraction(layout.schedule, **kw)
    f1 = bubble_fraction(layout.schedule, t_comm=hop, **kw)
    return work, work * f0 / (1 - f0), max(0.0, work / (1 - f1) - work / (1 - f0))


def volume_s(v: Volume, *, n: int, bw: float, latency: float, steps: int = 1) -> float:
    """Seconds of the collectives `v` counts on a ring of n ranks: its bytes at `bw`, and
    `steps`·(n − 1) latencies an op (2 for all-reduces)."""
    return v.bytes / bw + v.ops * steps * (n - 1) * latency if n > 1 else 0.0


# the layout search times each layout's dp traffic once per recomputation and bound pass
_dp_traffic = functools.lru_cache(maxsize=4096)(dp_traffic)


def issued_dp_parts(model: ModelConfig, cluster: ClusterSpec, layout: Layout, step
                    ) -> tuple[float, float, float, float]:
    """(reductions, parameter all-gathers, replica all-reduces, one replica all-reduce)
    seconds of the dp collectives hpctrain issues (`comm_volume.dp_traffic`) on whichever
    end of the pipeline sends more (the embedding's or the head's stage)."""
    dims, zero = layout.dims, layout.zero
    step = replace(step, recompute="none")  # what the dp traffic does not depend on
    d = max((_dp_traffic(model, layout, step, pp_rank=r) for r in {0, layout.pp - 1}),
            key=lambda d: d.reduce.bytes + d.gathers.bytes + d.expert_reduce.bytes
            + d.expert_gathers.bytes)
    reduce_steps = 2 if zero == 0 and step.grad_comm_dtype == "fp32" else 1
    bw, lat = dp_link(cluster, stride=dims.stride("dp"), dp=dims.dp_shard)
    link = dict(n=dims.shard_size, bw=bw, latency=lat)
    rs = volume_s(d.reduce, steps=reduce_steps, **link)
    ag = volume_s(d.gathers, **link)
    if layout.ep > 1:  # every ep-th dp coordinate of the replica holds the same experts
        bw, lat = dp_link(cluster, stride=dims.stride("ep") * dims.ep,
                          dp=dims.dp_shard // dims.ep)
        link = dict(n=dims.expert_shard_size, bw=bw, latency=lat)
        rs += volume_s(d.expert_reduce, steps=reduce_steps, **link)
        ag += volume_s(d.expert_gathers, **link)
    r = layout.dp_replicate
    bw, lat = dp_link(cluster, stride=dims.stride("replicate"), dp=r)
    replicas = volume_s(d.replicate, n=r, bw=bw, latency=lat, steps=2)
    one = replicas / d.replicate.ops if d.replicate.ops else 0.0
    return rs, ag, replicas, one


def _dp_time(model, cluster, layout, *, precision, dp_overlap, ov, costs, issued=None) -> float:
    """Exposed dp seconds: (1 − dp_overlap) of the reduce-scatter + all-gather, or under
    ov.dp what outlasts one microbatch's backward / forward on this rank (`plan.stack`);
    HSDP's replica all-reduces in full, or (`issued`) what outlasts the last micro-batch's
    backward."""
    if issued is None:
        rs, ag = dp_comm_parts(model, cluster, layout, precision=precision, ov=ov)
        replicas = replicate_s(model, cluster, layout, precision=precision, ov=ov)
    else:
        rs, ag, replicas, one = issued_dp_parts(model, cluster, layout, issued)
        backward = layout.virtual_stages * (costs[1] + costs[2])
        replicas = max(one, replicas - backward) if replicas else 0.0
    if not ov.dp:
        return (1.0 - dp_overlap) * (rs + ag) + replicas
    v = layout.virtual_stages
    bucket = stack.BUCKET_PARAMS * ov.grad_bytes(state_bytes_per_param(precision)[1])
    bw, lat = dp_link(cluster, stride=layout.dims.stride("dp"), dp=layout.dims.dp_shard)
    one = ring_time(bucket, n=layout.dims.shard_size, bw=bw, latency=lat, op="reduce_scatter")
    return replicas + stack.dp_exposed(rs, ag, bucket_s=one,
                                       backward_s=v * (costs[1] + costs[2]),
                                       forward_s=v * costs[0])


def step_time(
    model: Shape, cluster: ClusterSpec, *, layout: Layout, global_batch: int,
    micro_batch_size: int, seq_len: int, recompute: str = "none", precision: str = "bf16",
    dp_overlap: float = 0.0, attended_per_token: float | None = None, fp8: bool = False,
    pipeline: bool = True, ov: Stack = stack.NONE, issued=None,
) -> StepTime:
    """Predict one optimizer step of `model` on `cluster` under `layout` (module docstring).

    dp_overlap: fraction of the data-parallel communication hidden behind backward compute
    (0 = none, as in Megatron-LM 2021; ~0.5–0.9 for bucketed DDP/FSDP with prefetch);
    ignored when ov.dp models the overlap itself.
    attended_per_token: keys a token attends to on average (unmasked count): seq_len (None)
    without documents, Σ lᵢ²/Σ lᵢ under document masks.
    fp8: the block linears run in float8 (train.fp8) at the device's FP8 peak; ValueError
    for a device without one.
    pipeline=False: leave out the bubble and the exposed p2p (no simulation): a lower bound
    of the step time that the layout search prunes with (`hpctrain.plan.search`).
    ov: the training stack: which tp, dp and pp traffic it overlaps with compute, and the
    gradients' element size in the dp reduction (`hpctrain.plan.stack`).
    issued: the step's `StepShape` (its micro-batch count matching this one's) for a
    `ModelConfig`: price the collectives hpctrain issues (module docstring) instead of the
    published stacks' traffic (None).
    """
    if not 0.0 <= dp_overlap <= 1.0:
        raise ValueError(f"dp_overlap={dp_overlap} must be in [0, 1]")
    check_layout(model, layout, global_batch=global_batch, micro_batch_size=micro_batch_size)
    m = num_microbatches(global_batch, micro_batch_size=micro_batch_size, dp=layout.dp)
    attn = seq_len if attended_per_token is None else attended_per_token
    if not 0 < attn <= seq_len:
        raise ValueError(f"attended_per_token={attn} must be in (0, seq_len={seq_len}]")
    if issued is not None and (not isinstance(model, ModelConfig)
                               or issued.microbatches != m):
        raise ValueError(f"issued={issued} must be the StepShape of this step ({m} "
                         "micro-batches) of a ModelConfig: the collectives hpctrain issues "
                         f"are known for a model's parameter list, not for {type(model)}")
    kw = dict(m=m, mbs=micro_batch_size, seq_len=seq_len // layout.cp, precision=precision)
    *costs, kernels, tp_chunk = _action_costs(
        model, cluster, layout, mbs=micro_batch_size, seq_len=seq_len // layout.cp, keys=attn,
        recompute=recompute, precision=precision, fp8=fp8, tp_overlap=ov.tp,
        tp_calls=None if issued is None else issued_tp_calls(model, layout, recompute))
    r = roofline(cluster.device, precision=precision,
                 achievable_fraction=cluster.achievable_fraction,
                 measured=cluster.measured_gemms(precision))
    mb = dict(mbs=micro_batch_size, seq_len=seq_len // layout.cp, tp=layout.tp)
    head = m * (head_cost(model, r, precision=precision, **mb) + loss_cost(model, r, **mb))
    compute = m * layout.virtual_stages * kernels + head
    tp = m * layout.virtual_stages * tp_chunk
    hop = pp_comm_s(model, cluster, layout, **{**kw, "m": 1}) / (2 * layout.virtual_stages)
    if ov.pp:
        hop = min(hop, pp_link(cluster, layout)[1])  # only the latency stays exposed
    if issued is not None and layout.pp > 1 and not layout.sp:  # the pieces' tp all-gather
        bw, lat = tp_link(cluster, layout.tp)
        hop += ring_time(micro_batch_size * seq_len // layout.cp * model.dim
                         * _act_bytes(precision), n=layout.tp, bw=bw, latency=lat,
                         op="all_gather")
    if pipeline:
        work, bubble, pp = _pipeline(layout, m=m, costs=costs, hop=hop)
    else:
        work, bubble, pp = m * layout.virtual_stages * sum(costs), 0.0, 0.0
    cp_traffic = cp_comm_s(model, cluster, layout, **{**kw, "seq_len": seq_len},
                           recompute=recompute)
    cp = cp_exposed_s(cp_traffic, compute_s=compute, transport=layout.cp_comm)
    ep = ep_comm_s(model, cluster, layout, recompute=recompute, **kw)
    dp = _dp_time(model, cluster, layout, precision=precision, dp_overlap=dp_overlap, ov=ov,
                  costs=costs, issued=issued)
    return _rates(model, cluster, layout, global_batch=global_batch, seq_len=seq_len, attn=attn,
                  recompute=recompute, precision=precision,
                  parts=dict(compute_s=compute, comm_tp_s=tp, comm_pp_s=pp, bubble_s=bubble,
                             comm_cp_s=cp, comm_ep_s=ep, comm_dp_s=dp),
                  frac=bubble / (bubble + work) if work else 0.0)


def _rates(model, cluster, layout, *, global_batch, seq_len, attn, recompute, precision,
           parts: dict[str, float], frac: float) -> StepTime:
    """The StepTime of `parts` with the rates derived from their sum (module docstring)."""
    total = sum(parts.values())
    n, tokens = layout.n_devices, global_batch * seq_len
    executed = tokens * training_flops_per_token(model, seq_len=attn, recompute=recompute)
    model_flops = tokens * model.flops_per_token(attn)
    return StepTime(step_time_s=total, bubble_fraction=frac, tokens_per_s=tokens / total,
                    tflops_per_device=executed / n / total / 1e12,
                    mfu=model_flops / n / total / cluster.device.peak_flops(precision), **parts)
