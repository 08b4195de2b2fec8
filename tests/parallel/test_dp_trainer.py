"""The trainer runs end to end on the data-parallel engine (dp=2, every ZeRO stage)."""

import math

import pytest

from tests.parallel.trainer_runs import losses_and_memory


@pytest.mark.parametrize("zero", [0, 3])
def test_trainer_runs_with_zero(world2, tmp_path, zero):
    overrides = ["model=debug", "train=debug", "train.eval_every=3",
                 "cluster.procs_per_node=2", "parallel.dp=2", f"parallel.zero={zero}",
                 "logger.wandb=disabled", "train.resume=never"]
    results = world2.run(losses_and_memory, overrides, str(tmp_path / f"z{zero}"), steps=3,
                         timeout_s=90)
    (losses0, mem0), (losses1, _) = results
    assert losses0 == losses1 and len(losses0) == 3 and all(map(math.isfinite, losses0))
    assert mem0["mem_optim_bytes"] > 0


STEPS = 4
BASE = ["model=debug", "train=debug", "train.eval_every=0",
        "cluster.procs_per_node=2", "parallel.dp=2", "logger.wandb=disabled",
        "train.resume=never"]


@pytest.mark.parametrize("zero", [1, 3])
def test_cpu_offload_gives_the_same_trajectory(world2, tmp_path, zero):
    """offload=cpu moves the optimizer state and its update to the host: same numbers."""
    on_device = world2.run(losses_and_memory, [*BASE, f"parallel.zero={zero}"],
                           str(tmp_path / "dev"), steps=STEPS, timeout_s=90)[0][0]
    offloaded = world2.run(losses_and_memory, [*BASE, f"parallel.zero={zero}",
                                               "parallel.offload=cpu"],
                           str(tmp_path / "off"), steps=STEPS, timeout_s=90)[0][0]
    assert offloaded == on_device


def test_fp16_with_loss_scaling_tracks_fp32(world2, tmp_path):
    """fp16 parameters, fp32 masters, dynamic loss scale agreed by both ranks."""
    ref = world2.run(losses_and_memory, [*BASE, "parallel.zero=2"], str(tmp_path / "fp32"),
                     steps=STEPS, timeout_s=90)[0][0]
    got = world2.run(losses_and_memory, [*BASE, "parallel.zero=2", "train.precision=fp16",
                                         "train.allow_slow_precision=true"],
                     str(tmp_path / "fp16"), steps=STEPS, timeout_s=120)
    (l0, _), (l1, _) = got
    assert l0 == l1
    assert all(abs(a - b) < 0.02 * a for a, b in zip(ref, l0, strict=True)), (ref, l0)
