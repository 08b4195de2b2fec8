"""The world harness itself: collectives run, errors surface with the rank's traceback."""

import pytest
import torch
import torch.distributed as dist


def _allreduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank1():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")
    return 0


def test_all_reduce(world2):
    assert world2.run(_allreduce_rank) == [3.0, 3.0]


def test_error_surfaces_and_world_recovers(world2):
    with pytest.raises(AssertionError, match="boom on purpose"):
        world2.run(_fail_on_rank1)
    assert world2.run(_allreduce_rank) == [3.0, 3.0]
