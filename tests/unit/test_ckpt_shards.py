"""The chunk arithmetic of sharded checkpoints: a flat range of a row-major tensor as boxes
(exact tiling, each box contiguous, at most 2·ndim − 1 of them), and a box's place in the
full tensor under ep and tp slices."""

from __future__ import annotations

import math
import random

import torch

from hpctrain.checkpoint.shards import boxes, full_offsets
from hpctrain.parallel.state import WHOLE, ParamShard
from hpctrain.parallel.tensor.plan import TpSlice


def _check(shape: tuple[int, ...], start: int, stop: int) -> None:
    flat = torch.arange(math.prod(shape)).view(shape)
    seen = torch.zeros(shape, dtype=torch.int64)
    found = boxes(shape, start, stop)
    pos = start
    for offsets, sizes, first in found:
        assert first == pos, (shape, start, stop, found)
        where = tuple(slice(o, o + n) for o, n in zip(offsets, sizes, strict=True))
        values = flat[where].reshape(-1)
        # contiguous in memory: the box's elements are consecutive flat indices
        assert torch.equal(values, torch.arange(first, first + values.numel())), found
        seen[where] += 1
        pos += values.numel()
    assert pos == stop or not found
    assert int(seen.sum()) == stop - start
    assert bool((seen.reshape(-1)[start:stop] == 1).all())
    assert len(found) <= max(1, 2 * len(shape) - 1)


def test_boxes_tile_any_range_of_any_shape():
    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 4)))
        n = math.prod(shape)
        start = rng.randint(0, n)
        _check(shape, start, rng.randint(start, n))


def test_boxes_examples():
    assert boxes((4, 3), 0, 12) == [((0, 0), (4, 3), 0)]
    assert boxes((4, 3), 2, 10) == [((0, 2), (1, 1), 2), ((1, 0), (2, 3), 3),
                                    ((3, 0), (1, 1), 9)]
    assert boxes((4, 3), 5, 5) == []


def test_full_offsets_add_the_ep_then_the_tp_slice():
    # local (2, 3, 4) of full (8, 6, 4): experts 4..5 of 8 (ep index 2 of 4), tp half 1 on dim 1
    shard = ParamShard("w", (2, 3, 4), TpSlice(1, index=1, parts=2), 0, 0, 0, (0,),
                       ep=TpSlice(0, index=2, parts=4))
    assert shard.full_shape == (8, 6, 4)
    assert full_offsets(shard, (1, 2, 0)) == (5, 5, 0)
    plain = ParamShard("n", (5,), WHOLE, 0, 0, 0, (0,))
    assert full_offsets(plain, (3,)) == (3,)
