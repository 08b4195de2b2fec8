"""Float8 quantization and the three scaled GEMMs of a linear layer, with dynamic scaling.

Legend: T tokens (B·L flattened), I input features, O output features.
A linear layer y_TO = x_TI W_OIᵀ has three products, each run here in float8:

  forward      y  = x · Wᵀ     x E4M3, W E4M3      contraction over I
  grad-input   dx = dy · W     dy E5M2, W E4M3     contraction over O
  grad-weight  dW = dyᵀ · x    dy E5M2, x E4M3     contraction over T

Scaling is "current" (dynamic): scale = finfo(fp8).max / amax, computed from the tensor being
cast, no history. `tensorwise` takes one amax per tensor; `rowwise` one per row of an operand
along its contraction axis (x per token for the forward, per input feature for grad-weight;
W per output row for the forward, per input column for grad-input; dy per token for
grad-input, per output feature for grad-weight), so a row's outlier only coarsens its own row.
The quantized value is q = cast(clamp(t·scale, ±max)); the GEMM is
(q_a · scale_a⁻¹) @ (q_b · scale_b⁻¹) with fp32 accumulation, which is exactly what
`emulated_mm` computes (hpctrain's path on CPU, see `scaled_mm`), and what `torch._scaled_mm`
computes with FP8 tensor cores on Hopper (and on CPU, to fp32 rounding).

Tensor parallelism (`Fp8Spec.sharded`): a scale must be what the single process would compute,
so an amax taken over a tensor (tensorwise) or along an axis (rowwise) that is split across the
tp group is all-reduced (MAX) over that group first. Column-parallel (W split by output rows,
"out"): x is replicated (or all-gathered under sp), W and dy are split along O, so tensorwise
reduces W's and dy's amax, rowwise reduces only the grad-input scales (its contraction, O, is
split). Row-parallel ("in": W split by input columns, x along I): tensorwise reduces W's and
x's amax, rowwise only the forward scales (contraction I is split). Grad-weight contracts over
T, never split by tp (sp gathers the sequence before the layer), so its rowwise scales are
local. Every amax and cast happens in forward or in the immediate part of backward; the
deferred weight gradient of a zero-bubble schedule uses the quantized tensors saved then,
with no collective.

ZeRO-3: the engine all-gathers a block's parameters in their own dtype before its forward
(`hpctrain.parallel.data.zero3`) and the linears quantize the gathered weights, so the scales are
the full tensors'; all-gathering parameters in float8 (halving that traffic) is not built.
On CUDA, torch's rowwise `_scaled_mm` is more restrictive than on CPU (dtypes, bf16 output):
the GPU benchmark uses tensorwise; rowwise has only been run on CPU.

Why not torchao (0.18 installs here, and its `Float8Linear` runs on CPU): it swaps
`nn.Linear` modules for its own subclass whose autograd function computes grad-weight inside
backward (no way to defer it to the W action of a zero-bubble schedule), and it makes scales
tp-consistent through DTensor, which hpctrain's explicit-group layers do not use. The math
above is ~100 lines, so hpctrain owns it rather than adding a dependency that fits neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

Recipe = Literal["tensorwise", "rowwise"]
Sharded = Literal["none", "out", "in"]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
AMAX_EPS = 1e-12  # an all-zero tensor gets a finite scale (its quantized values stay 0)


@dataclass(frozen=True)
class Fp8Spec:
    """How one linear layer runs in float8: the scaling `recipe`, and for a tp-sharded layer
    the tp `group` and which weight dim is split over it ("out" column-, "in" row-parallel)."""

    recipe: Recipe = "tensorwise"
    sharded: Sharded = "none"
    group: object = None

    def reduces(self, *, operand_split: bool, contraction_split: bool) -> bool:
        """Whether an amax must be all-reduced over the group (module docstring's table)."""
        if self.sharded == "none" or self.group is None or dist.get_world_size(self.group) == 1:
            return False
        return operand_split if self.recipe == "tensorwise" else contraction_split


@dataclass(frozen=True)
class Quantized:
    """q (float8) and its dequantization factor inv = 1/scale: t ≈ q · inv. `inv` is a
    0-d tensor (tensorwise) or broadcasts along the non-contraction axis (rowwise)."""

    q: torch.Tensor
    inv: torch.Tensor

    def t(self) -> Quantized:
        return Quantized(self.q.t(), self.inv.t() if self.inv.dim() else self.inv)


def quantize(t: torch.Tensor, dtype: torch.dtype, *, dim: int | None,
             group: dist.ProcessGroup | None) -> Quantized:
    """Quantize `t` (2-d) to `dtype` with a scale from its amax: over the whole tensor
    (dim None) or along `dim` (one scale per slice, kept as a broadcastable dim). `group`:
    all-reduce the amax (MAX) over it first, so a shard gets the full tensor's scale; None:
    this tensor is whole (`Fp8Spec.reduces` says which operands are shards)."""
    a = t.detach().abs().amax() if dim is None else t.detach().abs().amax(dim=dim, keepdim=True)
    a = a.float()
    if group is not None:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    fmax = torch.finfo(dtype).max
    scale = fmax / a.clamp(min=AMAX_EPS)
    q = (t.detach().float() * scale).clamp(-fmax, fmax).to(dtype)
    return Quantized(q, scale.reciprocal())


def scaled_mm(a: Quantized, b: Quantized, *, out_dtype: torch.dtype) -> torch.Tensor:
    """a (M×K) @ b (K×N) in float8 with fp32 accumulation, scaled back. On an accelerator
    `torch._scaled_mm` (FP8 tensor cores); on CPU the fp32 emulation, which no CPU loses by
    (none has float8 units): on x86 CPUs with AMX or avx512_bf16 torch's CPU `_scaled_mm`
    takes a fused oneDNN kernel ~800× slower (4.7 s against 6 ms for one 512² product; a tiny
    model's first FP8 step took 134 s) and one fp32 ulp from the emulation."""
    if a.q.device.type == "cpu":
        return emulated_mm(a, b, out_dtype=out_dtype)
    return torch_scaled_mm(a, b, out_dtype=out_dtype)


def torch_scaled_mm(a: Quantized, b: Quantized, *, out_dtype: torch.dtype) -> torch.Tensor:
    """`torch._scaled_mm` on the operands, laid out as cuBLAS wants them (a row-major, b
    column-major); rowwise `inv`s are (M, 1) and (1, N)."""
    b_q = b.q.t().contiguous().t()
    return torch._scaled_mm(a.q.contiguous(), b_q, scale_a=_dense(a.inv), scale_b=_dense(b.inv),
                            out_dtype=out_dtype)


def _dense(inv: torch.Tensor) -> torch.Tensor:
    # fresh row-major strides: a transposed (M, 1) view counts as contiguous but has
    # stride(1) = M, which _scaled_mm rejects
    return inv.float().clone(memory_format=torch.contiguous_format)


def emulated_mm(a: Quantized, b: Quantized, *, out_dtype: torch.dtype) -> torch.Tensor:
    """The reference for `scaled_mm`: dequantize with the same scales, multiply in fp32."""
    return ((a.q.float() * a.inv) @ (b.q.float() * b.inv)).to(out_dtype)
