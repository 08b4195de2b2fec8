"""The `bench` group (task=bench): a typed BenchConfig and its checks.

`cfg.extra["bench"]` holds the composed group as a plain dict; `bench_config` turns it into a
frozen BenchConfig (unknown keys rejected with a suggestion) and `check_bench` lists every
mistake with the value and the fix, so a bad sweep fails before any rank starts.

Fault injection: `slow_ranks` / `slow_nodes` make those ranks run every timed operation
`slow_factor`× slower (each op is followed by a sleep of (factor − 1) × its own duration).
It exists to check, on a healthy cluster, that the outlier logic names the node it should.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from hpctrain.config.build import build
from hpctrain.config.rule import check
from hpctrain.config.schema import Config
from hpctrain.distributed.device import resolve_device_type

Bench = Literal["comm", "p2p", "gemm", "train"]
Collective = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"]
# the mesh's named groups (hpctrain.distributed.dims.GROUP_NAMES) a comm benchmark can time
AxisGroup = Literal["world", "tp", "cp", "dp", "pp", "shard", "replicate", "ep"]
GemmPrecision = Literal["fp32", "tf32", "bf16", "fp16"]
BENCHES = typing.get_args(Bench)
COLLECTIVES = typing.get_args(Collective)
GROUPS = typing.get_args(AxisGroup)


@dataclass(frozen=True)
class BenchConfig:
    """The `bench` group. comm: collectives over the world and each parallel axis group;
    p2p: latency and bandwidth between every ordered pair of ranks; gemm: matmul throughput
    (the model's projections and a square sweep); train: a few steps of the real trainer."""

    name: Bench = "comm"
    collectives: tuple[Collective, ...] = COLLECTIVES
    groups: tuple[AxisGroup, ...] = GROUPS  # comm: groups of the layout, 1 < size < world only
    # (shard/replicate: HSDP's; ep: the expert-parallel groups, where MoE runs its all-to-all)
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"  # comm/p2p buffers (fp16: not on CPU)
    min_bytes: int = 1024  # sweep: powers of two from min_bytes (p2p: the latency message)...
    max_bytes: int = 16 * 2**20  # ... up to this cap (16 MiB; 1-8 GiB on GPU clusters)
    iters: int = 20  # timed calls per measurement (train: timed steps)
    warmup: int = 5  # untimed calls first
    gemm_min_dim: int = 128  # gemm square sweep: powers of two from here ...
    gemm_max_dim: int = 2048  # ... up to this (8192+ on GPUs)
    precisions: tuple[GemmPrecision, ...] = ()  # () → the device's (cpu: fp32, bf16)
    outlier_fraction: float = 0.8  # name ranks/nodes/links below this × their peers' median
    slow_ranks: tuple[int, ...] = ()  # fault injection: see the module docstring
    slow_nodes: tuple[str, ...] = ()
    slow_factor: float = 1.0  # 1.0: injection off

    def sizes(self) -> list[int]:
        """Message sizes in bytes: min_bytes, 2·min_bytes, … up to max_bytes."""
        out, size = [], self.min_bytes
        while size <= self.max_bytes:
            out.append(size)
            size *= 2
        return out

    def is_slow(self, *, rank: int, node: str) -> bool:
        return self.slow_factor > 1 and (rank in self.slow_ranks or node in self.slow_nodes)


def bench_config(extra: dict[str, Any]) -> BenchConfig:
    return build(BenchConfig, "bench", extra.get("bench") or {})


def default_precisions(device_type: str) -> tuple[str, ...]:
    return ("fp32", "tf32", "bf16", "fp16") if device_type == "cuda" else ("fp32", "bf16")


def _ranges(b: BenchConfig, world: int) -> list[str]:
    errs = [f"bench.{k}={v} must be > 0: set it to 1 or more" for k, v in
            {"min_bytes": b.min_bytes, "iters": b.iters, "gemm_min_dim": b.gemm_min_dim}.items()
            if v <= 0]
    if b.max_bytes < b.min_bytes:
        errs.append(f"bench.max_bytes={b.max_bytes} < bench.min_bytes={b.min_bytes}: "
                    "raise max_bytes or lower min_bytes")
    if b.gemm_max_dim < b.gemm_min_dim:
        errs.append(f"bench.gemm_max_dim={b.gemm_max_dim} < bench.gemm_min_dim={b.gemm_min_dim}: "
                    "raise gemm_max_dim or lower gemm_min_dim")
    if b.warmup < 0:
        errs.append(f"bench.warmup={b.warmup} must be >= 0: set it to 0 (no warmup) or more")
    if not 0 < b.outlier_fraction <= 1:
        errs.append(f"bench.outlier_fraction={b.outlier_fraction} must be in (0, 1], e.g. 0.8")
    if b.slow_factor < 1:
        errs.append(f"bench.slow_factor={b.slow_factor} must be >= 1 (1 disables injection)")
    bad = [r for r in b.slow_ranks if not 0 <= r < world]
    if bad:
        errs.append(f"bench.slow_ranks={list(b.slow_ranks)} has ranks outside 0..{world - 1}: "
                    "list ranks of this job only")
    return errs


def _device_errors(b: BenchConfig, device_type: str) -> list[str]:
    if device_type == "cuda":
        return []
    errs = []
    if "tf32" in b.precisions:
        errs.append("bench.precisions has 'tf32', which exists only on CUDA: drop it on CPU")
    if "fp16" in b.precisions or b.dtype == "fp16":
        errs.append("fp16 on CPU is ~100× slower than bf16: use bf16 or fp32 in "
                    "bench.precisions / bench.dtype")
    return errs


@check("bench", "cluster.", "parallel.")
def check_bench(c: Config) -> list[str]:
    """The bench group: given for task=bench, its keys known and in range, the device's
    precisions."""
    if c.task != "bench":  # the group is always composed (sweeps need it); only bench reads it
        return []
    if not c.extra.get("bench"):
        return ["task=bench needs a benchmark: add bench=comm (or p2p, gemm, train)"]
    try:
        b = bench_config(c.extra)
    except ValueError as err:
        return [str(err)]
    errs = _ranges(b, c.cluster.world_size)  # choices: the Literal fields, checked by build
    return errs + _device_errors(b, resolve_device_type(c.cluster.device))


def needs_data(extra: dict[str, Any]) -> bool:
    """Only the training benchmark reads the token cache (`extra`: the config's extra groups)."""
    return bench_config(extra).name == "train"


def bench_trains(extra: dict[str, Any]) -> bool:
    """bench=train runs the trainer (a backward); the others time collectives and GEMMs. A bad
    bench group is check_bench's to report: False here."""
    try:
        return needs_data(extra)
    except ValueError:
        return False
