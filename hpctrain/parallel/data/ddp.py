"""Bucketed, overlapped gradient reduction over the dp group.

Parameters are grouped into units (buckets of ≈ parallel.bucket_mb, in reverse order of
registration ≈ the order backward produces their gradients; under ZeRO-3 one unit per
transformer block). A post-accumulate-grad hook counts each unit's ready gradients; when the
last one lands, the unit's collective is issued asynchronously while backward continues:

  zero 0    all_reduce of the flat bucket (p.grad are views into it)
  zero 1    reduce_scatter of the flat bucket into this rank's grad shard: the bucket holds
            the full local gradients through accumulation (the difference from ZeRO-2), but
            only this rank's shard of their sum is needed, so ZeRO-1 sends what ZeRO-2 does
  zero 2/3  reduce_scatter into this rank's grad shard (full local grads are freed)

On gloo every reduce-scatter is an all-reduce of which the rank keeps its shard (`_scatters`).

Reduction is an explicit step: `no_sync()` (entered by the step for every micro-batch but the
last of an accumulation window) only accumulates locally; `finish()` issues whatever is left
(units with unused parameters), waits for every collective and divides by dp.

At ZeRO 2/3 a unit's gradients are packed into a transient flat buffer for its
reduce-scatter. Each unit issued waits for the ones before it and lands them (their reductions
have had a block's backward to finish), so one packed buffer is in flight at a time, not the
whole model's (measured on model=medium at dp 2: 2 GB of packed gradients alive at the end of
backward before), as FSDP2 keeps its reduce-scatters.

Hybrid sharding: `group` is the shard group and `replicas` the same shards' ranks in the other
replicas; each unit's reduced result (its full buffer at zero 0, else its grad shard) is then
all-reduced over `replicas` in fp32 (fp64 for fp64) before the division by dp = shard size ×
replicas. That all-reduce overlaps the rest of backward: when a unit is issued, the units
issued before it are waited for (their reductions have had a block's backward to finish),
landed and their replica all-reduces issued, in issue order, the same on every replica. (It
waits rather than asks: gloo's reduce-scatter reports itself complete only once waited on.)
`finish` lands the last ones and waits for every replica all-reduce.

Wire dtype: with grad_comm_dtype=fp32 the sum is exact in fp32 (fp64 for fp64 grads). With
bf16/fp16 on the wire, gradients are sent in 16 bits but summed in fp32: each rank all-gathers
the 16-bit buffers and adds them locally (gloo has no PREMUL_SUM or mixed-dtype reduce).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size
from hpctrain.parallel.data.units import FlatUnit

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _scatters(group) -> bool:
    """Reduce-scatter with the collective of that name (NCCL, and the dry run's groups) or, on
    gloo, as an all-reduce of which each rank keeps its shard: measured on 2 CPU ranks, gloo's
    reduce_scatter took 156 ms for 80 MB where an all-reduce took 69 ms (10.6 and 7.4 ms for
    8 MB), so ZeRO-1's reduce-scatter made its step 10% slower there than its all-reduce."""
    return dist.get_backend(group) != "gloo"


def size_groups(named: list[tuple[str, torch.nn.Parameter]], *, bucket_bytes: float,
                bytes_per_elem: int) -> list[list[tuple[str, torch.nn.Parameter]]]:
    """Consecutive groups of `named` (already in reduction order) of ≈ bucket_bytes each."""
    groups: list[list] = [[]]
    size = 0
    for name, p in named:
        if groups[-1] and size + p.numel() * bytes_per_elem > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, p))
        size += p.numel() * bytes_per_elem
    return [g for g in groups if g]


@dataclass
class _Pending:
    unit: FlatUnit
    work: dist.Work | None
    buf: torch.Tensor | None  # what the collective reduces into; None once landed
    target: torch.Tensor | None = None  # set once landed: the reduced values, before division
    replica_work: dist.Work | None = None  # HSDP: its all-reduce over the replicas


