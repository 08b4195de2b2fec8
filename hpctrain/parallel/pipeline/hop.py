"""What one pipeline hop puts on the wire: Megatron's scatter/gather under tp without sp.

Without sequence parallelism, the residual stream a stage hands to the next is the same on every
tp rank (each block ends in an all-reduce), and so is the gradient coming back (each block's
input passes the tp region's copy, whose backward all-reduces). Sending the whole tensor from
every tp rank moves t copies of one message between the two stages. Instead each tp rank sends
its 1/t piece of the flattened tensor to its counterpart, and the receiving stage's tp ranks
all-gather the pieces (Megatron-LM's scatter-gather optimisation, Narayanan et al. 2021 §4.1):
b·s·h/t bytes a hop per rank on the pipeline's links, the all-gather on the tp group's faster
ones. The result is bit for bit the tensor sent, since every tp rank held the same one.

With sp the activations between stages are already the rank's sequence shard: nothing to split,
`WHOLE` passes tensors through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hpctrain.distributed.mesh import Mesh


@dataclass(frozen=True)
class Hop:
    """How a stage-boundary tensor of `shape` travels: whole (`group` None) or as this rank's
    piece of `size` over the tp `group`, of which this rank is `rank`."""

    group: dist.ProcessGroup | None
    rank: int = 0
    size: int = 1

    def wire_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one message: the tensor, or a flat piece of ⌈numel/t⌉ elements."""
        if self.group is None:
            return shape
        return (math.ceil(math.prod(shape) / self.size),)

    def outgoing(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `x` (contiguous; zero-padded when numel is not a multiple of t)."""
        if self.group is None:
            return x
        n = self.wire_shape(tuple(x.shape))[0]
        flat = x.detach().reshape(-1)
        piece = flat[self.rank * n : (self.rank + 1) * n]
        if piece.numel() == n:
            return piece
        return torch.cat([piece, piece.new_zeros(n - piece.numel())])

    def incoming(self, piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor of `shape` from this rank's received `piece`: all-gathered over tp."""
        if self.group is None:
            return piece
        numel = math.prod(shape)
        out = piece.new_empty(self.size * piece.numel())
        dist.all_gather_single(out, piece, group=self.group)
        if out.numel() == numel:
            return out.view(shape)
        return out[:numel].clone().view(shape)  # drop the padding's storage too


WHOLE = Hop(None)  # tensors travel as they are


def stage_hop(mesh: Mesh, *, sp: bool) -> Hop:
    """Scatter each hop over tp and gather it on arrival where a stage's tp ranks hold the same
    activations (tp > 1 without sp); otherwise send them whole."""
    tp = mesh.dims.tp
    if tp == 1 or sp:
        return WHOLE
    return Hop(mesh.group("tp"), rank=mesh.coord("tp"), size=tp)
