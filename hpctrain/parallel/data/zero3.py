"""ZeRO-3 parameter residency: all-gather a block just before it is used, free it after.

Units: unit 0 holds the parameters outside the transformer blocks (embeddings, final norm,
output); it is gathered when the model's forward starts and freed when its gradients have
been reduced (or after a no-grad forward). Unit i+1 is block i of `model.layers`:

  forward   pre-hook: wait for / gather block i, prefetch block i+1; post-hook: free block i
            and hook the block's output so that ...
  backward  ... when the output's gradient arrives (just before the block's backward), block i
            is gathered again and block i-1 prefetched; once all of block i's parameter
            gradients have landed (GradReducer.on_unit_done) the block is freed.

`peak_bytes` is the ledger's high-water mark of parameter bytes alive on this rank: all
persistent shards plus the gathered units in flight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hpctrain.parallel.data.units import FlatUnit


class Zero3Params:
    def __init__(self, model: torch.nn.Module, units: list[FlatUnit], *, group):
        self.units, self.group = units, group
        self.blocks = list(model.layers)
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
        if 0 <= k < len(self.units) and not self.units[k].gathered:
            self._works[k] = self.units[k].gather_async(self.group)
            self.peak_bytes = max(self.peak_bytes, self.live_bytes())

    def ensure(self, k: int) -> None:
        """Block until unit k is gathered and its parameters point into it."""
        unit = self.units[k]
        if not unit.gathered:
            self.prefetch(k)
        work = self._works.pop(k, "bound")
        if work == "bound":
            return
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
        self.free(self.units[k])
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
