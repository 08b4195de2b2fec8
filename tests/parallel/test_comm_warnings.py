"""Tensor- and context-parallel collectives use torch's current names: a tp or cp run prints no
FutureWarning (torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor)."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from hpctrain.parallel.tensor.comm import gather_seq, reduce_scatter_seq


def _collect_warnings() -> list[str]:
    group = dist.new_group(list(range(dist.get_world_size())))
    x = torch.ones(2, 4, 3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gather_seq(x, group=group)
        reduce_scatter_seq(x, group=group)
    return [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]


def test_sequence_parallel_collectives_warn_nothing(world2):
    assert world2.run(_collect_warnings) == [[], []]
