"""Rotary position embedding (RoPE), the rotate-half form used by Llama.

Legend: B batch, N heads, L sequence, H head dim. Pairs (i, i + H/2) of each head are rotated
by angle pos · θ^(−2i/H). A token's position is its index in the row, or — in packed rows —
its offset inside its own document (ops/documents.py), so every document starts at 0.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class RopeScaling(Protocol):
    """What the tables read of a scaling (hpctrain.models.config.RopeScaling: the math)."""

    type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_seq_len: int


def rope_tables(head_dim: int, max_len: int, *, theta: float,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_LH, sin_LH in fp64 for positions 0..max_len-1 (cast to the activation dtype on use),
    with `scaling`'s frequencies (`inv_frequencies`)."""
    inv_freq = inv_frequencies(head_dim, theta=theta, scaling=scaling)
    angles_LH2 = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    angles_LH = torch.cat([angles_LH2, angles_LH2], dim=-1)
    return angles_LH.cos(), angles_LH.sin()


def inv_frequencies(head_dim: int, *, theta: float,
                    scaling: RopeScaling | None = None) -> torch.Tensor:
    """inv_freq_i = θ^(−2i/H), i < H/2, in fp64, then `scaling`'s (None or type none: as is)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    if scaling is not None and scaling.type == "llama3":
        inv_freq = llama3_frequencies(inv_freq, scaling)
    return inv_freq


def llama3_frequencies(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling (the math is `RopeScaling`'s docstring)."""
    wavelen = 2 * math.pi / inv_freq
    context = s.original_max_seq_len
    blend = (context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * inv_freq / s.factor + blend * inv_freq
    out = torch.where(wavelen > context / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    medium = (wavelen >= context / s.high_freq_factor) & (wavelen <= context / s.low_freq_factor)
    return torch.where(medium, blended, out)


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
