"""Seconds of one transformer layer's kernels for one microbatch on one tp rank.

The compute part of the step-time model (`hpctrain.plan.time`). Each layer is the kernels a
Megatron-style block launches, timed with a roofline against the device's datasheet:

  GEMM (M×K)·(K×N), 2-byte operands:  max(2MNK / (peak · achievable_fraction),
                                           2(MK + KN + MN) / (hbm · HBM_EFFICIENCY))
  memory-bound kernel of n bytes:      n / (hbm · HBM_EFFICIENCY)

so the GEMM efficiency follows the matrix shape: the attention core (K = head dim 96–160 for
QKᵀ, N = head dim for AV) is bandwidth-bound on an A100 while the big projections are
compute-bound, and the elementwise work grows as s·h + a·s² per token against the GEMMs' h².
That is why larger models reach a larger fraction of peak (Narayanan et al. 2021, Table 1:
44% at h = 2304 to 52% at h = 25600) with one set of constants.

Forward kernels per layer, per token, as Megatron-LM 2021 runs them (its §4.2: fused
bias+GeLU, bias+dropout+add and scale+mask+softmax kernels; no sequence parallelism, so the
LayerNorms and residual adds are repeated on every tp rank):
  GEMMs: QKV (N = (h + 2·kv·d)/t), output projection (K = h/t), MLP up (N = f/t, twice for a
         gated MLP), MLP down (K = f/t); QKᵀ and AV per head (a/t heads, M = s); a fused
         attention backend (sdpa, flash: no score matrix in HBM) is timed by its FLOPs alone
  bytes: 2 LayerNorms 2·2h, 2 bias+dropout+add 2·3.5h (3 tensors + 1-byte mask), bias+GeLU
         2·2f/t (f/t in, f/t out), softmax 4·a·s/t, attention dropout 5·a·s/t (in, out, mask)
Backward = the input-gradient GEMMs (same shapes) + 2× the forward's elementwise bytes (read
the gradient and the saved input, write the gradient) + the attention core twice (dQ, dK, dV);
the weight-gradient GEMMs are the W part, one per projection. Full recomputation runs the
forward again inside B. Selective recomputation redoes the attention core (softmax, dropout,
QKᵀ, AV) inside B. Element sizes follow the precision (4 bytes for fp32).

Constants (defaults, both overridable): achievable_fraction (ClusterSpec, 0.7: the share of
the dense peak that well-shaped fp16/bf16 GEMMs sustain inside a training step; cuBLAS on
an A100 reaches 70–80% of 312 TFLOP/s on large GEMMs) and HBM_EFFICIENCY = 0.8 (streaming
kernels reach ~80% of the HBM datasheet rate: ~1.6 of 2.0 TB/s on an A100 in STREAM-like
copies). A device whose HBM bandwidth is unknown (a CPU measured on the spot) is timed by
its FLOPs alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.plan.shapes import GPTShape, Shape

HBM_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Roofline:
    """The rates a kernel is timed against: FLOP/s for math, bytes/s for memory traffic."""

    flops: float  # peak · achievable_fraction
    bytes_per_s: float  # hbm · HBM_EFFICIENCY; inf when unknown (FLOPs alone)

    def gemm(self, m: float, n: float, k: float, *, elem: int, count: float = 1.0) -> float:
        """Seconds of `count` (m×k)·(k×n) GEMMs of `elem`-byte operands."""
        math_s = 2 * m * n * k / self.flops
        memory_s = elem * (m * k + k * n + m * n) / self.bytes_per_s
        return count * max(math_s, memory_s)

    def stream(self, nbytes: float) -> float:
        return nbytes / self.bytes_per_s


def roofline(device, *, precision: str, achievable_fraction: float) -> Roofline:
    """The device's Roofline in `precision` (module docstring)."""
    hbm = getattr(device, "hbm_bandwidth", math.nan)
    bw = hbm * HBM_EFFICIENCY if hbm and hbm == hbm else math.inf
    return Roofline(flops=device.peak_flops(precision) * achievable_fraction, bytes_per_s=bw)


