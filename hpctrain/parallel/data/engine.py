"""DataParallel: the flat-shard engine behind DDP (zero=0) and ZeRO-1/2/3.

One object per rank owns the units (flat buffers), the GradReducer, the ShardedAdamW and, for
zero=3, the parameter gather/free hooks. `train_step` is the trainer's step for this engine:
each micro-batch's mean loss is weighted by its real tokens (hpctrain.parallel.step
`loss_divisors`: the step's loss is the mean over every real token of the global batch),
an MoE model's router losses (aux + z, hpctrain.models.moe.layer) join each micro-batch's loss
before that division (the reported loss is the LM loss alone), micro-batches run under
`reducer.no_sync()` except the last of the accumulation window, then
the reduction is finished explicitly, the loss is averaged over dp, overflow is agreed by all
ranks (fp16), and the sharded optimizer clips by the global norm and updates — unless the loss
or the norm is non-finite (hpctrain.parallel.finite): then no rank updates, and the result
says what was non-finite (the trainer decides what to do next).

Composition with tensor and pipeline parallelism: the engine works over the dp group on the
local parameters a rank holds (tp shards, pipeline stages). What the other axes need is passed
in, not special-cased here: `pre_reduce` runs on the local gradients before the dp reduction
(tp: complete the partial gradients of replicated parameters) — with it, reduction is not
overlapped with backward, every collective is issued by `reduce_and_update`; `norm` (a
`NormSpec`, read from the shard spec) makes the clip norm that of the whole model (see
ShardedAdamW). A pipeline runs
its schedule under `reducer.no_sync()` (no dp collective in the middle of the schedule's p2p)
and then calls `reduce_and_update`.

Hybrid sharding (HSDP): `group` is then the shard group (the dp×cp ranks of one replica: units
are sharded, gathered and their norms summed there) and `replicas` the ranks holding the same
shards in the other replicas; every reduced gradient is all-reduced over `replicas` before the
update, so replicas step identically. `batch_group` (all dp×cp ranks) averages the loss and
weighs the micro-batches. Without HSDP `replicas` is None (or one rank) and `batch_group` is
`group`.

Precision: for bf16/fp16 the model's parameters are cast to 16 bits (compute copies) and fp32
masters live in the optimizer shards; fp32 (and fp64) parameters are their own masters.

`device`: where the units live. A model built on the meta device gets its memory there, unit
by unit, and its values afterwards (`FlatUnit.deferred`; hpctrain.checkpoint.initial).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_rank, group_size
from hpctrain.models.moe.layer import take_router_loss
from hpctrain.models.registry import model_blocks
from hpctrain.ops.documents import split_micro_batch
from hpctrain.parallel.data.ddp import GradReducer, size_groups
from hpctrain.parallel.data.units import FlatUnit
from hpctrain.parallel.data.zero import NormSpec, ShardedAdamW
from hpctrain.parallel.data.zero3 import Zero3Params
from hpctrain.parallel.finite import SKIPPED
from hpctrain.parallel.memory import storage_bytes
from hpctrain.parallel.moe import ExpertGroups
from hpctrain.parallel.scaler import LossScaler
from hpctrain.parallel.step import (
    StepResult,
    allreduce_mean,
    autocast,
    lm_loss,
    loss_divisors,
)

PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _groups(model: torch.nn.Module, named, *, zero: int, bucket_bytes: float, elem: int):
    if zero < 3:
        return size_groups(list(reversed(named)), bucket_bytes=bucket_bytes, bytes_per_elem=elem)
    blocks = model_blocks(model)
    block_of = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    groups = [[(n, p) for n, p in named if id(p) not in block_of]]
    groups += [[(n, p) for n, p in named if block_of.get(id(p)) == i]
               for i in range(len(blocks))]
    return groups


def _expert_groups(model: torch.nn.Module, named, *, zero: int, bucket_bytes: float,
                   elem: int) -> list[tuple[int | None, list]]:
    """(block index or None, parameters) of the expert units: buckets (zero < 3) or, for
    ZeRO-3, one unit per block holding experts (gathered and freed with that block)."""
    if zero < 3:
        return [(None, g) for g in size_groups(list(reversed(named)), bucket_bytes=bucket_bytes,
                                               bytes_per_elem=elem)]
    blocks = model_blocks(model)
    block_of = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    groups = [(i, [(n, p) for n, p in named if block_of.get(id(p)) == i])
              for i in range(len(blocks))]
    return [(i, g) for i, g in groups if g]


def _expert_norm(named, experts: ExpertGroups, norm: NormSpec) -> NormSpec:
    """zero = 0 with expert parallelism: the clip norm also sums over the ep group (its
    ranks hold different experts), where every dense parameter is held ep times (counted
    1/ep each). With zero ≥ 1 the sum over dp already counts each element once: dense
    shards are disjoint over dp, expert shards over (ep, expert-data) = dp."""
    ep = group_size(experts.ep_group)
    replicas = dict(norm.replicas)
    for _, p in named:
        if id(p) not in experts.params:
            replicas[id(p)] = replicas.get(id(p), 1) * ep
    return NormSpec((*norm.groups, experts.ep_group), replicas)


class DataParallel:
    def __init__(self, model: torch.nn.Module, *, group, batch_group, zero: int, precision: str,
                 optim, bucket_mb: float = 25.0, grad_comm_dtype: str = "fp32",
                 norm: NormSpec, offload: str = "none",
                 pre_reduce: Callable[[], None] | None = None,
                 experts: ExpertGroups | None = None, replicas=None,
                 reshard_after_forward: bool = True, device: torch.device | None = None):
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero={zero} must be one of 0, 1, 2, 3")
        self.model, self.group, self.zero, self.pre_reduce = model, group, zero, pre_reduce
        self.replicas = replicas  # HSDP (module docstring); None or one rank: no replicas
        self.batch_group = batch_group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if experts is not None and zero == 0:  # see _expert_norm
            norm = _expert_norm(named, experts, norm)
        # Overflow must be agreed by every rank that steps together: the dp group alone only
        # when the units hold the whole model, else every rank (tp/pp shards step together).
        split = any(group_size(g) > 1 for g in norm.groups)
        self.overflow_group = dist.group.WORLD if split else self.batch_group
        dp, rank = group_size(group), group_rank(group)
        dtype = PARAM_DTYPES.get(precision, named[0][1].dtype)
        is_expert = (lambda p: id(p) in experts.params) if experts else (lambda p: False)
        kw = dict(zero=zero, bucket_bytes=bucket_mb * 2**20, elem=dtype.itemsize)
        dense = _groups(model, [(n, p) for n, p in named if not is_expert(p)], **kw)
        self.units = [FlatUnit(i, g, dp=dp, rank=rank, zero=zero, dtype=dtype, group=group,
                               device=device) for i, g in enumerate(dense)]
        block_units = {}  # ZeRO-3: block + 1 → its expert unit, gathered with the block
        if experts is not None:  # reduced and sharded over the ranks holding the same experts
            for block, g in _expert_groups(model, [(n, p) for n, p in named if is_expert(p)],
                                           **kw):
                if block is not None:
                    block_units[block + 1] = len(self.units)
                self.units.append(FlatUnit(
                    len(self.units), g, dp=group_size(experts.group),
                    rank=group_rank(experts.group), zero=zero, dtype=dtype,
                    group=experts.group, grad_divisor=experts.divisor, device=device))
        self.zero3 = (Zero3Params(model, self.units, group=group, experts=block_units,
                                  reshard_after_forward=reshard_after_forward)
                      if zero == 3 else None)
        self.reducer = GradReducer(self.units, group, zero, grad_comm_dtype, replicas=replicas,
                                   on_unit_done=self.zero3.on_unit_done if self.zero3 else None)
        self.optimizer = ShardedAdamW(self.units, optim, group=group, offload=offload,
                                      norm=norm)

    def train_step(self, micro_batches, *, n_micro: int, precision: str, scaler: LossScaler,
                   grad_clip: float, loss_fn: Callable | None = None) -> StepResult:
        micro_batches = list(micro_batches)
        divisors = loss_divisors(micro_batches, dp_group=self.batch_group,
                                 device=self.units[0].device)
        multiplier = scaler.loss_multiplier()
        loss_sum = self.accumulate(micro_batches, divisors=divisors, n_micro=n_micro,
                                   precision=precision, multiplier=multiplier, loss_fn=loss_fn)
        return self.reduce_and_update(scaler=scaler, multiplier=multiplier,
                                      grad_clip=grad_clip, loss=loss_sum)

    def accumulate(self, micro_batches, *, divisors, n_micro: int, precision: str,
                   multiplier: float = 1.0, loss_fn: Callable | None = None) -> torch.Tensor:
        """Forward and backward of every micro-batch, its loss divided by its divisor (and
        scaled by the loss `multiplier`); returns this rank's loss sum (fp64, 0-d). The last
        backward of the accumulation window starts the reduction (overlapped) unless
        `pre_reduce` is set. The dry run (hpctrain.tasks.dryrun.run) calls it on meta tensors."""
        device = self.units[0].device
        loss_fn = lm_loss if loss_fn is None else loss_fn  # None: the model's own loss
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, (micro, divisor) in enumerate(zip(micro_batches, divisors, strict=True)):
            inputs_BL, targets_BL, docs = split_micro_batch(micro)
            docs = None if docs is None else docs.to(device)
            overlap = i == n_micro - 1 and self.pre_reduce is None
            with self.reducer.no_sync() if not overlap else contextlib.nullcontext():
                with autocast(precision, device):
                    logits = self.model(inputs_BL.to(device), docs=docs)
                loss = loss_fn(logits, targets_BL.to(device)) / divisor
                router = take_router_loss(self.model)  # MoE aux + z: weighted as the LM loss
                total = loss if router is None else loss + router / divisor
                (total * multiplier).backward()
            loss_sum += loss.detach().double()
        return loss_sum

    def reduce(self) -> None:
        """Finish the gradient reduction: `pre_reduce` (tp, tied embeddings), then the dp
        reduction the last backward started (or all of it, after `no_sync`)."""
        if self.pre_reduce is not None:
            self.pre_reduce()
        self.reducer.finish()

    def reduce_and_update(self, *, scaler: LossScaler, multiplier: float, grad_clip: float,
                          loss: torch.Tensor | None) -> StepResult:
        """After backward (overlapped, or run under `reducer.no_sync()`): pre_reduce, finish the
        dp reduction, average `loss` (this rank's loss sum, 0-d; None on pipeline stages that
        hold no loss) over dp in place, agree on overflow, then clip + update unless the loss or
        the grad norm is non-finite; zero the gradients. Collective over the world when
        the norm spans more than dp (tp, pp). The result's grad norm is the one before clipping."""
        self.reduce()
        if loss is not None:  # before the update, so every dp rank judges the same mean loss
            allreduce_mean([loss], self.batch_group)
        skipped = scaler.enabled and scaler.found_overflow(self.optimizer.grad_shards(),
                                                           group=self.overflow_group)
        scaler.update(skipped)
        verdict = SKIPPED
        if not skipped:
            verdict = self.optimizer.step(unscale=multiplier, max_norm=grad_clip, loss=loss)
        self.optimizer.zero_grad()
        if self.zero3 is not None:
            self.zero3.free_all()
        return StepResult(float(loss) if loss is not None else math.nan, verdict.norm, skipped,
                          verdict.nonfinite)

    def parameter_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding parameter values: the model's parameters and the units' buffers
        (ZeRO-3's gathered ones too, whose storages outlive each gather): what an
        `ActivationMeter` must not count as saved activations."""
        return [*self.model.parameters(), *(u.full for u in self.units),
                *(u.shard for u in self.units)]

    def ledger(self) -> dict[str, int]:
        """Bytes this rank holds now, de-duplicated by storage (what `model_state_bytes` models).

        Parameters: the flat buffers (full, or the shard under zero 3 plus gathered units);
        gradients: full buckets (zero < 2) or grad shards (zero ≥ 2: their size at the
        reduction, though released between steps); optimizer: master (when it is not
        the parameter shard itself), exp_avg, exp_avg_sq. Offloaded optimizer state is
        reported as mem_optim_host_bytes.
        """
        seen: set[int] = set()
        params = [u.full for u in self.units] + [u.shard for u in self.units]
        out = {"mem_params_bytes": storage_bytes(params, seen),
               "mem_grads_bytes": sum(u.grad_bytes for u in self.units)}
        optim = storage_bytes(self.optimizer.tensors(), seen)
        host = self.optimizer.offload == "cpu"
        out["mem_optim_bytes"] = 0 if host else optim
        out["mem_optim_host_bytes"] = optim if host else 0
        out["mem_buffers_bytes"] = storage_bytes(self.model.buffers(), seen)
        if self.zero3 is not None:  # the step's high-water mark of gathered units
            out["mem_gathered_peak_bytes"] = self.zero3.peak_bytes - self.zero3.shard_bytes
        return out

    def padding(self) -> int:
        """Padding elements in this rank's shards (zero ≥ 1) — what the formulas leave out."""
        return sum(u.layout.padding for u in self.units)
