"""The published memory formulas: model states (ZeRO paper) + activations (Korthikanti et al.
2022), the terms' types, and the buffers both counts share.

Model states, Ψ = parameters on this rank's (tp, pp) shard, Nd = dp (Rajbhandari et al. 2019):
  bf16/fp16 compute, fp32 Adam: params 2Ψ, grads 2Ψ, optimizer KΨ, K = 12 (master, m, v)
  fp32:                         params 4Ψ, grads 4Ψ, optimizer 8Ψ  (m, v; no master copy)
  ZeRO stage ≥ 1 divides the optimizer term by Nd, ≥ 2 also grads, 3 also params.
  offload='cpu' moves the optimizer term to host memory (reported as `host`).
  An asynchronous checkpoint stages one host copy of the rank's own shard of the fp32 masters
  and both moments, 12 bytes per owned parameter in any precision (reported as `staging`,
  host memory, not in the device total: hpctrain.checkpoint.checkpointer).

Activations per transformer layer, in bytes, for s·b tokens of width h, a heads, tp = t
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", Table 2):
  no parallelism     s·b·h·(34 + 5·a·s/h)
  tp                 s·b·h·(10 + 24/t + 5·a·s/(h·t))
  tp + sp            s·b·h/t·(34 + 5·a·s/h)
  selective          the same without the 5·a·s/h attention-score term
  full               2·s·b·h (the layer input only; /t under sp, where the stored input is
                     sequence-sharded), plus one layer's full activations while it is recomputed
The attention-score term 5·a·s/h is the L×L softmax output and dropout mask that the eager
backend (and Megatron's GPT tables: GPTShape) keeps for backward. A fused backend (sdpa, flash,
triton, flex: `FUSED_ATTENTION`) keeps no L×L matrix, only the fp32 log-sum-exp per head and
token (4·a/h instead of 5·a·s/h) and recomputes the scores in backward; document masks do not
change either count (sdpa's explicit mask, b·s² bytes once per micro-batch, is left out).
The constants assume 16-bit activations, GPT's MHA and 4h GELU MLP. For Llama-style models
(GQA, SwiGLU with ffn_dim ≠ 4h, no dropout) they are applied unchanged as an approximation
(missing dropout masks and smaller K/V make it overcount attention; SwiGLU keeps more
ffn-wide tensors than GELU, so it undercounts the MLP); fp32 activations count double.
Stored activations = in_flight × (n_layers / (pp·v)) layers, in_flight from the schedule (see
`hpctrain.plan.bubble.in_flight_microbatches`). With pp = 1 the output layer adds
4·s·b·(h + V)/t (final-norm input and fp32 logits, the paper's δ_{p=1} term); with pp > 1 the
busiest rank is the first stage, which has no output layer. The embedding dropout mask is
not counted. Context parallelism (cp) replaces s by s/cp in every activation term (each rank
holds s/cp tokens of each row) and shards ZeRO states over dp·cp (parameters are replicated
over both axes). Mixture of experts (routed experts 1/ep per rank, their ZeRO states over
(dp/ep)·cp): `hpctrain.plan.experts`.

These are the published formulas, for the GPT shapes of those papers; the planner's one model
for the models hpctrain trains (what its engine and blocks hold, MoE blocks included) is
`hpctrain.plan.memory.model`, which takes its states and buffers from here where they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.plan import experts
from hpctrain.plan.layout import PRECISIONS, RECOMPUTES, Layout
from hpctrain.plan.shapes import Shape, rank_params

# Gradient-reduction bucket (torch DDP's default bucket_cap_mb = 25).
REDUCE_BUCKET_BYTES = 25 * 2**20
# Attention backends that never hold the L×L score matrix (hpctrain.ops.attention).
FUSED_ATTENTION = ("sdpa", "flash", "triton", "flex")


def stores_scores(model: Shape) -> bool:
    """True when `model`'s attention backend keeps the L×L scores for backward: `eager`, and
    shapes without a backend (GPTShape, Megatron's tables)."""
    return getattr(model, "attention", "eager") not in FUSED_ATTENTION


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on one rank (device) and moved to host by offload."""

    params: float
    grads: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class MemoryBreakdown:
    """Device bytes per rank; `host` is offloaded optimizer state and `staging` an async
    checkpoint's host copy of the rank's shard (neither in `total`)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    host: float = 0.0
    staging: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.buffers

    def fits(self, device_memory: float) -> bool:
        return self.total <= device_memory


def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(params, grads, optimizer K) bytes per parameter: (2, 2, 12) mixed, (4, 4, 8) fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} must be one of {PRECISIONS}")
    return (4, 4, 8) if precision == "fp32" else (2, 2, 12)


