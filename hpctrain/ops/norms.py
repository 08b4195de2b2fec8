"""RMSNorm: y = x / sqrt(mean(x²) + eps) · g, computed in at least fp32 and cast back
(fp64 inputs stay fp64, so fp64 reference comparisons are not limited to fp32 rounding)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        x32 = x_BLD.to(torch.promote_types(x_BLD.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(x32.dtype)).to(x_BLD.dtype)
