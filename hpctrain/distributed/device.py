"""The one place that talks to accelerator runtimes (CUDA today).

Library code asks this module for the device, its name and its memory counters; nothing else
calls `torch.cuda.*` directly, so adding another accelerator means editing only this file.
"""

from __future__ import annotations

import resource
import sys

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve_device_type(requested: str) -> str:
    """'auto' → 'cuda' when a CUDA device is visible, else 'cpu'."""
    if requested == "auto":
        return "cuda" if cuda_available() else "cpu"
    return requested


def local_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """The marketing name used to look up the peak FLOP/s ('NVIDIA H200', or the CPU)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """Peak bytes allocated by tensors on the device (CUDA), or the process's peak RSS (CPU).

    On CPU the RSS includes the interpreter and libraries; the trainer's tensor ledger gives
    the model-state bytes exactly.
    """
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
