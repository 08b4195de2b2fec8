"""What every benchmark shares: the node name, the timed loop, torch dtypes, the record stem."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from hpctrain.config.bench import BenchConfig
from hpctrain.distributed.device import synchronize

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "tf32": torch.float32}


def node_name() -> str:
    """The node as Slurm names it (what `--exclude=` needs), else the short hostname."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]


def stem(bench: str, *, rank: int, node: str, **fields: Any) -> dict[str, Any]:
    """The fields every record starts with: which benchmark, which rank on which node."""
    return {"bench": bench, "rank": rank, "node": node, **fields}


def timed(op: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
          slow_factor: float = 1.0) -> float:
    """Mean seconds per call of `op` over `iters` calls, after `warmup` untimed calls.

    With slow_factor > 1 (fault injection) each call is followed by a sleep of
    (slow_factor − 1) × its own duration, inside the timed window, so peers of a collective
    wait for this rank as they would for a genuinely slow one.
    """
    for _ in range(warmup):
        op()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        if slow_factor > 1:
            t_op = time.perf_counter()
            op()
            synchronize(device)
            time.sleep((slow_factor - 1) * (time.perf_counter() - t_op))
        else:
            op()
    synchronize(device)
    return (time.perf_counter() - t0) / iters


def slow_factor_for(b: BenchConfig, *, rank: int, node: str) -> float:
    return b.slow_factor if b.is_slow(rank=rank, node=node) else 1.0
