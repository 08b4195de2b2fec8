"""`task=bench` on every rank: run the chosen benchmark, gather records, report on one rank.

The report rank is the logging rank of the layout (dp=0, tp=0, last pipeline stage; rank 0
without pipelining), the one that owns W&B in a training run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from hpctrain.bench.comm import run_comm
from hpctrain.bench.gemm import run_gemm
from hpctrain.bench.p2p import run_p2p
from hpctrain.bench.report import write_report
from hpctrain.bench.train import run_train
from hpctrain.config.bench import BenchConfig, bench_config
from hpctrain.config.schema import Config
from hpctrain.distributed.mesh import Mesh


def _runners():
    return {"comm": lambda b, mesh, cfg: run_comm(b, mesh),
            "p2p": lambda b, mesh, cfg: run_p2p(b, mesh),
            "gemm": run_gemm, "train": run_train}


def measure(b: BenchConfig, mesh: Mesh, cfg: Config) -> list[dict[str, Any]]:
    return _runners()[b.name](b, mesh, cfg)


def run_bench(cfg: Config, mesh: Mesh) -> dict[str, Any]:
    b = bench_config(cfg.extra)
    records = measure(b, mesh, cfg)
    world = mesh.dims.world_size
    dst = next(r for r in range(world) if mesh.dims.is_logging_rank(r))
    gathered: list[Any] | None = [None] * world if mesh.rank == dst else None
    dist.gather_object(records, gathered, dst=dst)
    if mesh.rank != dst:
        return {}
    flat = [r for per_rank in gathered for r in per_rank]
    return write_report(flat, b=b, cfg=cfg, run_dir=Path(cfg.run_dir))
