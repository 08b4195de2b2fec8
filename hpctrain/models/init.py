"""Deterministic, order-independent initialisation.

Each parameter draws from its own generator seeded by (seed, parameter name), so a pipeline
stage that builds only some layers, or a tensor-parallel rank that slices a full-size tensor,
gets exactly the values the single-process model has.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

from hpctrain.models.config import ModelConfig


def param_std(name: str, cfg: ModelConfig) -> float | None:
    """Normal std for a weight, or None for norm gains (ones). Residual-branch outputs are
    scaled by 1/√(2·layers) (GPT-2) so the residual stream's variance stays bounded."""
    if name.endswith("norm.weight"):
        return None
    if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        return 0.02 / math.sqrt(2 * cfg.n_layers)
    return 0.02


def full_init(name: str, shape: torch.Size, cfg: ModelConfig, *, seed: int) -> torch.Tensor:
    """The full-size fp32 initial value of parameter `name` (a pure function of its inputs):
    biases start at zero."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = param_std(name, cfg)
    if std is None:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen).mul_(std)  # in place: one full-size tensor


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig, *, seed: int) -> None:
    for name, p in model.named_parameters():
        p.copy_(full_init(name, p.shape, cfg, seed=seed).to(p.dtype))
