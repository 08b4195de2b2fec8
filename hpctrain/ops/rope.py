"""Rotary position embedding (RoPE), the rotate-half form used by Llama.

Legend: B batch, N heads, L sequence, H head dim. Pairs (i, i + H/2) of each head are rotated
by angle pos · θ^(−2i/H).
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_len: int, *, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_LH, sin_LH in fp64 for positions 0..max_len-1 (cast to the activation dtype on use)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles_LH2 = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles_LH = torch.cat([angles_LH2, angles_LH2], dim=-1)
    return angles_LH.cos(), angles_LH.sin()


def apply_rope(x_BNLH: torch.Tensor, cos_LH: torch.Tensor, sin_LH: torch.Tensor) -> torch.Tensor:
    half = x_BNLH.shape[-1] // 2
    x1, x2 = x_BNLH[..., :half], x_BNLH[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    L = x_BNLH.shape[-2]
    cos, sin = cos_LH[:L].to(x_BNLH.dtype), sin_LH[:L].to(x_BNLH.dtype)
    return x_BNLH * cos + rotated * sin
