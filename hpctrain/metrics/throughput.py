"""Tokens/s and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per device / the device's dense bf16 peak, with model FLOPs from
`ModelConfig.flops_per_token` (6 per weight per token plus attention; no recomputation counted).
An unknown device (including any CPU) has no peak in the table: MFU is None, never a guess.
"""

from __future__ import annotations

import logging

from hpctrain.metrics.devices import lookup_device
from hpctrain.models.config import ModelConfig

log = logging.getLogger(__name__)


def peak_bf16_flops(device_name: str) -> float | None:
    spec = lookup_device(device_name)
    if spec is None:
        log.warning("no peak FLOP/s known for device %r: MFU is reported as null", device_name)
        return None
    return spec.bf16_flops


def mfu(model: ModelConfig, *, tokens_per_s: float, seq_len: int, n_devices: int,
        peak_flops: float | None) -> float | None:
    if peak_flops is None or tokens_per_s <= 0:
        return None
    achieved = model.flops_per_token(seq_len) * tokens_per_s / n_devices
    return achieved / peak_flops
