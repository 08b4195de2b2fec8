"""Rotary position embedding (RoPE), the rotate-half form used by Llama.

Legend: B batch, N heads, L sequence, H head dim. Pairs (i, i + H/2) of each head are rotated
by angle pos · θ^(−2i/H). A token's position is its index in the row, or — in packed rows —
its offset inside its own document (ops/documents.py), so every document starts at 0.
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_len: int, *, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_LH, sin_LH in fp64 for positions 0..max_len-1 (cast to the activation dtype on use)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles_LH2 = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles_LH = torch.cat([angles_LH2, angles_LH2], dim=-1)
    return angles_LH.cos(), angles_LH.sin()


def rope_at(tables: tuple[torch.Tensor, torch.Tensor],
            positions_BL: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (cos, sin) of this batch's tokens: the tables themselves (position = row index;
    `apply_rope` takes the first L), or B×1×L×H for per-token `positions_BL`. Computed once
    per forward and shared by every layer."""
    cos_LH, sin_LH = tables
    if positions_BL is None:
        return cos_LH, sin_LH
    return cos_LH[positions_BL][:, None], sin_LH[positions_BL][:, None]


def apply_rope(x_BNLH: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by the angles (cos, sin) of `rope_at` (cast to x's dtype)."""
    half = x_BNLH.shape[-1] // 2
    x1, x2 = x_BNLH[..., :half], x_BNLH[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    if cos.dim() == 2:  # a table by row index: positions 0..L-1
        L = x_BNLH.shape[-2]
        cos, sin = cos[:L], sin[:L]
    elif cos.shape[-2] != x_BNLH.shape[-2]:
        raise ValueError(f"document positions for {cos.shape[-2]} tokens, but the row has "
                         f"{x_BNLH.shape[-2]}: build the Documents from this batch's tokens")
    return x_BNLH * cos.to(x_BNLH.dtype) + rotated * sin.to(x_BNLH.dtype)
