"""The `triton` attention backend: hpctrain's own FlashAttention-2 kernels as an autograd op.

Legend: B batch, N query heads, K key/value heads, L sequence, H head dim.
`triton_attention(q_BNLH, k_BKLH, v_BKLH, docs)` computes causal softmax(q kᵀ/√H) v with
grouped-query attention and optional document masks, like every backend in ops/attention.py.
Forward keeps only O and the log-sum-exp (B·N·L floats), never an L×L matrix; backward
recomputes the probabilities from them (kernels and math in ops/triton_attention_kernels.py).

Devices. Triton fixes its mode when it is first imported: with TRITON_INTERPRET=1 in the
environment every kernel runs under its CPU interpreter, otherwise compiled for the GPU. So:
CUDA tensors need a process without TRITON_INTERPRET (they run in their own dtype: bf16/fp16
natively, fp32 with IEEE dot products); CPU tensors need TRITON_INTERPRET=1 set before anything
imports triton (config validation refuses `model.attention=triton` on CPU without it, and
tests/unit/conftest.py sets it on machines without CUDA). The interpreter is slow (tests, tiny
models) and its bf16 dot products are wrong, so there inputs are computed in fp32 and the result
cast back. Triton is an optional dependency (`pip install hpctrain[triton]`), imported on first
use; a mismatch between device and mode is a ValueError naming the fix.
"""

from __future__ import annotations

import math
import os
import sys

import torch

from hpctrain.ops.documents import Documents

# (BM, BN) of the forward, dq and dk/dv kernels, and (num_warps, num_stages) on the GPU.
# From Triton's fused-attention tutorial for H ≤ 128; untuned on this project's GPUs yet.
GPU_TILES = {"fwd": (128, 64), "dq": (128, 32), "dkdv": (32, 128)}
GPU_LAUNCH = {"fwd": (8, 3), "dq": (4, 3), "dkdv": (4, 3)}
# Small tiles under the interpreter: test lengths of ~70 tokens still span several tiles.
INTERPRETER_TILE = 32


def interpreter_on() -> bool:
    """Whether this process's Triton runs kernels under its CPU interpreter."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def kernels():
    """The kernel module, jitted in the process's Triton mode (see the module docstring)."""
    from hpctrain.ops import triton_attention_kernels

    return triton_attention_kernels


def mode_problem(device_type: str) -> str | None:
    """Why this process cannot run the kernels on `device_type`, with the fix; None if it can."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if "triton" in sys.modules:
        interpret = interpreter_on()  # Triton's own reading of the setting
    if device_type == "cuda" and interpret:
        return ("model.attention=triton on CUDA but TRITON_INTERPRET=1 runs Triton's CPU "
                "interpreter (slow, wrong in bf16): unset TRITON_INTERPRET")
    if device_type != "cuda" and not interpret:
        return (f"model.attention=triton on {device_type} runs only under Triton's interpreter:"
                " start the process with TRITON_INTERPRET=1 in the environment (it must be set "
                "before triton is imported), or use model.attention=sdpa")
    return None


def _tiles(name: str, interpret: bool) -> tuple[int, int]:
    return (INTERPRETER_TILE,) * 2 if interpret else GPU_TILES[name]


def _launch(name: str, interpret: bool) -> dict:
    if interpret:
        return {}
    warps, stages = GPU_LAUNCH[name]
    return {"num_warps": warps, "num_stages": stages}


def _doc_bounds(ids_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First index and one-past-last index of each token's document (ids non-decreasing)."""
    ids_BL = ids_BL.contiguous()
    return (torch.searchsorted(ids_BL, ids_BL, right=False),
            torch.searchsorted(ids_BL, ids_BL, right=True))


