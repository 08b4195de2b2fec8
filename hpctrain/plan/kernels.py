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

Fused attention (sdpa, flash, …; GPTShape(attention="flash") for Transformer Engine runs)
keeps the scores on chip and skips the tiles above the causal diagonal: forward 4·s·k'·d FLOPs
per head with k' = `causal_keys` (keys/2 + half a 128-key tile), backward 2.5× that
(FlashAttention-2 §3.2: five matmuls, P recomputed), at the generation's attention shares.
The output layer adds the fp32 vocab-parallel cross entropy over its mbs·s·V/t logits,
CE_BYTES_PER_LOGIT bytes each (`loss_cost`).

Constants, per device generation (`hpctrain.plan.hardware`, each with its source):
achievable_fraction (ClusterSpec; default the generation's in-step GEMM share: A100 0.7, H100
and H200 0.5), the fused-attention shares (benchmark shares × gemm/mamf: what a training step
keeps of a standalone benchmark) and the HBM share (0.8: ~1.6 of 2.0 TB/s on an A100 in
STREAM-like copies). A device whose HBM bandwidth is unknown (a CPU measured on the spot) is
timed by its FLOPs alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpctrain.plan.hardware import kernel_constants
from hpctrain.plan.shapes import GPTShape, Shape

FLASH_BWD_FLOPS = 2.5  # backward / forward FLOPs of a fused attention kernel
FLASH_TILE = 128  # key block of the fused kernels: diagonal tiles run unmasked
# Bytes per logit of Megatron's vocab-parallel cross entropy, in fp32 (fp16_lm_cross_entropy
# off, its default): forward upcast 2+4, max 4, subtract 4+4, exp 4+4, sum 4, normalise
# 4+4; backward scale by the loss gradient 4+4, downcast 4+2.
CE_BYTES_PER_LOGIT = 6 + 4 + 8 + 8 + 4 + 8 + 8 + 6


@dataclass(frozen=True)
class Roofline:
    """The rates a kernel is timed against: FLOP/s for math, bytes/s for memory traffic, and
    the fused attention kernels' FLOP/s (forward, backward; `hpctrain.plan.hardware`)."""

    flops: float  # peak · achievable_fraction
    bytes_per_s: float  # hbm · hbm share; inf when unknown (FLOPs alone)
    attn_fwd: float = math.nan  # peak · attention shares; NaN: same as flops
    attn_bwd: float = math.nan
    measured: tuple[tuple[int, int, int, float], ...] = ()  # (M, K, N, standalone FLOP/s)
    in_step: float = 1.0  # achievable_fraction / mamf: what a step keeps of a standalone run

    def gemm(self, m: float, n: float, k: float, *, elem: int, count: float = 1.0) -> float:
        """Seconds of `count` (m×k)·(k×n) GEMMs of `elem`-byte operands: the roofline, or for
        a shape timed on this device its measured rate · in_step (the measured kernel already
        includes its memory traffic)."""
        measured = self.measured_rate(m, n, k)
        if measured is not None:
            return count * 2 * m * n * k / (measured * self.in_step)
        math_s = 2 * m * n * k / self.flops
        memory_s = elem * (m * k + k * n + m * n) / self.bytes_per_s
        return count * max(math_s, memory_s)

    def measured_rate(self, m: float, n: float, k: float) -> float | None:
        """Standalone FLOP/s measured for (M, K, N) = (m, k, n) on this device, or None."""
        key = (round(m), round(k), round(n))
        return next((f for mm, kk, nn, f in self.measured if (mm, kk, nn) == key), None)

    def stream(self, nbytes: float) -> float:
        return nbytes / self.bytes_per_s

    def flash(self, flops_fwd: float) -> tuple[float, float]:
        """(forward, backward) seconds of a fused attention kernel doing `flops_fwd` in its
        forward and 2.5× that in its backward (FlashAttention-2 §3.2: five matmuls, P
        recomputed from the saved log-sum-exp)."""
        fwd = self.flops if self.attn_fwd != self.attn_fwd else self.attn_fwd
        bwd = self.flops if self.attn_bwd != self.attn_bwd else self.attn_bwd
        return flops_fwd / fwd, FLASH_BWD_FLOPS * flops_fwd / bwd