@dataclass(frozen=True)
class LayerCost:
    """Seconds of one layer for one microbatch: forward F, input gradient B (with whatever
    recomputation the run does), weight gradient W. Communication is not included."""

    f: float
    b: float
    w: float


def mlp_width(model: Shape) -> float:
    """The MLP width a token passes through, averaged over layers: ffn_dim for dense layers,
    (top_k + shared) · expert_ffn_dim for MoE layers (the active experts' GEMMs)."""
    moe = getattr(model, "moe", None)
    if moe is None or not moe.enabled:
        return model.ffn_dim
    n_moe = model.n_moe_layers
    active = (moe.top_k + moe.shared_experts) * model.expert_ffn_dim
    return ((model.n_layers - n_moe) * model.ffn_dim + n_moe * active) / model.n_layers


def _projections(model: Shape, r: Roofline, *, tokens: int, tp: int, elem: int) -> float:
    d, f = model.dim, mlp_width(model)
    kv = model.n_kv_heads * (d // model.n_heads)
    ups = 1 if isinstance(model, GPTShape) else 2  # GELU MLP vs gated (SwiGLU) MLP
    return (r.gemm(tokens, (d + 2 * kv) / tp, d, elem=elem)
            + r.gemm(tokens, d, d / tp, elem=elem)
            + r.gemm(tokens, f / tp, d, elem=elem, count=ups)
            + r.gemm(tokens, d, f / tp, elem=elem))


def _attention_core(model: Shape, r: Roofline, *, mbs: int, seq_len: int, keys: float, tp: int,
                    elem: int) -> float:
    """QKᵀ (s×d)·(d×keys) and AV (s×keys)·(keys×d) per head. Eager attention (GPTShape,
    attention=eager) writes the scores and runs softmax and dropout over them; a fused backend
    (sdpa, flash, …) keeps them on chip and is timed by its FLOPs."""
    heads, d = mbs * model.n_heads / tp, model.dim // model.n_heads
    if getattr(model, "attention", "eager") != "eager":
        return 4 * heads * seq_len * keys * d / r.flops
    gemms = r.gemm(seq_len, keys, d, elem=elem, count=heads)
    gemms += r.gemm(seq_len, d, keys, elem=elem, count=heads)
    scores = heads * seq_len * keys
    return gemms + r.stream(scores * (2 * elem + 2 * elem + 1))


def layer_cost(model: Shape, r: Roofline, *, mbs: int, seq_len: int, keys: float, tp: int,
               sp: bool, recompute: str, precision: str, fp8: Roofline | None = None
               ) -> LayerCost:
    """F, B, W seconds of one layer (module docstring). keys: attended keys per query.
    fp8: the roofline of FP8 linears (train.fp8): the projections run on it, 1-byte operands."""
    elem = 4 if precision == "fp32" else 2
    tokens = mbs * seq_len
    shared = 2 * 2 + 2 * 3.5  # elements ×h per token: 2 LayerNorms, 2 bias+dropout+add
    per_token = (shared * model.dim / (tp if sp else 1) + 2 * mlp_width(model) / tp) * elem
    proj = (_projections(model, r, tokens=tokens, tp=tp, elem=elem) if fp8 is None
            else _projections(model, fp8, tokens=tokens, tp=tp, elem=1))
    core = _attention_core(model, r, mbs=mbs, seq_len=seq_len, keys=keys, tp=tp, elem=elem)
    elementwise = r.stream(tokens * per_token)
    fwd = proj + core + elementwise
    redo = {"none": 0.0, "selective": core, "full": fwd}[recompute]
    return LayerCost(f=fwd, b=redo + proj + 2 * core + 2 * elementwise, w=proj)


def head_cost(model: Shape, r: Roofline, *, mbs: int, seq_len: int, tp: int,
              precision: str) -> float:
    """Forward + both backward GEMMs of the output layer for one microbatch (never recomputed)."""
    elem = 4 if precision == "fp32" else 2
    return r.gemm(mbs * seq_len, model.vocab_size / tp, model.dim, elem=elem, count=3)