def model_state_bytes(
    psi: float, *, dp: int = 1, zero: int = 0, precision: str = "bf16", offload: str = "none"
) -> ModelStates:
    """Params/grads/optimizer bytes for Ψ = `psi` parameters under ZeRO `zero` over `dp` ranks.

    Mixed precision: stage 0 (2+2+K)Ψ, 1 4Ψ+KΨ/Nd, 2 2Ψ+(2+K)Ψ/Nd, 3 (4+K)Ψ/Nd, K = 12.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} must be one of 0, 1, 2, 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be >= 1")
    p_b, g_b, k = state_bytes_per_param(precision)
    params = p_b * psi / (dp if zero >= 3 else 1)
    grads = g_b * psi / (dp if zero >= 2 else 1)
    optimizer = k * psi / (dp if zero >= 1 else 1)
    if offload == "cpu":
        return ModelStates(params, grads, 0.0, host=optimizer)
    if offload != "none":
        raise ValueError(f"offload={offload!r} must be 'none' or 'cpu'")
    return ModelStates(params, grads, optimizer)


def layer_activation_bytes(
    model: Shape, *, seq_len: int, micro_batch_size: int, tp: int = 1, sp: bool = False,
    recompute: str = "none",
) -> float:
    """Bytes one layer stores for one microbatch (the Korthikanti table above, 16-bit; the
    score term by backend, see `stores_scores`)."""
    if recompute not in RECOMPUTES:
        raise ValueError(f"recompute={recompute!r} must be one of {RECOMPUTES}")
    s, b, h, a, t = seq_len, micro_batch_size, model.dim, model.n_heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    scores = 5 * a * s / h if stores_scores(model) else 4 * a / h
    if recompute == "selective":
        scores = 0.0
    if sp or t == 1:
        return sbh / t * (34 + scores)
    return sbh * (10 + 24 / t + scores / t)


def activation_bytes(
    model: Shape, layout: Layout, *, seq_len: int, micro_batch_size: int, in_flight: int,
    recompute: str = "none", precision: str = "bf16",
) -> float:
    """in_flight × layers-per-chunk × per-layer bytes (+ recompute working set, + output layer)."""
    if in_flight < 1:
        raise ValueError(f"in_flight={in_flight} must be >= 1 (microbatches whose activations "
                         "are alive at the peak; 1 for pp=1)")
    seq_len //= layout.cp  # each cp rank holds seq_len/cp tokens of every row
    kw = dict(seq_len=seq_len, micro_batch_size=micro_batch_size, tp=layout.tp, sp=layout.sp)
    per_layer = layer_activation_bytes(model, recompute=recompute, **kw)
    layers = model.n_layers / (layout.pp * layout.virtual_stages)
    total = in_flight * layers * per_layer
    if recompute == "full":  # the layer being recomputed holds its full activations
        total += layer_activation_bytes(model, recompute="none", **kw)
    if layout.pp == 1:
        s, b, h, v = seq_len, micro_batch_size, model.dim, model.vocab_size
        total += 4 * s * b * (h + v) / layout.tp
    return total * (2 if precision == "fp32" else 1)


def buffer_bytes(model: Shape, layout: Layout, *, precision: str = "bf16") -> float:
    """Communication buffers: one gradient bucket when dp > 1, and under ZeRO-3 two layers of
    unsharded parameters (the one in use and the prefetched next)."""
    p_b = state_bytes_per_param(precision)[0]
    total = REDUCE_BUCKET_BYTES if layout.dp > 1 else 0.0
    if layout.zero == 3 and layout.dp > 1 and experts.is_moe(model):
        total += 2 * p_b * experts.rank_layer_params(model, tp=layout.tp, ep=layout.ep)
    elif layout.zero == 3 and layout.dp > 1:
        total += 2 * p_b * model.layer_params() / layout.tp
    return float(total)


def rank_state_bytes(model: Shape, layout: Layout, *, precision: str = "bf16") -> ModelStates:
    """Model states on one rank: dense Ψ sharded (ZeRO) over the dp×cp group, which replicates
    it; routed experts' Ψ_E/(pp·ep) over the (dp/ep)·cp ranks holding the same experts. Under
    HSDP both shard inside one replica: dp_shard replaces dp."""
    kw = dict(zero=layout.zero, precision=precision, offload=layout.offload)
    psi = rank_params(model, tp=layout.tp, pp=layout.pp)
    states = model_state_bytes(psi, dp=layout.dims.shard_size, **kw)
    psi_e = experts.rank_expert_params(model, ep=layout.ep, pp=layout.pp)
    if not psi_e:
        return states
    ex = model_state_bytes(psi_e, dp=layout.dims.expert_shard_size, **kw)
    return ModelStates(states.params + ex.params, states.grads + ex.grads,
                       states.optimizer + ex.optimizer, host=states.host + ex.host)


def checkpoint_staging_bytes(model: Shape, layout: Layout) -> float:
    """Host bytes an asynchronous save stages on the busiest rank: its own shard of the fp32
    masters and both AdamW moments, 12 bytes per owned parameter — dense Ψ over the dp×cp
    shards, routed experts over the (dp/ep)·cp ranks holding them (dp_shard for dp under HSDP:
    the first replica writes); all of it at zero 0."""
    def share(psi: float, shards: int) -> float:
        return 12.0 * psi / (shards if layout.zero >= 1 else 1)

    psi = rank_params(model, tp=layout.tp, pp=layout.pp)
    psi_e = experts.rank_expert_params(model, ep=layout.ep, pp=layout.pp)
    return share(psi, layout.dims.shard_size) + share(psi_e, layout.dims.expert_shard_size)


def fp8_buffer_bytes(model: Shape, layout: Layout, *, in_flight: int, recompute: str) -> float:
    """FP8 GEMMs (train.fp8) save a float8 copy of each weight they use for backward, 1 byte
    per parameter, per in-flight microbatch (only the recomputed layer's under full
    recompute): the block's projections (/tp), and in an MoE block the rank's routed experts
    (/ep, whole under tp) and the shared experts (whole) in place of the dense MLP; norms and
    the router stay in their dtype (`fp8_layer_params`). Their saved inputs are float8 too,
    which the 16-bit activation constants over-count: the activation term is left as is (an
    upper bound)."""
    per_layer = fp8_layer_params(model, layout)
    if recompute == "full":
        return float(per_layer)
    return float(in_flight * model.n_layers / (layout.pp * layout.virtual_stages) * per_layer)


def fp8_layer_params(model: Shape, layout: Layout) -> float:
    """Parameters of the largest block's FP8 GEMMs on one rank (`fp8_buffer_bytes`)."""
    if not experts.is_moe(model):
        return (model.layer_params() - 2 * model.dim) / layout.tp
    m, h = model.moe, model.dim
    best = 0.0
    for i in range(model.n_layers):
        routed = experts.layer_expert_params(model, i)
        if not routed:
            best = max(best, (model.layer_params(i) - 2 * h) / layout.tp)
            continue
        shared = m.shared_experts * 3 * h * model.expert_ffn_dim
        attention = model.layer_params(i) - routed - shared - m.num_experts * h - 2 * h
        best = max(best, attention / layout.tp + routed / layout.ep + shared)
    return best