@dataclass
class GradReducer:
    units: list[FlatUnit]
    group: dist.ProcessGroup | None  # the dp group (None only without torch.distributed)
    zero: int
    comm_dtype: str = "fp32"
    on_unit_done: Callable[[FlatUnit], None] | None = None  # ZeRO-3 frees params here
    replicas: dist.ProcessGroup | None = None  # HSDP: all-reduce each result over these
    issue_times: list[tuple[int, float]] = field(default_factory=list)  # this step's only
    replica_times: list[tuple[int, float]] = field(default_factory=list)  # HSDP, this step's
    _sync: bool = True
    _ready: dict[int, int] = field(default_factory=dict)
    _issued: set[int] = field(default_factory=set)
    _pending: list[_Pending] = field(default_factory=list)
    _handles: list = field(default_factory=list)

    def __post_init__(self):
        self.dp = group_size(self.group)
        # The hooks hold the reducer weakly: a parameter's hooks live in its C++ grad
        # accumulator, which the garbage collector cannot see, so a strong reference would
        # make parameter → hook → reducer (or unit) → parameter a cycle never freed (nor the
        # process groups it holds, each with a polling gloo thread) once the trainer is gone.
        on_grad = weakref.WeakMethod(self._on_grad)

        def hook(k: int, i: int) -> None:
            reducer = on_grad()
            if reducer is not None:  # a reducer that is gone reduces nothing
                reducer(k, i)

        for k, unit in enumerate(self.units):
            for i, p in enumerate(unit.params):
                self._handles.append(p.register_post_accumulate_grad_hook(
                    lambda _p, k=k, i=i: hook(k, i)))

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; no collective is issued inside."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def _on_grad(self, k: int, i: int) -> None:
        unit = self.units[k]
        if unit.grad_full is not None:
            unit.adopt_grad(i)
        n = self._ready.get(unit.index, 0) + 1
        self._ready[unit.index] = n
        if n < len(unit.params):
            return
        self._ready[unit.index] = 0
        if self._sync:
            self._issue(unit)
        if self.on_unit_done is not None:
            self.on_unit_done(unit)

    def _acc_dtype(self, unit: FlatUnit) -> torch.dtype:
        return torch.promote_types(unit.dtype, torch.float32)

    def _issue(self, unit: FlatUnit) -> None:
        if not self._issued:  # the first bucket of a step: forget the previous step's times
            self.issue_times.clear()
            self.replica_times.clear()
        if unit.grad_full is None or group_size(self.replicas) > 1:
            self._land_issued()
        self._issued.add(unit.index)
        self.issue_times.append((unit.index, time.perf_counter()))
        acc = self._acc_dtype(unit)
        wire = WIRE_DTYPES.get(self.comm_dtype, acc)
        if unit.grad_full is not None:
            buf = unit.grad_full.to(wire)  # no copy when dtypes agree: reduced in place
        else:
            buf = unit.pack_grads(wire)
        group, dp = self._group_of(unit)
        if dp == 1:  # nothing to reduce: skip the collective
            self._pending.append(_Pending(unit, None, buf))
            return
        if wire != acc:  # 16-bit wire, fp32 sum: gather everyone's buffer
            out = torch.empty(dp * buf.numel(), dtype=wire, device=buf.device)
            work = dist.all_gather_single(out, buf, group=group, async_op=True)
        elif unit.layout.n_shards == 1 or not _scatters(group):  # zero 0, or gloo
            out, work = buf, dist.all_reduce(buf, group=group, async_op=True)
        else:
            out = torch.empty(unit.layout.shard_size, dtype=wire, device=buf.device)
            work = dist.reduce_scatter_single(out, buf, group=group, async_op=True)
        self._pending.append(_Pending(unit, work, out))

    def finish(self) -> None:
        """Issue units that never completed (unused parameters, or gradients that did not come
        through autograd: a pipeline's deferred weight gradients are assigned in its W actions,
        so no hook adopts them into the bucket), wait for all, average."""
        for unit in self.units:
            if unit.index not in self._issued:
                self._ready[unit.index] = 0
                unit.adopt_grads()
                unit.fill_missing_grads()
                self._issue(unit)
        self._land_issued()
        for pending in self._pending:
            if pending.replica_work is not None:
                pending.replica_work.wait()
            self._divide(pending)
        self._pending.clear()
        self._issued.clear()

    def _land_issued(self) -> None:
        """Land the units issued so far, in issue order (module docstring): at ZeRO 2/3 that
        frees their packed gradients, under HSDP it issues their replica all-reduces; `finish`
        lands the rest."""
        for pending in self._pending:
            if pending.target is None:
                if pending.work is not None:
                    pending.work.wait()
                    pending.work = None  # a Work holds its input (the packed buffer)
                self._land(pending)

    def _divide(self, pending: _Pending) -> None:
        unit = pending.unit
        divisor = unit.grad_divisor or self._group_of(unit)[1] * group_size(self.replicas)
        if divisor != 1:  # x / 1 is x: skip a pass over the bucket (dp=1, e.g. pp only)
            pending.target.div_(divisor)

    def _land(self, pending: _Pending) -> None:
        """The unit's reduced values into its gradient buffer; under HSDP its all-reduce over
        the replicas is issued (asynchronously)."""
        unit, buf = pending.unit, pending.buf
        acc = self._acc_dtype(unit)
        dp = self._group_of(unit)[1]
        sharded = unit.layout.n_shards > 1  # zero ≥ 1: only this rank's shard is reduced
        lo, hi = unit.layout.shard_range(unit.shard_rank)
        if dp > 1 and buf.dtype != acc:
            parts = buf.view(dp, unit.layout.padded_numel)
            buf = (parts[:, lo:hi] if sharded else parts).to(acc).sum(0)
        if unit.grad_full is None:
            target = unit.hold_grad_shard()
        else:
            target = unit.grad_shard if sharded else unit.grad_full
        if buf.numel() != target.numel():  # the whole unit reduced (gloo's all-reduce, dp 1)
            buf = buf[lo:hi]
        if buf.data_ptr() != target.data_ptr():
            target.copy_(buf)
        pending.target, pending.buf = target, None  # the packed buffer goes now, not at finish
        if group_size(self.replicas) > 1:  # the other replicas' sums of the same elements
            self.replica_times.append((unit.index, time.perf_counter()))
            pending.replica_work = dist.all_reduce(target, group=self.replicas, async_op=True)

    def _group_of(self, unit: FlatUnit) -> tuple:
        """(group, its size) a unit is reduced over (the ZeRO group, or its experts')."""
        return unit.group, group_size(unit.group)

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
