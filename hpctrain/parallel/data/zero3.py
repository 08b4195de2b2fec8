"""ZeRO-3 parameter residency: all-gather a block just before it is used, free it after.

Units: unit 0 holds the parameters outside the transformer blocks (embeddings, final norm,
output); it is gathered when the model's forward starts and freed when its gradients have
been reduced (or after a no-grad forward). Unit i+1 is the model's block i (its family's):

  forward   pre-hook: wait for / gather block i, prefetch block i+1; post-hook: free block i
            and hook the block's output so that ...
  backward  ... when the output's gradient arrives (just before the block's backward), block i
            is gathered again and block i-1 prefetched; once all of block i's parameter
            gradients have landed (GradReducer.on_unit_done) the block is freed.

Under expert parallelism a block's routed experts are a second unit, sharded over the ranks
holding the same experts (its own group): it is gathered, prefetched and freed with its block.

`peak_bytes` is the ledger's high-water mark of parameter bytes alive on this rank: all
persistent shards plus the gathered units in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.models.registry import model_blocks
from hpctrain.parallel.data.units import FlatUnit


class Zero3Params:
    def __init__(self, model: torch.nn.Module, units: list[FlatUnit], *, group,
                 experts: dict[int, int] | None = None):
        """`experts`: block index + 1 → the index of the unit holding that block's expert
        parameters (expert parallelism: sharded over their own group, gathered and freed
        with the block)."""
        self.units, self.group = units, group
        self.blocks = model_blocks(model)
        self.members = {k: [k] for k in range(len(self.blocks) + 1)}
        for k, extra in (experts or {}).items():
            self.members[k].append(extra)
        self._works: dict[int, dist.Work | None] = {}
        self._in_backward: set[int] = set()
        self.shard_bytes = sum(u.shard.nbytes for u in units)
        self.peak_bytes = self.shard_bytes
        self._handles = [model.register_forward_pre_hook(lambda m, a: self.ensure(0)),
                         model.register_forward_hook(self._after_model)]
        for i, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(
                lambda m, a, k=i + 1: self._before_block(k)))
            self._handles.append(block.register_forward_hook(
                lambda m, a, out, k=i + 1: self._after_block(k, out)))

    def live_bytes(self) -> int:
        return self.shard_bytes + sum(u.full.nbytes for u in self.units if u.gathered)

    def prefetch(self, k: int) -> None:
        """Start gathering block k's units (k = 0: the parameters outside the blocks)."""
        for u in self.members.get(k, ()):
            unit = self.units[u]
            if not unit.gathered:
                group = unit.group
                self._works[u] = unit.gather_async(group)
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
        self.prefetch(k + 1)

    def _after_block(self, k: int, out) -> None:
        if k in self._in_backward:  # recomputation inside backward (activation checkpointing)
            return
        for u in self.members[k]:
            self.free(self.units[u])
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda g, k=k: self._before_block_backward(k, g))

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
