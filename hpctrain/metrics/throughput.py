"""Tokens/s, model FLOPs utilisation (MFU) and what a step's batch held.

MFU = achieved model FLOP/s per device / the device's dense bf16 peak, with model FLOPs from
`ModelConfig.training_flops` (6 per weight per token plus attention; no recomputation counted).
For a mixture of experts the weights are the active ones (router, top_k routed and shared
experts a token passes through), as Mixtral and DeepSeek report MFU; the run summary says so
(`parameter_counts`).
Only real tokens count: padding (targets = IGNORE_INDEX) is neither throughput nor FLOPs, and
attention FLOPs come from the real document lengths (Σ lᵢ² over the documents of packed rows,
L² per row without documents). An unknown device (including any CPU) has no peak in the table:
MFU is None, never a guess.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size
from hpctrain.metrics.devices import lookup_device
from hpctrain.models.config import ModelConfig
from hpctrain.ops.documents import IGNORE_INDEX, split_micro_batch

log = logging.getLogger(__name__)


def parameter_counts(model: ModelConfig) -> dict[str, int | str]:
    """The summary's counts: `params` (total); with routed experts also `params_active` (per
    token) and `mfu_flops` naming the FLOPs MFU counts."""
    out: dict[str, int | str] = {"params": model.num_params()}
    if model.moe.enabled:
        out.update(params_active=model.num_params(active=True),
                   mfu_flops="active (router + top_k routed + shared experts per token)")
    return out


def peak_bf16_flops(device_name: str) -> float | None:
    spec = lookup_device(device_name)
    if spec is None:
        log.warning("no peak FLOP/s known for device %r: MFU is reported as null", device_name)
        return None
    return spec.bf16_flops


def flops_utilization(flops_per_s: float, *, n_devices: int,
                      peak_flops: float | None) -> float | None:
    """Model FLOP/s of the whole job per device over the peak; None without a peak."""
    if peak_flops is None or flops_per_s <= 0:
        return None
    return flops_per_s / n_devices / peak_flops


@dataclass(frozen=True)
class BatchCounts:
    """What a set of micro-batches held: real tokens (not padding), slots (B·L summed),
    documents (padding excluded) and Σ lᵢ² of their real tokens per document."""

    tokens: int
    slots: int
    documents: int
    attended: int

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.tokens / self.slots if self.slots else 0.0

    def flops(self, model: ModelConfig) -> int:
        return model.training_flops(tokens=self.tokens, attended=self.attended)


def batch_counts(micro_batches, *, group, device: torch.device | None = None) -> BatchCounts:
    """Count `micro_batches` ((inputs, targets[, docs]) tuples), summed over `group` (the dp
    group: each rank holds its own share of the global batch; one small all-reduce on
    `device`, the mesh's)."""
    sums = torch.zeros(4, dtype=torch.float64)
    for micro in micro_batches:
        _, targets_BL, docs = split_micro_batch(micro)
        real_BL = (targets_BL != IGNORE_INDEX).cpu()
        ids_BL = (torch.zeros_like(targets_BL) if docs is None else docs.ids_BL).cpu()
        for ids_L, real_L in zip(ids_BL, real_BL, strict=True):
            per_doc = torch.bincount(ids_L[real_L]).double()
            per_doc = per_doc[per_doc > 0]
            sums += torch.stack([real_L.sum().double(), torch.tensor(float(len(ids_L))),
                                 torch.tensor(float(len(per_doc))), per_doc.pow(2).sum()])
    if group_size(group) > 1:
        reduced = sums.to(device)
        dist.all_reduce(reduced, group=group)
        sums = reduced.cpu()
    return BatchCounts(*(int(v) for v in sums.tolist()))
