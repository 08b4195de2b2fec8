"""One (query chunk, key chunk) block of ring attention, with its log-sum-exp.

Legend: B batch, N query heads, K kv heads, C chunk length, H head dim.
Forward of a block: s = q kᵀ/√H masked, lse = log Σ_j exp s_j, o = softmax(s) v. Partial
results over key blocks merge exactly (the online-softmax rule):
  lse = logaddexp(lse₁, lse₂),  o = o₁·exp(lse₁ − lse) + o₂·exp(lse₂ − lse).
Backward of a block, given the row's final lse and D = rowsum(dO ⊙ O) (FlashAttention-2):
  p = exp(s − lse), dv = pᵀ dO, ds = p ⊙ (dO vᵀ − D), dq = ds k/√H, dk = dsᵀ q/√H.
The eager math runs in the input dtype (fp64 in the exactness tests), in fp32 for bf16/fp16
inputs (`compute_dtype`: its results are fp32, as a fused kernel's accumulators); the sdpa backend's
forward block is torch's fused CPU kernel (sdpa_lse.py), the triton backend's both directions
hpctrain's kernels (ops/triton_attention_block.py); context/backends.py picks them.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Block:
    """One non-empty (query chunk, key chunk) block: the chunks' document ids and whether it
    is a diagonal block (the same chunk: causal inside) or an earlier key chunk (every key
    precedes every query). Kernels build the mask from these inside their tiles; `mask_BCC`,
    the B×C×C boolean mask, is formed only for the eager and sdpa math that reads it."""

    ids_q_BC: torch.Tensor
    ids_k_BC: torch.Tensor
    diagonal: bool

    @cached_property
    def mask_BCC(self) -> torch.Tensor:
        mask_BCC = self.ids_q_BC[:, :, None] == self.ids_k_BC[:, None, :]
        if self.diagonal:
            C = mask_BCC.shape[-1]
            mask_BCC = mask_BCC & torch.ones(C, C, dtype=torch.bool,
                                             device=mask_BCC.device).tril()
        return mask_BCC


class BlockCache:
    """What `build` derives from a block's document ids (a flex BlockMask, flash-attn's
    segments), built once per micro-batch and reused by every layer and the backward. Keyed by
    the ids' memory; the cache holds the ids, so that memory cannot be reused by other ids while
    their entry lives. A rank's micro-batch has 4·cp blocks (two query chunks × 2·cp key chunks)."""

    def __init__(self, build: Callable[[Block], object], size: int = 64):
        self.build, self.size = build, size
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()

    def get(self, block: Block):
        ids_q, ids_k = block.ids_q_BC, block.ids_k_BC
        key = (ids_q.data_ptr(), ids_k.data_ptr(), ids_q.shape, ids_q.stride(), ids_k.stride(),
               str(ids_q.device), block.diagonal)
        if key not in self.entries:
            self.entries[key] = (ids_q, ids_k, self.build(block))
            if len(self.entries) > self.size:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        return self.entries[key][2]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are computed and merged in: fp32 for 16-bit inputs, else their own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def _up(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(compute_dtype(x.dtype)) for x in xs)


def _expand(x_BKCH: torch.Tensor, n_heads: int) -> torch.Tensor:
    groups = n_heads // x_BKCH.shape[1]
    return x_BKCH if groups == 1 else x_BKCH.repeat_interleave(groups, dim=1)


def _fold(dx_BNCH: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum the gradient of repeated kv heads back onto the K heads (GQA)."""
    B, N, C, H = dx_BNCH.shape
    return dx_BNCH.view(B, kv_heads, N // kv_heads, C, H).sum(2)


def _scores(q_BNCH, k_BKCH, mask_BCC):
    s_BNCC = q_BNCH @ _expand(k_BKCH, q_BNCH.shape[1]).transpose(-1, -2)
    s_BNCC = s_BNCC / math.sqrt(q_BNCH.shape[-1])
    return s_BNCC.masked_fill(~mask_BCC[:, None], float("-inf"))


def block_forward(q_BNCH, k_BKCH, v_BKCH, block: Block):
    """(o_BNCH, lse_BNC) of one block; rows the mask empties get o = 0, lse = −inf."""
    q_BNCH, k_BKCH, v_BKCH = _up(q_BNCH, k_BKCH, v_BKCH)
    s_BNCC = _scores(q_BNCH, k_BKCH, block.mask_BCC)
    lse_BNC = torch.logsumexp(s_BNCC, dim=-1)
    p_BNCC = torch.exp(s_BNCC - torch.where(lse_BNC.isinf(), 0, lse_BNC)[..., None])
    return p_BNCC @ _expand(v_BKCH, q_BNCH.shape[1]), lse_BNC


def merge(o_BNCH, lse_BNC, o2_BNCH, lse2_BNC):
    """The online-softmax merge of two partial results (lse_BNC finite: the first partial
    always holds the diagonal block, where every query sees itself)."""
    lse = torch.logaddexp(lse_BNC, lse2_BNC)
    w_BNC, w2_BNC = torch.exp(lse_BNC - lse), torch.exp(lse2_BNC - lse)
    return o_BNCH * w_BNC[..., None] + o2_BNCH * w2_BNC[..., None], lse


def block_backward(q_BNCH, k_BKCH, v_BKCH, block: Block, do_BNCH, o_BNCH, lse_BNC, d_BNC):
    """(dq_BNCH, dk_BKCH, dv_BKCH) of one block given the final lse and D of its rows (their
    final O, which a kernel that forms D itself reads, is not needed here)."""
    q_BNCH, k_BKCH, v_BKCH, do_BNCH = _up(q_BNCH, k_BKCH, v_BKCH, do_BNCH)
    N, K = q_BNCH.shape[1], k_BKCH.shape[1]
    p_BNCC = torch.exp(_scores(q_BNCH, k_BKCH, block.mask_BCC) - lse_BNC[..., None])
    dv_BNCH = p_BNCC.transpose(-1, -2) @ do_BNCH
    dp_BNCC = do_BNCH @ _expand(v_BKCH, N).transpose(-1, -2)
    ds_BNCC = p_BNCC * (dp_BNCC - d_BNC[..., None]) / math.sqrt(q_BNCH.shape[-1])
    dq_BNCH = ds_BNCC @ _expand(k_BKCH, N)
    dk_BNCH = ds_BNCC.transpose(-1, -2) @ q_BNCH
    return dq_BNCH, _fold(dk_BNCH, K), _fold(dv_BNCH, K)
