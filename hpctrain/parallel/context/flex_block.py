"""The `flex` backend's block of ring attention: torch's flex_attention on one (query chunk,
key chunk) block, with the log-sum-exp it returns.

Legend: B batch, N query heads, K kv heads, C chunk length, H head dim.
Forward: flex_attention with a BlockMask built from the block's document ids (same document,
and causal on the diagonal block), so its kernel skips every tile with no visible key and
never holds a C×C score matrix; a block of one document needs no ids (causal, or no mask).
The BlockMask of a block is reused by every layer of the micro-batch (blocks.BlockCache).

Backward, given the row's final lse and D = rowsum(dO ⊙ O): the block's output enters the
merged O with weight w = exp(lse_b − lse), and its lse_b through that weight, so
  dL/do_b = w · dO,   dL/dlse_b = w · (rowsum(dO ⊙ o_b) − D),
and autograd through flex's own backward (which takes a gradient for its lse) with these two
gives the block's (dq, dk, dv) — `autograd_block_backward`, exact for any differentiable block
forward (tests/unit/test_cp_layout.py checks it against blocks.block_backward with the eager
forward in fp64). flex has no backward on CPU (hpctrain.ops.attention_flex): training with it
is refused there before launch; its forward runs everywhere (evaluation under cp).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask
from torch.nn.attention.flex_attention import flex_attention as _flex

from hpctrain.ops.attention_flex import COMPILED_DTYPES, _compiled_flex
from hpctrain.parallel.context.blocks import Block, BlockCache, compute_dtype


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _build(block: Block) -> BlockMask | None:
    ids_q, ids_k, B, C = block.ids_q_BC, block.ids_k_BC, *block.ids_q_BC.shape
    first_BC = ids_q[:, :1]
    if bool((ids_q == first_BC).all() and (ids_k == first_BC).all()):  # one document
        return create_block_mask(_causal, None, None, C, C, device=str(ids_q.device)) \
            if block.diagonal else None

    if block.diagonal:
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (ids_q[b, q_idx] == ids_k[b, kv_idx])
    else:
        def mask(b, h, q_idx, kv_idx):
            return ids_q[b, q_idx] == ids_k[b, kv_idx]
    return create_block_mask(mask, B, None, C, C, device=str(ids_q.device))


block_mask_of = BlockCache(_build).get  # the BlockMask of a block (None: every key visible)


def flex_block_forward(q_BNCH, k_BKCH, v_BKCH, block: Block):
    """(o_BNCH, lse_BNC) of one block by flex_attention; rows the mask empties get o = 0 and
    lse = −inf. Compiled for fp32/bf16/fp16 (as the flex backend), the reference path in fp64."""
    kwargs = {"block_mask": block_mask_of(block), "enable_gqa": q_BNCH.shape[1] > k_BKCH.shape[1],
              "return_aux": AuxRequest(lse=True)}
    if q_BNCH.dtype in COMPILED_DTYPES:
        o_BNCH, aux = _compiled_flex()(q_BNCH, k_BKCH, v_BKCH, **kwargs)
    else:
        with warnings.catch_warnings():  # the unfused path is chosen on purpose (fp64)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            o_BNCH, aux = _flex(q_BNCH, k_BKCH, v_BKCH, **kwargs)
    return o_BNCH, aux.lse.to(compute_dtype(q_BNCH.dtype))


def autograd_block_backward(forward: Callable) -> Callable:
    """A block backward (q, k, v, block, dO, lse, D) → (dq, dk, dv) from a differentiable block
    forward, by the chain rule of the module docstring."""

    def backward(q_BNCH, k_BKCH, v_BKCH, block: Block, do_BNCH, o_BNCH, lse_BNC, d_BNC):
        with torch.enable_grad():
            inputs = [x.detach().requires_grad_() for x in (q_BNCH, k_BKCH, v_BKCH)]
            o_BNCH, lse_b_BNC = forward(*inputs, block)
            w_BNC = torch.exp(lse_b_BNC.detach().to(lse_BNC.dtype) - lse_BNC)
            g_o = (do_BNCH.to(w_BNC.dtype) * w_BNC[..., None]).to(o_BNCH.dtype)
            rows_BNC = (do_BNCH.to(w_BNC.dtype) * o_BNCH.detach().to(w_BNC.dtype)).sum(-1)
            g_lse = (w_BNC * (rows_BNC - d_BNC)).to(lse_b_BNC.dtype)
            return torch.autograd.grad((o_BNCH, lse_b_BNC), inputs, (g_o, g_lse))

    return backward


flex_block_backward = autograd_block_backward(flex_block_forward)
