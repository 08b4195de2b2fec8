"""The per-block math of ring and all-gather attention for each `model.attention` backend.

A block function pair is (forward(q, k, v, block) → (o, lse), backward(q, k, v, block, dO,
lse, D) → (dq, dk, dv)), with `block` a blocks.Block. `eager` uses the eager math of
blocks.py; `sdpa` torch's fused CPU forward (sdpa_lse.py) with the eager backward; `triton`
hpctrain's FlashAttention-2 kernels in both directions (ops/triton_attention_block.py), which
build each block's mask from the chunks' document ids inside their tiles and never hold a C×C
score matrix or mask (ring.block_mask skips empty blocks from the chunk indices and document
boundaries; only the eager and sdpa math form Block.mask_BCC); `flex` torch's flex_attention
with a BlockMask per block and the log-sum-exp it returns, its backward through flex's own
(flex_block.py). `flash` has no block form: refused under cp (BLOCK_BACKENDS,
hpctrain.validate_cp says why).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hpctrain.ops.triton_attention_block import triton_block_backward, triton_block_forward
from hpctrain.parallel.context.blocks import Block, block_backward, block_forward
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


def triton_backward(q_BNCH, k_BKCH, v_BKCH, block: Block, do_BNCH, lse_BNC, d_BNC):
    """(dq_BNCH, dk_BKCH, dv_BKCH) of `block` by hpctrain's Triton backward kernels."""
    return triton_block_backward(q_BNCH, k_BKCH, v_BKCH, do_BNCH, lse_BNC, d_BNC,
                                 **_kernel_ids(block))


BlockFns = tuple[Callable[..., tuple[torch.Tensor, torch.Tensor]], Callable[..., tuple]]


# Backends whose own math runs each block of the ring (eager's is the reference). flash has
# no block form: hpctrain.validate_cp refuses it under cp instead of running the eager math
# behind the user's back (it stores each block's C×C scores).
BLOCK_BACKENDS = ("eager", "sdpa", "triton", "flex")


def block_functions(backend: str) -> BlockFns:
    """(forward, backward) per block for `model.attention=backend`."""
    if backend == "triton":
        return triton_forward, triton_backward
    if backend == "sdpa":
        return sdpa_block_forward, block_backward
    if backend == "flex":
        return flex_block_forward, flex_block_backward
    return block_forward, block_backward
