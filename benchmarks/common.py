"""Shared pieces of the side-by-side benchmarks: rank spawning, the benchmark model, an
nn.Linear copy of it for torch's own parallel APIs, storage-deduplicated memory and a
byte-counting dispatch mode for collectives.

Ranks are spawned (not forked), run 1 thread each and rendezvous through a FileStore in a temp
dir; rank 0 returns its result through a JSON file.
"""

from __future__ import annotations

import copy
import ctypes
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from hpctrain.distributed.teardown import close_process_groups  # noqa: E402
from hpctrain.models import ModelConfig  # noqa: E402
from hpctrain.ops.linear import Linear  # noqa: E402


def bench_config(*, layers: int = 4, dim: int = 256, seq: int = 128) -> ModelConfig:
    """A Llama-style model of a few million parameters: 4 heads, 2 kv heads (GQA), SwiGLU."""
    return ModelConfig("bench", 512, dim, layers, 4, 2, int(2.75 * dim), seq)


def _entry(rank: int, world: int, store_path: str, fn, args, out_path: str,
           timeout_s: float = 120.0) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # deprecation chatter from gloo/DTensor on every call
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    finished = False
    try:
        result = fn(rank, world, args)
        if rank == 0:
            Path(out_path).write_text(json.dumps(result))
        finished = True
    finally:
        close_process_groups(clean=finished)


def spawn(fn, args, *, world: int = 2, timeout_s: float = 120.0) -> dict:
    """Run fn(rank, world, args) on `world` spawned gloo ranks (collectives time out after
    `timeout_s`); return rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        torch.multiprocessing.spawn(_entry, args=(world, os.path.join(tmp, "store"), fn, args,
                                                  out, timeout_s), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def status_bytes(key: str) -> int:
    """A `/proc/self/status` size (VmRSS, VmHWM, RssAnon, ...) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def measure_phase(fn, *, collective: bool = True):
    """(fn(), seconds, peak resident bytes over those when it began, peak resident bytes).
    Freed heap is returned first (malloc_trim) and the high-water mark reset (VmHWM := VmRSS
    through /proc/self/clear_refs), so the peak is this phase's own. `collective`: ranks
    start and end together (barriers outside the timed part)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    if collective:
        dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    start = status_bytes("VmRSS")
    t0 = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - t0
    if collective:
        dist.barrier()
    peak = status_bytes("VmHWM")
    return result, seconds, peak - start, peak


def to_nn_linear(model: nn.Module) -> nn.Module:
    """A deep copy of `model` whose hpctrain Linears are torch.nn.Linear (same weights)."""
    model = copy.deepcopy(model)
    for name, m in list(model.named_modules()):
        if type(m) is Linear:
            new = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            with torch.no_grad():
                new.weight.copy_(m.weight)
                if m.bias is not None:
                    new.bias.copy_(m.bias)
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor → its shard


def state_bytes(params, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states, each storage counted once."""
    seen: set[int] = set()

    def count(tensors) -> int:
        total = 0
        for t in tensors:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            s = _local(t).untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        return total

    params = list(params)
    out = {"params": count(params), "grads": count(p.grad for p in params)}
    out["optim"] = count(v for st in optimizer.state.values() for v in st.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    out["total"] = sum(out.values())
    return out


class CollectiveBytes(TorchDispatchMode):
    """Bytes this rank sends in collectives seen by the dispatcher, by the ring formulas that
    hpctrain's CommCounter uses: all-reduce 2(p−1)/p·n, all-gather (p−1)/p·out,
    reduce-scatter (p−1)/p·in. Counts torch functional collectives (DTensor) and c10d ops.
    Sizes are the local tensors that reach the collective (DTensor shards)."""

    def __init__(self, world: int):
        super().__init__()
        self.p, self.bytes, self.counts = world, {}, {}

    def _add(self, kind: str, nbytes: float) -> None:
        self.bytes[kind] = self.bytes.get(kind, 0) + int(nbytes)
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into collectives first (as CommDebugMode)
        kwargs = kwargs or {}
        name, p = func.name(), self.p
        nb = lambda t: t.numel() * t.element_size()  # noqa: E731
        if name in ("_c10d_functional::all_reduce", "_c10d_functional::all_reduce_"):
            self._add("all_reduce", 2 * (p - 1) / p * nb(args[0]))
        elif name == "_c10d_functional::all_gather_into_tensor":
            self._add("all_gather", (p - 1) * nb(args[0]))
        elif name == "_c10d_functional::reduce_scatter_tensor":
            self._add("reduce_scatter", (p - 1) / p * nb(args[0]))
        elif name.startswith("_c10d_functional::all_to_all"):
            self._add("all_to_all", (p - 1) / p * nb(args[0]))
        elif name == "c10d::allreduce_":
            self._add("all_reduce", 2 * (p - 1) / p * sum(nb(t) for t in args[0]))
        elif name == "c10d::_allgather_base_":
            self._add("all_gather", (p - 1) / p * nb(args[0]))
        elif name == "c10d::_reduce_scatter_base_":
            self._add("reduce_scatter", (p - 1) / p * nb(args[1]))
        return func(*args, **kwargs)


def median(xs) -> float:
    return statistics.median(xs)
