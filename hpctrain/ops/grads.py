"""Helpers shared by hpctrain's linear autograd functions (`linear`, `fp8_linear`).

Autocast has no meta device (torch raises for it): on the dry run's meta tensors
(hpctrain.tasks.dryrun.rank) it is simply off."""

from __future__ import annotations

import contextlib

import torch


def autocast_enabled(device_type: str) -> bool:
    """torch.is_autocast_enabled, False on meta (module docstring)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str):
    """A scope with autocast disabled on `device_type` (nothing to disable on meta)."""
    if device_type == "meta":
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad in the parameter's dtype (set it when there is none yet)."""
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad += grad.to(param.dtype)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes in: autocast's when enabled on x's device, else x's."""
    device_type = x.device.type
    if autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype
