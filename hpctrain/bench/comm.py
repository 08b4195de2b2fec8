"""`bench=comm`: collective time, algorithm and bus bandwidth over a message-size sweep.

Definitions follow nccl-tests (PERFORMANCE.md). `size` is the bytes of the whole buffer (the
output of all_gather, the input of reduce_scatter and all_to_all), algbw = size / time and
busbw = algbw × factor(n), the rate each link must sustain, comparable across collectives:

    all_reduce                             2(n−1)/n
    all_gather, reduce_scatter, all_to_all  (n−1)/n
    broadcast                               1

Each (collective, size) is first run once on rank-dependent values and checked against the
closed form, then timed on a separate buffer. Groups: the mesh's named groups that `bench.groups`
asks for (hpctrain.distributed.dims.GROUP_NAMES: the world, every axis, HSDP's shard and
replicate groups, the expert-parallel groups where MoE runs its all-to-all), each of more than
one rank and less than the world (that is the world group), and each set of ranks once: a
group equal to an earlier one (dp_cp at cp = 1, shard without HSDP) is not timed twice.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from hpctrain.bench.timing import TORCH_DTYPES, node_name, slow_factor_for, stem, timed
from hpctrain.config.bench import BenchConfig
from hpctrain.distributed.dims import GROUP_NAMES
from hpctrain.distributed.mesh import Mesh

log = logging.getLogger(__name__)

BUSBW_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}
# torch ≥ 2.13 renames the tensor collectives to *_single; older releases have only the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bus_bandwidth(collective: str, algbw: float, n: int) -> float:
    """nccl-tests' bus bandwidth for `collective` over `n` ranks (same unit as algbw)."""
    if collective not in BUSBW_FACTORS:
        raise ValueError(f"unknown collective {collective!r}; known: {', '.join(BUSBW_FACTORS)}")
    return algbw * BUSBW_FACTORS[collective](n)


def bench_groups(mesh: Mesh, wanted: tuple[str, ...]) -> list[tuple[str, Any, list[int]]]:
    """(name, process group, global ranks) of each wanted group of the mesh, in GROUP_NAMES
    order (module docstring says which are left out)."""
    world, seen, out = mesh.dims.world_size, set(), []
    for name in (n for n in GROUP_NAMES if n in wanted):
        ranks = mesh.ranks(name)
        if tuple(ranks) in seen or (name != "world" and not 1 < len(ranks) < world):
            continue
        seen.add(tuple(ranks))
        out.append((name, mesh.group(name), ranks))
    return out


def _buffers(collective: str, numel: int, n: int, dtype, device):
    """(input, output) for one call; numel is the size of the whole buffer in elements."""
    shard = numel // n
    if collective == "all_gather":
        return torch.zeros(shard, dtype=dtype, device=device), torch.zeros(numel, dtype=dtype,
                                                                            device=device)
    if collective == "reduce_scatter":
        return torch.zeros(numel, dtype=dtype, device=device), torch.zeros(shard, dtype=dtype,
                                                                            device=device)
    out = torch.zeros(numel, dtype=dtype, device=device)
    return torch.zeros(numel, dtype=dtype, device=device), out


def _call(collective: str, inp, out, group, src: int):
    """A zero-argument callable running one collective (in place where nccl-tests is)."""
    ops = {
        "all_reduce": lambda: dist.all_reduce(inp, group=group),
        "all_gather": lambda: _all_gather(out, inp, group=group),
        "reduce_scatter": lambda: _reduce_scatter(out, inp, group=group),
        "all_to_all": lambda: dist.all_to_all_single(out, inp, group=group),
        "broadcast": lambda: dist.broadcast(inp, src=src, group=group),
    }
    return ops[collective]


def _inputs_and_expected(collective: str, numel: int, n: int, r: int):
    """Rank-dependent float64 inputs and the closed-form result on group rank r."""
    i = torch.arange(numel, dtype=torch.float64)
    shard = numel // n
    j = torch.arange(shard, dtype=torch.float64)
    chunk_of = torch.div(i, shard, rounding_mode="floor")
    if collective == "all_reduce":
        return (r + 1) + i % 5, n * (n + 1) / 2 + n * (i % 5)
    if collective == "all_gather":
        return (r + 1) + j % 3, (chunk_of + 1) + (i % shard) % 3
    if collective == "reduce_scatter":
        return (r + 1) + i % 7, n * (n + 1) / 2 + n * ((r * shard + j) % 7)
    if collective == "all_to_all":
        return r * n + chunk_of, chunk_of * n + r
    expected = 1 + i % 9  # broadcast from group rank 0
    return (expected if r == 0 else torch.zeros(numel, dtype=torch.float64)), expected


def check_result(collective: str, numel: int, group, src: int, dtype, device) -> bool:
    """Run `collective` once on known values; True if the result equals the closed form."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    values, expected = _inputs_and_expected(collective, numel, n, r)
    inp, out = _buffers(collective, numel, n, dtype, device)
    inp.copy_(values.to(dtype))
    _call(collective, inp, out, group, src)()
    result = inp if collective in ("all_reduce", "broadcast") else out
    rtol = 0.0 if dtype == torch.float32 else 1e-2
    return bool(torch.allclose(result.double().cpu(), expected, rtol=rtol, atol=0.0))


def _measure(collective: str, size: int, group, ranks: list[int], b: BenchConfig,
             mesh: Mesh, slow: float) -> dict[str, Any]:
    dtype, n = TORCH_DTYPES[b.dtype], len(ranks)
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(n, size // elem // n * n)  # whole elements, a multiple of n
    src = ranks[0]
    correct = check_result(collective, numel, group, src, dtype, mesh.device)
    inp, out = _buffers(collective, numel, n, dtype, mesh.device)
    dist.barrier(group=group)
    seconds = timed(_call(collective, inp, out, group, src), iters=b.iters, warmup=b.warmup,
                    device=mesh.device, slow_factor=slow)
    nbytes = numel * elem
    algbw = nbytes / seconds / 1e9
    return {"bytes": nbytes, "time_s": seconds, "algbw_GBps": algbw,
            "busbw_GBps": bus_bandwidth(collective, algbw, n), "correct": correct}


def _unsupported(err: Exception) -> bool:
    """A backend refusing an op (reported as such), as opposed to a failure (re-raised)."""
    text = str(err).lower()
    return isinstance(err, NotImplementedError) or "support" in text or "implement" in text


def run_comm(b: BenchConfig, mesh: Mesh) -> list[dict[str, Any]]:
    """Every collective × group × size on this rank; one record per measurement."""
    node = node_name()
    slow = slow_factor_for(b, rank=mesh.rank, node=node)
    records = []
    for label, group, ranks in bench_groups(mesh, b.groups):
        for collective in b.collectives:
            base = stem("comm", rank=mesh.rank, node=node, collective=collective, group=label,
                        group_ranks=ranks, n=len(ranks), dtype=b.dtype)
            for size in b.sizes():
                try:
                    result = _measure(collective, size, group, ranks, b, mesh, slow)
                except (RuntimeError, NotImplementedError) as err:
                    if not _unsupported(err):
                        raise
                    log.warning("%s over %s is not supported here: %s", collective, label, err)
                    records.append({**base, "supported": False, "error": str(err)[:200]})
                    break
                records.append({**base, "supported": True, **result})
    return records
