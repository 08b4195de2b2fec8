"""Two helpers shared by hpctrain's linear autograd functions (`linear`, `fp8_linear`)."""

from __future__ import annotations

import torch


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad in the parameter's dtype (set it when there is none yet)."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad += grad.to(param.dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes in: autocast's when enabled on x's device, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
