"""Flat shard layout: every element owned exactly once, padding explicit."""

import pytest

from hpctrain.parallel.data.layout import ShardLayout

CASES = [((5, 3, 8), 2), ((5, 3, 8), 3), ((7,), 4), ((1, 1, 1), 4), ((10, 0, 6), 4), ((12,), 1)]


@pytest.mark.parametrize("numels,dp", CASES)
def test_every_element_owned_once(numels, dp):
    lay = ShardLayout(numels, n_shards=dp)
    owner = {}
    for r in range(dp):
        lo, _ = lay.shard_range(r)
        for pc in lay.owned(r):
            assert pc.rank == r
            for k in range(pc.length):
                flat = lay.offsets[pc.index] + pc.param_offset + k
                assert flat == lo + pc.local_offset + k
                assert flat not in owner
                owner[flat] = r
    assert sorted(owner) == list(range(sum(numels)))
    assert lay.padded_numel == dp * lay.shard_size >= lay.numel
    assert lay.padding == lay.padded_numel - sum(numels) < dp
    assert sum(lay.shard_padding(r) for r in range(dp)) == lay.padding


def test_pieces_cover_each_parameter_in_order():
    lay = ShardLayout((5, 3, 8), n_shards=3)  # S = 6: [0,6) [6,12) [12,18)
    assert [(p.rank, p.local_offset, p.param_offset, p.length) for p in lay.pieces(2)] == \
        [(1, 2, 0, 4), (2, 0, 4, 4)]
    assert lay.shard_size == 6 and lay.padding == 2 and lay.shard_padding(2) == 2


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="n_shards=0"):
        ShardLayout((3,), n_shards=0)
    with pytest.raises(ValueError, match="rank=2"):
        ShardLayout((3,), n_shards=2).shard_range(2)
