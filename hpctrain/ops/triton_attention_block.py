"""hpctrain's FlashAttention-2 kernels on one block of context parallelism: (out, lse) forward,
and the backward given the rows' merged log-sum-exp.

Legend: B batch, N query heads, K key/value heads, C chunk length, H head dim.
Ring attention (hpctrain.parallel.context) computes a rank's query chunk against one key/value
chunk at a time and merges the partial results by their log-sum-exp, so a block needs what the
whole-row kernel keeps to itself: lse (natural log here; the kernels store log2). The mask of a
block follows the chunks' global positions: the same chunk (`causal`: j ≤ i inside it), or an
earlier key chunk (every key precedes every query: no causal term); with documents key j is
visible to query i only if ids_k[b, j] == ids_q[b, i]. The backward of a block is
FlashAttention-2's given the row's *final* lse and D = rowsum(dO ∘ O) of the merged output, so
the blocks' gradients add up to the row's. Kernels, tiles and devices as ops/triton_attention.py
(CPU only under TRITON_INTERPRET=1; there inputs other than fp32/fp64 are computed in fp32).
"""

from __future__ import annotations

import math

import torch

from hpctrain.ops.triton_attention import (
    backward_given,
    forward_lse2,
    mode_problem,
    rows_contiguous,
)

LN2 = math.log(2.0)


def _prepare(q_BNCH: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Row-contiguous inputs in a dtype the kernels run on this device; ValueError if this
    process's Triton mode cannot run them (with the fix)."""
    if (problem := mode_problem(q_BNCH.device.type)) is not None:
        raise ValueError(problem)
    out = [rows_contiguous(x) for x in (q_BNCH, *tensors)]
    if q_BNCH.device.type != "cuda" and q_BNCH.dtype not in (torch.float32, torch.float64):
        out = [x.float() for x in out]  # the interpreter's bf16 dot products are wrong
    return out


def _ids(ids_BC: torch.Tensor | None) -> torch.Tensor | None:
    return None if ids_BC is None else ids_BC.to(torch.int32).contiguous()


def triton_block_forward(q_BNCH: torch.Tensor, k_BKCH: torch.Tensor, v_BKCH: torch.Tensor, *,
                         ids_q_BC: torch.Tensor | None, ids_k_BC: torch.Tensor | None,
                         causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(o_BNCH, lse_BNC) of one block (module docstring); ids None: one document. Rows that
    see no key of the block get o = 0 and lse = −inf. lse is in the accumulation dtype (fp32,
    fp64 for fp64 inputs), o in the inputs' dtype."""
    q, k, v = _prepare(q_BNCH, k_BKCH, v_BKCH)
    o_BNCH, lse2_BNC = forward_lse2(q, k, v, _ids(ids_q_BC), interpret=q.device.type != "cuda",
                                ids_k=_ids(ids_k_BC), causal=causal)
    return o_BNCH.to(q_BNCH.dtype), lse2_BNC * LN2


def triton_block_backward(q_BNCH: torch.Tensor, k_BKCH: torch.Tensor, v_BKCH: torch.Tensor,
                          do_BNCH: torch.Tensor, lse_BNC: torch.Tensor, d_BNC: torch.Tensor, *,
                          ids_q_BC: torch.Tensor | None, ids_k_BC: torch.Tensor | None,
                          causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq_BNCH, dk_BKCH, dv_BKCH) of one block, given the rows' final lse_BNC (natural log,
    finite) and D = rowsum(dO ∘ O) of the final output."""
    q, k, v, do = _prepare(q_BNCH, k_BKCH, v_BKCH, do_BNCH)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse2_BNC = (lse_BNC.to(acc) / LN2).contiguous()
    dq, dk, dv = backward_given(do, q, k, v, lse2_BNC, d_BNC.to(acc).contiguous(),
                                 _ids(ids_q_BC), interpret=q.device.type != "cuda",
                                 ids_k=_ids(ids_k_BC), causal=causal)
    dtype = q_BNCH.dtype
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)
