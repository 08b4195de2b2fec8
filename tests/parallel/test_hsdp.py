"""Hybrid sharding (HSDP): dp = dp_replicate × dp_shard; ZeRO shards inside a replica and the
replicas all-reduce (hpctrain.distributed.dims).

dp_shard=2 × dp_replicate=2 with ZeRO 0-3 equals the single-process run in fp64 (1e-12, the
clip active), each replica holding the same shards, each shard half the model; the trainer
with tp=2 and with pp=2 (8 ranks) follows the single-process loss (fp32, 1e-5); a checkpoint
saved at 2×2 resumes at 4×1, and that one at 1×4, on the uninterrupted trajectory.
"""

from __future__ import annotations

import pytest
import torch

from hpctrain.checkpoint import save_load as ckpt
from tests.conftest import get_world
from tests.parallel import dp_helpers as h
from tests.parallel.trainer_runs import assert_trajectory_close, logged_trajectory, train_in_world


@pytest.mark.parametrize("zero,accum", [(0, 1), (1, 2), (2, 1), (2, 2), (3, 2)])
def test_hsdp_2x2_matches_single_process_fp64(world4, zero, accum):
    errs = world4.run(h.compare_with_reference, 2, zero=zero, accum=accum,
                      dtype=torch.float64, replicate=2, grad_clip=0.05)
    assert max(errs) < 1e-12, errs


@pytest.mark.parametrize("zero", [1, 3])
def test_hsdp_shards_inside_a_replica_and_replicas_agree(world4, zero):
    for owned, psi, differs in world4.run(h.hsdp_shards, zero):
        assert differs == 0
        assert psi / 2 <= owned <= psi / 2 + 64 * 4  # half the model (+ padding per unit)


@pytest.mark.parametrize("zero", [0, 2])
def test_replica_all_reduces_start_inside_backward(world4, zero):
    """Each unit's all-reduce over the replicas is issued once its own reduction is done,
    while backward goes on (issue 44), every unit's once; the values stay exact (the fp64
    comparison above)."""
    for times, t_end, n_units in world4.run(h.replica_overlap_times, zero):
        assert n_units >= 3 and len(times) == n_units
        assert any(t < t_end for t in times), (times, t_end)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return get_world(1).run(train_in_world, [], str(tmp_path_factory.mktemp("ref")))[0]


def test_hsdp_checkpoint_resumes_across_shard_and_replicate_changes(world4, tmp_path, reference):
    first = tmp_path / "2x2"
    world4.run(train_in_world, ["parallel.dp=4", "parallel.dp_replicate=2", "parallel.zero=2",
                                "train.stop_after=1"], str(first))
    path = ckpt.latest_complete(first)
    assert path is not None and path.name.endswith("00000001")
    second = tmp_path / "4x1"
    runs = world4.run(train_in_world, ["parallel.dp=4", "parallel.zero=3", "train.stop_after=2",
                                       f"train.resume={path}"], str(second))
    assert_trajectory_close(logged_trajectory(runs), reference[1:2])
    path = ckpt.latest_complete(second)
    runs = world4.run(train_in_world, ["parallel.dp=4", "parallel.dp_replicate=4",
                                       "parallel.zero=1", f"train.resume={path}"],
                      str(tmp_path / "1x4"))
    assert_trajectory_close(logged_trajectory(runs), reference[2:])