def roofline(device, *, precision: str, achievable_fraction: float,
             measured: tuple[tuple[int, int, int, float], ...] = ()) -> Roofline:
    """The device's Roofline in `precision` (module docstring); the attention and HBM shares
    from its generation's row (`hpctrain.plan.hardware.kernel_constants`); `measured`: GEMM
    shapes (M, K, N) timed on this device and their FLOP/s (ClusterSpec.gemm_flops)."""
    k = kernel_constants(device)
    hbm = getattr(device, "hbm_bandwidth", math.nan)
    bw = hbm * k.hbm if hbm and hbm == hbm else math.inf
    peak = device.peak_flops(precision)
    in_step = achievable_fraction / k.mamf  # what the step keeps of standalone benchmarks
    return Roofline(flops=peak * achievable_fraction, bytes_per_s=bw,
                    attn_fwd=peak * k.attn_fwd * in_step, attn_bwd=peak * k.attn_bwd * in_step,
                    measured=measured, in_step=in_step)


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


def causal_keys(keys: float) -> float:
    """Keys per query a causal fused kernel computes: half the attended keys plus half a key
    tile (the diagonal tiles run whole, those above it are skipped; FlashAttention-2 §3.1.1)."""
    return min(keys, keys / 2 + FLASH_TILE / 2)


def _attention_core(model: Shape, r: Roofline, *, mbs: int, seq_len: int, keys: float, tp: int,
                    elem: int) -> tuple[float, float]:
    """(forward, backward) seconds of QKᵀ (s×d)·(d×keys) and AV (s×keys)·(keys×d) per head.
    Eager attention (GPTShape's default, attention=eager) computes every score, masked or
    not, writes them and runs softmax and dropout over them; its backward is twice its
    forward. A fused backend (sdpa, flash, …) keeps the scores on chip and skips the causal
    mask's upper tiles: 4·s·causal_keys·d FLOPs per head forward, 2.5× that backward, at the
    generation's attention shares (`Roofline.flash`)."""
    heads, d = mbs * model.n_heads / tp, model.dim // model.n_heads
    if getattr(model, "attention", "eager") != "eager":
        return r.flash(4 * heads * seq_len * causal_keys(keys) * d)
    gemms = r.gemm(seq_len, keys, d, elem=elem, count=heads)
    gemms += r.gemm(seq_len, d, keys, elem=elem, count=heads)
    scores = heads * seq_len * keys
    fwd = gemms + r.stream(scores * (2 * elem + 2 * elem + 1))
    return fwd, 2 * fwd


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
    core_f, core_b = _attention_core(model, r, mbs=mbs, seq_len=seq_len, keys=keys, tp=tp,
                                     elem=elem)
    elementwise = r.stream(tokens * per_token)
    fwd = proj + core_f + elementwise
    redo = {"none": 0.0, "selective": core_f, "full": fwd}[recompute]
    return LayerCost(f=fwd, b=redo + proj + core_b + 2 * elementwise, w=proj)


def loss_cost(model: Shape, r: Roofline, *, mbs: int, seq_len: int, tp: int) -> float:
    """Seconds of the vocab-parallel cross entropy over one microbatch's mbs·s·V/t logits,
    forward and backward, memory-bound at CE_BYTES_PER_LOGIT (fp32, Megatron-LM's
    `vocab_parallel_cross_entropy`)."""
    return r.stream(mbs * seq_len * model.vocab_size / tp * CE_BYTES_PER_LOGIT)


def head_cost(model: Shape, r: Roofline, *, mbs: int, seq_len: int, tp: int,
              precision: str) -> float:
    """Forward + both backward GEMMs of the output layer for one microbatch (never recomputed)."""
    elem = 4 if precision == "fp32" else 2
    return r.gemm(mbs * seq_len, model.vocab_size / tp, model.dim, elem=elem, count=3)
