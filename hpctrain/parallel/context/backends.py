"""The per-block math of ring and all-gather attention for each `model.attention` backend.

A block function pair is (forward(q, k, v, block) → (o, lse), backward(q, k, v, block, dO,
O, lse, D) → (dq, dk, dv)), with `block` a blocks.Block and O, lse, D the row's final ones.
- `eager`: the eager math of blocks.py (the reference; it forms Block.mask_BCC).
- `sdpa`: torch's fused CPU forward (sdpa_lse.py; on other devices the eager one), the eager
  backward.
- `triton`: hpctrain's FlashAttention-2 kernels in both directions
  (ops/triton_attention_block.py), which build each block's mask from the chunks' document ids
  inside their tiles and never hold a C×C score matrix or mask.
- `flex`: torch's flex_attention with a BlockMask per block and the log-sum-exp it returns, its
  backward through flex's own (flex_block.py).
- `flash`: flash-attn's variable-length kernels over segments from the document ids, the
  backward against the row's final O and lse (flash_block.py; CUDA, and a flash-attn whose
  private entry points hpctrain knows: hpctrain.config.validate.layout checks before launch).
ring.block_mask skips empty blocks from the chunk indices and document boundaries alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hpctrain.ops.triton_attention_block import triton_block_backward, triton_block_forward
from hpctrain.parallel.context.blocks import Block, block_backward, block_forward
from hpctrain.parallel.context.flash_block import flash_block_backward, flash_block_forward
from hpctrain.parallel.context.flex_block import flex_block_backward, flex_block_forward
from hpctrain.parallel.context.sdpa_lse import sdpa_block_forward


def _kernel_ids(block: Block) -> dict:
    """The kernels' view of `block`: ids None when one document covers the whole block of
    every row (the kernels then skip the mask wherever causality allows)."""
    first_BC = block.ids_q_BC[:, :1]
    one_doc = bool((block.ids_q_BC == first_BC).all() and (block.ids_k_BC == first_BC).all())
    ids_q, ids_k = (None, None) if one_doc else (block.ids_q_BC, block.ids_k_BC)
    return {"ids_q_BC": ids_q, "ids_k_BC": ids_k, "causal": block.diagonal}


def triton_forward(q_BNCH, k_BKCH, v_BKCH, block: Block):
    """(o_BNCH, lse_BNC) of `block` by hpctrain's Triton forward kernel."""
    return triton_block_forward(q_BNCH, k_BKCH, v_BKCH, **_kernel_ids(block))


def triton_backward(q_BNCH, k_BKCH, v_BKCH, block: Block, do_BNCH, o_BNCH, lse_BNC, d_BNC):
    """(dq_BNCH, dk_BKCH, dv_BKCH) of `block` by hpctrain's Triton backward kernels."""
    return triton_block_backward(q_BNCH, k_BKCH, v_BKCH, do_BNCH, lse_BNC, d_BNC,
                                 **_kernel_ids(block))


BlockFns = tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]], Callable[..., tuple]]


# Every model.attention backend's own math per block of the ring (eager's is the reference):
# none runs the eager math behind the user's back, which would store each block's C×C scores
# (tests/unit/test_cp_layout.py checks that every backend has its entry).
BLOCK_FUNCTIONS: dict[str, BlockFns] = {
    "eager": (block_forward, block_backward),
    "sdpa": (sdpa_block_forward, block_backward),
    "triton": (triton_forward, triton_backward),
    "flex": (flex_block_forward, flex_block_backward),
    "flash": (flash_block_forward, flash_block_backward),
}


def block_functions(backend: str) -> BlockFns:
    """(forward, backward) per block for `model.attention=backend`."""
    if backend not in BLOCK_FUNCTIONS:
        raise ValueError(f"model.attention={backend!r} has no block functions for ring attention;"
                         f" under parallel.cp use one of {', '.join(BLOCK_FUNCTIONS)}")
    return BLOCK_FUNCTIONS[backend]