def query_tile_ranges(ids_BL: torch.Tensor, *, bm: int, bn: int) -> torch.Tensor:
    """[B, tiles, 3] int32 (lo, free_lo, free_hi) for the query tiles (rows t·bm … t·bm+bm−1).

    Keys [lo, hi) may be visible (hi = min(t·bm + bm, L)); lo is the start of the first row's
    document rounded down to bn, so tiles before it are skipped. Keys [free_lo, free_hi) are
    visible to every row — the tile lies in one document and they are in it, before row t·bm —
    so they run without a mask. lo ≤ free_lo ≤ free_hi ≤ hi, all multiples of bn.
    """
    assert bm % bn == 0, (bm, bn)  # the mask-free keys must end exactly at the tile's first row
    first, _ = _doc_bounds(ids_BL)
    L = ids_BL.shape[1]
    m0 = torch.arange(0, L, bm, device=ids_BL.device)
    single = ids_BL[:, m0] == ids_BL[:, (m0 + bm - 1).clamp(max=L - 1)]
    lo = first[:, m0] // bn * bn
    free_lo = torch.where(single, -(-first[:, m0] // bn) * bn, lo)
    free_hi = torch.where(single, m0.expand_as(lo), lo)
    return torch.stack([lo, free_lo, free_hi], dim=-1).int().contiguous()


def key_tile_ranges(ids_BL: torch.Tensor, *, bm: int, bn: int) -> torch.Tensor:
    """[B, tiles, 3] int32 (free_lo, free_hi, hi) for the key tiles (keys t·bn … t·bn+bn−1).

    Queries [lo, hi) may see the tile (lo = t·bn rounded down to bm; hi = the end of its last
    key's document), so later query tiles are skipped. Queries [free_lo, free_hi) see all of
    it — the tile lies in one document, the queries are in it and after its last key — so they
    run without a mask. lo ≤ free_lo ≤ free_hi ≤ hi; free_* are multiples of bm.
    """
    _, end = _doc_bounds(ids_BL)
    L = ids_BL.shape[1]
    n0 = torch.arange(0, L, bn, device=ids_BL.device)
    n_last = (n0 + bn - 1).clamp(max=L - 1)
    hi = end[:, n_last]
    f_lo, f_hi = -(-(n0 + bn - 1) // bm) * bm, end[:, n0] // bm * bm
    # f_lo < f_hi implies the tile is whole and in one document: otherwise its first key's
    # document ends (and L comes) by its last key, so f_hi ≤ last key ≤ f_lo.
    ok = f_lo < f_hi
    free_lo, free_hi = torch.where(ok, f_lo, hi), torch.where(ok, f_hi, hi)
    return torch.stack([free_lo, free_hi, hi], dim=-1).int().contiguous()


def cross_tile_ranges(L: int, *, step: int, documents: bool, keys: bool, device) -> torch.Tensor:
    """[1, tiles, 3] int32 tile ranges of a non-causal block (every key precedes every query):
    nothing skipped; mask-free up to the last whole tile of `step` rows without documents
    (rows past L must be masked), all masked with them. Query tiles (lo, free_lo, free_hi),
    key tiles (free_lo, free_hi, hi) as in query_tile_ranges / key_tile_ranges."""
    free = 0 if documents else L // step * step
    row = (0, free, L) if keys else (0, 0, free)
    tiles = triton_cdiv(L, step)
    return torch.tensor(row, dtype=torch.int32, device=device).expand(1, tiles, 3).contiguous()


def _ranges(fn, ids, *, B: int, L: int, bm: int, bn: int, device,
            causal: bool = True) -> torch.Tensor:
    """fn's tile ranges for every row; without documents one row of zeros, shared (stride 0).
    Non-causal: cross_tile_ranges, shared by every row."""
    if not causal:
        keys = fn is key_tile_ranges
        return cross_tile_ranges(L, step=bm if keys else bn, documents=ids is not None,
                                 keys=keys, device=device).expand(B, -1, -1)
    if ids is not None:
        return fn(ids, bm=bm, bn=bn)
    return fn(torch.zeros(1, L, dtype=torch.int32, device=device), bm=bm, bn=bn).expand(B, -1, -1)


def _strides(x: torch.Tensor) -> tuple[int, int, int]:
    return x.stride(0), x.stride(1), x.stride(2)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _tl_dtype(dtype: torch.dtype):
    import triton.language as tl

    return tl.float64 if dtype == torch.float64 else tl.float32


def _head_pad(H: int) -> int:
    return max(16, 1 << (H - 1).bit_length())  # tl.arange needs a power of two, tl.dot ≥ 16


def forward_lse2(q, k, v, ids, *, interpret, ids_k=None, causal=True):
    """(o, lse2): lse2 in log2 units. `ids_k` the keys' document ids (default `ids`)."""
    B, N, L, H = q.shape
    bm, bn = _tiles("fwd", interpret)
    o = torch.empty(B, L, N, H, dtype=q.dtype, device=q.device).transpose(1, 2)  # BNLH view
    lse = torch.empty(B, N, L, dtype=_acc_dtype(q.dtype), device=q.device)
    ranges = _ranges(query_tile_ranges, ids, B=B, L=L, bm=bm, bn=bn, device=q.device,
                     causal=causal)
    grid = (triton_cdiv(L, bm), B * N)
    kernels().attn_fwd[grid](
        q, k, v, o, lse, ids, ids if ids_k is None else ids_k, ranges,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        ranges.stride(0), L, H, N, N // k.shape[1], QK_SCALE2=_scale(H) * math.log2(math.e),
        HAS_DOCS=ids is not None, BM=bm, BN=bn, HP=_head_pad(H), PREC=_precision(q.dtype),
        ACC=_tl_dtype(q.dtype), CAUSAL=causal, **_launch("fwd", interpret))
    return o, lse


def _backward(do, q, k, v, o, lse, ids, *, interpret):
    # The preprocess: Δ_i = Σ_h dO_ih O_ih, in the accumulation dtype.
    delta = (do.to(lse.dtype) * o.to(lse.dtype)).sum(-1).contiguous()
    return backward_given(do, q, k, v, lse, delta, ids, interpret=interpret)


def backward_given(do, q, k, v, lse, delta, ids, *, interpret, ids_k=None, causal=True):
    """(dq, dk, dv) from the rows' final lse2 (log2 units) and Δ = rowsum(dO ∘ O)."""
    B, N, L, H = q.shape
    K = k.shape[1]
    ids_k = ids if ids_k is None else ids_k
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(HAS_DOCS=ids is not None, HP=_head_pad(H), PREC=_precision(q.dtype),
                  ACC=_tl_dtype(q.dtype), CAUSAL=causal)
    scales = dict(QK_SCALE2=_scale(H) * math.log2(math.e), SM_SCALE=_scale(H))
    bm, bn = _tiles("dq", interpret)
    ranges = _ranges(query_tile_ranges, ids, B=B, L=L, bm=bm, bn=bn, device=q.device,
                     causal=causal)
    kernels().attn_bwd_dq[(triton_cdiv(L, bm), B * N)](
        q, k, v, do, dq, lse, delta, ids, ids_k, ranges, *_strides(q), *_strides(k), *_strides(v),
        *_strides(do), *_strides(dq), ranges.stride(0), L, H, N, N // K, **scales, BM=bm,
        BN=bn, **common, **_launch("dq", interpret))
    bm, bn = _tiles("dkdv", interpret)
    ranges = _ranges(key_tile_ranges, ids_k, B=B, L=L, bm=bm, bn=bn, device=q.device,
                     causal=causal)
    kernels().attn_bwd_dkdv[(triton_cdiv(L, bn), B * K)](
        q, k, v, do, dk, dv, lse, delta, ids, ids_k, ranges,
        *_strides(q), *_strides(k), *_strides(v),
        *_strides(do), *_strides(dk), *_strides(dv), ranges.stride(0), L, H, K, N // K,
        **scales, BM=bm, BN=bn, **common, **_launch("dkdv", interpret))
    return dq, dk, dv


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale(H: int) -> float:
    return 1.0 / math.sqrt(H)


def rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonAttention(torch.autograd.Function):
    """out = FlashAttention-2(q, k, v, ids); gradients for q, k and v (ids: int32 or None)."""

    @staticmethod
    def forward(ctx, q, k, v, ids):
        interpret = q.device.type != "cuda"
        o, lse = forward_lse2(q, k, v, ids, interpret=interpret)
        ctx.save_for_backward(q, k, v, o, lse, ids)
        ctx.interpret = interpret
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, ids = ctx.saved_tensors
        dq, dk, dv = _backward(rows_contiguous(do), q, k, v, o, lse, ids,
                               interpret=ctx.interpret)
        return dq, dk, dv, None


def triton_attention(q_BNLH: torch.Tensor, k_BKLH: torch.Tensor, v_BKLH: torch.Tensor,
                     docs: Documents | None = None) -> torch.Tensor:
    """hpctrain's fused kernel (see the module docstring for devices and dtypes)."""
    if (problem := mode_problem(q_BNLH.device.type)) is not None:
        raise ValueError(problem)
    dtype = q_BNLH.dtype
    q, k, v = (rows_contiguous(x) for x in (q_BNLH, k_BKLH, v_BKLH))
    if q.device.type != "cuda" and dtype not in (torch.float32, torch.float64):
        q, k, v = q.float(), k.float(), v.float()
    ids = None if docs is None else docs.ids_BL.to(torch.int32).contiguous()
    return TritonAttention.apply(q, k, v, ids).to(dtype)
