"""FlatUnit: a group of parameters that share one flat shard layout and move together.

A unit is the bucket of gradient reduction and, under ZeRO-3, the block that is all-gathered
before use. Buffers (Ψᵤ = the unit's elements, S = its shard size, dp·S = Ψᵤ + padding):

  full        dp·S params, compute dtype; the model's parameters are views into it
              (persistent for zero < 3; under zero 3 one tensor for the run whose storage
              holds memory only while gathered: freeing resizes it to 0 bytes, gathering
              back to dp·S, so what autograd saved as views of it is released with it
              and valid again once the unit is gathered, as FSDP2 frees its blocks)
  shard       S params: a view of `full` for zero < 3, the persistent storage for zero 3
  grad_full   dp·S grads for zero < 2; p.grad are views into it (bucket-as-grad-view)
  grad_shard  S grads: a view of `grad_full` for zero < 2; for zero ≥ 2 its own storage,
              which holds memory only from the step's reduction to its update (the
              reduction writes it whole; `zero_grad` shrinks it to 0 bytes, as FSDP2 sets its
              sharded gradients to None): the peak of a step, early in backward, holds none

For zero = 0 the layout has one shard (the whole unit): every rank updates everything.

Parameters built on the meta device (hpctrain.train.setup: a rank's model is built there and
sharded before anything is materialised) get their memory here, on `device`: the buffers
above and nothing else: at ZeRO-3 only the shards, the full buffer getting its memory at the
unit's first gather. Their values are not known yet (`deferred`): the caller
fills the optimizer's masters (hpctrain.checkpoint.initial) and refreshes the parameters.

`group`: the ranks the unit is reduced and sharded over — the engine's (ZeRO) group, or for
expert parameters (hpctrain.parallel.moe) the ranks holding the same experts. `grad_divisor`:
what the gradient sum is divided by (the whole dp size for experts); None: that group's size
times the HSDP replicas (hpctrain.parallel.data.ddp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import group_size
from hpctrain.parallel.data.layout import ShardLayout


def _broadcasts(group) -> bool:
    """Gather shards as one broadcast per owner on gloo: measured on 2 CPU ranks for 26 MB,
    two async broadcasts took 11 ms where one all_gather_into_tensor took 22–31 ms (and an
    all-reduce of the same buffer 21 ms); NCCL keeps its all-gather."""
    return dist.get_backend(group) == "gloo"


class Works:
    """Several collectives waited as one (the per-owner broadcasts of a gather)."""

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


class FlatUnit:
    def __init__(self, index: int, named: list[tuple[str, torch.nn.Parameter]], *, dp: int,
                 rank: int, zero: int, dtype: torch.dtype, group: dist.ProcessGroup | None,
                 grad_divisor: int | None = None, device: torch.device | None = None):
        self.index, self.zero, self.dtype = index, zero, dtype
        self.group, self.grad_divisor = group, grad_divisor
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.shapes = [p.shape for p in self.params]
        self.device = self.params[0].device if device is None else torch.device(device)
        self.layout = ShardLayout(tuple(p.numel() for p in self.params),
                                  n_shards=dp if zero >= 1 else 1)
        self.shard_rank = rank if zero >= 1 else 0
        lo, hi = self.layout.shard_range(self.shard_rank)
        self.deferred = self.params[0].is_meta and self.device.type != "meta"
        if self.deferred:  # module docstring: memory here, values later
            self._materialise_params()
            self.initial_master = None
            if zero < 3:
                self.full = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
                self.shard = self.full[lo:hi]
            else:  # the shard only: the full buffer gets its memory when gathered
                self.full = _empty(dtype, self.device)
                self.shard = torch.zeros(hi - lo, dtype=dtype, device=self.device)
        else:
            flat = self._flatten_values()  # original precision, e.g. fp32 before casting to bf16
            self.initial_master = flat[lo:hi].clone() if flat.dtype != dtype else None
            self.full = flat.to(dtype)
            self.shard = self.full[lo:hi] if zero < 3 else self.full[lo:hi].clone()
        self.grad_full = None
        if zero < 2:
            self.grad_full = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
            self.grad_shard = self.grad_full[lo:hi]
            # each parameter's slice address: adopt_grad's check without building a view
            self._grad_ptrs = [self.grad_full.data_ptr() + o * self.grad_full.element_size()
                               for o in self.layout.offsets]
        else:
            self.grad_shard = torch.empty(hi - lo, dtype=dtype, device=self.device)
            self.grad_shard.untyped_storage().resize_(0)  # `hold_grad_shard` gives it memory
        if self.full.numel():
            self.bind_params()
        self.bind_grads()
        if zero == 3:
            self.free_params()

    def _materialise_params(self) -> None:
        """Turn each meta parameter into an empty one on this unit's device, in place (the same
        Python object: every reference to it stays valid); `bind_params` gives it memory."""
        for p in self.params:
            torch.utils.swap_tensors(p, torch.nn.Parameter(
                _empty(self.dtype, self.device), requires_grad=p.requires_grad))

    def _flatten_values(self) -> torch.Tensor:
        flat = torch.zeros(self.layout.padded_numel, dtype=self.params[0].dtype,
                           device=self.device)
        for p, o in zip(self.params, self.layout.offsets, strict=True):
            flat[o : o + p.numel()].copy_(p.detach().reshape(-1))
        return flat

    def _view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        o = self.layout.offsets[i]
        return buf[o : o + self.layout.numels[i]].view(self.shapes[i])

    # -- parameters --------------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        return self.gathered_bytes > 0

    @property
    def gathered_bytes(self) -> int:
        """Bytes the full buffer's storage holds now (ZeRO-3: 0 while freed)."""
        return self.full.untyped_storage().nbytes()

    def bind_params(self) -> None:
        for i, p in enumerate(self.params):
            p.data = self._view(self.full, i)

    def free_params(self) -> None:
        """ZeRO-3: release the gathered buffer's memory. The storage shrinks to 0 bytes, so
        the views autograd saved of it pin nothing; the parameters become empty tensors until
        the next gather (a stray use fails plainly instead of reading a released buffer)."""
        self.full.untyped_storage().resize_(0)
        for p in self.params:
            p.data = _empty(self.dtype, self.device)

    def gather_async(self, group) -> dist.Work | Works | None:
        """ZeRO-3: give `full`'s storage its memory back and start all-gathering the shards
        into it; views saved from it earlier (autograd's) read the gathered values again."""
        storage = self.full.untyped_storage()
        storage.resize_(self.layout.padded_numel * self.full.element_size())
        self.full.set_(storage, 0, (self.layout.padded_numel,), (1,))  # a deferred unit's first
        if group_size(group) == 1:
            self.full.copy_(self.shard)
            return None
        if not _broadcasts(group):
            return dist.all_gather_single(self.full, self.shard, group=group, async_op=True)
        self._slot(self.full, self.shard_rank).copy_(self.shard)
        return self._broadcast_slots(group, async_op=True)

    def all_gather_params(self, group, *, async_op: bool = False) -> dist.Work | Works | None:
        """zero 1/2: every rank's updated shard into `full` (in place, views stay valid).

        The input is this rank's own slot of the output (`shard` is a view of `full`): the
        in-place form NCCL documents, and gloo handles it too (checked for 2-4 ranks), so no
        shard-sized copy is made per unit and step. On gloo, one broadcast per owner instead
        (`_broadcasts` says why).
        """
        if self.layout.n_shards == 1 or group_size(group) == 1:
            return None
        if _broadcasts(group):
            return self._broadcast_slots(group, async_op=async_op)
        return dist.all_gather_single(self.full, self.shard, group=group, async_op=async_op)

    def _slot(self, buf: torch.Tensor, r: int) -> torch.Tensor:
        lo, hi = self.layout.shard_range(r)
        return buf[lo:hi]

    def _broadcast_slots(self, group, *, async_op: bool) -> Works | None:
        """full[slot r] ← rank r's slot, for every rank r of `group`, in the same order on all."""
        works = [dist.broadcast(self._slot(self.full, r), group=group, group_src=r,
                                async_op=async_op) for r in range(self.layout.n_shards)]
        return Works(works) if async_op else None

    # -- gradients -----------------------------------------------------------------------------
    def bind_grads(self) -> None:
        if self.grad_full is None:
            return
        for i, p in enumerate(self.params):
            p.grad = self._view(self.grad_full, i)

    def adopt_grads(self) -> None:
        """`adopt_grad` for every parameter (zero < 2): gradients assigned outside autograd."""
        if self.grad_full is not None:
            for i in range(len(self.params)):
                self.adopt_grad(i)

    def adopt_grad(self, i: int) -> None:
        """Keep p.grad a view of grad_full even if autograd replaced it (out-of-place add)."""
        p = self.params[i]
        # runs in a hook per parameter and micro-batch: compare addresses, build a view only
        # when a copy is due (profiled: the view per call was most of the hook's time)
        if p.grad is not None and p.grad.data_ptr() != self._grad_ptrs[i]:
            view = self._view(self.grad_full, i)
            view.copy_(p.grad)
            p.grad = view

    def fill_missing_grads(self) -> None:
        """zero < 2: parameters that got no gradient since zero_grad contribute zeros."""
        if self.grad_full is None:
            return
        for i, p in enumerate(self.params):
            if p.grad is None:
                p.grad = self._view(self.grad_full, i).zero_()

    def pack_grads(self, dtype: torch.dtype) -> torch.Tensor:
        """zero ≥ 2: the full local gradients as one padded flat tensor; p.grad freed."""
        flat = torch.zeros(self.layout.padded_numel, dtype=dtype, device=self.device)
        for p, o in zip(self.params, self.layout.offsets, strict=True):
            if p.grad is not None:
                flat[o : o + p.grad.numel()].copy_(p.grad.reshape(-1))
            p.grad = None
        return flat

    def hold_grad_shard(self) -> torch.Tensor:
        """zero ≥ 2: the grad shard with its memory (uninitialised: the reduction that
        calls this overwrites all of it)."""
        storage = self.grad_shard.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.layout.shard_size * self.grad_shard.element_size())
        return self.grad_shard

    @property
    def grad_bytes(self) -> int:
        """Bytes its gradients hold at a step's reduction (zero ≥ 2: the grad shard, also
        while released between steps)."""
        if self.grad_full is not None:
            return self.grad_full.untyped_storage().nbytes()
        return self.layout.shard_size * self.grad_shard.element_size()

    def zero_grad(self) -> None:
        """zero < 2 is lazy: p.grad is dropped and the next gradient is copied over its bucket
        slice (adopt_grad) instead of added to zeros, as DDP does; `fill_missing_grads` zeroes
        the slices no gradient reached. That saves a fill and a read of every bucket per step.
        zero ≥ 2 releases the grad shard's memory until the next reduction (module docstring).
        """
        if self.grad_full is None:
            self.grad_shard.untyped_storage().resize_(0)
        for p in self.params:
            p.grad = None