def memory_breakdown(
    model: Shape, layout: Layout, *, seq_len: int, micro_batch_size: int, in_flight: int,
    recompute: str = "none", precision: str = "bf16", fp8: bool = False,
    checkpoint_async: bool = True,
) -> MemoryBreakdown:
    """Bytes on the busiest rank of `layout` (see the module docstring for every term);
    `fp8` adds the float8 weight copies of FP8 linears to the buffers (`fp8_buffer_bytes`);
    `checkpoint_async` the staging copy of asynchronous saves (`checkpoint_staging_bytes`).

    `in_flight`: (microbatch, chunk) activation sets alive at the peak; take it from the
    pipeline simulator, or `bubble.in_flight_microbatches` for the closed form (1 for pp=1).
    """
    states = rank_state_bytes(model, layout, precision=precision)
    acts = activation_bytes(
        model, layout, seq_len=seq_len, micro_batch_size=micro_batch_size,
        in_flight=in_flight, recompute=recompute, precision=precision,
    )
    return MemoryBreakdown(
        params=states.params,
        grads=states.grads,
        optimizer=states.optimizer,
        activations=acts,
        buffers=buffer_bytes(model, layout, precision=precision) + (
            fp8_buffer_bytes(model, layout, in_flight=in_flight, recompute=recompute)
            if fp8 else 0.0),
        host=states.host,
        staging=checkpoint_staging_bytes(model, layout) if checkpoint_async else 0.0,
    )
