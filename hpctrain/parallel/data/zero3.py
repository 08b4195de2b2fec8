"""ZeRO-3 parameter residency: all-gather a block just before it is used, free it after.

Units: unit 0 holds the parameters outside the transformer blocks (embeddings, final norm,
output); it is gathered when the model's forward starts and freed when its gradients have
been reduced (or after a no-grad forward). Unit i+1 is the model's block i (its family's):

  forward   pre-hook: wait for / gather block i, prefetch block i+1; post-hook: free block i
            and hook the block's output so that ...
  backward  ... when the output's gradient arrives (just before the block's backward), block i
            is gathered again and block i-1 prefetched; once all of block i's parameter
            gradients have landed (GradReducer.on_unit_done) the block is freed.

Freeing releases the memory even though autograd saved the block's weights (or views of them)
for its backward: the unit's buffer keeps one storage for the run, shrunk to 0 bytes when freed
and regrown when gathered (hpctrain.parallel.data.units), so the saved views pin nothing and
read the re-gathered values in backward. A rank's parameter bytes at any moment are therefore
its shards + unit 0 + at most two blocks (the one running and the one prefetched).

`reshard_after_forward=False` (train.zero3_reshard_after_forward) is FSDP2's other choice: a
block stays gathered from its forward to the end of its backward: one gather a micro-batch
instead of two, every block of the rank held at the end of the forward.

A block recomputed inside backward (activation checkpointing) runs its forward hooks again:
they neither free it nor prefetch the next block. A block whose output carries no gradient (or
is not a tensor) cannot announce its backward, so it stays gathered until its gradients land.

Under expert parallelism a block's routed experts are a second unit, sharded over the ranks
holding the same experts (its own group): it is gathered, prefetched and freed with its block.

`peak_bytes` is the high-water mark of parameter bytes alive on this rank, read from the
storages themselves: all persistent shards plus the gathered units in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.models.registry import model_blocks
from hpctrain.parallel.data.units import FlatUnit


class Zero3Params:
    def __init__(self, model: torch.nn.Module, units: list[FlatUnit], *, group,
                 experts: dict[int, int] | None = None, reshard_after_forward: bool = True):
        """`experts`: block index + 1 → the index of the unit holding that block's expert
        parameters (expert parallelism: sharded over their own group, gathered and freed
        with the block)."""
        self.units, self.group = units, group
        self.reshard_after_forward = reshard_after_forward
        self.blocks = model_blocks(model)
        self.members = {k: [k] for k in range(len(self.blocks) + 1)}
        for k, extra in (experts or {}).items():
            self.members[k].append(extra)
        self._works: dict[int, dist.Work | None] = {}
        self._in_backward: set[int] = set()
        self.shard_bytes = sum(u.shard.untyped_storage().nbytes() for u in units)
        self.peak_bytes = self.live_bytes()
        self._handles = [model.register_forward_pre_hook(lambda m, a: self.ensure(0)),
                         model.register_forward_hook(self._after_model)]
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(
                lambda m, a, k=i + 1: self._before_block(k)))
            self._handles.append(block.register_forward_hook(
                lambda m, a, out, k=i + 1: self._after_block(k, out)))

    def live_bytes(self) -> int:
        """Parameter bytes this rank holds now: its shards and every gathered unit."""
        return self.shard_bytes + sum(u.gathered_bytes for u in self.units)

    def prefetch(self, k: int) -> None:
        """Start gathering block k's units (k = 0: the parameters outside the blocks)."""
        for u in self.members.get(k, ()):
            unit = self.units[u]
            if not unit.gathered:
                self._works[u] = unit.gather_async(unit.group)
                self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def ensure(self, k: int) -> None:
        """Block until block k's units are gathered and their parameters point into them."""
        for u in self.members[k]:
            unit = self.units[u]
            if not unit.gathered:
                self.prefetch(k)
            work = self._works.pop(u, "bound")
            if work == "bound":
                continue
            if work is not None:
                work.wait()
            unit.bind_params()

    def free(self, unit: FlatUnit) -> None:
        work = self._works.pop(unit.index, None)
        if work is not None:
            work.wait()  # never drop a buffer a collective is still writing
        if unit.gathered:
            unit.free_params()
        self._in_backward.discard(unit.index)

    def _before_block(self, k: int) -> None:
        self.ensure(k)
        if k not in self._in_backward:  # a recomputation needs no next block
            self.prefetch(k + 1)

    def _after_block(self, k: int, out) -> None:
        if k in self._in_backward:  # recomputation inside backward (activation checkpointing)
            return
        if torch.is_grad_enabled():
            if not (isinstance(out, torch.Tensor) and out.requires_grad):
                return  # no hook can gather it again: held until its gradients land
            out.register_hook(lambda g, k=k: self._before_block_backward(k, g))
            if not self.reshard_after_forward:
                return
        for u in self.members[k]:
            self.free(self.units[u])

    def _before_block_backward(self, k: int, grad):
        self._in_backward.add(k)
        self.ensure(k)
        if k - 1 >= 1:
            self.prefetch(k - 1)
        return grad

    def _after_model(self, model, args, out) -> None:
        if not torch.is_grad_enabled():
            self.free(self.units[0])

    def on_unit_done(self, unit: FlatUnit) -> None:
        """All of the unit's gradients have landed in this backward: its parameters can go."""
        self.free(unit)

    def free_all(self) -> None:
        for unit in self.units:
            self.free(unit)
