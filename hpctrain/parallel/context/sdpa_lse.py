"""The one place that calls a private torch op: torch's fused CPU attention with its log-sum-exp.

`torch.nn.functional.scaled_dot_product_attention` does not return the log-sum-exp that ring
attention needs to merge blocks; aten's `_scaled_dot_product_flash_attention_for_cpu` (torch
2.13) does, exactly in fp64. It is the per-block forward of the `sdpa` backend under cp on
CPU; other devices use the eager block (blocks.block_forward).

Legend: B batch, N query heads, K kv heads, C chunk length, H head dim.
"""

from __future__ import annotations

import torch

from hpctrain.parallel.context.blocks import Block, block_forward


def sdpa_block_forward(q_BNCH, k_BKCH, v_BKCH, block: Block):
    """(o_BNCH, lse_BNC) of one block, as blocks.block_forward: rows the mask empties get
    o = 0 and lse = −inf (the op itself reports lse = 0 for them)."""
    if q_BNCH.device.type != "cpu":
        return block_forward(q_BNCH, k_BKCH, v_BKCH, block)
    mask_BCC = block.mask_BCC
    groups = q_BNCH.shape[1] // k_BKCH.shape[1]
    k_BNCH = k_BKCH.repeat_interleave(groups, dim=1) if groups > 1 else k_BKCH
    v_BNCH = v_BKCH.repeat_interleave(groups, dim=1) if groups > 1 else v_BKCH
    bias_B1CC = torch.zeros(mask_BCC.shape, dtype=q_BNCH.dtype, device=q_BNCH.device)
    bias_B1CC = bias_B1CC.masked_fill(~mask_BCC, float("-inf"))[:, None]
    o_BNCH, lse_BNC = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BNCH, k_BNCH, v_BNCH, 0.0, False, attn_mask=bias_B1CC)[:2]
    empty_B1C = ~mask_BCC.any(-1)[:, None]
    return o_BNCH, lse_BNC.masked_fill(empty_B1C, float("-inf"))
