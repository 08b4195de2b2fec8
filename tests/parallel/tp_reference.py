"""Shared helpers for the tensor-parallel tests: meshes and slicing full tensors per rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.dims import ParallelDims
from hpctrain.distributed.mesh import build_mesh


def tp_group():
    """The tp group of a world where every rank is on the tp axis."""
    dims = ParallelDims(tp=dist.get_world_size())
    return build_mesh(dims, rank=dist.get_rank(), device=torch.device("cpu")).group("tp")


def shard(full: torch.Tensor, dim: int, *, index: int | None = None, n: int | None = None):
    index = dist.get_rank() if index is None else index
    n = dist.get_world_size() if n is None else n
    return full.chunk(n, dim=dim)[index]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())
