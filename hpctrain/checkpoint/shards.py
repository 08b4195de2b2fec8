"""What one rank hands to a checkpoint: its own shards, as chunks of the full tensors.

A checkpoint stores every tensor under the single-process model's name and shape, as DCP
chunks (offsets + sizes in the full tensor), so any later layout finds each element:

  model.<name>                      the fp32 (or fp64) master weights
  optim.state.<name>.exp_avg        AdamW's moments, same shape
  optim.state.<name>.exp_avg_sq
  optim.state.<name>.step           the optimizer step (a scalar, identical everywhere)

These are the keys `get_state_dict` gives torch's AdamW, and the keys checkpoints written
before sharding used (one whole-tensor chunk each), so those still load.

A rank owns, per flat unit, the range [lo, hi) of each parameter's flattened local (tp- and
ep-sliced) tensor that its ZeRO shard holds (`ShardLayout.owned`). A contiguous flat range of
a row-major tensor is a union of at most 2·ndim − 1 boxes (`boxes`), each contiguous in
memory, so every chunk is a view of the rank's flat buffer: nothing is copied to save, and
loading writes straight into the buffers. The box's place in the full tensor adds the ep
slice's offset (experts), then the tp slice's (`ParamShard`).

Replicated values (zero 0 over dp, norm gains over tp, kv heads shared by tp ranks) give the
same chunk on every replica; DCP keeps one of them (`dedup_save_plans`, the rank with the
least planned so far). A tied embedding held by two pipeline ranks (`ParamShard.copy`) is
written by the first stage's rank only, since the copy's flat layout differs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hpctrain.distributed.mesh import group_rank
from hpctrain.parallel.state import ParallelState, ParamShard


def state_path(state: str, name: str) -> tuple[str, ...]:
    """Where an optimizer state key of parameter `name` lives in the nested state dict
    {"model": {name: master}, "optim": {"state": {name: {"exp_avg", "exp_avg_sq", "step"}}}}
    (its DCP key is the path joined by dots)."""
    return ("model", name) if state == "master" else ("optim", "state", name, state)


STATES = ("master", "exp_avg", "exp_avg_sq")

Box = tuple[tuple[int, ...], tuple[int, ...], int]  # (offsets, sizes, flat start)


@dataclass(frozen=True)
class Chunk:
    """`data` (a view of this rank's buffer) is the box [offsets, offsets + sizes) of the full
    tensor at `path` (`state_path`) of shape `size`."""

    path: tuple[str, ...]
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    data: torch.Tensor

    @property
    def key(self) -> str:
        """The DCP key: the path joined by dots (as DCP flattens a nested state dict)."""
        return ".".join(self.path)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.data.shape)


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The flat range [start, stop) of a row-major tensor of `shape` as boxes, in flat order:
    (offsets, sizes, flat offset of the box's first element). Boxes tile the range exactly and
    each is contiguous in memory."""
    if start >= stop:
        return []
    if not shape:
        return [((), (), start)]
    inner = math.prod(shape[1:])
    if start % inner == 0 and stop % inner == 0:  # whole rows
        return [((start // inner, *[0] * (len(shape) - 1)),
                 (stop // inner - start // inner, *shape[1:]), start)]
    first, last = start // inner, (stop - 1) // inner
    if first == last:  # inside one row: recurse into it
        base = first * inner
        return [((first, *off), (1, *size), base + flat)
                for off, size, flat in boxes(shape[1:], start - base, stop - base)]
    head_end, tail_start = (first + 1) * inner, last * inner
    head_end = start if start % inner == 0 else head_end
    tail_start = stop if stop % inner == 0 else tail_start
    return (boxes(shape, start, head_end) + boxes(shape, head_end, tail_start)
            + boxes(shape, tail_start, stop))


def full_offsets(shard: ParamShard, local: tuple[int, ...]) -> tuple[int, ...]:
    """Offsets of a box of the local tensor inside the full tensor: ep's slice, then tp's."""
    out, shape = list(local), list(shard.full_shape)
    for piece in (shard.ep, shard.tp):
        if piece.dim is not None:
            shape[piece.dim] //= piece.parts
            out[piece.dim] += piece.index * shape[piece.dim]
    return tuple(out)


def unit_chunks(parallel: ParallelState, flats: dict[int, dict[str, torch.Tensor]], *,
                copies: bool = False) -> list[Chunk]:
    """This rank's chunks of every state key, cut from `flats` (unit index → {"master",
    "exp_avg", "exp_avg_sq"} flat shards: the optimizer's own, or a staged copy of them).
    `copies`: include the pieces of parameters this rank holds as a copy (to load them; a
    save leaves them to the original's rank, and under HSDP to the first replica)."""
    out = []
    if not copies and group_rank(parallel.engine.replicas) != 0:
        return out  # another replica holds (and writes) the same shards
    for unit in parallel.engine.units:
        for piece in unit.layout.owned(unit.shard_rank):
            shard = parallel.shards[unit.names[piece.index]]
            if shard.copy and not copies:
                continue
            lo = piece.param_offset
            for offsets, sizes, flat in boxes(shard.local_shape, lo, lo + piece.length):
                at = piece.local_offset + flat - lo
                for state in STATES:
                    data = flats[unit.index][state][at : at + math.prod(sizes)].view(sizes)
                    out.append(Chunk(state_path(state, shard.name), shard.full_shape,
                                     full_offsets(shard, offsets), data))
    return out


def step_chunks(parallel: ParallelState, step: torch.Tensor) -> list[Chunk]:
    """The optimizer step under every parameter this rank holds (a scalar each, identical on
    every rank: DCP writes each once)."""
    return [Chunk(state_path("step", name), (), (), step)
            for name, s in parallel.shards.items() if not s.copy]


def optimizer_flats(parallel: ParallelState) -> dict[int, dict[str, torch.Tensor]]:
    """The optimizer's own flat shards, by unit index."""
    state = parallel.engine.optimizer.state
    return {u.index: {k: state[u.index][k] for k in STATES} for u in parallel.engine.units}


def owned_bytes(parallel: ParallelState) -> int:
    """Bytes of this rank's own shard of every state key (padding and copies excluded)."""
    return sum(c.data.numel() * c.data.element_size()
               for c in unit_chunks(parallel, optimizer_flats(parallel)))
